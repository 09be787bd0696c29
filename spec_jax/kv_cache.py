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


def tree_mask(cache_length_B: jax.Array, ancestor_TT: jax.Array, max_len: int) -> jax.Array:
  """Mask for a token tree written at slots length..length+T-1 (node i at slot length+i).

  Each node sees the committed prefix (slots < length) and its ancestors within the
  block (ancestor_TT[i, j]: node j is node i or an ancestor of node i).
  """
  slots_S = jnp.arange(max_len, dtype=jnp.int32)
  prefix_BS = slots_S[None, :] < cache_length_B[:, None]
  offset_BS = slots_S[None, :] - cache_length_B[:, None]  # index of the node in slot s
  num_nodes = ancestor_TT.shape[0]
  in_block_BS = (offset_BS >= 0) & (offset_BS < num_nodes)
  node_BS = jnp.clip(offset_BS, 0, num_nodes - 1)
  # block_BTS[b, i, s] = ancestor[i, node(b, s)] for slots inside the block
  block_BTS = jnp.take(ancestor_TT, node_BS, axis=1).transpose(1, 0, 2)
  return prefix_BS[:, None, :] | (in_block_BS[:, None, :] & block_BTS)
