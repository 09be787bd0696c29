"""The programs of recent `speculate` calls, found again by identity.

A call validates its params against the models (names, shapes), builds its program and, for
gamma="auto", looks up its cost table: ~0.35 ms of host time on this 2-core CPU right after
a run (its caches cold), 3-4% of a 128-token stories260K generation, where `generate`
spends ~0.1 ms. A loop that calls `speculate` again with the same target, drafter, params
and settings needs none of it but the per-call arguments' checks (prompts, budgets, EOS,
key). An entry is found by the objects' ids and the static settings (with their types: 4.0
== 4 hashes alike, but only 4 is a gamma) and holds only if every params leaf is still the
very array it was (weakrefs: a rebuilt or mutated params tree misses, and is checked again);
the target and drafter are held (the program holds them anyway; they are configs, not
weights). Leaves that cannot be weakly referenced (Python scalars) keep a tree out.
"""

from __future__ import annotations

import weakref
from typing import Any, NamedTuple

import jax

# the settings a program depends on; the others (eos_id, key, budgets_B, pad_id) are per call
STATIC_SETTINGS = ("gamma", "max_new_tokens", "sampling", "cache_len", "verifier")
_MAX_ENTRIES = 16


class _Entry(NamedTuple):
  target: Any
  drafter: Any
  treedefs: tuple
  leaves: tuple  # weakrefs to every params leaf, draft params' after the target's
  program: Any
  tokens_shape: tuple  # the validated prompts' [B, P] (lists of prompts have no shape to key)


_ENTRIES: dict[tuple, _Entry] = {}


def _flat(params, draft_params):
  """-> (treedefs, leaves) of the params and, unless they are the same object, the draft
  params'."""
  leaves, treedef = jax.tree_util.tree_flatten(params)
  if draft_params is params:
    return (treedef,), leaves
  draft_leaves, draft_treedef = jax.tree_util.tree_flatten(draft_params)
  return (treedef, draft_treedef), leaves + draft_leaves


def _key(target, params, drafter, draft_params, tokens_BP, lengths_B, settings) -> tuple | None:
  try:
    static = tuple((name, type(settings.get(name)), settings.get(name))
                   for name in STATIC_SETTINGS)
    key = (id(target), id(params), id(drafter), id(draft_params), static,
           getattr(tokens_BP, "shape", None), getattr(lengths_B, "shape", None))
    hash(key)
  except TypeError:  # an unhashable setting (e.g. a config holding a list): no memo
    return None
  return key


def find(target, params, drafter, draft_params, tokens_BP, lengths_B, settings):
  """(program, its validated prompts' shape) a call with these objects and settings built
  before, if every params leaf is still the same array; else None. The caller checks its
  own validated prompts against that shape (prompts given as lists key no shape)."""
  key = _key(target, params, drafter, draft_params, tokens_BP, lengths_B, settings)
  entry = None if key is None else _ENTRIES.get(key)
  if entry is None or entry.target is not target or entry.drafter is not drafter:
    return None
  treedefs, leaves = _flat(params, draft_params)
  if treedefs != entry.treedefs or len(leaves) != len(entry.leaves):
    return None
  if any(ref() is not leaf for ref, leaf in zip(entry.leaves, leaves)):
    return None
  return entry.program, entry.tokens_shape


def remember(target, params, drafter, draft_params, tokens_BP, lengths_B, settings,
             program, tokens_shape: tuple) -> None:
  """Keeps the program a validated call built (the oldest entry goes past _MAX_ENTRIES)."""
  key = _key(target, params, drafter, draft_params, tokens_BP, lengths_B, settings)
  if key is None:
    return
  treedefs, leaves = _flat(params, draft_params)
  try:
    refs = tuple(weakref.ref(leaf) for leaf in leaves)
  except TypeError:  # a leaf without weakrefs: identity cannot be checked later
    return
  if len(_ENTRIES) >= _MAX_ENTRIES:
    del _ENTRIES[next(iter(_ENTRIES))]
  _ENTRIES[key] = _Entry(target, drafter, treedefs, refs, program, tuple(tokens_shape))


def forget_all() -> None:
  """Drops every entry (tests)."""
  _ENTRIES.clear()
