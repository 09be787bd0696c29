"""Branches that update large buffers (KV caches) in place.

XLA never lets a conditional's output share its operand's buffer, so a branch of `lax.cond`
or `lax.switch` that writes a KV cache first copies all of it (and the enclosing loop copies
the result back into its carry): four whole-cache copies a round, found in the compiled HLO
of gamma="auto" and absent from the fixed-gamma loop. A while loop's carry, by contrast, is
updated in place. So these run each branch as a while loop of zero or one trip: the same
computation, with the carry aliased.

Each branch maps the carry to a value of the same structure (put extra results in the carry
with a placeholder before the call). Only the chosen branch runs; the others cost a
predicate.
"""

from __future__ import annotations

from typing import Callable, Sequence, TypeVar

import jax
import jax.numpy as jnp

Carry = TypeVar("Carry")


def zeros_like_outputs(fn: Callable, *args):
  """Zeros shaped like fn(*args)'s outputs (traced abstractly, nothing runs): placeholders
  for a branch's extra results in the carry."""
  return jax.tree.map(lambda x: jnp.zeros(x.shape, x.dtype), jax.eval_shape(fn, *args))


def run_if(pred: jax.Array, fn: Callable[[Carry], Carry], carry: Carry) -> Carry:
  """fn(carry) where pred (a traced bool scalar), else carry; in place."""
  def once(c):
    return jnp.zeros_like(c[0]), fn(c[1])

  return jax.lax.while_loop(lambda c: c[0], once, (jnp.asarray(pred, bool), carry))[1]


def cond_in_place(pred: jax.Array, true_fn: Callable[[Carry], Carry],
                  false_fn: Callable[[Carry], Carry], carry: Carry) -> Carry:
  """lax.cond(pred, true_fn, false_fn, carry) for branches with the carry's structure."""
  pred = jnp.asarray(pred, bool)
  return run_if(~pred, false_fn, run_if(pred, true_fn, carry))


def switch_in_place(index: jax.Array, branches: Sequence[Callable[[Carry], Carry]],
                    carry: Carry) -> Carry:
  """lax.switch(index, branches, carry) for branches with the carry's structure (index
  clamped to the branches, as lax.switch does)."""
  index = jnp.clip(index, 0, len(branches) - 1)
  for i, fn in enumerate(branches):
    carry = run_if(index == i, fn, carry)
  return carry
