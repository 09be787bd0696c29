"""Prompt lookup (n-gram) drafting, on device: copy what followed the last n tokens before.

No model and no parameters. Each round, per row, over the row's token buffer (prompt and
generated so far, the pending token last): find the most recent earlier occurrence of the
last n tokens, trying n from max_ngram down to min_ngram, and propose the gamma tokens
that followed it. The search is a fixed-shape comparison over the whole buffer, so it
runs inside the jitted loop for any prompt without recompiling or syncing with the host.

Continuations that run past the known tokens read the proposal itself, like an
overlapping LZ77 copy: a match ending p tokens before the end proposes the last p known
tokens repeated, i.e. the repeat continues with its own period. A row with no match
proposes its last token repeated (the same rule with p = 1) and is marked not `found`.
Proposals are deterministic: probs is None, the verifier takes q as one-hot.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from flax import struct

from spec_jax.drafters.base import HINDSIGHT_WIDTH, DraftContext, Drafter, PromptInfo
from spec_jax.drafters.common import window_positions
from spec_jax.core.sampling import SamplingConfig
from spec_jax.drafters.registry import BuildOptions, DrafterFamily, register


def _shift_right(x_BS: jax.Array, k: int, fill: int) -> jax.Array:
  """out[:, i] = x[:, i - k] (fill where i < k)."""
  if k == 0:
    return x_BS
  pad_Bk = jnp.full((x_BS.shape[0], k), fill, x_BS.dtype)
  return jnp.concatenate([pad_Bk, x_BS[:, :-k]], axis=1)


def ngram_lookup(seq_BS: jax.Array, length_B: jax.Array, gamma: int, max_ngram: int,
                 min_ngram: int) -> tuple[jax.Array, jax.Array]:
  """Proposes gamma tokens per row from the most recent earlier match of its last n tokens.

  Args:
    seq_BS: [B, S] token buffers; only the first length_B[b] tokens of row b are read.
    length_B: [B] number of known tokens per row (>= 1); the suffix is seq[L - n : L].
    gamma, max_ngram, min_ngram: static ints, 1 <= min_ngram <= max_ngram.
  Returns:
    tokens_BG: [B, gamma] int32 proposals.
    found_B: [B] bool, whether some n in [min_ngram, max_ngram] matched.

  A match is an n-gram seq[e - n + 1 : e + 1] equal to the suffix with end e < L - 1 (it
  may overlap the suffix, never be it). The longest n wins, then the largest e.
  """
  seq_BS = seq_BS.astype(jnp.int32)
  length_B = length_B.astype(jnp.int32)
  batch, width = seq_BS.shape
  end_S = jnp.arange(width, dtype=jnp.int32)
  before_suffix_BS = end_S[None, :] < (length_B - 1)[:, None]
  match_BS = jnp.ones((batch, width), bool)  # n-grams ending at e equal the suffix so far
  best_end_B = jnp.full((batch,), -1, jnp.int32)
  found_B = jnp.zeros((batch,), bool)
  matches = []
  for k in range(max_ngram):  # extend every candidate by one more token to the left
    suffix_B = jnp.take_along_axis(seq_BS, jnp.maximum(length_B - 1 - k, 0)[:, None], 1)[:, 0]
    match_BS = match_BS & (_shift_right(seq_BS, k, -1) == suffix_B[:, None])
    matches.append(match_BS & before_suffix_BS & (end_S[None, :] >= k))
  for n in range(max_ngram, min_ngram - 1, -1):  # the longest n-gram that matches wins
    end_B = jnp.max(jnp.where(matches[n - 1], end_S[None, :], -1), axis=1)
    take_B = ~found_B & (end_B >= 0)
    best_end_B = jnp.where(take_B, end_B, best_end_B)
    found_B = found_B | take_B
  # copy from e + 1 on; past the last known token the copy repeats with period p = L - 1 - e
  period_B = jnp.where(found_B, length_B - 1 - best_end_B, 1)
  j_G = jnp.arange(gamma, dtype=jnp.int32)
  src_BG = (length_B - period_B)[:, None] + j_G[None, :] % period_B[:, None]
  return jnp.take_along_axis(seq_BS, src_BG, axis=1), found_B


def first_guesses(seq_BS: jax.Array, pending_BA: jax.Array, max_ngram: int,
                  min_ngram: int) -> tuple[jax.Array, jax.Array]:
  """Lookup's first draft for a round started at each pending position pending_BA[b, a]
  (the tokens up to it known, in seq_BS) -> (tokens_BA, found_BA): what `propose` would
  draft first there, and whether it matched. A combination's hindsight for lookup's record
  (FallbackDrafter.primary_hindsight): one search per position, each over the buffer."""
  search = lambda length_B: ngram_lookup(seq_BS, length_B, 1, max_ngram, min_ngram)
  tokens_BA1, found_BA = jax.vmap(search, in_axes=1, out_axes=1)(pending_BA + 1)
  return tokens_BA1[..., 0], found_BA


def lookup_hindsight(seq_BS: jax.Array, position_B: jax.Array, width: int, max_ngram: int,
                     min_ngram: int) -> tuple[jax.Array, jax.Array]:
  """How lookup's first draft would have fared in a round started at each of the last `width`
  positions before the pending token at position_B (L - width .. L - 1, the tokens after
  them known) -> (copied_BA, found_BA) [B, width] bool: whether it matched there and copied
  the token that followed, and whether it matched (padding positions, before the buffer's
  start, did neither)."""
  pending_BA = window_positions(position_B, width)
  guess_BA, found_BA = first_guesses(seq_BS, pending_BA, max_ngram, min_ngram)
  followed_BA = jnp.take_along_axis(seq_BS, jnp.maximum(pending_BA + 1, 0), axis=1)
  found_BA &= pending_BA >= 0
  return found_BA & (guess_BA == followed_BA), found_BA


@struct.dataclass
class PromptLookupState:
  found_B: jax.Array  # [B] bool: the last proposal came from a match (see FallbackDrafter)


def found_match(state: PromptLookupState) -> jax.Array:
  """Per-row predicate for FallbackDrafter: rows whose lookup found a match."""
  return state.found_B


@dataclasses.dataclass(frozen=True)
class PromptLookupDrafter(Drafter):
  """n-gram drafting from the row's own tokens. draft_params: None."""
  max_ngram: int = 3
  min_ngram: int = 1

  def __post_init__(self):
    if not 1 <= self.min_ngram <= self.max_ngram:
      raise ValueError(f"need 1 <= min_ngram <= max_ngram, got {self.min_ngram}, {self.max_ngram}")

  def init(self, params, prompt: PromptInfo) -> PromptLookupState:
    return PromptLookupState(jnp.zeros(prompt.lengths_B.shape, bool))

  def propose(self, params, state: PromptLookupState, ctx: DraftContext, gamma: int,
              sampling: SamplingConfig, key: jax.Array):
    tokens_BG, found_B = ngram_lookup(ctx.seq_BS, ctx.position_B + 1, gamma, self.max_ngram,
                                      self.min_ngram)
    return tokens_BG, None, PromptLookupState(found_B)

  def empty_rows(self, state: PromptLookupState) -> jax.Array:
    return ~state.found_B

  @property
  def skips_rounds(self) -> bool:
    return True  # every proposal searches the row's tokens afresh

  def catch_up_after(self, params, state: PromptLookupState, ctx: DraftContext, rounds: int,
                     gamma: int) -> PromptLookupState:
    return state

  @property
  def guesses_at_init(self) -> bool:
    return True

  def init_with_first_logits(self, params, prompt: PromptInfo, positions_BA: jax.Array):
    """init, and lookup's first draft in a round whose pending token sat at each prompt
    position, int [B, A] (deterministic: Drafter.init_with_first_logits), -1 where it finds
    no match: a miss, as in its stretches' hindsight. A prompt whose tail repeats nothing
    then starts the estimates low instead of drafting at the prior (on stories260K three or
    four rounds, most with no match, cost ~5% of a 128-token run: docs/adaptive_log.md,
    stop 68)."""
    guess_BA, found_BA = first_guesses(prompt.tokens_BP, positions_BA, self.max_ngram,
                                       self.min_ngram)
    return (self.init(params, prompt), jnp.where(found_BA, guess_BA, -1).astype(jnp.int32),
            jnp.ones_like(found_BA))

  def hindsight(self, ctx: DraftContext, width: int) -> tuple[jax.Array, jax.Array]:
    """lookup_hindsight at ctx with this drafter's n-gram range."""
    return lookup_hindsight(ctx.seq_BS, ctx.position_B, width, self.max_ngram, self.min_ngram)

  @property
  def has_hindsight(self) -> bool:
    return True

  @property
  def has_sampled_hindsight(self) -> bool:
    return True

  @property
  def hindsight_speaks_for_later_drafts(self) -> bool:
    # a later draft continues the round's copy; the guess at the next position is a fresh
    # search (often the same copy, not always): the later estimates learn from verified
    # rounds, and the record's floor (for drafts that follow their first) stays off
    return False

  def catch_up_with_hindsight(self, params, state: PromptLookupState, ctx: DraftContext,
                              rounds: int, gamma: int):
    """The state as it is, and whether a round started at each of the stretch's last
    min(rounds + 1, HINDSIGHT_WIDTH) positions would have accepted lookup's first draft: it
    matched there and copied the token that followed. No match is a miss: a round planned
    there yields one token for a round's cost (a round counts such a row a miss beside rows
    that verify; alone, it learns nothing and runs a plain step). The guess is
    deterministic, so in a sampled run whether the drawn token equals it is already an
    unbiased score of its acceptance p(guess) = sum_x min(p, one-hot)."""
    copied_BA, _ = self.hindsight(ctx, min(rounds + 1, HINDSIGHT_WIDTH))
    if ctx.sampled_hindsight is not None:
      copied_BA = copied_BA.astype(jnp.float32)
    return state, copied_BA


def _build(target, target_params, opts: BuildOptions):
  return PromptLookupDrafter(opts.max_ngram, 1 if opts.min_ngram is None else opts.min_ngram), None


register(DrafterFamily(name="prompt_lookup", summary="n-gram lookup in the row's own tokens "
                       "(on device, deterministic, no params)", build=_build,
                       reads_target=False, options=("max_ngram", "min_ngram")))
