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
from spec_jax.drafters.common import autoregressive_drafts, feed_tokens_before_pending
from spec_jax.generate import at_positions, prefill, prefill_all
from spec_jax.core.kv_cache import KVCache
from spec_jax.drafters.registry import (BuildOptions, DrafterFamily, DrafterSizes, Trained,
                                        TreeOptions, register)
from spec_jax.losses import TargetOutputs, positions_of, token_loss
from spec_jax.models.llama import LlamaConfig, LlamaModel
from spec_jax.core.sampling import SamplingConfig


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

  def init_with_first_logits(self, params, prompt: PromptInfo, positions_BA):
    # the prefill's logits at those positions: its next token's distribution after each
    logits_BPV, _, cache = prefill_all(self.model, params, prompt.tokens_BP, prompt.lengths_B,
                                       prompt.cache_len)
    return (DraftModelState(cache), at_positions(logits_BPV, positions_BA),
            jnp.ones(positions_BA.shape, bool))

  @property
  def guesses_at_init(self) -> bool:
    return True

  def propose(self, params, state: DraftModelState, ctx: DraftContext, gamma: int,
              sampling: SamplingConfig, key: jax.Array):
    pos_B = ctx.position_B
    prev_B = jnp.take_along_axis(ctx.seq_BS, (pos_B - 1)[:, None], axis=1)[:, 0]
    tokens_B2 = jnp.stack([prev_B, ctx.pending_B], axis=1)
    positions_B2 = jnp.stack([pos_B - 1, pos_B], axis=1)
    logits_B1V, _, cache = self.model.apply(params, tokens_B2, positions_B2, state.cache,
                                            last_logits_only=True)

    def step(cache, token_B, offset):
      logits_B1V, _, cache = self.model.apply(params, token_B[:, None],
                                              (pos_B + offset)[:, None], cache)
      return cache, logits_B1V[:, 0]

    tokens_BG, probs_BGV, cache = autoregressive_drafts(step, cache, logits_B1V[:, 0], gamma,
                                                        sampling, key, ctx.history,
                                                        ctx.max_drafts)
    return tokens_BG, probs_BGV, DraftModelState(cache)

  def catch_up(self, params, state: DraftModelState, ctx: DraftContext, gamma: int,
               sampling: SamplingConfig, key: jax.Array) -> DraftModelState:
    # a round without drafts: feeding [prev, pending] (propose's first pass) is all the
    # cache needs; commit then keeps slots up to L
    pos_B = ctx.position_B
    prev_B = jnp.take_along_axis(ctx.seq_BS, (pos_B - 1)[:, None], axis=1)[:, 0]
    _, _, cache = self.model.apply(params, jnp.stack([prev_B, ctx.pending_B], axis=1),
                                   jnp.stack([pos_B - 1, pos_B], axis=1), state.cache)
    return DraftModelState(cache)

  @property
  def skips_rounds(self) -> bool:
    return True

  def catch_up_after(self, params, state: DraftModelState, ctx: DraftContext, rounds: int,
                     gamma: int) -> DraftModelState:
    # Before the stretch, slots up to L0 - 2 held (L0: its first pending position); the
    # stretch added at most `rounds` tokens. Feeding slots L - rounds - 1 .. L - 1 in one pass
    # leaves every slot before the pending one right.
    return DraftModelState(
        feed_tokens_before_pending(self.model, params, state.cache, ctx, rounds + 1))

  @property
  def has_hindsight(self) -> bool:
    return True

  @property
  def has_sampled_hindsight(self) -> bool:
    return True  # (its catch-up has the model's logits: common.hindsight_scores)

  def catch_up_with_hindsight(self, params, state: DraftModelState, ctx: DraftContext,
                              rounds: int, gamma: int):
    # the catch-up's second pass has the model's logits at the last fed positions: its
    # greedy guess of each next token, all of them known (the last fed position is L - 1,
    # whose next token is the pending one)
    cache, agree_BA = feed_tokens_before_pending(self.model, params, state.cache, ctx,
                                                 rounds + 1, hindsight=True)
    return DraftModelState(cache), agree_BA

  def commit(self, params, state: DraftModelState, outcome: RoundOutcome) -> DraftModelState:
    # Slots L-1 .. L+gamma-1 were written with [prev, pending, d_1..d_{gamma-1}]; those up to
    # the last accepted draft are valid, and never more than the target keeps.
    gamma = outcome.draft_tokens_BG.shape[1]
    pos_B = outcome.context.position_B
    valid_B = pos_B + 1 + jnp.minimum(outcome.num_accepted_B, gamma - 1)
    return DraftModelState(state.cache.with_length(
        jnp.minimum(valid_B, outcome.new_target_length_B)))


# --- the family ---------------------------------------------------------------------------------

def new_draft_model(target, sizes: DrafterSizes):
  """A small Llama shaped after the target: `sizes.layers` layers of width `sizes.dim`
  (default half the target's), the target's head_dim and vocabulary."""
  cfg = target.config
  dim = sizes.dim or max(cfg.dim // 2, 8)
  head_dim = cfg.resolved_head_dim
  heads = max(1, dim // head_dim)
  small = dataclasses.replace(cfg, dim=dim, n_layers=sizes.layers, n_heads=heads,
                              n_kv_heads=heads // 2 if heads % 2 == 0 else heads,
                              head_dim=head_dim, hidden_dim=sizes.hidden or 2 * dim)
  return LlamaModel(small)


def _model_from_config(config: dict):
  return LlamaModel(LlamaConfig.from_dict(config))


def draft_model_loss(model, params, t: TargetOutputs, rng=None, *, token: str = "kl"):
  """A separate draft model (a CausalLM) on the same tokens: logits at t vs the target's."""
  batch, length = t.tokens_BT.shape
  logits_BTV, _, _ = model.apply(params, t.tokens_BT, positions_of(t),
                                 model.init_cache(batch, length))
  loss, agree = token_loss(logits_BTV, t, 1, token)
  return loss, {"token_loss": loss, "agree_1": agree}


def _tree_drafter(model, tree: TreeOptions):
  from spec_jax.drafters.draft_model_tree import DraftModelTreeDrafter
  return DraftModelTreeDrafter(model, tree.depth, tree.top_k, tree.nodes)


def _build(target, target_params, opts: BuildOptions):
  if opts.draft_model is None or opts.draft_params is None:
    raise ValueError("drafter 'draft_model' needs draft_model and draft_params (or a "
                     "checkpoint written by scripts/train_drafter.py --export-dir)")
  if opts.tree is not None:
    return _tree_drafter(opts.draft_model, opts.tree), opts.draft_params
  return DraftModelDrafter(opts.draft_model), opts.draft_params


register(DrafterFamily(
    name="draft_model", summary="a separate small draft model with its own KV cache",
    build=_build, tree=True, combinable=True, options=("draft_model", "draft_params"),
    trained=Trained(new_model=new_draft_model, model_from_config=_model_from_config,
                    chain=DraftModelDrafter, tree=_tree_drafter, loss=draft_model_loss,
                    reads_target_head=False)))
