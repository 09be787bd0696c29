"""A separate (small) draft model with its own KV cache, drafting gamma tokens in a lax.scan.

Cache bookkeeping: at the start of a round the target holds every token before the
pending one (positions < L). The draft's first step feeds two tokens, the one at L-1 and
the pending one at L. Rewriting slot L-1 is a no-op after a partial acceptance and is
the catch-up after a full one (the last draft was never fed to the draft model). So the
rounds have fixed shapes whatever was accepted, and rollback is only a length.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from flax import struct

from spec_jax.drafters.base import DraftContext, Drafter, PromptInfo, RoundOutcome
from spec_jax.generate import prefill
from spec_jax.core.kv_cache import KVCache
from spec_jax.core.sampling import SamplingConfig, sample, warped_probs


@struct.dataclass
class DraftModelState:
  cache: KVCache


@dataclasses.dataclass(frozen=True)
class DraftModelDrafter(Drafter):
  model: object  # a CausalLM (see spec_jax.generate.CausalLM), hashable

  @property
  def vocab_size(self) -> int:
    return self.model.vocab_size

  def check(self, target, gamma: int) -> None:
    super().check(target, gamma)
    if self.model.max_seq_len < 1:
      raise ValueError("draft model has no context")

  def init(self, params, prompt: PromptInfo) -> DraftModelState:
    # the target's own prefill, run on the draft model (its last logits are unused)
    _, _, cache = prefill(self.model, params, prompt.tokens_BP, prompt.lengths_B,
                          prompt.cache_len)
    return DraftModelState(cache)

  def propose(self, params, state: DraftModelState, ctx: DraftContext, gamma: int,
              sampling: SamplingConfig, key: jax.Array):
    pos_B = ctx.position_B
    prev_B = jnp.take_along_axis(ctx.seq_BS, (pos_B - 1)[:, None], axis=1)[:, 0]
    keys = jax.random.split(key, gamma)

    def draw(logits_BV, step_key):
      token_B = sample(step_key, logits_BV, sampling)
      probs_BV = None if sampling.is_greedy else warped_probs(logits_BV, sampling)
      return token_B, probs_BV

    tokens_B2 = jnp.stack([prev_B, ctx.pending_B], axis=1)
    positions_B2 = jnp.stack([pos_B - 1, pos_B], axis=1)
    logits_B2V, _, cache = self.model.apply(params, tokens_B2, positions_B2, state.cache)
    first_B, first_probs_BV = draw(logits_B2V[:, 1], keys[0])

    def step(carry, inputs):
      cache, token_B = carry
      step_key, offset = inputs
      logits_B1V, _, cache = self.model.apply(params, token_B[:, None],
                                              (pos_B + offset)[:, None], cache)
      next_B, probs_BV = draw(logits_B1V[:, 0], step_key)
      return (cache, next_B), (next_B, probs_BV)

    (cache, _), (rest_GB, rest_probs_GBV) = jax.lax.scan(
        step, (cache, first_B), (keys[1:], jnp.arange(1, gamma, dtype=jnp.int32)))
    tokens_BG = jnp.concatenate([first_B[:, None], rest_GB.T], axis=1)
    probs_BGV = None
    if not sampling.is_greedy:
      probs_BGV = jnp.concatenate([first_probs_BV[:, None], rest_probs_GBV.transpose(1, 0, 2)], 1)
    return tokens_BG, probs_BGV, DraftModelState(cache)

  def commit(self, params, state: DraftModelState, outcome: RoundOutcome) -> DraftModelState:
    # Slots L-1 .. L+gamma-1 were written with [prev, pending, d_1..d_{gamma-1}]; those up to
    # the last accepted draft are valid, and never more than the target keeps.
    gamma = outcome.draft_tokens_BG.shape[1]
    pos_B = outcome.context.position_B
    valid_B = pos_B + 1 + jnp.minimum(outcome.num_accepted_B, gamma - 1)
    return DraftModelState(state.cache.with_length(
        jnp.minimum(valid_B, outcome.new_target_length_B)))
