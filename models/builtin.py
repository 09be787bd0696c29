"""The built-in default model pair: a small code target and its distilled draft.

Both were trained by `scripts/train.py` on the Python standard library's own source and
ship in `models/builtin/`:

    target.safetensors, draft.safetensors   weights (see below), our flat parameter names
    target.json, draft.json                 LlamaConfig fields (+ "format": FORMAT)
    tokenizer.json, tokenizer_config.json   byte-level BPE; <|endoftext|> separates files
    training.json, README.md                recipe, sizes, losses, wall times, measurements

Storage: every matrix is int8 with a float32 scale per output channel (`<name>.scale`,
broadcastable against it: max |w| / 127 over the contraction axis); vectors (norm scales)
are bfloat16. That is a quarter of float32, so the pair ships in a few MB. The stored
values *are* the model: `scripts/train.py` distils the draft from the target as loaded back
from its file, and the loader dequantizes to float32 by default because bfloat16 and int8
matmuls are slower than float32 on CPUs.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

import ml_dtypes
import numpy as np
import safetensors
import safetensors.numpy

from spec_jax.models.llama import LlamaConfig, LlamaModel
from spec_jax.models.params_io import (CheckpointError, check_all_finite, check_dtype,
                                      check_layer_count, check_widths, params_from_flat, params_to_flat, read_json,
                                      to_layout)
from spec_jax.models.tokenizer import HFTokenizer, TokenizerError, check_vocab_compatible

BUILTIN_DIR = Path(__file__).resolve().parent / "builtin"
FORMAT = "spec_jax-builtin"
VECTOR_DTYPE = ml_dtypes.bfloat16
SCALE_SUFFIX = ".scale_int8"
EMBED = "embed"  # [vocab, dim]: looked up by row and, tied, the head contracts over dim
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")
REBUILD_HINT = "rebuild it with `python scripts/train.py --out models/builtin`"


def quantize_tensor(name: str, w: np.ndarray) -> dict[str, np.ndarray]:
  """-> the stored tensors for one parameter: int8 + per-output-channel scale, or bfloat16."""
  w = np.asarray(w, np.float32)
  if w.ndim != 2:
    return {name: np.ascontiguousarray(w.astype(VECTOR_DTYPE))}
  contraction_axis = 1 if name == EMBED else 0  # kernels are [in, out]
  scale = np.max(np.abs(w), axis=contraction_axis, keepdims=True) / 127.0
  scale = np.where(scale > 0, scale, 1.0).astype(np.float32)
  q = np.clip(np.round(w / scale), -127, 127).astype(np.int8)
  return {name: np.ascontiguousarray(q), name + SCALE_SUFFIX: np.ascontiguousarray(scale)}


def dequantize_tensors(tensors: dict[str, np.ndarray], source: str) -> dict[str, np.ndarray]:
  """Inverse of quantize_tensor over a whole file -> float32 arrays by parameter name."""
  flat = {}
  for name, arr in tensors.items():
    if name.endswith(SCALE_SUFFIX):
      if name[:-len(SCALE_SUFFIX)] not in tensors:
        raise CheckpointError(f"{source}: scale {name} has no int8 tensor")
      continue
    if arr.dtype == np.int8:
      scale = tensors.get(name + SCALE_SUFFIX)
      if scale is None:
        raise CheckpointError(f"{source}: int8 tensor {name} has no {name + SCALE_SUFFIX}")
      if scale.ndim != arr.ndim or any(s not in (1, a) for s, a in zip(scale.shape, arr.shape)):
        raise CheckpointError(f"{source}: scale {scale.shape} of {name} does not broadcast "
                              f"against {arr.shape}")
      flat[name] = arr.astype(np.float32) * scale.astype(np.float32)
    else:
      flat[name] = arr.astype(np.float32)
  return flat


def stored_params(model: LlamaModel, params):
  """The params as they come back from save_model: what the shipped model computes with."""
  flat = {}
  for name, leaf in params_to_flat(params).items():
    flat.update(quantize_tensor(name, leaf))
  return params_from_flat(model, dequantize_tensors(flat, "stored params"),
                          source="stored params")


def save_model(folder: str | Path, name: str, model: LlamaModel, params) -> None:
  """Writes `name.safetensors` (int8 matrices, see the module doc) and `name.json` (the config),
  in the checkpoint layout whatever layout `params` are in."""
  model, params = to_layout(model, params, "checkpoint")
  folder = Path(folder)
  folder.mkdir(parents=True, exist_ok=True)
  tensors = {}
  for key, leaf in params_to_flat(params).items():
    tensors.update(quantize_tensor(key, leaf))
  config = dataclasses.asdict(model.config) | {"dtype": "float32", "format": FORMAT}
  tmp = folder / f"{name}.safetensors.tmp"
  safetensors.numpy.save_file(tensors, str(tmp), metadata={"format": FORMAT})
  tmp.chmod(0o644)  # safetensors creates files private to the user; these ship
  tmp.replace(folder / f"{name}.safetensors")
  (folder / f"{name}.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")


def _read_config(path: Path, dtype: str) -> LlamaConfig:
  raw = read_json(path, error=lambda m: CheckpointError(f"{m}; {REBUILD_HINT}"))
  if not isinstance(raw, dict) or raw.pop("format", None) != FORMAT:
    raise CheckpointError(f"{path}: not a {FORMAT} config")
  try:
    return LlamaConfig.from_dict(raw | {"dtype": dtype})
  except (TypeError, ValueError) as e:
    raise CheckpointError(f"{path}: invalid LlamaConfig: {e}") from e


def _read_tensors(path: Path) -> dict[str, np.ndarray]:
  try:
    with safetensors.safe_open(str(path), framework="numpy") as f:
      return {name: f.get_tensor(name) for name in f.keys()}
  except (safetensors.SafetensorError, OSError, TypeError, ValueError) as e:
    raise CheckpointError(f"{path}: truncated or malformed safetensors file ({e}); "
                          f"{REBUILD_HINT}") from e


def load_model(folder: str | Path, name: str, *, dtype: str = "float32"
               ) -> tuple[LlamaModel, Any]:
  """Reads `name.json` + `name.safetensors` from `folder` -> (LlamaModel, params in dtype)."""
  folder = Path(folder)
  dtype = check_dtype(dtype, "load_model: dtype")  # an argument, not the file's fault
  missing = [f for f in (f"{name}.json", f"{name}.safetensors") if not (folder / f).is_file()]
  if missing:
    raise CheckpointError(f"{folder}: missing {', '.join(missing)}; {REBUILD_HINT}")
  cfg = _read_config(folder / f"{name}.json", dtype)
  path = folder / f"{name}.safetensors"
  tensors = _read_tensors(path)
  check_layer_count(cfg.n_layers, tensors, str(path))  # before anything is built per layer
  check_widths(cfg, tensors, str(path))
  flat = dequantize_tensors(tensors, str(path))
  check_all_finite(flat, str(path))
  model = LlamaModel(cfg)
  return model, params_from_flat(model, flat, source=str(path))


def load_builtin(folder: str | Path | None = None, *, dtype: str = "float32"):
  """-> (target_model, target_params, draft_model, draft_params, tokenizer).

  Raises CheckpointError (a ValueError) naming what is missing or broken.
  """
  folder = BUILTIN_DIR if folder is None else Path(folder)
  if not folder.is_dir():
    raise CheckpointError(f"{folder}: no built-in model folder; {REBUILD_HINT}")
  if not (folder / TOKENIZER_FILES[0]).is_file():
    raise CheckpointError(f"{folder}: missing {TOKENIZER_FILES[0]}; {REBUILD_HINT}")
  try:
    tokenizer = HFTokenizer.from_file(folder)
  except TokenizerError as e:
    raise CheckpointError(f"{folder}: broken tokenizer ({e}); {REBUILD_HINT}") from e
  target, target_params = load_model(folder, "target", dtype=dtype)
  draft, draft_params = load_model(folder, "draft", dtype=dtype)
  if target.vocab_size != draft.vocab_size:
    raise CheckpointError(f"{folder}: target vocab {target.vocab_size} != draft vocab "
                          f"{draft.vocab_size}")
  check_vocab_compatible(tokenizer, target.vocab_size)
  return target, target_params, draft, draft_params, tokenizer


def builtin_drafter(kind: str, folder: str | Path | None = None) -> str | None:
  """The folder of a drafter of `kind` trained for the built-in target and shipped with it
  (models/builtin/<kind>/: drafter.json + drafter.safetensors, int8; made by
  `scripts/train_drafter.py --model builtin`), or None."""
  path = (BUILTIN_DIR if folder is None else Path(folder)) / kind
  return str(path) if (path / "drafter.json").is_file() else None

