"""One entry point for every checkpoint format we read, and tokenizer discovery beside it.

    *.bin                                  llama2.c version 0     -> spec_jax.models.llama2c
    folder/config.json with native marker  spec_jax-native        -> spec_jax.models.native
    folder/config.json + *.safetensors     Hugging Face           -> spec_jax.models.hf
    *.gguf                                 GGUF (llama.cpp)       -> spec_jax.models.gguf
"""

from __future__ import annotations

import glob
import os
from typing import Any

from spec_jax.core.errors import BadArgument, CheckpointNotFound
from spec_jax.models.llama import LlamaModel
from spec_jax.models.params_io import CheckpointError, check_dtype, read_json


def _describe(folder: str, limit: int = 12) -> str:
  names = sorted(os.listdir(folder))
  return ", ".join(names[:limit]) + (f" ... ({len(names)} entries)" if len(names) > limit else "")


def load_model(path: str, *, dtype: str | None = "float32") -> tuple[LlamaModel, Any]:
  """Loads a checkpoint of any supported format -> (LlamaModel, params).

  `dtype=None` keeps a native checkpoint's saved dtype (float32 for the other formats).
  """
  if not isinstance(path, (str, os.PathLike)):
    raise BadArgument(f"load_model: path must be a str or os.PathLike, got {type(path).__name__}")
  path = os.fspath(path)
  if dtype is not None:
    dtype = check_dtype(dtype, "load_model: dtype")
  if not os.path.exists(path):
    raise CheckpointNotFound(f"no checkpoint at {path}")
  if os.path.isfile(path):
    if path.endswith(".bin"):
      from spec_jax.models.llama2c import load_llama2c
      return load_llama2c(path, dtype=dtype or "float32")
    if path.endswith(".gguf"):
      from spec_jax.models.gguf import load_gguf
      return load_gguf(path, dtype=dtype or "float32")
    raise CheckpointError(f"{path}: unsupported checkpoint file (expected a llama2.c *.bin, "
                          "a *.gguf, or a folder with config.json)")
  if not os.path.isfile(os.path.join(path, "config.json")):
    raise CheckpointError(f"{path}: folder has no config.json; found: {_describe(path)}")
  read_json(os.path.join(path, "config.json"))  # random bytes: a clear error, whatever format
  from spec_jax.models import native  # here: orbax loads only for native folders
  if native.is_native(path):
    return native.load_native(path, dtype=dtype)
  if glob.glob(os.path.join(path, "*.safetensors")):
    from spec_jax.models.hf import load_hf
    return load_hf(path) if dtype is None else load_hf(path, dtype=dtype)
  raise CheckpointError(f"{path}: config.json is neither spec_jax-native nor accompanied by "
                        f"*.safetensors weights; found: {_describe(path)}")


def _llama2c_vocab(path: str) -> int | None:
  from spec_jax.models.llama2c import read_header
  try:
    return abs(read_header(path)["vocab_size"])
  except (CheckpointError, OSError):
    return None


def find_tokenizer_path(path: str) -> str | None:
  """The tokenizer that ships beside a checkpoint, or None.

  llama2.c: `tok{vocab}.bin` in the same folder, else the only `tok*.bin` there.
  Folders (HF or native): `tokenizer.json` inside. GGUF: the file itself (its metadata).
  """
  if os.path.isdir(path):
    candidate = os.path.join(path, "tokenizer.json")
    return candidate if os.path.isfile(candidate) else None
  if os.path.isfile(path) and path.endswith(".gguf"):
    return path
  if not (os.path.isfile(path) and path.endswith(".bin")):
    return None
  folder = os.path.dirname(path) or "."
  vocab = _llama2c_vocab(path)
  if vocab is not None and os.path.isfile(preferred := os.path.join(folder, f"tok{vocab}.bin")):
    return preferred
  found = [p for p in sorted(glob.glob(os.path.join(folder, "tok*.bin")))
           if os.path.abspath(p) != os.path.abspath(path)]
  return found[0] if len(found) == 1 else None
