"""The built-in default model pair: a small code target and its distilled draft.

Both were trained by `scripts/train.py` on the Python standard library's own source and
ship in `models/builtin/`:

    target.safetensors, draft.safetensors   weights in bfloat16, our flat parameter names
    target.json, draft.json                 LlamaConfig fields (+ "format": FORMAT)
    tokenizer.json, tokenizer_config.json   byte-level BPE; <|endoftext|> separates files
    training.json, README.md                recipe, sizes, losses, wall times, measurements

bfloat16 halves the files; the loader casts to float32 by default because bfloat16
matmuls are several times slower than float32 on CPUs.
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

from models.llama import LlamaConfig, LlamaModel
from models.params_io import CheckpointError, params_from_flat, params_to_flat
from models.tokenizer import HFTokenizer, TokenizerError, check_vocab_compatible

BUILTIN_DIR = Path(__file__).resolve().parent / "builtin"
FORMAT = "spec_jax-builtin"
STORED_DTYPE = ml_dtypes.bfloat16
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")
REBUILD_HINT = "rebuild it with `python scripts/train.py --out models/builtin`"


def save_model(folder: str | Path, name: str, model: LlamaModel, params) -> None:
  """Writes `name.safetensors` (bfloat16) and `name.json` (the config) into `folder`."""
  folder = Path(folder)
  folder.mkdir(parents=True, exist_ok=True)
  tensors = {k: np.ascontiguousarray(np.asarray(v, np.float32).astype(STORED_DTYPE))
             for k, v in params_to_flat(params).items()}
  config = dataclasses.asdict(model.config) | {"dtype": "float32", "format": FORMAT}
  tmp = folder / f"{name}.safetensors.tmp"
  safetensors.numpy.save_file(tensors, str(tmp), metadata={"format": FORMAT})
  tmp.chmod(0o644)  # safetensors creates files private to the user; these ship
  tmp.replace(folder / f"{name}.safetensors")
  (folder / f"{name}.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")


def _read_config(path: Path, dtype: str) -> LlamaConfig:
  try:
    raw = json.loads(path.read_text())
  except (OSError, ValueError) as e:
    raise CheckpointError(f"{path}: unreadable config ({e}); {REBUILD_HINT}") from e
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
  except (safetensors.SafetensorError, OSError, TypeError) as e:
    raise CheckpointError(f"{path}: truncated or malformed safetensors file ({e}); "
                          f"{REBUILD_HINT}") from e


def load_model(folder: str | Path, name: str, *, dtype: str = "float32"
               ) -> tuple[LlamaModel, Any]:
  """Reads `name.json` + `name.safetensors` from `folder` -> (LlamaModel, params in dtype)."""
  folder = Path(folder)
  missing = [f for f in (f"{name}.json", f"{name}.safetensors") if not (folder / f).is_file()]
  if missing:
    raise CheckpointError(f"{folder}: missing {', '.join(missing)}; {REBUILD_HINT}")
  model = LlamaModel(_read_config(folder / f"{name}.json", dtype))
  path = folder / f"{name}.safetensors"
  flat = _read_tensors(path)
  if not all(np.all(np.isfinite(a.astype(np.float32))) for a in flat.values()):
    raise CheckpointError(f"{path}: non-finite weights; {REBUILD_HINT}")
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
