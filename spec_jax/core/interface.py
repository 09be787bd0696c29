"""The functional model interface: what every decoding loop and drafter needs of a model.

spec_jax never imports a model class. A model reaches the loops as a frozen, hashable
handle (a jit static argument) plus a params pytree (a traced argument, never a constant):

    logits_BTV, hidden_BTD, cache = model.apply(params, tokens_BT, positions_BT, cache)

See docs/design.md ("The functional model interface") and spec_jax.models.llama.LlamaModel.
"""

from __future__ import annotations

from typing import Protocol

import jax

from spec_jax.core.kv_cache import KVCache


class CausalLM(Protocol):
  """A causal language model as pure functions over an explicit KV cache."""
  vocab_size: int
  max_seq_len: int

  def init_cache(self, batch_size: int, max_len: int) -> KVCache: ...

  def apply(self, params, tokens_BT, positions_BT, cache,
            **kw) -> tuple[jax.Array, jax.Array, KVCache]:
    """kw: slots_BT, mask_BTS (token trees), last_logits_only (logits [B,1,V] of the last
    token alone: what drafters' windows ask for)."""
