"""The KV cache: an explicit pytree of fixed-shape arrays, plus masks built from positions.

Slots are absolute positions: the token at position p of a row lives in slot p of that
row. A row's `length` counts its valid slots; anything beyond is stale and masked, and
gets overwritten later. Rolling back after a rejected draft is therefore only a change
of `length` (see DESIGN.md, "Rollback is a length, not a copy").
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import struct


@struct.dataclass
class KVCache:
  k_LBSKH: jax.Array  # [layers, batch, slots, kv_heads, head_dim]
  v_LBSKH: jax.Array
  length_B: jax.Array  # [batch] int32: number of valid slots per row

  @property
  def max_len(self) -> int:
    return self.k_LBSKH.shape[2]

  @property
  def batch_size(self) -> int:
    return self.k_LBSKH.shape[1]

  @classmethod
  def zeros(cls, *, num_layers: int, batch_size: int, max_len: int, num_kv_heads: int,
            head_dim: int, dtype=jnp.float32) -> "KVCache":
    shape = (num_layers, batch_size, max_len, num_kv_heads, head_dim)
    return cls(jnp.zeros(shape, dtype), jnp.zeros(shape, dtype),
               jnp.zeros((batch_size,), jnp.int32))

  def with_length(self, length_B: jax.Array) -> "KVCache":
    return self.replace(length_B=jnp.asarray(length_B, jnp.int32))


def write_rows(cache_LBSKH: jax.Array, slots_BT: jax.Array, values_BTKH: jax.Array,
               layer: int) -> jax.Array:
  """Writes values[b, t] into cache[layer, b, slots[b, t]]; slots outside are dropped.

  One scatter into the stacked buffer, so under jit (and in a loop carry) it updates in
  place instead of copying the whole cache every step.
  """
  batch_idx = jnp.arange(cache_LBSKH.shape[1])[:, None]
  return cache_LBSKH.at[layer, batch_idx, slots_BT].set(
      values_BTKH.astype(cache_LBSKH.dtype), mode="drop")


def causal_mask(positions_BT: jax.Array, max_len: int) -> jax.Array:
  """mask[b, t, s]: query at positions[b, t] may attend to slot s (slot == position).

  Slots beyond the query's own position are stale or in its future, so masked.
  Padding queries (position < 0) see nothing and produce garbage nobody reads.
  """
  slots_S = jnp.arange(max_len, dtype=jnp.int32)
  return slots_S[None, None, :] <= positions_BT[:, :, None]


def tree_mask(cache_length_B: jax.Array, ancestor_TM: jax.Array, max_len: int) -> jax.Array:
  """Mask for T queries over a block of M slots written at length..length+M-1.

  Each query sees the committed prefix (slots < length) and the block slots j with
  ancestor[i, j] (for a token tree with node i at slot length+i: node j is node i or one
  of its ancestors). `ancestor` is [T, M] shared by all rows, or [B, T, M] per row
  (dynamic trees); M may exceed T when only some nodes of the block are queried.
  """
  slots_S = jnp.arange(max_len, dtype=jnp.int32)
  prefix_BS = slots_S[None, :] < cache_length_B[:, None]
  offset_BS = slots_S[None, :] - cache_length_B[:, None]  # index of the block slot s
  block_len = ancestor_TM.shape[-1]
  in_block_BS = (offset_BS >= 0) & (offset_BS < block_len)
  node_BS = jnp.clip(offset_BS, 0, block_len - 1)
  if ancestor_TM.ndim == 2:
    # block_BTS[b, i, s] = ancestor[i, node(b, s)] for slots inside the block
    block_BTS = jnp.take(ancestor_TM, node_BS, axis=1).transpose(1, 0, 2)
  else:
    num_queries = ancestor_TM.shape[1]
    node_BTS = jnp.broadcast_to(node_BS[:, None, :], (node_BS.shape[0], num_queries, max_len))
    block_BTS = jnp.take_along_axis(ancestor_TM, node_BTS, axis=2)
  return prefix_BS[:, None, :] | (in_block_BS[:, None, :] & block_BTS)
