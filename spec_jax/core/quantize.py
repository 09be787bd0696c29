"""Weight-only int8 quantization as a function over a params pytree.

Each selected weight matrix becomes int8 values plus one float scale per output channel
(symmetric, absmax / 127): `kernel` leaves are `[in, out]` (QuantizedArray), `kernel_OI`
leaves `[out, in]` (QuantizedArrayOI; LlamaConfig.kernels_out_in). Models multiply through
`dense`, which accepts a plain array or either quantized kind, so any model that routes its
matmuls through `dense` runs quantized without a second definition.
"""

from __future__ import annotations

from typing import Callable

import jax
import jax.numpy as jnp
from flax import struct


@struct.dataclass
class QuantizedArray:
  values_IO: jax.Array  # int8 [in, out]
  scale_O: jax.Array  # float32 [out]

  @property
  def shape(self):
    return self.values_IO.shape

  def dequantize(self, dtype=jnp.float32) -> jax.Array:
    return (self.values_IO.astype(jnp.float32) * self.scale_O).astype(dtype)


@struct.dataclass
class QuantizedArrayOI:
  """QuantizedArray of an [out, in] kernel (LlamaConfig.kernels_out_in)."""
  values_OI: jax.Array  # int8 [out, in]
  scale_O: jax.Array  # float32 [out]

  @property
  def shape(self):
    return self.values_OI.shape

  def dequantize(self, dtype=jnp.float32) -> jax.Array:
    return (self.values_OI.astype(jnp.float32) * self.scale_O[:, None]).astype(dtype)


def quantize_int8(w_IO: jax.Array) -> QuantizedArray:
  w = jnp.asarray(w_IO, jnp.float32)
  absmax_O = jnp.max(jnp.abs(w), axis=0)
  scale_O = jnp.where(absmax_O > 0, absmax_O / 127.0, 1.0)
  values = jnp.clip(jnp.round(w / scale_O), -127, 127).astype(jnp.int8)
  return QuantizedArray(values, scale_O)


def quantize_int8_out_in(w_OI: jax.Array) -> QuantizedArrayOI:
  q = quantize_int8(jnp.asarray(w_OI).T)
  return QuantizedArrayOI(q.values_IO.T, q.scale_O)


def dense(x_NI: jax.Array, w, *, out_in: bool = False) -> jax.Array:
  """x @ w for a plain [in, out] array ([out, in] if out_in) or an int8 QuantizedArray(OI)
  of that orientation (scale applied after the matmul)."""
  if isinstance(w, (QuantizedArray, QuantizedArrayOI)):
    if isinstance(w, QuantizedArrayOI) != out_in:
      raise ValueError(f"dense: a {type(w).__name__} kernel with out_in={out_in}")
    values = w.values_OI if out_in else w.values_IO
    y = dense(x_NI, values.astype(x_NI.dtype), out_in=out_in)
    return y * w.scale_O.astype(y.dtype)
  return jnp.einsum("...i,oi->...o" if out_in else "...i,io->...o", x_NI, w)


def _names(path) -> list[str]:
  return [str(getattr(k, "key", getattr(k, "name", k))) for k in path]


def _is_kernel(path, leaf) -> bool:
  names = _names(path)
  return bool({"kernel", "kernel_OI"} & set(names)) and getattr(leaf, "ndim", 0) == 2


def quantize_params(params, should_quantize: Callable = _is_kernel):
  """Returns params with every leaf selected by should_quantize(path, leaf) int8-quantized.

  By default: every 2-D leaf on a path containing `kernel` or `kernel_OI` (the projection
  matrices, each in its own orientation); embeddings and norms stay in float.
  """
  def maybe_quantize(path, leaf):
    if not should_quantize(path, leaf):
      return leaf
    return quantize_int8_out_in(leaf) if "kernel_OI" in _names(path) else quantize_int8(leaf)
  return jax.tree_util.tree_map_with_path(maybe_quantize, params)
