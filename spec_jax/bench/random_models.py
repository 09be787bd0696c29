"""Random Llamas of a given shape (speed does not depend on the weights' values), and sizes."""

from __future__ import annotations

from typing import Any

import jax
import numpy as np


def random_model(seed: int, max_seq_len: int = 512, **cfg) -> tuple[Any, Any]:
  """(LlamaModel, params) with random weights; cfg goes to LlamaConfig (layout, dtype too)."""
  from spec_jax.models.llama import LlamaConfig, LlamaModel
  model = LlamaModel(LlamaConfig(max_seq_len=max_seq_len, **cfg))
  return model, model.init_params(jax.random.key(seed))


def param_bytes(params) -> int:
  return int(sum(np.asarray(x).nbytes for x in jax.tree.leaves(params)))


def param_count(params) -> int:
  return int(sum(np.size(x) for x in jax.tree.leaves(params)))
