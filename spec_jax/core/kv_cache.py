"""The KV cache: an explicit pytree of fixed-shape arrays, plus masks built from positions.

Slots are absolute positions: the token at position p of a row lives in slot p of that
row. A row's `length` counts its valid slots; anything beyond is stale and masked, and
gets overwritten later. Rolling back after a rejected draft is therefore only a change
of `length` (see docs/design.md, "Invariants").

K and V share one layout, [layers, batch, kv_heads, head_dim, slots], slots minor: at decode
and verification widths over several rows the attention scores are a multiply-and-reduce
over head_dim whose inner loop runs along contiguous slots (models/llama.py,
`cache_scores`), not batch x kv_heads tiny dots; and a layer's K or V is one contiguous
[batch, kv_heads, head_dim, slots] block.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import struct


SLOT_AXIS = 4  # slots in k_LBKES and v_LBKES


@struct.dataclass
class KVCache:
  k_LBKES: jax.Array  # [layers, batch, kv_heads, head_dim, slots]
  v_LBKES: jax.Array  # [layers, batch, kv_heads, head_dim, slots]
  length_B: jax.Array  # [batch] int32: number of valid slots per row

  @property
  def max_len(self) -> int:
    return self.k_LBKES.shape[SLOT_AXIS]

  @property
  def batch_size(self) -> int:
    return self.k_LBKES.shape[1]

  @classmethod
  def zeros(cls, *, num_layers: int, batch_size: int, max_len: int, num_kv_heads: int,
            head_dim: int, dtype=jnp.float32) -> "KVCache":
    shape = (num_layers, batch_size, num_kv_heads, head_dim, max_len)
    return cls(jnp.zeros(shape, dtype), jnp.zeros(shape, dtype),
               jnp.zeros((batch_size,), jnp.int32))

  def with_length(self, length_B: jax.Array) -> "KVCache":
    return self.replace(length_B=jnp.asarray(length_B, jnp.int32))


def write_rows(cache_LBKES: jax.Array, slots_BT: jax.Array, values_BTKE: jax.Array,
               layer: int) -> jax.Array:
  """Writes T new tokens' K or V into one layer at per-row slots; slots outside are dropped.

  For each row b and token t, values[b, t] ([kv_heads, head_dim]) lands at slot slots[b, t]
  of cache[layer, b]. One scatter into the stacked buffer, so under jit (and in a loop carry)
  it updates in place instead of copying the whole cache every step.
  """
  batch_idx_B1 = jnp.arange(cache_LBKES.shape[1])[:, None]
  # The integer indices are not adjacent (kv_heads and head_dim lie between batch and
  # slots), so by NumPy's rule their broadcast dims [B, T] lead the indexed shape and the
  # sliced dims follow: [B, T, kv_heads, head_dim].
  index = (layer, batch_idx_B1, slice(None), slice(None), slots_BT)
  return cache_LBKES.at[index].set(values_BTKE.astype(cache_LBKES.dtype), mode="drop")


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
