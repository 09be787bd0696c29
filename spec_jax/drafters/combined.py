"""Two drafters in one: per row, the primary's proposal where it vouches for it, else the other's.

Both drafters propose every round (fixed shapes), each row takes one of the two proposals,
and both commit the same, true outcome. In a round where every row takes the primary's, the
secondary only catches up (`Drafter.catch_up`: for the resynced draft model, nothing at all
until its next pass, which feeds what it missed). Typical: prompt lookup first, a draft
model where lookup finds no match, so repetitive rows copy and the others draft.

Lossless when sampling: the verifier must see the q each row's tokens were drawn from. A
row that takes a deterministic drafter's tokens (probs None) gets a one-hot q when the
other drafter has probs. The choice must be fixed before this round's tokens are drawn
(here: a function of the primary's state after proposing, e.g. whether lookup matched,
which depends on the context only); a choice that looked at the sampled drafts would make
q a different distribution.

With gamma="auto" a combination whose primary is prompt lookup (has_sources) is planned
source by source (spec_jax.adaptive.rounds.AdaptiveRound.sourced_plan): the rounds keep one
acceptance record per source, tell `propose` which rows may copy (DraftContext.primary_B:
where lookup matches and its record promises at least the model's), and price a round whose
rows all copy at lookup's cost.

Whatever each drafter keeps across rounds must stay right on rows that took the other's
tokens: `commit` sees the drafts the verifier saw, which there are not its own. A plain
DraftModelDrafter assumes they are (its cache keeps its own drafts up to the accepted
count), so inside a combination use ResyncDraftModelDrafter. Drafters that read the target's
hidden states (Medusa, EAGLE, MTP, DFlash, DSpark) keep only what the target verified, and
combine as they are (`lookup+eagle`).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

import jax
import jax.numpy as jnp
from flax import struct

from spec_jax.drafters.base import DraftContext, Drafter, PromptInfo, RoundOutcome
from spec_jax.drafters.draft_model import DraftModelDrafter, DraftModelState
from spec_jax.drafters.common import autoregressive_drafts, window_positions
from spec_jax.drafters.prompt_lookup import PromptLookupDrafter, found_match
from spec_jax.drafters.registry import BuildOptions, DrafterFamily, register
from spec_jax.core.control import cond_in_place, switch_in_place, zeros_like_outputs
from spec_jax.core.errors import BadArgument
from spec_jax.core.sampling import SamplingConfig


# A deferred catch-up's lag is fed in the resync's own pass, widened by the smallest of these
# that covers it (a pass of the tiny draft model costs about the same at 9 tokens as at 17:
# mostly its fixed cost); a lag past the widest is first fed in passes of that width.
LAG_WIDTHS = (0, 8, 32)


@dataclasses.dataclass(frozen=True)
class ResyncDraftModelDrafter(DraftModelDrafter):
  """A draft model that keeps only verified tokens in its cache, whoever drafted them.

  Each round its first step re-feeds the known tokens its cache lacks (slots length_B .. L,
  the pending one last: the last round's accepted drafts and the target's token, 2 to
  gamma + 1 of them), in the narrowest compiled window that covers every row's
  (resync_widths), and `commit` keeps only slots up to L. So its cache never holds a draft,
  and other drafters' tokens never reach it. The price: up to gamma + 1 tokens instead of 2
  in the first draft step.

  Rounds it sits out cost it nothing: `catch_up` and `catch_up_after` leave the cache as it
  is, valid below its length_B, and the next pass that reads the cache first feeds the
  known tokens it missed (one wider window where the lag fits LAG_WIDTHS). In a combination
  whose rows copy from lookup for several rounds running, that is one pass when the model
  next drafts instead of one window pass per round (0.7 ms against a 2.2 ms target step on
  the built-in pair), and none at all where it never drafts again.
  """

  def _resync(self, params, state: DraftModelState, ctx: DraftContext, gamma: int):
    """Feeds slots L - gamma .. L, and any before them the cache lacks -> (the pending
    token's logits [B, V], the cache, valid up to L)."""
    pos_B = ctx.position_B
    cache = fill_below(self.model, params, state.cache, ctx.seq_BS,
                       pos_B - gamma - LAG_WIDTHS[-1])
    widths = resync_widths(gamma)
    # slots length_B .. L are missing: the narrowest window that covers every row's
    need = jnp.max(pos_B + 1 - cache.length_B)  # <= widths[-1] after fill_below

    def window(width):
      def run(c):
        # slots L + 1 - width .. L, clamped at 0 early on: repeated (token 0, position 0)
        # entries write the same values
        window_BW = jnp.maximum(window_positions(pos_B + 1, width), 0)
        tokens_BW = jnp.take_along_axis(ctx.seq_BS, window_BW, axis=1)
        logits_B1V, _, cache = self.model.apply(params, tokens_BW, window_BW, c[1],
                                                last_logits_only=True)
        return logits_B1V[:, 0], cache
      return run

    pick = jnp.searchsorted(jnp.asarray(widths, jnp.int32), need)
    unused_BV = zeros_like_outputs(window(widths[0]), (None, cache))[0]
    logits_BV, cache = switch_in_place(pick, [window(w) for w in widths], (unused_BV, cache))
    return logits_BV, cache.with_length(pos_B + 1)

  def catch_up(self, params, state: DraftModelState, ctx: DraftContext, gamma: int,
               sampling: SamplingConfig, key: jax.Array) -> DraftModelState:
    return state  # deferred to the next pass (see the class docstring)

  def catch_up_after(self, params, state: DraftModelState, ctx: DraftContext, rounds: int,
                     gamma: int) -> DraftModelState:
    return state  # deferred, as catch_up

  def catch_up_with_hindsight(self, params, state: DraftModelState, ctx: DraftContext,
                              rounds: int, gamma: int):
    # its window (L - rounds - 1 .. L - 1) attends to every slot before it: fed first
    cache = fill_below(self.model, params, state.cache, ctx.seq_BS, ctx.position_B - rounds - 1)
    return super().catch_up_with_hindsight(params, DraftModelState(cache), ctx, rounds, gamma)

  def propose(self, params, state: DraftModelState, ctx: DraftContext, gamma: int,
              sampling: SamplingConfig, key: jax.Array):
    pos_B = ctx.position_B
    logits_BV, cache = self._resync(params, state, ctx, gamma)

    def step(cache, token_B, offset):
      logits_B1V, _, cache = self.model.apply(params, token_B[:, None],
                                              (pos_B + offset)[:, None], cache)
      return cache, logits_B1V[:, 0]

    tokens_BG, probs_BGV, cache = autoregressive_drafts(step, cache, logits_BV, gamma,
                                                        sampling, key, ctx.history,
                                                        ctx.max_drafts)
    return tokens_BG, probs_BGV, DraftModelState(cache)

  def commit(self, params, state: DraftModelState, outcome: RoundOutcome) -> DraftModelState:
    # valid up to L after a propose, below the lag after a round it sat out
    kept_B = jnp.minimum(state.cache.length_B, outcome.new_target_length_B)
    return DraftModelState(state.cache.with_length(kept_B))


def resync_widths(gamma: int) -> tuple[int, ...]:
  """The windows a resync may feed (tokens, the pending one last), narrowest first: after a
  round the model drafted in, it lacks the accepted drafts and the target's token (2 after
  a round that accepted one draft, gamma + 1 after one that accepted all); after rounds it
  sat out, a lag LAG_WIDTHS may widen the widest. A window of gamma + 1 every round cost a
  lookup + draft model combination at gamma_max 8 its rounds of one draft 0.6 ms more than
  the same rounds at gamma 1 (the built-in pair, a target step 1.7 ms)."""
  return tuple(sorted({min(w, gamma + 1) for w in (2, 5)}
                      | {gamma + 1 + extra for extra in LAG_WIDTHS}))


def fill_below(model, params, cache, seq_BS: jax.Array, upto_B: jax.Array):
  """A draft model's deferred catch-up: feeds the known tokens at slots length_B .. upto_B - 1
  (seq_BS's) in passes of LAG_WIDTHS[-1] tokens, as many as the longest lag needs (none
  when no row lags) -> the cache, valid below max(length_B, upto_B). Rows that lag less
  pad their pass with writes that land nowhere (slot max_len)."""
  width = LAG_WIDTHS[-1]

  def feed(cache):
    positions_BW = cache.length_B[:, None] + jnp.arange(width, dtype=jnp.int32)[None, :]
    needed_BW = positions_BW < upto_B[:, None]
    positions_BW = jnp.where(needed_BW, positions_BW, 0)
    tokens_BW = jnp.take_along_axis(seq_BS, positions_BW, axis=1)
    _, _, filled = model.apply(params, tokens_BW, positions_BW, cache,
                               slots_BT=jnp.where(needed_BW, positions_BW, cache.max_len))
    return filled.with_length(jnp.maximum(cache.length_B,
                                          jnp.minimum(cache.length_B + width, upto_B)))

  return jax.lax.while_loop(lambda c: jnp.any(c.length_B < upto_B), feed, cache)


@struct.dataclass
class FallbackState:
  primary: Any
  secondary: Any


def _q_or_one_hot(tokens_BG, probs_BGV, vocab: int):
  return jax.nn.one_hot(tokens_BG, vocab, dtype=jnp.float32) if probs_BGV is None else probs_BGV


@dataclasses.dataclass(frozen=True)
class FallbackDrafter(Drafter):
  """Rows where use_primary(primary state after proposing) holds take the primary's drafts.

  draft_params: (primary params, secondary params).
  """
  primary: Drafter
  secondary: Drafter
  use_primary: Callable[[Any], jax.Array] = found_match  # -> [B] bool

  @property
  def vocab_size(self) -> int | None:
    v = self.primary.vocab_size
    return self.secondary.vocab_size if v is None else v

  @property
  def max_gamma(self) -> int | None:
    limits = [m for m in (self.primary.max_gamma, self.secondary.max_gamma) if m is not None]
    return min(limits) if limits else None

  @property
  def feature_layers(self) -> tuple[int, ...]:
    # the target layers a DFlash or DSpark secondary reads besides the last (both parts see
    # one hidden-state layout, [last ; those layers]: check() keeps the primary off them)
    return tuple(self.secondary.feature_layers)

  def check_context(self, positions: int) -> None:
    for part in (self.primary, self.secondary):
      part.check_context(positions)

  def check(self, target, gamma: int) -> None:
    if self.primary.feature_layers:
      raise ValueError(f"{type(self).__name__}: the primary ({type(self.primary).__name__}) "
                       "reads target layers; only the secondary may")
    for part in (self.primary, self.secondary):
      part.check(target, gamma)
      if isinstance(part, DraftModelDrafter) and not isinstance(part, ResyncDraftModelDrafter):
        raise ValueError(f"{type(part).__name__} keeps its own drafts in its cache, wrong on rows "
                         "that took the other drafter's; combine ResyncDraftModelDrafter(model)")

  def extra_slots(self, gamma: int) -> int:
    return max(self.primary.extra_slots(gamma), self.secondary.extra_slots(gamma))

  def check_params(self, params, signature: tuple | None = None) -> None:
    if not isinstance(params, (tuple, list)) or len(params) != 2:
      raise BadArgument(f"draft params for {type(self).__name__}: expected (primary params, "
                        f"secondary params), got {type(params).__name__}")
    self.primary.check_params(params[0])
    self.secondary.check_params(params[1])

  def init(self, params, prompt: PromptInfo) -> FallbackState:
    return FallbackState(self.primary.init(params[0], prompt),
                         self.secondary.init(params[1], prompt))

  def init_with_first_logits(self, params, prompt: PromptInfo, positions_BA):
    # the secondary's first drafts (its record: see catch_up_with_hindsight)
    secondary, logits_BAV, has_BA = self.secondary.init_with_first_logits(params[1], prompt,
                                                                           positions_BA)
    state = FallbackState(self.primary.init(params[0], prompt), secondary)
    return (state, logits_BAV, has_BA) if self.guesses_at_init else (state, None, None)

  @property
  def guesses_at_init(self) -> bool:
    return self.has_hindsight and self.secondary.guesses_at_init

  @property
  def has_sources(self) -> bool:
    # lookup's match is a function of the context alone, so a round may plan by it
    return isinstance(self.primary, PromptLookupDrafter) and self.use_primary is found_match

  def primary_rows(self, params, state: FallbackState, ctx: DraftContext) -> jax.Array:
    if not self.has_sources:
      return super().primary_rows(params, state, ctx)
    # (lookup has no key and no state: the same search `propose` makes)
    _, _, found = self.primary.propose(params[0], state.primary, ctx, 1, None, None)
    return self.use_primary(found)

  def primary_hindsight(self, ctx: DraftContext, width: int):
    if not self.has_sources:
      return super().primary_hindsight(ctx, width)
    return self.primary.hindsight(ctx, width)

  def propose(self, params, state: FallbackState, ctx: DraftContext, gamma: int,
              sampling: SamplingConfig, key: jax.Array):
    return self._propose(params, state, ctx, gamma, sampling, key, None)

  def propose_for_timing(self, params, state: FallbackState, ctx: DraftContext, gamma: int,
                         sampling: SamplingConfig, key: jax.Array):
    if not self.has_sources:
      return self.propose(params, state, ctx, gamma, sampling, key)
    return self._propose(params, state, ctx, gamma, sampling, key,
                         jnp.zeros(ctx.position_B.shape, bool))

  def _propose(self, params, state: FallbackState, ctx: DraftContext, gamma: int,
               sampling: SamplingConfig, key: jax.Array, use_B):
    """propose, with each row's choice given (use_B [B] bool) or, None, use_primary's."""
    key_1, key_2 = jax.random.split(key)
    tokens_1, probs_1, state_1 = self.primary.propose(params[0], state.primary, ctx, gamma,
                                                      sampling, key_1)
    if use_B is None:
      use_B = self.use_primary(state_1)
      if ctx.primary_B is not None:  # (gamma="auto": the secondary where its record is better)
        use_B &= ctx.primary_B

    def secondary_drafts(secondary_state):
      return self.secondary.propose(params[1], secondary_state, ctx, gamma, sampling, key_2)

    # in place (spec_jax.core.control): a lax.cond copied the secondary's cache each round
    unused = zeros_like_outputs(secondary_drafts, state.secondary)[:2]

    def primary_everywhere(o):  # the secondary's drafts would go unused: keep the zeros
      return (*o[:2], self.secondary.catch_up(params[1], o[2], ctx, gamma, sampling, key_2))

    off = jnp.bool_(False) if ctx.secondary_off is None else ctx.secondary_off
    tokens_2, probs_2, state_2 = cond_in_place(
        jnp.all(use_B) | off, primary_everywhere, lambda o: secondary_drafts(o[2]),
        (*unused, state.secondary))
    use_B |= off  # (the rest, unverified, keep lookup's placeholders: a one-hot q)
    tokens_BG = jnp.where(use_B[:, None], tokens_1, tokens_2)
    probs_BGV = None
    if probs_1 is not None or probs_2 is not None:
      vocab = (probs_1 if probs_1 is not None else probs_2).shape[-1]
      probs_BGV = jnp.where(use_B[:, None, None], _q_or_one_hot(tokens_1, probs_1, vocab),
                            _q_or_one_hot(tokens_2, probs_2, vocab))
    return tokens_BG, probs_BGV, FallbackState(state_1, state_2)

  def acceptance_estimates(self, state: FallbackState):
    # the secondary's head (DSpark's confidences) for the rows that drafted from it. Only
    # with sources: a gamma="auto" round then knows which rows took lookup's drafts
    # (primary_B) and reads those as lookup's own (no head); without, no round could tell
    # which rows a head speaks for
    if not self.has_sources:
      return None
    return self.secondary.acceptance_estimates(state.secondary)

  @property
  def skips_rounds(self) -> bool:
    return self.primary.skips_rounds and self.secondary.skips_rounds

  def catch_up_after(self, params, state: FallbackState, ctx: DraftContext, rounds: int,
                     gamma: int) -> FallbackState:
    return FallbackState(
        self.primary.catch_up_after(params[0], state.primary, ctx, rounds, gamma),
        self.secondary.catch_up_after(params[1], state.secondary, ctx, rounds, gamma))

  @property
  def has_hindsight(self) -> bool:
    # the look in hindsight is the secondary's: with sources (has_sources), gamma="auto"
    # keeps lookup's record apart (it learns from lookup's rounds and primary_hindsight)
    return self.has_sources and self.secondary.has_hindsight

  @property
  def has_sampled_hindsight(self) -> bool:
    # (lookup's copies are one-hot drafts: agreement with the token a plain step drew is
    # already an unbiased estimate of their acceptance, p(copy))
    return self.has_hindsight and self.secondary.has_sampled_hindsight

  def catch_up_with_hindsight(self, params, state: FallbackState, ctx: DraftContext,
                              rounds: int, gamma: int):
    # the secondary's guesses at every position, lookup's matches or not: they speak for
    # the secondary's record (an earlier version took lookup's copy where lookup matched,
    # one record for both, and priced lookup's rounds at the model's drafting cost)
    secondary, agree_BA = self.secondary.catch_up_with_hindsight(params[1], state.secondary,
                                                                 ctx, rounds, gamma)
    primary = self.primary.catch_up_after(params[0], state.primary, ctx, rounds, gamma)
    return FallbackState(primary, secondary), agree_BA

  @property
  def hindsight_speaks_for_later_drafts(self) -> bool:
    return self.secondary.hindsight_speaks_for_later_drafts

  def record_plain_step(self, params, state: FallbackState, hidden_BD, position_B, fed_B):
    return FallbackState(
        self.primary.record_plain_step(params[0], state.primary, hidden_BD, position_B, fed_B),
        self.secondary.record_plain_step(params[1], state.secondary, hidden_BD, position_B, fed_B))

  def commit(self, params, state: FallbackState, outcome: RoundOutcome) -> FallbackState:
    return FallbackState(self.primary.commit(params[0], state.primary, outcome),
                         self.secondary.commit(params[1], state.secondary, outcome))


# In a combination a unigram match (min_ngram 1) exists nearly always, and would shut the
# model out; two tokens of context are the least evidence that lookup is worth trusting.
FALLBACK_MIN_NGRAM = 2


def lookup_or(drafter: Drafter, params, opts: BuildOptions):
  """Prompt lookup where it matches, else `drafter`: a draft model's model, resynced (see
  above), or a drafter that reads the target's hidden states (Medusa, EAGLE, MTP, DFlash,
  DSpark) as it is. Their state follows the target alone: `commit` stores the round's
  verified hidden states and tokens, whichever drafter's drafts were verified, and the next
  `propose` starts from them (EAGLE's and MTP's window re-feeds the true features, DFlash's
  context K/V comes from the target), so rows that took lookup's drafts leave nothing wrong
  behind (tests/test_combinations.py compares its drafts after such rounds with a fresh
  one's)."""
  min_ngram = min(FALLBACK_MIN_NGRAM, opts.max_ngram) if opts.min_ngram is None else opts.min_ngram
  secondary = (ResyncDraftModelDrafter(drafter.model) if isinstance(drafter, DraftModelDrafter)
               else drafter)
  return (FallbackDrafter(PromptLookupDrafter(opts.max_ngram, min_ngram), secondary),
          (None, params))


register(DrafterFamily(name="lookup", summary="prompt lookup where it matches, else the other "
                       "drafter (rows choose per round): lookup+<family>",
                       combine=lookup_or))
