"""Shared fixtures: the real stories260K model from ../shared, and small random models."""

from __future__ import annotations

from pathlib import Path

import jax
import numpy as np
import pytest

REPO = Path(__file__).resolve().parents[1]
SHARED = REPO.parent / "shared"
STORIES_DIR = SHARED / "models" / "stories260K"
REFERENCE_DIR = SHARED / "reference"
REFERENCE_STEM = "stories260K_greedy_once_upon_a_time_n200"


@pytest.fixture(autouse=True, scope="module")
def _release_compiled_programs():
  """Drops jax's compiled programs after each test module. Each XLA:CPU executable keeps its
  own memory mappings, and the whole suite in one process passes the kernel's
  vm.max_map_count (65530 by default): a later compile then aborts or segfaults."""
  yield
  jax.clear_caches()


def require_shared(path: Path) -> Path:
  if not path.exists():
    pytest.skip(f"needs {path} (the ../shared folder beside the repository)")
  return path


@pytest.fixture(scope="session")
def stories():
  """(model, params) of stories260K, read from ../shared."""
  from spec_jax.models.llama2c import load_llama2c
  return load_llama2c(str(require_shared(STORIES_DIR / "stories260K.bin")))


@pytest.fixture(scope="session")
def reference_tokens() -> list[int]:
  path = require_shared(REFERENCE_DIR / f"{REFERENCE_STEM}.tokens.txt")
  return [int(t) for t in path.read_text().split()]


@pytest.fixture(scope="session")
def story_prompts(reference_tokens) -> list[list[int]]:
  """A batch of prompts of different lengths (BOS first), from the reference and elsewhere."""
  return [reference_tokens[:5], [1, 403, 407], reference_tokens[:11], [1, 300, 263, 400, 271],
          [1, 413, 409, 416, 327, 263, 415, 294]]


def tiny_llama(vocab_size=32, dim=32, n_layers=2, n_heads=4, n_kv_heads=2, hidden_dim=48,
               seed=0, **kw):
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
