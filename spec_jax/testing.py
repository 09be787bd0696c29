"""Small models and paths that the tests and the scripts share.

Tiny random Llamas to test against, a noisy copy of params (a draft that agrees with its
target only part of the time), and where ../shared (the folder beside the repository, with
stories260K and its reference outputs) lives.
"""

from __future__ import annotations

from pathlib import Path

import jax
import numpy as np

import spec_jax

REPO = Path(spec_jax.__file__).resolve().parents[1]
SHARED = REPO.parent / "shared"
STORIES_DIR = SHARED / "models" / "stories260K"
REFERENCE_DIR = SHARED / "reference"
REFERENCE_STEM = "stories260K_greedy_once_upon_a_time_n200"


def tiny_llama(vocab_size=32, dim=32, n_layers=2, n_heads=4, n_kv_heads=2, hidden_dim=48,
               seed=0, **kw):
  """(model, params) of a small random Llama; kw go to LlamaConfig (max_seq_len 256 default)."""
  from spec_jax.models.llama import LlamaConfig, LlamaModel
  model = LlamaModel(LlamaConfig(vocab_size=vocab_size, dim=dim, n_layers=n_layers,
                                 n_heads=n_heads, n_kv_heads=n_kv_heads, hidden_dim=hidden_dim,
                                 max_seq_len=kw.pop("max_seq_len", 256), **kw))
  return model, model.init_params(jax.random.key(seed))


def perturbed(params, scale: float, seed: int = 0):
  """A noisy copy of params: a draft that agrees with its target only part of the time."""
  leaves, treedef = jax.tree.flatten(params)
  keys = jax.random.split(jax.random.key(seed), len(leaves))
  return jax.tree.unflatten(treedef, [
      leaf + scale * np.std(np.asarray(leaf)) * jax.random.normal(k, leaf.shape, leaf.dtype)
      for leaf, k in zip(leaves, keys)])


# The XLA:CPU option checks of compiled programs compile with, as users do. The test suite
# compiles with the fusion emitters off (tests/conftest.py: a third less compile time), and
# the legacy emitters copy a whole KV cache per step and split loops where the fusion
# emitters update in place: what a check of copies or loop carries reads must be the
# program users run.
USER_COMPILER_OPTIONS = {"xla_cpu_use_fusion_emitters": True}


def compiled_text(lowered) -> str:
  """The optimised HLO of a jax Lowered, compiled with USER_COMPILER_OPTIONS."""
  return lowered.compile(USER_COMPILER_OPTIONS).as_text()


def whole_cache_copies(hlo_text: str, cache) -> list[str]:
  """The sources of copies of a whole K or V buffer of `cache` (a KVCache) in compiled HLO
  text, except copies of a broadcast (the zero-initialised cache, before any loop). In a
  decode loop each such copy moves a cache's worth of bytes per step or round."""
  import re
  shapes = {f"f32[{','.join(map(str, x.shape))}]" for x in (cache.k_LBKES, cache.v_LBKES)}
  found = []
  for shape in shapes:
    found += re.findall(r"= " + re.escape(shape) + r"\{[0-9,]+\} copy\(%([a-z_.\-0-9]+)\)",
                        hlo_text)
  return [src for src in found if not src.startswith("wrapped_broadcast")]
