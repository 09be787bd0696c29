"""MTP (DeepSeek-V3 multi-token prediction modules) as a drafter: module k drafts d_k.

Module k's element i pairs h^{k-1}_i (h^0: the target's hidden state) with x_{i+k}, sits at
position i of the module's own cache layer (each module attends over its own sequence of
h^k), and predicts x_{i+k+1}. With the pending token x_L, module k at i = L-1 reads
x_{L-1+k}, which is d_{k-1} for k > 1, and predicts x_{L+k} = d_k: gamma <= K drafts,
one module each, in order.

Cache bookkeeping (fixed shapes, rollback by overwriting). Module k's entry i is exact
once x_{i+k} is known and h^{k-1}_i is exact, i.e. for i <= L-k when x_L is the newest known
token. Its entries L-k+1 .. L-1 need drafts and are provisional. So each round, in module
order, every module runs the same window of 2*gamma positions L-2*gamma .. L-1, with
h^{k-1} from the previous module's window (true target features for k = 1, kept by
position as in EAGLE) and tokens x_{i+k} from the known sequence up to x_L and from this
round's drafts beyond. Why 2*gamma: after the previous round (started at L_prev >=
L-gamma-1) module k's first non-exact entry is L_prev-k+1 >= L-2*gamma, so the window
rewrites every entry that the last verify made known or that last round's drafts wrote,
and re-derives the rest (a no-op up to round-off). Padding positions below 0 are
computed but never stored. The state needs no gamma at init: the prompt runs through all
K modules (entries past each prompt's end are garbage that the first window rewrites).
Cost per round: gamma module passes over 2*gamma tokens each.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from flax import struct

from spec_jax.drafters.base import DraftContext, Drafter, PromptInfo, RoundOutcome
from spec_jax.drafters.eagle import (gather_positions, prompt_features, store_verified_features,
                                     window_positions)
from spec_jax.drafters.medusa import draw
from spec_jax.kv_cache import KVCache
from spec_jax.sampling import SamplingConfig


@struct.dataclass
class MTPState:
  cache: KVCache  # layer k-1 is module k's; entries below length_B are exact in every module used
  features_BSD: jax.Array  # target hidden states by position, valid below the target's length


@dataclasses.dataclass(frozen=True)
class MTPDrafter(Drafter):
  model: object  # models.drafter_heads.MTPModel (hashable); params: HeadParams

  @property
  def vocab_size(self) -> int:
    return self.model.vocab_size

  def check(self, target, gamma: int) -> None:
    super().check(target, gamma)
    if gamma > self.model.num_modules:
      raise ValueError(f"MTP with {self.model.num_modules} modules drafts at most that many "
                       f"tokens per round, got gamma={gamma}")

  def init(self, params, prompt: PromptInfo) -> MTPState:
    features_BSD = prompt_features(prompt)
    tokens_BP = prompt.tokens_BP
    batch, width = tokens_BP.shape
    positions_BP = jnp.broadcast_to(jnp.arange(width, dtype=jnp.int32), (batch, width))
    cache = self.model.init_cache(batch, prompt.cache_len)
    _, cache = self.model.apply(params, features_BSD[:, :width], tokens_BP, positions_BP, cache)
    num_modules = self.model.num_modules
    return MTPState(cache.with_length(jnp.maximum(prompt.lengths_B - num_modules, 0)),
                    features_BSD)

  def propose(self, params, state: MTPState, ctx: DraftContext, gamma: int,
              sampling: SamplingConfig, key: jax.Array):
    pos_B = ctx.position_B
    keys = jax.random.split(key, gamma)
    pos_BW = window_positions(pos_B, 2 * gamma)
    h_BWD = gather_positions(state.features_BSD, pos_BW)
    cache = state.cache
    drafts_BG = jnp.zeros((pos_B.shape[0], gamma), jnp.int32)
    probs = []
    for k in range(1, gamma + 1):
      token_pos_BW = pos_BW + k  # module k reads x_{i+k}: known up to x_L, then drafts
      from_draft_BW = gather_positions(drafts_BG, token_pos_BW - pos_B[:, None] - 1)
      tokens_BW = jnp.where(token_pos_BW <= pos_B[:, None],
                            gather_positions(ctx.seq_BS, token_pos_BW), from_draft_BW)
      logits_BWV, h_BWD, cache = self.model.apply_module(params, k, h_BWD, tokens_BW, pos_BW,
                                                         cache)
      d_B, q_BV = draw(keys[k - 1], logits_BWV[:, -1], sampling)
      drafts_BG = drafts_BG.at[:, k - 1].set(d_B)
      probs.append(q_BV)
    probs_BGV = None if sampling.is_greedy else jnp.stack(probs, axis=1)
    # module k is exact for i <= L-k: below L-gamma+1 in all of the modules used
    cache = cache.with_length(jnp.maximum(pos_B - gamma + 1, 0))
    return drafts_BG, probs_BGV, MTPState(cache, state.features_BSD)

  def commit(self, params, state: MTPState, outcome: RoundOutcome) -> MTPState:
    return state.replace(features_BSD=store_verified_features(state.features_BSD, outcome))
