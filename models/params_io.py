"""Filling a model's NNX params from a flat {dotted.path: array} dict, with shape checks.

Every checkpoint reader converts its file's tensors to our names and layouts, then calls
`params_from_flat`, so shape and completeness checks live in one place.
"""

from __future__ import annotations

import dataclasses
import json
import re

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from spec_jax.core.errors import BadArgument, CheckpointError  # noqa: F401  (CheckpointError's old home)
from spec_jax.core.pytree_names import check_names_and_shapes, flatten_with_names, path_to_name
from spec_jax.models.llama import LAYOUTS, LlamaModel


def check_dtype(dtype, name: str = "dtype") -> str:
  """A floating dtype's name (float32, bfloat16, ...), or BadArgument naming `name`."""
  try:
    floating = jnp.issubdtype(jnp.dtype(dtype), jnp.floating)
  except TypeError:
    floating = False
  if not floating or isinstance(dtype, bool):
    raise BadArgument(f"{name} must be a floating dtype (float32, bfloat16, ...), got {dtype!r}")
  return str(jnp.dtype(dtype))


def read_json(path, error=None):
  """A JSON file -> its value; unreadable, non-UTF-8 or malformed text raises `error`
  (CheckpointError by default) naming the file, never a UnicodeDecodeError."""
  error = error or CheckpointError
  try:
    with open(path, "rb") as f:
      return json.loads(f.read().decode("utf-8"))
  except OSError as e:
    raise error(f"{path}: unreadable: {e}") from e
  except UnicodeDecodeError as e:
    raise error(f"{path}: not UTF-8 text (bad byte at offset {e.start}): not a JSON file") from e
  except (ValueError, RecursionError) as e:  # JSONDecodeError, or absurdly deep nesting
    raise error(f"{path}: malformed JSON: {str(e)[:200]}") from e


def check_finite(name: str, array, source: str) -> None:
  """CheckpointError naming `source` and tensor `name` unless every value is finite (one
  vectorised pass; integer tensors are always finite)."""
  a = np.asarray(array)
  if a.dtype.kind not in "fc" and a.dtype.name not in ("bfloat16", "float8_e4m3fn",
                                                       "float8_e5m2"):
    return
  finite = np.isfinite(a)
  if not finite.all():
    bad = int(a.size - np.count_nonzero(finite))
    first = np.unravel_index(int(np.argmin(finite.reshape(-1))), a.shape) if a.ndim else ()
    raise CheckpointError(f"{source}: tensor {name} holds {bad} non-finite values (NaN or inf; "
                          f"first at index {tuple(int(i) for i in first)}): corrupt weights")


def check_all_finite(flat: dict, source: str) -> None:
  for name, array in flat.items():
    check_finite(name, array, source)


_LAYER_INDEX = re.compile(r"(?:^|\.)layers\.(\d+)\.")


def check_layer_count(n_layers, names, source: str, field: str = "n_layers") -> None:
  """The config's layer count must match the layers the file holds tensors for: checked on
  names alone, before anything is built per layer (a config claiming 10**7 layers fails
  here, in microseconds, not after building 10**7 layers' names)."""
  found = {int(m.group(1)) for n in names if (m := _LAYER_INDEX.search(n))}
  if n_layers != len(found) or (found and max(found) != len(found) - 1):
    held = f"layers {min(found)}..{max(found)} ({len(found)} distinct)" if found else "no layers"
    raise CheckpointError(f"{source}: the config says {field}={n_layers}, but the file holds "
                          f"tensors for {held}")


def flat_names(model: LlamaModel) -> dict[str, jax.ShapeDtypeStruct]:
  """{name: abstract array} for every parameter of the model."""
  return flatten_with_names(model.abstract_params())


def params_to_flat(params) -> dict[str, np.ndarray]:
  return {name: np.asarray(leaf) for name, leaf in flatten_with_names(params).items()}


def is_quantized(flat: dict) -> bool:
  """True when flat params hold int8 leaves (spec_jax.core.quantize's QuantizedArray fields)."""
  return any(name.endswith((".values_IO", ".scale_O", ".values_OI")) for name in flat)


def check_widths(cfg, shapes: dict, source: str) -> None:
  """Every width the config implies must fit the file's largest tensor dimension: checked on
  shapes alone, before any (abstract) array of the config's sizes is built (a vocab_size of
  2**70 would otherwise overflow deep inside jax)."""
  largest = max((max(s) for s in (tuple(getattr(v, "shape", v)) for v in shapes.values()) if s),
                default=0)
  head_dim = cfg.resolved_head_dim
  for field, value in (("vocab_size", cfg.vocab_size), ("dim", cfg.dim),
                       ("hidden_dim", cfg.hidden_dim),
                       ("n_heads * head_dim", cfg.n_heads * head_dim),
                       ("n_kv_heads * head_dim", cfg.n_kv_heads * head_dim)):
    if value > largest:
      raise CheckpointError(f"{source}: the config's {field}={value} exceeds every tensor "
                            f"dimension in the file (the largest is {largest})")


def params_from_flat(model: LlamaModel, flat: dict[str, np.ndarray], *, source: str = "checkpoint"):
  """Builds the model's params pytree from `flat`; every name must be present with its shape."""
  check_names_and_shapes(flat_names(model), flat, source=source, error=CheckpointError)
  abstract_state = model.abstract_params()
  leaves_with_path, treedef = jax.tree_util.tree_flatten_with_path(abstract_state)
  dtype = model.config.jnp_dtype
  new_leaves = [jnp.asarray(flat[path_to_name(p)], dtype) for p, _ in leaves_with_path]
  return jax.tree_util.tree_unflatten(treedef, new_leaves)


def permute_adjacent_to_half(w_OI: np.ndarray, n_heads: int) -> np.ndarray:
  """Reorders the output rows of a q/k projection from adjacent-pair RoPE to half-split RoPE.

  Within each head, rows (2i, 2i+1) become rows (i, i + head_dim/2); attention scores are
  unchanged because q and k are permuted alike.
  """
  out_f, in_f = w_OI.shape
  head_dim = out_f // n_heads
  return (w_OI.reshape(n_heads, head_dim // 2, 2, in_f).transpose(0, 2, 1, 3)
          .reshape(out_f, in_f))


# fused kernels: {fused module suffix: the separate ones, concatenated in this order}
_FUSED_PARTS = {"attn.wqkv": ("attn.wq", "attn.wk", "attn.wv"),
                "mlp.w_gate_up": ("mlp.w_gate", "mlp.w_up")}


def to_layout(model: LlamaModel, params, layout: str) -> tuple[LlamaModel, nnx.State]:
  """The same function with its params in another layout (spec_jax.models.llama.LAYOUTS), from any.

  Readers, writers, HF conversion and tensor-parallel sharding use the checkpoint layout;
  convert after loading, for decoding (the writers convert back themselves). Fused outputs
  are concatenated ([q | k | v], [gate | up]), so logits agree with the checkpoint layout up
  to float rounding; the conversion itself only moves values, so a round trip is exact.
  Plain arrays only: convert, then quantize (spec_jax.core.quantize knows `kernel_OI`).
  """
  if layout not in LAYOUTS:
    raise ValueError(f"unknown layout {layout!r}; choose from {sorted(LAYOUTS)}")
  if model.config.layout == LAYOUTS[layout]:
    return model, params
  flat = flatten_with_names(params)
  if is_quantized(flat):
    raise ValueError("to_layout: params are int8-quantized; convert, then quantize")
  flat = _checkpoint_flat(model, flat)
  new_model = dataclasses.replace(
      model, config=dataclasses.replace(model.config, **LAYOUTS[layout]))
  out = {}
  for name in flat_names(new_model):
    base, _, leaf = name.rpartition(".")  # "layers.3.attn.wqkv", "kernel_OI"
    fused = next((f for f in _FUSED_PARTS if base.endswith("." + f)), None)
    sources = [base[:-len(fused)] + part for part in _FUSED_PARTS[fused]] if fused else [base]
    source_leaf = "kernel" if leaf == "kernel_OI" else leaf
    parts = [flat[f"{src}.{source_leaf}" if src else source_leaf] for src in sources]
    w = parts[0] if len(parts) == 1 else jnp.concatenate(parts, axis=-1)
    out[name] = w.T if leaf == "kernel_OI" else w
  return new_model, params_from_flat(new_model, out, source=f"to_layout({layout!r})")


def _fused_home(base: str) -> tuple[str, tuple[str, ...], int] | None:
  """'layers.3.attn.wk' -> ('layers.3.attn.wqkv', its parts, 1); None if never fused."""
  for fused, parts in _FUSED_PARTS.items():
    for i, part in enumerate(parts):
      if base.endswith("." + part):
        return base[:-len(part)] + fused, parts, i
  return None


def _checkpoint_flat(model: LlamaModel, flat: dict) -> dict:
  """Flat params in the model's layout -> the same in the checkpoint layout: `kernel_OI`
  transposed back, fused kernels and biases split at their parts' widths."""
  if model.config.layout == LAYOUTS["checkpoint"]:
    return flat
  checkpoint = dataclasses.replace(
      model, config=dataclasses.replace(model.config, **LAYOUTS["checkpoint"]))
  shapes = {name: a.shape for name, a in flat_names(checkpoint).items()}
  out = {}
  for name in shapes:
    base, _, leaf = name.rpartition(".")  # "layers.3.attn.wk", "kernel"
    home = _fused_home(base) if model.config.fused_projections else None
    source = home[0] if home else base
    if leaf == "kernel" and f"{source}.kernel_OI" in flat:
      w = flat[f"{source}.kernel_OI"].T
    else:
      w = flat[f"{source}.{leaf}" if source else leaf]
    if home:  # this part's columns of the fused output
      _, parts, i = home
      prefix = base[:-len(parts[i])]
      widths = [shapes[f"{prefix}{part}.{leaf}"][-1] for part in parts]
      w = w[..., sum(widths[:i]):sum(widths[:i + 1])]
    out[name] = w
  return out
