"""Parameter pytrees as flat {dotted name: array} dicts, and the one check that a flat set of
tensors matches what a model expects (names and shapes), shared by every reader and writer."""

from __future__ import annotations

import functools
from typing import Callable, Mapping

import jax
import numpy as np

from spec_jax.core.errors import BadArgument
from spec_jax.core.quantize import QuantizedArray, QuantizedArrayOI


def path_to_name(path) -> str:
  """A pytree key path as a '.'-joined name (dict keys, attribute names, sequence indices;
  an nnx Variable's own `value` field is skipped)."""
  parts = []
  for k in path:
    k = getattr(k, "key", getattr(k, "name", getattr(k, "idx", k)))
    if k == "value":
      continue
    parts.append(str(k))
  return ".".join(parts)


def flatten_with_names(tree) -> dict[str, object]:
  """{dotted name: leaf} for every leaf of `tree`."""
  return {path_to_name(p): leaf for p, leaf in jax.tree_util.tree_leaves_with_path(tree)}


def check_names_and_shapes(expected: Mapping[str, object], actual: Mapping[str, object], *,
                           source: str, error: Callable[[str], Exception] = ValueError,
                           expected_by: str = "the model") -> None:
  """Raises `error` naming `source` unless `actual` has exactly `expected`'s names, each with
  the same shape. Values may be arrays, abstract arrays, or shape tuples."""
  shape = lambda x: tuple(x) if isinstance(x, (tuple, list)) else tuple(x.shape)
  missing = sorted(set(expected) - set(actual))
  extra = sorted(set(actual) - set(expected))
  if missing or extra:
    more = lambda names: " ..." if len(names) > 8 else ""
    raise error(f"{source}: parameters do not match {expected_by}: missing {missing[:8]}"
                f"{more(missing)}, unexpected {extra[:8]}{more(extra)}")
  for name, want in expected.items():
    if shape(actual[name]) != shape(want):
      raise error(f"{source}: parameter {name} has shape {shape(actual[name])}, {expected_by} "
                  f"expects {shape(want)}")


def _is_quantized(x) -> bool:
  return isinstance(x, (QuantizedArray, QuantizedArrayOI))


def _shapes(tree) -> dict[str, tuple[int, ...]]:
  # a quantized kernel counts as one tensor of its logical shape, as the float one it replaces
  leaves = jax.tree_util.tree_leaves_with_path(tree, is_leaf=_is_quantized)
  return {path_to_name(p): tuple(getattr(x, "shape", None) or np.shape(x)) for p, x in leaves}


@functools.lru_cache(maxsize=64)
def expected_shapes(model) -> dict[str, tuple[int, ...]]:
  """{name: shape} of the params `model` (hashable, with abstract_params()) runs on."""
  return _shapes(model.abstract_params())


# (model, treedef, leaf shapes) already found to fit: the names follow from the treedef, so
# a structure and shapes seen before need no second look (the named check costs 0.5-1 ms of
# host time a call, 5% of a short generation with a small model)
_FITTING: set = set()
_FITTING_MAX = 256


def params_signature(params) -> tuple:
  """What compiled code depends on in a params pytree, hashable: its structure and each
  leaf's shape and dtype (a quantized kernel is a pytree node, so its parts are leaves and
  its type is in the structure). One flatten, without an is_leaf callback (which would call
  Python at every node): a generation of ~10 ms (stories260K) feels each 0.1 ms of it."""
  leaves, treedef = jax.tree_util.tree_flatten(params)
  return treedef, tuple(map(_leaf_signature, leaves))


def _leaf_signature(x) -> tuple:
  try:  # jax and numpy arrays, abstract arrays
    return x.shape, x.dtype
  except AttributeError:  # Python scalars
    return np.shape(x), np.result_type(x)


def check_params_fit(model, params, *, what: str, signature: tuple | None = None) -> tuple:
  """BadArgument unless `params` has the names and shapes `model.abstract_params()` says,
  checked on the host before tracing (params of another model otherwise fail deep inside
  jax, as "Incorrect number of leaves"). Models without abstract_params are not checked.
  -> params_signature(params) (pass it as `signature` when known, to save the flatten)."""
  signature = params_signature(params) if signature is None else signature
  if not hasattr(model, "abstract_params"):
    return signature
  key = (model, signature)
  if key in _FITTING:
    return signature
  check_names_and_shapes(expected_shapes(model), _shapes(params), source=what,
                         error=BadArgument, expected_by=f"the {type(model).__name__} given")
  if len(_FITTING) >= _FITTING_MAX:
    _FITTING.clear()
  _FITTING.add(key)
  return signature
