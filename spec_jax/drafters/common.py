"""What several drafter families share, written once: drawing a draft from warped logits, the
autoregressive draft scan, ranking tree children, and target-feature bookkeeping."""

from __future__ import annotations

from typing import Any, Callable

import jax
import jax.numpy as jnp

from spec_jax.core.sampling import (SamplingConfig, TokenHistory, acceptance_probability,
                                    greedy, process_logits, sample, token_acceptance,
                                    warp_logits, warped_probs)
from spec_jax.drafters.base import HINDSIGHT_WIDTH, DraftContext, PromptInfo, RoundOutcome
from spec_jax.generate import at_positions, last_position


def draw(key: jax.Array, logits_BV: jax.Array, sampling: SamplingConfig,
         history: TokenHistory | None = None):
  """-> (token [B], the warped probs [B, V] it was drawn from, or None when greedy).

  With a history (DraftContext.history, pushed past the earlier drafts) the logits are
  first processed as the target's are (penalties, min_new_tokens), so drafts agree more.
  """
  logits_BV = process_logits(logits_BV, sampling, history)
  token_B = sample(key, logits_BV, sampling)
  return token_B, (None if sampling.is_greedy else warped_probs(logits_BV, sampling))


def autoregressive_drafts(step: Callable[[Any, jax.Array, jax.Array], tuple[Any, jax.Array]],
                          carry, first_logits_BV: jax.Array, gamma: int,
                          sampling: SamplingConfig, key: jax.Array,
                          history: TokenHistory | None = None, limit: jax.Array | None = None):
  """Draws d_1 from `first_logits_BV`, then d_2..d_gamma in a lax.scan.

  `limit` ([] int, DraftContext.max_drafts): drafts past it will not be verified, so a
  while_loop stops there, as if gamma were `limit`; the tokens past it are 0 (probs 0).

  `step(carry, token_B, offset) -> (carry, logits_BV)` feeds draft `offset` (1-based) to the
  drafter and returns its logits for the next one. Each draft is drawn from its own warped
  distribution given the context and the earlier drafts only, as the lossless contract asks
  (processed with `history`, the round's DraftContext.history, pushed past each draft).
  -> (tokens [B, gamma], probs [B, gamma, V] or None when greedy, final carry).
  """
  keys = jax.random.split(key, gamma)
  first_B, first_probs_BV = draw(keys[0], first_logits_BV, sampling, history)
  history = None if history is None else history.push(first_B)

  if limit is not None:
    return _drafts_up_to(step, carry, first_B, first_probs_BV, gamma, sampling, keys, history,
                         jnp.clip(limit, 1, gamma))

  def scan_step(state, inputs):
    carry, token_B, history = state
    step_key, offset = inputs
    carry, logits_BV = step(carry, token_B, offset)
    next_B, probs_BV = draw(step_key, logits_BV, sampling, history)
    history = None if history is None else history.push(next_B)
    return (carry, next_B, history), (next_B, probs_BV)

  (carry, _, _), (rest_GB, rest_probs_GBV) = jax.lax.scan(
      scan_step, (carry, first_B, history), (keys[1:], jnp.arange(1, gamma, dtype=jnp.int32)))
  tokens_BG = jnp.concatenate([first_B[:, None], rest_GB.T], axis=1)
  probs_BGV = None
  if not sampling.is_greedy:
    probs_BGV = jnp.concatenate([first_probs_BV[:, None], rest_probs_GBV.transpose(1, 0, 2)], 1)
  return tokens_BG, probs_BGV, carry


def _drafts_up_to(step, carry, first_B, first_probs_BV, gamma, sampling, keys, history, limit):
  """autoregressive_drafts' scan as a while_loop over offsets 1..limit-1 (same keys, so the
  same drafts as the scan up to the limit)."""
  batch = first_B.shape[0]
  tokens_GB = jnp.zeros((gamma, batch), jnp.int32).at[0].set(first_B)
  probs_GBV = None
  if first_probs_BV is not None:
    probs_GBV = jnp.zeros((gamma, *first_probs_BV.shape), first_probs_BV.dtype)
    probs_GBV = probs_GBV.at[0].set(first_probs_BV)

  def body(c):
    offset, carry, token_B, history, tokens_GB, probs_GBV = c
    carry, logits_BV = step(carry, token_B, offset)
    next_B, probs_BV = draw(keys[offset], logits_BV, sampling, history)
    history = None if history is None else history.push(next_B)
    tokens_GB = tokens_GB.at[offset].set(next_B)
    probs_GBV = None if probs_GBV is None else probs_GBV.at[offset].set(probs_BV)
    return offset + 1, carry, next_B, history, tokens_GB, probs_GBV

  _, carry, _, _, tokens_GB, probs_GBV = jax.lax.while_loop(
      lambda c: c[0] < limit, body, (jnp.int32(1), carry, first_B, history, tokens_GB, probs_GBV))
  return tokens_GB.T, None if probs_GBV is None else probs_GBV.transpose(1, 0, 2), carry


def tree_log_probs(logits_NV: jax.Array, sampling: SamplingConfig,
                   history: TokenHistory | None = None, depth=0) -> jax.Array:
  """What tree drafters rank children by: the warped log-probs, or plain ones when greedy
  (greedy warping is one-hot, which would leave nothing to rank the other children by).

  With the round's history the logits are processed first: the root's ([B, V], depth 0)
  exactly as the target's; a level's ([B, T, V], its nodes at `depth`, an int or [T]) with
  the round's counts (not each node's path: any ranking keeps trees lossless).
  """
  if history is not None:
    logits_NV = process_logits(logits_NV, sampling,
                               history if logits_NV.ndim == 2 else history.ahead(depth))
  if sampling.is_greedy:
    return jax.nn.log_softmax(logits_NV.astype(jnp.float32), axis=-1)
  return warp_logits(logits_NV, sampling)


# --- target features ---------------------------------------------------------------------------

def _needs_hidden(what: str):
  return ValueError(f"this drafter needs the target's hidden states ({what})")


def last_hidden(prompt: PromptInfo) -> jax.Array:
  """[B, D] target hidden state at each prompt's last position."""
  if prompt.target_hidden_BPD is None:
    raise _needs_hidden("PromptInfo.target_hidden_BPD")
  return last_position(prompt.target_hidden_BPD, prompt.lengths_B)


def hidden_before_pending(outcome: RoundOutcome, old_BD: jax.Array) -> jax.Array:
  """[B, D] the verify block's hidden state just before the new pending token (old if none)."""
  if outcome.target_hidden_BG1D is None:
    raise _needs_hidden("RoundOutcome.target_hidden_BG1D")
  idx_B = outcome.new_target_length_B - 1 - outcome.context.position_B
  width = outcome.target_hidden_BG1D.shape[1]
  new_BD = jnp.take_along_axis(outcome.target_hidden_BG1D,
                               jnp.clip(idx_B, 0, width - 1)[:, None, None], axis=1)[:, 0]
  return jnp.where((idx_B >= 0)[:, None], new_BD, old_BD)  # rows that kept nothing stay


def prompt_features(prompt: PromptInfo, dtype=None) -> jax.Array:
  """[B, cache_len, D] target features by position, filled with the prompt's."""
  hidden_BPD = prompt.target_hidden_BPD
  if hidden_BPD is None:
    raise _needs_hidden("PromptInfo.target_hidden_BPD")
  batch, width, dim = hidden_BPD.shape
  features_BSD = jnp.zeros((batch, prompt.cache_len, dim), dtype or hidden_BPD.dtype)
  return features_BSD.at[:, :width].set(hidden_BPD.astype(features_BSD.dtype))


def store_features_at(features_BSD: jax.Array, hidden_BWD: jax.Array, positions_BW: jax.Array,
                      keep_BW: jax.Array) -> jax.Array:
  """Writes hidden_BWD[b, w] at positions_BW[b, w] where keep_BW; elsewhere nothing."""
  slots_BW = jnp.where(keep_BW, positions_BW, features_BSD.shape[1])  # out of range: dropped
  return features_BSD.at[jnp.arange(features_BSD.shape[0])[:, None], slots_BW].set(
      hidden_BWD.astype(features_BSD.dtype), mode="drop")


def store_verified_features(features_BSD: jax.Array, outcome: RoundOutcome) -> jax.Array:
  """Writes the verify pass's features at positions L..L+gamma, only those the target kept."""
  hidden_BG1D = outcome.target_hidden_BG1D
  if hidden_BG1D is None:
    raise _needs_hidden("RoundOutcome.target_hidden_BG1D")
  width = hidden_BG1D.shape[1]
  pos_BG1 = outcome.context.position_B[:, None] + jnp.arange(width, dtype=jnp.int32)[None, :]
  return store_features_at(features_BSD, hidden_BG1D, pos_BG1,
                           pos_BG1 < outcome.new_target_length_B[:, None])


def store_step_features(features_BSD: jax.Array, hidden_BD: jax.Array, position_B: jax.Array,
                        fed_B: jax.Array) -> jax.Array:
  """Writes a plain step's target hidden state at position_B, on rows that fed it."""
  return store_features_at(features_BSD, hidden_BD[:, None], position_B[:, None],
                           fed_B[:, None])


def feed_tokens_before_pending(model, params, cache, ctx: DraftContext, width: int, *,
                               hindsight: bool = False):
  """A draft model's catch-up after a plain stretch: the `width` known tokens before the
  pending one (positions L-width .. L-1) through `model` in one pass -> its cache, valid
  below L. Clamped at 0 early on: repeated (token 0, position 0) entries write the same
  values. hindsight: -> (cache, agree_BA), whether the model's greedy next token at each of
  the last A = min(width, HINDSIGHT_WIDTH) of those positions is the token that followed,
  or in a sampled run its score there (hindsight_scores; Drafter.catch_up_with_hindsight):
  the window then runs as two passes, the second (the last A tokens, attending to what the
  first wrote) with outputs."""
  window_BW = jnp.maximum(
      ctx.position_B[:, None] + jnp.arange(-width, 0, dtype=jnp.int32)[None, :], 0)
  tokens_BW = jnp.take_along_axis(ctx.seq_BS, window_BW, axis=1)
  if not hindsight:  # (the logits are dead code)
    return model.apply(params, tokens_BW, window_BW, cache)[2].with_length(ctx.position_B)
  split = width - min(width, HINDSIGHT_WIDTH)
  if split:  # keys and values alone
    cache = model.apply(params, tokens_BW[:, :split], window_BW[:, :split], cache)[2]
  logits_BAV, _, cache = model.apply(params, tokens_BW[:, split:], window_BW[:, split:], cache)
  return (cache.with_length(ctx.position_B),
          hindsight_scores(logits_BAV, window_BW[:, split:] + 1, ctx))


def hindsight_scores(logits_BAV: jax.Array, followed_BA: jax.Array,
                     ctx: DraftContext) -> jax.Array:
  """How the first draft of a round started before each position in followed_BA ([B, A],
  of ctx.seq_BS, clipped into range as gather_positions does) would have fared, the draft's
  logits there [B, A, V] (teacher-forced): greedy, [B, A] bool, whether its greedy token is
  the one that followed; sampled (ctx.sampled_hindsight), [B, A] float32, min(1, q(y) / p(y))
  for the token y that followed, an unbiased estimate of the acceptance probability
  sum_x min(p, q) (SampledHindsight)."""
  token_BA = gather_positions(ctx.seq_BS, followed_BA)
  hindsight = ctx.sampled_hindsight
  if hindsight is None:
    return greedy(logits_BAV) == token_BA
  logq_BA = jnp.take_along_axis(warp_logits(logits_BAV, hindsight.sampling),
                                token_BA[..., None], axis=-1)[..., 0]
  p_BA = gather_positions(hindsight.followed_prob_BS, followed_BA)
  # (p(y) > 0 for a drawn y; the floor only keeps an unread slot's 0 from dividing; a draft
  # with non-finite logits scores 0, a miss, as greedy agreement counts it)
  score_BA = jnp.minimum(jnp.exp(logq_BA) / jnp.maximum(p_BA, 1e-30), 1.0)
  return jnp.where(jnp.isnan(score_BA), 0.0, score_BA)


def first_draft_scores(target_logits_BAV: jax.Array, draft_logits_BAV: jax.Array,
                       sampling: SamplingConfig) -> jax.Array:
  """How a round's first draft would fare where both distributions are known (a look at
  the prompt, whose next tokens are not samples of the target), [B, A]: greedy, bool,
  whether the draft's greedy token is the target's; sampled, float32, the exact acceptance
  probability sum_x min(p, q) of a draft from q (both warped as a round warps them; a
  draft with non-finite logits scores 0, a miss). draft_logits_BAV may instead be int
  [B, A], a deterministic drafter's draft (q one-hot: p of it, sampled), -1 where it has
  none (a miss)."""
  if jnp.issubdtype(draft_logits_BAV.dtype, jnp.integer):
    guess_BA = draft_logits_BAV
    if sampling.is_greedy:  # (-1, no draft, never equals a greedy token)
      return guess_BA == greedy(target_logits_BAV)
    return token_acceptance(warped_probs(target_logits_BAV, sampling),
                            guess_BA).astype(jnp.float32)
  if sampling.is_greedy:
    return greedy(draft_logits_BAV) == greedy(target_logits_BAV)
  return acceptance_probability(warped_probs(target_logits_BAV, sampling),
                                warped_probs(draft_logits_BAV, sampling))


def window_positions(position_B: jax.Array, width: int) -> jax.Array:
  """[B, width] positions L-width .. L-1 (negative ones are padding, never stored)."""
  return position_B[:, None] - width + jnp.arange(width, dtype=jnp.int32)[None, :]


def gather_positions(x_BS, positions_BW):
  """x[b, positions[b, w]] for [B, S] or [B, S, D] buffers, positions clipped into range."""
  return at_positions(x_BS, jnp.clip(positions_BW, 0, x_BS.shape[1] - 1))
