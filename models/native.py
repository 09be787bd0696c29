"""spec_jax's own checkpoint format: a folder with `config.json` and an orbax `params/` tree.

    folder/config.json   LlamaConfig fields + {"format": "spec_jax-native", "version": 1,
                         "tensor_crc32": {dotted name: crc32 of its bytes, 8 hex digits}}
    folder/params/       orbax StandardSave of {"embed": ..., "layers": {"0": {...}}, ...}

Params are stored as a nested dict of plain arrays keyed by our dotted parameter names
(`params_io.flat_names`), so the files do not depend on NNX's State internals. Restore
builds an abstract target from `model.abstract_params()`, checks the saved shapes against
it first, and lets orbax read each array straight into its target sharding. No pickle.

Every restored tensor is checked: its crc32 against the one saved (flipped bytes in a data
file are a CheckpointError naming the tensor, never weights of 3e30), and all its values
finite. Folders written before checksums existed (no "tensor_crc32") load with the
finiteness check alone, silently.
"""

from __future__ import annotations

import dataclasses
import json
import os
import zlib
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp

from spec_jax.core.errors import BadArgument
from spec_jax.core.pytree_names import check_names_and_shapes, flatten_with_names, path_to_name
from spec_jax.models.llama import LlamaConfig, LlamaModel
from spec_jax.models.params_io import (CheckpointError, check_finite, check_layer_count,
                                      check_widths, flat_names, is_quantized, read_json)

FORMAT = "spec_jax-native"
VERSION = 1
CONFIG_FILE = "config.json"
PARAMS_DIR = "params"
CHECKSUMS = "tensor_crc32"

# a Sharding for every leaf, a function abstract-leaf -> Sharding, or a pytree of Shardings
ShardingSpec = Any


def is_native(folder: str) -> bool:
  """True when `folder/config.json` carries our format marker."""
  try:
    with open(os.path.join(folder, CONFIG_FILE)) as f:
      return json.load(f).get("format") == FORMAT
  except (OSError, ValueError, AttributeError):
    return False


def _nest(flat: dict[str, Any]) -> dict[str, Any]:
  """{"a.b.c": x} -> {"a": {"b": {"c": x}}}."""
  tree: dict[str, Any] = {}
  for name, leaf in flat.items():
    *parents, last = name.split(".")
    node = tree
    for p in parents:
      node = node.setdefault(p, {})
    node[last] = leaf
  return tree


def _flat_params(model: LlamaModel, params) -> dict[str, jax.Array]:
  flat = flatten_with_names(params)
  if is_quantized(flat):
    raise ValueError("save_native: params are int8-quantized; dequantize them first")
  check_names_and_shapes(flat_names(model), flat, source="save_native")
  return flat


def save_native(folder: str, model: LlamaModel, params, *, overwrite: bool = False) -> None:
  """Writes `model.config` and `params` to `folder` in the native format."""
  folder = os.path.abspath(folder)
  params_dir = os.path.join(folder, PARAMS_DIR)
  if os.path.exists(params_dir) and not overwrite:
    raise FileExistsError(f"{params_dir} exists; pass overwrite=True to replace it")
  flat = _flat_params(model, params)
  checksums = {}
  for name, leaf in flat.items():
    host = np.asarray(leaf)
    check_finite(name, host, "save_native")  # never write weights that cannot load back
    checksums[name] = f"{crc32(host):08x}"
  tree = _nest(flat)
  os.makedirs(folder, exist_ok=True)
  with ocp.StandardCheckpointer() as ckptr:
    ckptr.save(params_dir, tree, force=overwrite)
    ckptr.wait_until_finished()
  config = json.loads(model.config.to_json())
  config.update(format=FORMAT, version=VERSION, **{CHECKSUMS: checksums})
  tmp = os.path.join(folder, CONFIG_FILE + ".tmp")
  with open(tmp, "w") as f:
    json.dump(config, f, indent=2, sort_keys=True)
  os.replace(tmp, os.path.join(folder, CONFIG_FILE))


def crc32(array: np.ndarray) -> int:
  """crc32 of an array's bytes in C order (what the checksums in config.json hold)."""
  return zlib.crc32(np.ascontiguousarray(array).reshape(-1).view(np.uint8))


def _read_raw(folder: str) -> tuple[str, dict[str, Any]]:
  path = os.path.join(folder, CONFIG_FILE)
  if not os.path.isfile(path):
    raise CheckpointError(f"{folder}: no {CONFIG_FILE}; not a spec_jax-native checkpoint")
  raw = read_json(path)
  if not isinstance(raw, dict) or raw.get("format") != FORMAT:
    found = raw.get("format") if isinstance(raw, dict) else type(raw).__name__
    raise CheckpointError(f"{path}: not a spec_jax-native config (format={found!r}, "
                          f"expected {FORMAT!r})")
  if raw.get("version") != VERSION or isinstance(raw.get("version"), bool):
    raise CheckpointError(f"{path}: unsupported spec_jax-native version {raw.get('version')!r} "
                          f"(this code reads version {VERSION})")
  return path, raw


def read_config(folder: str) -> LlamaConfig:
  """Reads and validates `folder/config.json` of a native checkpoint."""
  path, raw = _read_raw(folder)
  fields = {k: v for k, v in raw.items() if k not in ("format", "version", CHECKSUMS)}
  try:
    return LlamaConfig.from_dict(fields)
  except (TypeError, ValueError) as e:
    raise CheckpointError(f"{path}: invalid LlamaConfig: {e}") from e


def _read_checksums(folder: str, names) -> dict[str, int] | None:
  """{name: crc32} from config.json, or None for a folder saved before checksums."""
  path, raw = _read_raw(folder)
  sums = raw.get(CHECKSUMS)
  if sums is None:
    return None
  ok = isinstance(sums, dict) and set(sums) == set(names) and all(
      isinstance(v, str) and len(v) == 8 and all(c in "0123456789abcdef" for c in v)
      for v in sums.values())
  if not ok:
    raise CheckpointError(f"{path}: malformed {CHECKSUMS}: expected 8 hex digits for each of "
                          f"the {len(names)} saved tensors")
  return {name: int(v, 16) for name, v in sums.items()}


def _verify(name: str, array: jax.Array, want: int | None, source: str) -> None:
  """The tensor's crc32 (when saved) and finiteness; CheckpointError naming it otherwise."""
  if not array.is_fully_addressable:  # multi-host: no host has all of it; check on device
    if not bool(jnp.all(jnp.isfinite(array))):
      raise CheckpointError(f"{source}: tensor {name} holds non-finite values: corrupt weights")
    return
  host = np.asarray(array)
  if want is not None and (got := crc32(host)) != want:
    raise CheckpointError(f"{source}: tensor {name} fails its checksum (crc32 {got:08x}, "
                          f"saved {want:08x}): the data file is corrupt")
  check_finite(name, host, source)


def _brief(e: Exception, limit: int = 300) -> str:
  text = str(e)  # TensorStore errors embed whole specs
  return text if len(text) <= limit else text[:limit] + " ..."


def _saved_shapes(params_dir: str) -> dict[str, tuple[int, ...]]:
  """{name: shape} from the orbax metadata, without reading any array data."""
  if not os.path.isdir(params_dir):
    raise CheckpointError(f"{params_dir}: missing params directory")
  try:
    with ocp.StandardCheckpointer() as ckptr:
      meta = ckptr.metadata(params_dir)
    tree = getattr(meta, "item_metadata", meta)
    tree = getattr(tree, "tree", tree)
    shapes = {name: tuple(m.shape) for name, m in flatten_with_names(tree).items()}
  except Exception as e:  # orbax raises assorted types for damaged checkpoints
    raise CheckpointError(f"{params_dir}: unreadable orbax metadata, missing or corrupt "
                          f"checkpoint ({type(e).__name__}: {_brief(e)})") from e
  if not shapes:
    raise CheckpointError(f"{params_dir}: orbax metadata lists no arrays; corrupt checkpoint")
  return shapes


def _check_shapes(model: LlamaModel, saved: dict[str, tuple[int, ...]], source: str) -> None:
  check_names_and_shapes(flat_names(model), saved, source=source, error=CheckpointError,
                         expected_by="config.json")


def _shardings(abstract: dict[str, jax.ShapeDtypeStruct], sharding: ShardingSpec | None):
  """{name: Sharding} from None (default device), one Sharding, a function, or a pytree."""
  if sharding is None:
    sharding = jax.sharding.SingleDeviceSharding(jax.devices()[0])
  if isinstance(sharding, jax.sharding.Sharding):
    return {name: sharding for name in abstract}
  if callable(sharding):
    return {name: sharding(leaf) for name, leaf in abstract.items()}
  leaves = jax.tree_util.tree_leaves_with_path(
      sharding, is_leaf=lambda x: isinstance(x, jax.sharding.Sharding))
  given = {path_to_name(p): s for p, s in leaves}
  if set(given) != set(abstract):
    raise ValueError(f"sharding pytree does not match params: missing "
                     f"{sorted(set(abstract) - set(given))[:8]}, unexpected "
                     f"{sorted(set(given) - set(abstract))[:8]}")
  return given


def load_native(folder: str, *, dtype: str | None = None,
                sharding: ShardingSpec | None = None) -> tuple[LlamaModel, Any]:
  """Reads a native checkpoint -> (LlamaModel, params as an nnx.State).

  `dtype` (default: the saved one) casts parameters on restore. `sharding` is a Sharding
  for every leaf, a function abstract-leaf -> Sharding, or a pytree of Shardings shaped
  like the params; each array is read directly into its sharding.
  """
  folder = os.path.abspath(folder)
  saved_cfg = read_config(folder)
  cfg = saved_cfg
  if dtype is not None:
    try:
      cfg = dataclasses.replace(cfg, dtype=str(jnp.dtype(dtype)))
    except TypeError as e:
      raise BadArgument(f"load_native: unknown dtype {dtype!r}") from e
  params_dir = os.path.join(folder, PARAMS_DIR)
  saved = _saved_shapes(params_dir)
  # the layer count against the saved names first: 10**7 layers fail here, cheaply
  check_layer_count(cfg.n_layers, saved, os.path.join(folder, CONFIG_FILE))
  check_widths(cfg, saved, os.path.join(folder, CONFIG_FILE))
  model = LlamaModel(cfg)
  _check_shapes(model, saved, folder)
  checksums = _read_checksums(folder, saved)

  abstract_state = model.abstract_params()
  leaves_with_path, treedef = jax.tree_util.tree_flatten_with_path(abstract_state)
  abstract = {path_to_name(p): leaf for p, leaf in leaves_with_path}
  shardings = _shardings(abstract, sharding)
  # restored in the saved dtype, so the checksums see the saved bytes; cast afterwards
  target = _nest({name: jax.ShapeDtypeStruct(leaf.shape, saved_cfg.jnp_dtype,
                                             sharding=shardings[name])
                  for name, leaf in abstract.items()})
  try:
    with ocp.StandardCheckpointer() as ckptr:
      restored = flatten_with_names(ckptr.restore(params_dir, target))
  except Exception as e:  # orbax raises assorted types for damaged checkpoints
    raise CheckpointError(f"{params_dir}: failed to restore params, corrupt checkpoint? "
                          f"({type(e).__name__}: {_brief(e)})") from e
  for name, array in restored.items():
    _verify(name, array, None if checksums is None else checksums[name], params_dir)
  if cfg.jnp_dtype != saved_cfg.jnp_dtype:
    restored = {name: a.astype(cfg.jnp_dtype) for name, a in restored.items()}
  return model, jax.tree_util.tree_unflatten(
      treedef, [restored[path_to_name(p)] for p, _ in leaves_with_path])
