"""How close a decoding step is to what the backend allows.

Compiled, warmed-up thunks to time side by side: a model's forward passes in a loop (step
costs), the step's weight matmuls alone, one matvec over the same bytes (streaming the
weights once), and a sweep of the same bytes split into more, smaller matmuls (what each
separate matmul costs apart from its bytes). Loops run `steps` times in one program, so
per step: seconds / steps.
"""

from __future__ import annotations

import functools
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np

from spec_jax.bench.timing import interleaved_medians, timed, timed_compile

Thunk = Callable[[], Any]


@functools.partial(jax.jit, static_argnames=("model", "steps"))
def _apply_loop(model, params, cache, tokens_BT, positions_BT, steps: int):
  """`steps` forward passes, each fed the previous pass's argmax (a true dependency)."""
  def body(_, carry):
    cache, tokens_BT = carry
    logits_BTV, _, cache = model.apply(params, tokens_BT, positions_BT, cache)
    return cache, jnp.argmax(logits_BTV, axis=-1).astype(jnp.int32)
  return jax.lax.fori_loop(0, steps, body, (cache, tokens_BT))[1]


def step_loop(model, params, *, tokens: int, cache_len: int, position: int,
              steps: int) -> tuple[Thunk, dict]:
  """A compiled, warmed-up thunk running `steps` forward passes over `tokens` tokens (batch 1)
  at a given position, and its info (compile_s, steps, tokens). Per step: time / steps."""
  cache = model.init_cache(1, cache_len)
  tokens_BT = jnp.ones((1, tokens), jnp.int32)
  positions_BT = position + jnp.arange(tokens, dtype=jnp.int32)[None, :]
  args = (model, params, cache, tokens_BT, positions_BT)
  compiled, timing = timed_compile(lambda: _apply_loop.lower(*args, steps=steps))
  info = {"compile_s": timing["lower_s"] + timing["compile_s"], "steps": steps, "tokens": tokens}
  thunk = lambda: compiled(*args[1:])  # noqa: E731
  timed(thunk)
  return thunk, info


def weight_matmuls(model, params) -> list[tuple[jax.Array, int]]:
  """Every weight matrix one decoding step multiplies a token by, with its contracting axis:
  the 2-D kernels (`kernel` [in, out] -> 0, `kernel_OI` [out, in] -> 1) and the head (the
  embedding table [V, D] when tied; an untied table is only gathered from)."""
  matmuls = []
  for path, leaf in jax.tree_util.tree_flatten_with_path(params)[0]:
    name = jax.tree_util.keystr(path)
    if getattr(leaf, "ndim", 0) != 2:
      continue
    if name.startswith("['embed']"):
      if model.config.tie_embeddings:
        matmuls.append((leaf, 1))
      continue
    matmuls.append((leaf, 1 if "kernel_OI" in name else 0))
  return matmuls


@functools.partial(jax.jit, static_argnames=("axes", "steps"))
def _matmul_chain(weights, x_N, axes: tuple[int, ...], steps: int):
  """`steps` rounds of one-row products with each weight in turn, each fed the one before."""
  def body(_, x_N):
    for w, k in zip(weights, axes):
      y_1O = jax.lax.dot_general(x_N[None, :w.shape[k]], w, (((1,), (k,)), ((), ())))
      x_N = x_N.at[:y_1O.shape[1]].add(1e-3 * y_1O[0])
    return x_N
  return jax.lax.fori_loop(0, steps, body, x_N)


def chain_thunk(weights: list[jax.Array], axes: tuple[int, ...], steps: int) -> Thunk:
  """A compiled, warmed-up thunk of one-row products with each weight in turn (contracting
  its axis in `axes`), `steps` rounds. Per round: time / steps."""
  x_N = jnp.zeros((max(max(w.shape) for w in weights),), weights[0].dtype)
  compiled = _matmul_chain.lower(weights, x_N, axes=axes, steps=steps).compile()
  thunk = functools.partial(compiled, weights, x_N)
  timed(thunk)
  return thunk


def matmul_chain_loop(model, params, steps: int) -> Thunk:
  """A warmed-up thunk running only the step's weight matmuls (one token, same shapes, same
  order of magnitude of launches) `steps` times: the fastest a step built from these separate
  XLA matmuls can be on this backend, whatever it does between them. Per step: time / steps."""
  matmuls = weight_matmuls(model, params)
  return chain_thunk([w for w, _ in matmuls], tuple(k for _, k in matmuls), steps)


def matmul_count_sweep(nbytes: int, counts: tuple[int, ...], dtype, *, steps: int,
                       repeats: int) -> dict:
  """One-row products over the same `nbytes` of weights split into `count` equal [512, M]
  matrices, chained, for each count, timed interleaved (seconds per round): how much a step
  pays per matmul on this backend, apart from the bytes it streams."""
  k, itemsize = 512, jnp.dtype(dtype).itemsize
  thunks = {}
  for count in counts:
    m = max(1, nbytes // itemsize // k // count)
    weights = [jnp.full((k, m), 1e-3, dtype) for _ in range(count)]  # separate buffers
    thunks[count] = chain_thunk(weights, (0,) * count, steps)
  t = interleaved_medians(thunks, repeats)
  counts = list(counts)
  per_round = [t[c] / steps for c in counts]
  return {"bytes": nbytes, "counts": counts, "s_per_round": per_round,
          "per_matmul_s": float(np.polyfit(counts, per_round, 1)[0])}  # least-squares slope


@jax.jit
def _matvec(x_I, w_IO):
  return x_I @ w_IO


def matvec_over(nbytes: int, dtype) -> tuple[Thunk, list[int]]:
  """A thunk multiplying a vector by one [1024, m] matrix of `nbytes` (and that shape)."""
  n = 1024
  m = max(1, nbytes // jnp.dtype(dtype).itemsize // n)
  w_IO = jnp.ones((n, m), dtype) * 1e-3
  x_I = jnp.ones((n,), dtype)
  return (lambda: _matvec(x_I, w_IO)), [n, m]


@jax.jit
def tree_sum(params):
  """The sum of every parameter: reads all the weights once."""
  return sum(jnp.sum(x) for x in jax.tree.leaves(params))


def step_bound(model, params, *, cache_len: int, position: int, steps: int,
               repeats: int) -> dict:
  """Our one-token step next to its weight matmuls alone and one matvec over the same bytes,
  timed interleaved (seconds per step): how close a step is to what this backend allows."""
  matmuls = weight_matmuls(model, params)
  streamed = sum(w.nbytes for w, _ in matmuls)
  matvec, _ = matvec_over(streamed, matmuls[0][0].dtype)
  step, _ = step_loop(model, params, tokens=1, cache_len=cache_len, position=position,
                      steps=steps)
  thunks = {"step_s": step, "matmul_chain_s": matmul_chain_loop(model, params, steps),
            "matvec_s": matvec}
  timed(matvec)
  t = interleaved_medians(thunks, repeats)
  per_step = {"step_s": steps, "matmul_chain_s": steps, "matvec_s": 1}
  return {"matmuls": len(matmuls), "streamed_bytes": streamed,
          **{k: v / per_step[k] for k, v in t.items()}}
