"""The trained-drafter file format: export after training, read and check for generation.

A trained drafter is two files in one folder:
  drafter.json          {"format": FORMAT, "kind": ..., "config": the model's config}
  drafter.safetensors   its own params ('.'-joined names); families that read the
                        target's embedding and head (Medusa, EAGLE, MTP) do not store them.
                        float32, float16, or int8: a matrix (ndim >= 2) as int8 NAME plus
                        float32 NAME.int8_scale (one scale per last-axis column, symmetric);
                        read back as float32 either way

How each kind builds its model from the config, and which target widths it must match, is
declared by its family (spec_jax.drafters.registry.Trained). Inference imports this module;
it needs safetensors, never optax or orbax.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from spec_jax.core.pytree_names import check_names_and_shapes, flatten_with_names, path_to_name
from spec_jax.drafters import registry
from spec_jax.drafters.base import check_feature_layers
from spec_jax.models.drafter_heads import HeadParams, shared_head
from spec_jax.models.params_io import CheckpointError, check_all_finite, read_json

FORMAT = "spec_jax-drafter"
DRAFTER_JSON = "drafter.json"
DRAFTER_WEIGHTS = "drafter.safetensors"


def abstract_own(model):
  """The model's own (stored) params as abstract arrays, in a plain nested dict."""
  from flax import nnx
  params = model.abstract_params()
  return nnx.to_pure_dict(params) if isinstance(params, nnx.State) else params


def describe(kind: str, model) -> dict:
  config = registry.trained_family(kind).trained.config_of(model)
  return {"kind": kind, "config": json.loads(json.dumps(config))}


def draft_params_for(kind: str, own, target, target_params):
  """What the generation loops take as draft_params: the own params, plus the target's
  embedding and head for families that share them."""
  if not registry.trained_family(kind).trained.reads_target_head:
    return own
  return HeadParams(own, shared_head(target, target_params))


EXPORT_DTYPES = ("float32", "float16", "int8")
INT8_SCALE = ".int8_scale"  # suffix of an int8 matrix's scales


def encode_tensors(flat: dict, dtype: str) -> dict[str, np.ndarray]:
  """Named float arrays -> what the file stores in `dtype` (int8: matrices only; vectors,
  e.g. norm scales, stay float32)."""
  if dtype not in EXPORT_DTYPES:
    raise ValueError(f"drafter dtype must be one of {EXPORT_DTYPES}, got {dtype!r}")
  out = {}
  for name, leaf in flat.items():
    x = np.asarray(leaf, np.float32)
    if dtype == "float16":
      x = x.astype(np.float16)
    elif dtype == "int8" and x.ndim >= 2:
      scale = np.max(np.abs(x), axis=tuple(range(x.ndim - 1))) / 127.0
      scale = np.where(scale > 0, scale, 1.0).astype(np.float32)
      out[name + INT8_SCALE] = scale
      x = np.clip(np.rint(x / scale), -127, 127).astype(np.int8)
    out[name] = np.ascontiguousarray(x)
  return out


def decode_tensors(flat: dict[str, np.ndarray], source: str) -> dict[str, np.ndarray]:
  """The inverse of encode_tensors: float arrays (int8 matrices times their scales)."""
  out = {}
  for name, x in flat.items():
    if name.endswith(INT8_SCALE):
      if name[:-len(INT8_SCALE)] not in flat:
        raise CheckpointError(f"{source}: {name} scales no tensor")
      continue
    if x.dtype == np.int8:
      scale = flat.get(name + INT8_SCALE)
      if scale is None or scale.shape != x.shape[-1:]:
        raise CheckpointError(f"{source}: int8 tensor {name} lacks scales of shape "
                              f"{x.shape[-1:]}")
      x = x.astype(np.float32) * scale.astype(np.float32)
    out[name] = x
  return out


def export_drafter(folder: str | os.PathLike, kind: str, model, own,
                   dtype: str = "float32") -> Path:
  """Writes drafter.json and drafter.safetensors (the drafter's own params, stored in
  `dtype`: float32, float16 or int8) into `folder`."""
  import safetensors.numpy
  folder = Path(folder)
  folder.mkdir(parents=True, exist_ok=True)
  tensors = encode_tensors(flatten_with_names(own), dtype)
  tmp = folder / (DRAFTER_WEIGHTS + ".tmp")
  safetensors.numpy.save_file(tensors, str(tmp), metadata={"format": FORMAT})
  tmp.replace(folder / DRAFTER_WEIGHTS)
  (folder / DRAFTER_JSON).write_text(json.dumps(
      {"format": FORMAT, **describe(kind, model)}, indent=2, sort_keys=True) + "\n")
  return folder


# config fields that count repeated modules (each holds at least one stored tensor), and
# widths (each is some stored tensor's dimension)
_COUNT_FIELDS = ("n_layers", "num_heads", "num_modules", "num_layers")
_WIDTH_FIELDS = ("dim", "hidden_dim", "head_dim")


def _check_counts(config, flat: dict, source: str) -> None:
  """Cheap bounds before any model is built: a config claiming 10**7 heads or a width of
  2**40 cannot describe a file of a few small tensors (and would take minutes and gigabytes
  to build, or overflow inside jax)."""
  largest = max((max(a.shape) for a in flat.values() if a.ndim), default=0)
  if isinstance(config, dict):
    for key, value in config.items():
      if isinstance(value, int) and key in _COUNT_FIELDS and value > max(len(flat), 1):
        raise CheckpointError(f"{source}: the description says {key}={value}, but the file "
                              f"holds only {len(flat)} tensors")
      if isinstance(value, int) and key in _WIDTH_FIELDS and value > largest:
        raise CheckpointError(f"{source}: the description says {key}={value}, more than any "
                              f"tensor dimension in the file (the largest is {largest})")
      _check_counts(value, flat, source)


def read_drafter(folder: str | os.PathLike) -> tuple[str, Any, Any]:
  """-> (kind, model handle, own params), validated against the stored config."""
  import safetensors
  folder = Path(folder)
  missing = [f for f in (DRAFTER_JSON, DRAFTER_WEIGHTS) if not (folder / f).is_file()]
  if missing:
    raise CheckpointError(f"{folder}: not an exported drafter (missing {', '.join(missing)}; "
                          "scripts/train_drafter.py --export-dir writes them)")
  path = folder / DRAFTER_WEIGHTS
  try:
    with safetensors.safe_open(str(path), framework="numpy") as f:
      flat = {name: f.get_tensor(name) for name in f.keys()}
  except (safetensors.SafetensorError, OSError, TypeError, ValueError) as e:
    raise CheckpointError(f"{path}: truncated or malformed safetensors file ({e})") from e
  flat = decode_tensors(flat, str(path))
  meta = read_json(folder / DRAFTER_JSON,
                   error=lambda m: CheckpointError(f"malformed drafter description: {m}"))
  try:
    kind, config = meta["kind"], meta["config"]
    fam = registry.trained_family(kind) if isinstance(kind, str) else None
    if fam is None:
      raise ValueError(f"kind {kind!r} is not a string")
    _check_counts(config, flat, str(path))
    model = fam.trained.model_from_config(config)
    leaves, treedef = jax.tree_util.tree_flatten_with_path(abstract_own(model))
  except CheckpointError:
    raise
  except (KeyError, TypeError, ValueError, AttributeError, IndexError, OverflowError) as e:
    raise CheckpointError(f"{folder / DRAFTER_JSON}: malformed drafter description ({e})") from e
  check_names_and_shapes({path_to_name(p): leaf for p, leaf in leaves}, flat, source=str(path),
                         error=CheckpointError, expected_by=f"the {kind} config")
  check_all_finite(flat, str(path))
  own = jax.tree_util.tree_unflatten(
      treedef, [jnp.asarray(flat[path_to_name(p)], leaf.dtype) for p, leaf in leaves])
  return kind, model, own


def check_drafter_fits(kind: str, model, target) -> None:
  """The target a drafter was trained for must match in vocabulary (and, for families that
  read the target's hidden states, in width)."""
  if model.vocab_size != target.vocab_size:
    raise ValueError(f"{kind} drafter vocabulary {model.vocab_size} != target vocabulary "
                     f"{target.vocab_size}: it was trained for another target")
  width_of = registry.trained_family(kind).trained.hidden_width
  if width_of is not None and width_of(model) != target.config.dim:
    raise ValueError(f"{kind} drafter reads hidden states of width {width_of(model)}, the "
                     f"target's are {target.config.dim}: it was trained for another target")
  # families conditioned on several target layers: those layers must exist in this target
  check_feature_layers(registry.trained_family(kind).trained.chain(model).feature_layers, target,
                       f"{kind} drafter")


def load_drafter(folder: str | os.PathLike, target, target_params):
  """An exported drafter for `target` -> (kind, model handle, draft params for generation)."""
  kind, model, own = read_drafter(folder)
  check_drafter_fits(kind, model, target)
  return kind, model, draft_params_for(kind, own, target, target_params)
