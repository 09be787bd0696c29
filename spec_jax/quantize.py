"""Weight-only int8 quantization as a function over a params pytree.

Each selected weight matrix `[in, out]` becomes int8 values plus one float scale per
output channel (symmetric, absmax / 127). Models multiply through `dense`, which accepts
either a plain array or a `QuantizedArray`, so any model that routes its matmuls through
`dense` runs quantized without a second definition.
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


def quantize_int8(w_IO: jax.Array) -> QuantizedArray:
  w = jnp.asarray(w_IO, jnp.float32)
  absmax_O = jnp.max(jnp.abs(w), axis=0)
  scale_O = jnp.where(absmax_O > 0, absmax_O / 127.0, 1.0)
  values = jnp.clip(jnp.round(w / scale_O), -127, 127).astype(jnp.int8)
  return QuantizedArray(values, scale_O)


def dense(x_NI: jax.Array, w) -> jax.Array:
  """x @ w for a plain [in, out] array or a QuantizedArray (scale applied after the matmul)."""
  if isinstance(w, QuantizedArray):
    y = jnp.einsum("...i,io->...o", x_NI, w.values_IO.astype(x_NI.dtype))
    return y * w.scale_O.astype(y.dtype)
  return jnp.einsum("...i,io->...o", x_NI, w)


def _is_kernel(path, leaf) -> bool:
  names = [str(getattr(k, "key", getattr(k, "name", k))) for k in path]
  return bool(names) and "kernel" in names and getattr(leaf, "ndim", 0) == 2


def quantize_params(params, should_quantize: Callable = _is_kernel):
  """Returns params with every leaf selected by should_quantize(path, leaf) int8-quantized.

  By default: every 2-D leaf on a path containing `kernel` (the projection matrices);
  embeddings and norms stay in float.
  """
  def maybe_quantize(path, leaf):
    return quantize_int8(leaf) if should_quantize(path, leaf) else leaf
  return jax.tree_util.tree_map_with_path(maybe_quantize, params)
