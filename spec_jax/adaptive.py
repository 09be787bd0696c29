"""Adaptive speculation: per-row draft lengths and a per-round verification width.

`gamma="auto"` (or an `AdaptiveConfig`) in speculate / prepare_program / speculative_generate
runs this round instead of the fixed-gamma one. The drafter proposes up to gamma_max tokens
per row; stopping rules truncate each row's block to its *admitted* length; a scheduler
picks, per round, one of a few compiled verification widths (`lax.switch`; a width of 1 is
the plain one-token step). Before drafting, the estimates from past rounds plan how many
drafts pay for their draft and verification cost (`planned_drafts`; autoregressive
drafters stop there, DraftContext.max_drafts); when none do, the round runs plain steps in
an inner loop until the next probe. One jit, fixed shapes, no host round trips: every
decision is data.

THE LOSSLESS CONDITION. Verifying only an admitted prefix of length m (accept at most m,
then draw the correction from the residual at the first rejection, or the bonus from the
target at position m) is exact when, for every position i, whether i is verified depends
only on what exists before draft x_i is drawn: the context, the earlier drafts x_<i, the
draft's distribution at i, and past rounds (m is a stopping time of the draft sequence).
It must never depend on x_i itself (e.g. its own draft probability q_i(x_i)), on later
drafts or confidences (they are computed from x_i), or on the target's verdict. So:
  - the confidence stop ends the block *after* a token with q_i(x_i) < threshold (that
    token is still verified), or *before* a position whose top probability max q_i is below
    it;
  - the survival S_i = a_1 * ... * a_i uses per-position acceptance estimates a_j known
    before x_j is drawn (the drafter's `acceptance_estimates`, else max q_j, capped by the
    row's online estimate from past rounds);
  - the per-row gamma schedule reads past rounds only (HF: +2 after a fully accepted block,
    -1 otherwise);
  - a row's remaining budget caps its plan and its admitted length (drafts it could never
    keep are worth nothing, and the budget is known before anything is drawn);
  - the width scheduler scans positions in order and stops at the first one past which no
    length raises the expected tokens per second (DSpark's early break, looking ahead with
    past rounds' estimates only): a later position's value (which depends on x_i) never
    decides whether x_i is verified.
tests/test_adaptive.py checks this with the distribution test, and keeps two leaky rules
(one peeks at the verdict, one drops drafts whose own probability is low) that fail it.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import math
import time
from typing import Callable, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from spec_jax.core.control import cond_in_place, switch_in_place, zeros_like_outputs
from spec_jax.core.pytree_names import params_signature
from spec_jax.core.sampling import (SamplingConfig, nonfinite_rows, process_logits, sample,
                                    split_unless_greedy)
from spec_jax.drafters.base import DraftContext, Drafter
from spec_jax.generate import decode_token, finite_prefix, remaining_tokens
from spec_jax.metrics import AdaptiveStats

DEFAULT_GAMMA_MAX = 8


def default_widths(gamma_max: int) -> tuple[int, ...]:
  """1, 2, 3, 5, 9, ... tokens per target pass (the pending token + drafts), capped by
  gamma_max + 1, which is always included."""
  widths, w = [1, 2, 3], 5
  while w < gamma_max + 1:
    widths.append(w)
    w = 2 * w - 1
  return tuple(sorted({x for x in widths if x <= gamma_max} | {gamma_max + 1}))


def tree_widths(num_nodes: int) -> tuple[int, ...]:
  """A tree program's widths: a plain step (1), then the tree cut to its first 2, 3, 5, 9,
  ... nodes, and the whole tree (num_nodes)."""
  return (1,) + tuple(w for w in default_widths(num_nodes - 1) if 1 < w < num_nodes) + (
      num_nodes,)


def default_costs(widths) -> tuple[float, ...]:
  """A guess when nothing was measured: a pass costs 1 + 0.1 per extra token."""
  return tuple(1.0 + 0.1 * (w - 1) for w in widths)


@dataclasses.dataclass(frozen=True)
class AdaptiveRules:
  """Stopping rules and scheduler settings (hashable: part of the compiled program).

  confidence: stop after a draft whose own probability is below it, or before a position
    whose top draft probability is below it (0 disables).
  survival: admit position i while the running product of acceptance estimates is >= it.
  schedule: HF's per-row gamma (+2 after a fully accepted block, -1 otherwise), starting at
    initial_gamma.
  prior / learning_rate: the online per-row, per-position acceptance estimates (an
    exponential moving average of "accepted, given reached and verified").
  forget: in each drafted round, a row's estimates of later positions it did not verify move
    this much of the way back to the prior, so that a position once rejected is tried again
    (the scheduler stops verifying it, and an estimate nothing updates would stay low for
    the whole generation: on the built-in pair, two early rejections of the second draft
    held a prompt at one draft a round, 0.69x of its best fixed gamma).
  probe_every: after this many rounds without drafting, draft anyway to refresh the
    estimates, while the slowest row's remaining budget, in plain steps, takes at least
    probe_every times the dearest drafted round (a probe near the end has no time to pay
    for itself: at 64 rows of a 292M target a 5-token round costs 3.5 plain steps, and three
    probes in 32 tokens cost `auto` 10%); probe_growth: the interval grows this many times
    after each probe that was not promising (drafted_or_plain; up to 64x probe_every), and
    returns to probe_every after one that was, or after a round that drafts because drafting
    pays. x2: probes after 8, 24, 56, 120 idle steps. x4 (8, 40, 168) saved a useless
    draft one probe in 128 tokens (about 3 plain steps on stories260K: 2-4%), but left good
    drafts unused: on the built-in pair at batch 1 two probes that happened to meet the
    draft model's rare misses (7 in 64 positions on one prompt) left three of six code
    prompts plain for the whole generation (geometric mean 1.20x against 1.35x with x2,
    gamma 4 1.43x). Any accepted draft in any row used to count as promising: in a large
    batch some row always accepts something.
  admit: research hook replacing the row rules: admit(AdmitInputs) -> [B] admitted lengths.
    It must obey the lossless condition (tests use it for a deliberately leaky rule).
  lookahead: the width scheduler's scan values lengths past each position with past rounds'
    estimates (schedule_length); False: it compares neighbours only, DSpark's scan.
  horizon: the plan values a draft length by the expected time to finish the batch
    (the slowest row: planned_drafts, finishing_rounds); False: by tokens per second summed
    over the rows, which overvalues drafting in large batches, whose rows finish rounds
    apart.
  """
  confidence: float = 0.05
  survival: float = 0.1
  schedule: bool = True
  initial_gamma: int = 4
  prior: float = 0.7
  learning_rate: float = 0.3
  forget: float = 0.05
  probe_every: int = 8
  probe_growth: int = 2
  admit: Callable | None = None
  lookahead: bool = True
  horizon: bool = True


# The catch-up passes compiled for a drafter that skips rounds: after at most the last
# (widest) many plain steps it catches up, in one pass over that many tokens (+1), through
# the narrowest width that covers the steps. Stretches run to the next probe (8, 16, 32, ...
# steps): a window of 8 cost a useless 1-layer draft of stories260K 15 catch-up passes in 128
# tokens, where 32 takes 5-6; a stretch of 2 steps between drafted rounds needs a 3-token
# pass, where a 33-token pass of the built-in draft model costs a few target steps.
CATCH_UP_WIDTHS = (2, 8, 32)
# plain_steps' stretch length when no probe is left: until every row is done
_TO_THE_END = np.iinfo(np.int32).max


@dataclasses.dataclass(frozen=True)
class AdaptiveConfig:
  """gamma="auto" with its settings. target_costs: seconds of one target pass at each width
  (same order as widths); draft_cost: seconds of one `propose` of gamma_max drafts;
  first_draft_cost: of one `propose` told to stop after its first draft (max_drafts 1).
  Drafting m drafts is charged by the line through the two (a draft model's steps grow with
  m; a block drafter or lookup costs the same at any m). None: `speculate` measures them
  once (measure_costs), prepare_program uses default_costs; first_draft_cost alone None: half
  of draft_cost."""
  gamma_max: int | None = None  # None: DEFAULT_GAMMA_MAX, or the drafter's max_gamma if less
  widths: tuple[int, ...] | None = None
  target_costs: tuple[float, ...] | None = None
  draft_cost: float | None = None
  first_draft_cost: float | None = None
  rules: AdaptiveRules = AdaptiveRules()
  # a tree drafter's node count (set by configure: widths are then a plain step, 1, and node
  # budgets up to tree_nodes, tree_widths; gamma_max is the tree's depth)
  tree_nodes: int | None = None
  # A plain stretch that runs to the end of the generation leaves the drafter's state behind:
  # nothing drafts again, and its catch-ups cost 5-7% of a 64-row run on the built-in pair.
  # True keeps it caught up, for callers that read the final drafter state (speculate's
  # return_state sets it: keeping_draft_state).
  final_draft_state: bool = False

  def resolved(self) -> "AdaptiveConfig":
    """Validated, with defaults filled in (raises ValueError with the reason)."""
    g = DEFAULT_GAMMA_MAX if self.gamma_max is None else self.gamma_max
    if isinstance(g, bool) or not isinstance(g, (int, np.integer)) or g < 1:
      raise ValueError(f"gamma_max must be an integer >= 1, got {g!r}")
    if self.tree_nodes is not None:
      n = int(self.tree_nodes)
      widths = tree_widths(n) if self.widths is None else tuple(int(w) for w in self.widths)
      if list(widths) != sorted(set(widths)) or widths[0] != 1 or widths[-1] != n:
        raise ValueError(f"a tree round verifies the tree cut to its first w nodes, or runs a "
                         f"plain step (w = 1): widths must be increasing, start at 1 and end "
                         f"at the tree's {n} nodes, got {widths}")
    else:
      widths = default_widths(int(g)) if self.widths is None else tuple(int(w) for w in self.widths)
      if list(widths) != sorted(set(widths)) or widths[0] != 1 or widths[-1] != g + 1:
        raise ValueError(f"widths must be increasing, start at 1 and end at gamma_max + 1 = "
                         f"{g + 1}, got {widths}")
    if self.target_costs is not None:
      check_costs(widths, self.target_costs, 0.0 if self.draft_cost is None else self.draft_cost)
    elif self.draft_cost is not None:
      check_costs(widths, default_costs(widths), self.draft_cost)
    if self.first_draft_cost is not None:
      check_costs(widths, default_costs(widths), self.first_draft_cost)
    r = self.rules
    if (not 1 <= r.initial_gamma or r.probe_every < 1 or not 0 < r.learning_rate <= 1
        or not 0 <= r.forget <= 1
        or not isinstance(r.probe_growth, (int, np.integer)) or r.probe_growth < 1):
      raise ValueError(f"bad adaptive rules: {r}")
    costs = None if self.target_costs is None else tuple(float(c) for c in self.target_costs)
    return dataclasses.replace(self, gamma_max=int(g), widths=widths, target_costs=costs)

  def target_cost_table(self) -> tuple[float, ...]:
    """Target costs per width: the supplied or measured ones, else defaults."""
    return default_costs(self.widths) if self.target_costs is None else self.target_costs

  @functools.cached_property
  def cost_table(self) -> "CostTable":
    """The table a chain round plans from (host-side, static; derived once per config)."""
    target_W = np.asarray(self.target_cost_table(), np.float32)
    return CostTable(target_W, cost_of_lengths(self.widths, target_W),
                     drafting_costs(self.gamma_max, self.draft_cost, self.first_draft_cost))


class RoundPlan(NamedTuple):
  """What a round decides before anything is drawn (AdaptiveRound.plan)."""
  can_probe: bool  # static: some drafted round could beat a plain step (the table alone)
  last_probe: float  # the probe window: fewest tokens left for a probe (probe_window)
  probe: jax.Array  # [] bool: draft whatever the estimates say (probe_due)
  drafts: jax.Array  # [] bool: this round drafts (planned, or a probe)
  size: jax.Array  # [] int32: chains: the drafts planned; trees: the node budget's index


class CostTable(NamedTuple):
  """A chain round's costs, in seconds (numpy, static: part of the compiled program)."""
  target_W: np.ndarray  # [W] a target pass at each compiled width (widths[0] == 1: a step)
  verify_G1: np.ndarray  # [G + 1] the pass that verifies k = 0..G drafts (cost_of_lengths)
  drafting_G: np.ndarray  # [G] a propose that makes m = 1..G drafts (drafting_costs)

  @property
  def plain(self) -> float:
    return float(self.verify_G1[0])

  @property
  def rounds_G(self) -> np.ndarray:
    """[G] a drafted round of m = 1..G drafts: drafting them and verifying them."""
    return self.verify_G1[1:] + self.drafting_G


def drafting_costs(gamma_max: int, full: float | None, first: float | None) -> np.ndarray:
  """[gamma_max] float32: the cost of a propose that makes m = 1..gamma_max drafts, on the
  line from `first` (m = 1) to `full` (m = gamma_max). first None: half of full (as if half
  of a call were fixed); first above full (timing noise of a drafter whose cost does not
  grow with m): full; gamma_max 1: full."""
  full = float(full or 0.0)
  if gamma_max == 1:
    return np.array([full], np.float32)
  first = 0.5 * full if first is None else min(float(first), full)
  m_G = np.arange(1, gamma_max + 1, dtype=np.float32)
  return (first + (full - first) * (m_G - 1) / (gamma_max - 1)).astype(np.float32)


def check_costs(widths, target_costs, draft_cost) -> None:
  """The cost table: one positive, finite time per width, and a finite draft cost >= 0."""
  if target_costs is None or len(target_costs) != len(widths):
    raise ValueError(f"the cost table needs one target time per width {tuple(widths)}, got "
                     f"{target_costs}")
  for w, c in zip(widths, target_costs):
    if not isinstance(c, (int, float, np.floating)) or not math.isfinite(c) or c <= 0:
      raise ValueError(f"the cost of width {w} must be a positive finite time, got {c!r}")
  if not math.isfinite(draft_cost) or draft_cost < 0:
    raise ValueError(f"the draft cost must be a finite time >= 0, got {draft_cost!r}")


def as_config(gamma, drafter=None) -> AdaptiveConfig | None:
  """gamma="auto" -> the default config; an AdaptiveConfig -> itself; an int -> None. A
  config without gamma_max gets DEFAULT_GAMMA_MAX capped at what the drafter can draft
  (Drafter.max_gamma: MTP's modules, Medusa's heads, a block's slots); an explicit gamma_max
  the drafter cannot hold is its check's error."""
  if isinstance(gamma, str):
    if gamma != "auto":
      raise ValueError(f"gamma must be an integer >= 1 or 'auto', got {gamma!r}")
    gamma = AdaptiveConfig()
  if not isinstance(gamma, AdaptiveConfig):
    return None
  limit = None if drafter is None else drafter.max_gamma
  if gamma.gamma_max is None and limit is not None:
    gamma = dataclasses.replace(gamma, gamma_max=min(DEFAULT_GAMMA_MAX, int(limit)))
  return gamma


@struct.dataclass
class AdmitInputs:
  """What a row rule may read (all known before each position's draft is drawn, except
  draft_prob_BG[:, i], the token's own probability, which only positions > i may use)."""
  draft_prob_BG: jax.Array  # q_i(x_i); 1 for deterministic drafters
  top_prob_BG: jax.Array  # max q_i; 1 for deterministic drafters
  survival_BG: jax.Array  # running product of acceptance estimates
  gamma_B: jax.Array  # the schedule's length
  # the drafts themselves: a rule must not let position i depend on tokens_BG[:, i:]
  tokens_BG: jax.Array | None = None


def _leading(ok_BG):
  return jnp.sum(jnp.cumprod(ok_BG.astype(jnp.int32), axis=1), axis=1).astype(jnp.int32)


def row_rule(rules: AdaptiveRules, x: AdmitInputs) -> jax.Array:
  """[B] admitted lengths: the longest prefix that every rule admits (a stopping time)."""
  gamma = x.draft_prob_BG.shape[1]
  ok_BG = x.survival_BG >= rules.survival
  ok_BG &= x.top_prob_BG >= rules.confidence
  # position i follows drafts 1..i-1: stop after a token whose own probability is low
  low_BG = x.draft_prob_BG < rules.confidence
  ok_BG &= jnp.concatenate([jnp.ones_like(low_BG[:, :1]), ~low_BG[:, :-1]], axis=1)
  if rules.schedule:
    ok_BG &= jnp.arange(gamma)[None, :] < x.gamma_B[:, None]
  return _leading(ok_BG)


def cost_of_lengths(widths, costs) -> np.ndarray:
  """[G + 1]: the cost of verifying k drafts, k = 0..G (the smallest width >= k + 1)."""
  return np.array([costs[next(j for j, w in enumerate(widths) if w >= k + 1)]
                   for k in range(widths[-1])], np.float32)


def width_index(widths, k_B):
  """Index of the smallest width holding k drafts."""
  return jnp.searchsorted(jnp.asarray(widths, jnp.int32), k_B + 1, side="left").astype(jnp.int32)


def schedule_length(survival_BG, admitted_B, active_B, cost_G1, estimate_BG=None,
                    limit_B=None) -> jax.Array:
  """[] drafts to verify this round: DSpark's scan with its early break, looking ahead.

  Expected tokens with k drafts: one per active row plus the survival of every admitted
  position <= k. The scan takes position k while some length m >= k is worth more tokens per
  second than stopping before k: positions up to k valued by their survivals, positions
  past k by projecting row b's survival at k with its past rounds' estimates
  (estimate_BG[b, k+1..m], capped at 1, up to limit_B[b], a length known before drafting).
  The first position that fails stops the scan. So whether position k is verified reads
  survivals up to k and past rounds only, never a later position's (which depends on x_k).
  The look-ahead matters where the cost table steps: on the built-in pair a 3-token pass
  cost 1.45x a 2-token one but a 5-token pass only 1.1x a 3-token one, and a scan that
  compared neighbours only stopped at one draft in every round (accepting 1 of 1) where a
  fixed gamma of 4-6 gained; the estimates past the first position then never moved from
  the prior. Without estimate_BG: neighbours only, DSpark's scan as published.
  """
  gamma = survival_BG.shape[1]
  j_G = jnp.arange(gamma)
  live_BG = (j_G[None, :] < admitted_B[:, None]) & active_B[:, None]
  gain_G = jnp.sum(jnp.where(live_BG, survival_BG, 0.0), axis=0)
  tokens_G1 = jnp.sum(active_B).astype(jnp.float32) + jnp.concatenate(
      [jnp.zeros(1), jnp.cumsum(gain_G)])
  # best_G[k]: the best rate over lengths m >= k + 1 reachable from position k (0-based)
  best_G = tokens_G1[1:] / cost_G1[1:]
  if estimate_BG is not None:
    limit_B = jnp.full_like(admitted_B, gamma) if limit_B is None else limit_B
    est_BG = jnp.minimum(estimate_BG, 1.0)
    best = []
    for k in range(gamma):  # static and small (gamma_max)
      # row b's projected survivals at k+1..gamma-1, from its survival at k (live rows)
      proj_BJ = survival_BG[:, k:k + 1] * jnp.cumprod(est_BG[:, k + 1:], axis=1)
      proj_BJ = jnp.where(live_BG[:, k:k + 1] & (j_G[None, k + 1:] < limit_B[:, None]),
                          proj_BJ, 0.0)
      tokens_J = tokens_G1[k + 1] + jnp.cumsum(jnp.sum(proj_BJ, axis=0))
      best.append(jnp.max(jnp.concatenate([best_G[k:k + 1], tokens_J / cost_G1[k + 2:]])))
    best_G = jnp.stack(best)
  keep_G = best_G >= tokens_G1[:-1] / cost_G1[:-1]
  return jnp.minimum(_leading(keep_G[None])[0], jnp.max(jnp.where(active_B, admitted_B, 0)))


def drafting_can_pay(cost_G1, draft_cost_G) -> bool:
  """Host-side, from the cost table: whether some draft length m beats a plain step's tokens
  per second when every draft is accepted ((1 + m) tokens for the pass and the drafting)."""
  m_G = np.arange(1, len(draft_cost_G) + 1)
  return bool(np.any((1 + m_G) / (cost_G1[1:] + draft_cost_G) > 1 / cost_G1[0]))


def planned_drafts(prior_BG, gamma_B, active_B, cost_G1, draft_cost_G, rules,
                   probe=False, remaining_B=None) -> jax.Array:
  """[] int32, from past rounds only: how many drafts to make this round, 0 for none.

  The length m that maximises expected tokens per second under the current estimates
  (survival = product of the rows' estimates, within their schedules), charging the target
  pass at m drafts plus drafting m (draft_cost_G[m - 1], from the cost table's two measured
  points: see AdaptiveConfig). Charging one cost per call whatever m made a draft model plan
  too few drafts, or none, where a fixed gamma gained (the built-in pair); charging the whole
  gamma_max cost at every m made the int8 target draft 8 to verify 2. 0 when no length beats
  a plain step. Decided before anything is drawn, it is a lossless stopping point for every
  row. A probe (traced bool) drafts the best length even when it does not beat a plain step:
  a probe of one draft only tests the first position, and two rejected ones in a row (the
  first tokens after a prompt are often the hardest) left the built-in pair plain for the
  rest of a generation whose draft model gains 1.4x at gamma 6.

  remaining_B [B]: the tokens each row's budget has left. A row keeps at most
  remaining - 1 drafts (the target adds one), so none past that are counted; and with
  `rules.horizon` a length is valued by the time to finish the batch at that length
  (`finishing_rounds`), not by tokens summed over rows: a batch runs until its slowest row
  is done, and rows that accept different numbers of drafts finish rounds apart. None: no
  budget known (tokens per second summed over rows)."""
  gamma = prior_BG.shape[1]
  j_G = jnp.arange(gamma)[None, :]
  survival_BG = jnp.cumprod(prior_BG, axis=1)
  ok_BG = survival_BG >= rules.survival
  if rules.schedule:
    ok_BG &= j_G < gamma_B[:, None]
  if remaining_B is not None:
    ok_BG &= j_G < remaining_B[:, None] - 1
  ok_BG = jnp.cumprod(ok_BG.astype(jnp.int32), axis=1).astype(bool) & active_B[:, None]
  survival_BG = jnp.where(ok_BG, survival_BG, 0.0)
  round_cost_G = cost_G1[1:] + jnp.asarray(draft_cost_G)
  if remaining_B is not None and rules.horizon:
    remaining_B = jnp.where(active_B, remaining_B, 0).astype(jnp.float32)
    time_G = finishing_rounds(survival_BG, remaining_B, active_B) * round_cost_G
    best = jnp.argmin(time_G).astype(jnp.int32) + 1
    pays = time_G[best - 1] < jnp.max(remaining_B) * cost_G1[0]
  else:
    tokens_G1 = jnp.sum(active_B).astype(jnp.float32) + jnp.concatenate(
        [jnp.zeros(1), jnp.cumsum(jnp.sum(survival_BG, axis=0))])
    rate_G = tokens_G1[1:] / round_cost_G
    best = jnp.argmax(rate_G).astype(jnp.int32) + 1
    pays = rate_G[best - 1] > tokens_G1[0] / cost_G1[0]
  return jnp.where(probe | pays, best, 0)


# grid points for the expected maximum of the rows' finishing rounds (finishing_rounds)
_MAX_GRID = 41


def finishing_rounds(survival_BG, remaining_B, active_B) -> jax.Array:
  """[G] expected rounds until every active row has its remaining_B tokens, if every round
  drafts m = 1..G (survival_BG[b, i]: P(row b accepts drafts 1..i + 1), 0 where not drafted).

  A row's tokens per round T (1 + the accepted drafts) has mean mu = 1 + sum_i S_i and
  E[T^2] = 1 + sum_i (2i + 3) S_i (0-based i). By renewal theory the rounds it needs to make
  r tokens are about normal, with mean (r + (E[T^2] - mu) / (2 mu)) / mu (the last round
  overshoots) and variance r var(T) / mu^3. The batch runs until its last row is done: the
  expected maximum of the rows' rounds (rows independent), integrated on a grid over its
  distribution. At one row that is the row's own mean, so the plan is tokens per second; at
  64 rows with equal budgets the tail adds about 2.3 standard deviations (on the built-in
  pair, gamma 2 needed 58 rounds for 128 tokens at 2.53 tokens a row and round: 13% of its
  row-rounds were rows already done). tests/test_adaptive.py checks it against simulation."""
  i_G = jnp.arange(survival_BG.shape[1], dtype=jnp.float32)
  mean_BG = 1.0 + jnp.cumsum(survival_BG, axis=1)
  second_BG = 1.0 + jnp.cumsum((2.0 * i_G + 3.0) * survival_BG, axis=1)
  var_BG = jnp.maximum(second_BG - mean_BG ** 2, 0.0)
  r_B1 = remaining_B[:, None]
  n_BG = (r_B1 + (second_BG - mean_BG) / (2.0 * mean_BG)) / mean_BG
  sd_BG = jnp.sqrt(r_B1 * var_BG / mean_BG ** 3)
  a_B1 = active_B[:, None]
  # E[max] = x0 + integral of P(max > x) above x0 - integral of P(max <= x) below it; the
  # grid spans 4 standard deviations below the largest mean to 6 above
  top_G = jnp.max(jnp.where(a_B1, n_BG, 0.0), axis=0)
  sd_G = jnp.max(jnp.where(a_B1, sd_BG, 0.0), axis=0) + 1e-6
  x_JG = top_G + jnp.linspace(-4.0, 6.0, _MAX_GRID)[:, None] * sd_G
  z_BJG = (x_JG[None] - n_BG[:, None, :]) / jnp.maximum(sd_BG, 1e-6)[:, None, :]
  cdf_JG = jnp.exp(jnp.sum(jnp.where(a_B1[:, :, None], jax.scipy.special.log_ndtr(z_BJG), 0.0),
                           axis=0))  # P(max <= x)
  trapezoid = lambda f_JG: (jnp.sum(f_JG, axis=0) - 0.5 * (f_JG[0] + f_JG[-1])) * (
      x_JG[1] - x_JG[0])
  x0_G = x_JG[0]
  return jnp.where(jnp.any(active_B), x0_G + trapezoid(1.0 - cdf_JG), 0.0)


def probe_window(rules, plain_cost, dearest_round_cost) -> float:
  """Host-side: the fewest tokens a batch must still have to make, for a probe to run: the
  remaining budget's plain steps must take probe_every times the dearest drafted round."""
  return float(rules.probe_every * dearest_round_cost / plain_cost)


def probe_due(stats, remaining_B, last_probe, can_probe) -> jax.Array:
  """[] bool: draft this round whatever the plan says (AdaptiveRules.probe_every)."""
  return ((stats.idle_rounds >= stats.probe_interval) & can_probe
          & (jnp.max(remaining_B) >= last_probe))


def steps_to_probe(stats, remaining_B, last_probe, can_probe) -> jax.Array:
  """[] int32: the plain steps after which probe_due holds (each step counts as an idle
  round and takes a token from every row), or _TO_THE_END when it never will in this run."""
  wait = jnp.maximum(stats.probe_interval - stats.idle_rounds, 1)
  return jnp.where(can_probe & (jnp.max(remaining_B) - wait >= last_probe), wait, _TO_THE_END)


def probe_was_promising(remaining_before_B, remaining_after_B, active_B, plain_cost,
                        extra_cost) -> jax.Array:
  """[] bool: a drafted round moved the batch's finish (the largest remaining budget of the
  rows active before it), beyond the one token a plain step gives, by at least half of what
  plain steps would in its extra_cost (its cost over a plain step's, with any catch-up)."""
  last = lambda r_B: jnp.max(jnp.where(active_B, r_B, 0))
  return 2 * (last(remaining_before_B) - last(remaining_after_B) - 1) * plain_cost >= extra_cost


def verify_admitted(verifier, draft_tokens_BG, draft_probs_BGV, logits_BG1V, sampling, key,
                    admitted_B):
  """Verifies each row as if its block held only its first admitted_B drafts.

  Any chain verifier: below the admitted length its result is the truncated block's (the
  first rejection and its residual depend only on earlier positions). A row that accepted
  all its admitted drafts takes the bonus from the target at position admitted_B, drawn
  with fresh randomness, exactly as if the block had ended there.
  """
  verify_key, bonus_key = jax.random.split(key)
  num_accepted_B, next_B = verifier(draft_tokens_BG, draft_probs_BGV, logits_BG1V, sampling,
                                    verify_key)
  at_end_BV = jnp.take_along_axis(logits_BG1V, admitted_B[:, None, None], axis=1)[:, 0]
  full_B = num_accepted_B >= admitted_B
  next_B = jnp.where(full_B, sample(bonus_key, at_end_BV, sampling), next_B)
  return jnp.minimum(num_accepted_B, admitted_B), next_B


@dataclasses.dataclass(frozen=True)
class AdaptiveRound:
  """A round_fn (speculative_round's signature) with adaptive lengths and widths."""
  config: AdaptiveConfig
  # measure_costs' timing round: every active row verifies exactly the planned drafts,
  # whatever the rules, the scheduler and the drafter's empty rows said (all still computed)
  forced: bool = False

  def __call__(self, target, drafter: Drafter, gamma: int, sampling: SamplingConfig, verifier,
               params, draft_params, lengths_B, budget_B, eos_id, s):
    cfg, rules = self.config, self.config.rules
    stats: AdaptiveStats = s.metrics.adaptive
    table = cfg.cost_table
    step = functools.partial(self.step, target, drafter, gamma, sampling, verifier, params,
                             draft_params, lengths_B, budget_B, eos_id)
    # a row can emit budget - generated more tokens, one of them the target's own: drafts
    # past that are never kept, so they are worth nothing (known before drafting: lossless)
    remaining_B = remaining_tokens(s.done_B, s.num_generated_B, budget_B)
    useful_B = jnp.maximum(remaining_B - 1, 0)
    plan = self.plan(stats, remaining_B)

    def drafted_round(s):
      return self.drafted_round(step, drafter, gamma, sampling, verifier, draft_params, eos_id,
                                jnp.asarray(table.verify_G1), plan.probe, plan.size, s,
                                useful_B=useful_B)

    plain_steps = functools.partial(self.plain_steps, target, drafter, gamma, sampling,
                                    verifier, params, draft_params, lengths_B, budget_B, eos_id,
                                    plan.can_probe, plan.last_probe)
    drafting = jnp.asarray(table.drafting_G)[jnp.maximum(plan.size, 1) - 1]
    costs_W = jnp.asarray(table.target_W)
    return self.drafted_or_plain(
        s, plan.drafts, plan.probe, drafted_round, plain_steps, schedule=rules.schedule,
        round_cost=lambda w_idx: costs_W[w_idx] + jnp.where(w_idx > 0, drafting, 0.0),
        budget_B=budget_B,
        catch_up_cost=float(table.drafting_G[-1]) if drafter.skips_rounds else 0.0)

  def plan(self, stats: AdaptiveStats, remaining_B) -> RoundPlan:
    """What a chain round decides before drafting: its size is the drafts planned (0: a
    plain stretch)."""
    rules = self.config.rules
    table = self.config.cost_table
    # no probes where even drafts that were all accepted could not beat a plain step: the
    # cost table alone (static) rules drafting out, and probing would only pay for drafts
    can_probe = drafting_can_pay(table.verify_G1, table.drafting_G)
    last_probe = probe_window(rules, table.plain, np.max(table.rounds_G))
    probe = probe_due(stats, remaining_B, last_probe, can_probe)
    planned = planned_drafts(jnp.minimum(stats.estimate_BG, 1.0), stats.gamma_B,
                             remaining_B > 0, jnp.asarray(table.verify_G1), table.drafting_G,
                             rules, probe, remaining_B)
    return RoundPlan(can_probe, last_probe, probe, planned > 0, planned)

  def never_drafts(self, stats: AdaptiveStats, remaining_B) -> jax.Array:
    """[] bool: the first round, from these stats, is a plain stretch to the end (nothing
    planned, no probe due now or later), so no round of this run drafts."""
    plan = self.plan(stats, remaining_B)
    return ~plan.drafts & (steps_to_probe(stats, remaining_B, plan.last_probe, plan.can_probe)
                           == _TO_THE_END)

  def drafted_or_plain(self, s, draft_now, probe, drafted_round, plain_steps, *, schedule,
                       round_cost, budget_B, catch_up_cost=0.0):
    """The tail of a chain or tree round: `drafted_round(s)` or `plain_steps(s)` (each ->
    (state, admitted_B, num_accepted_B, width index, rounds, plain row-rounds, empty_B)),
    then the acceptance statistics updated and written back into the metrics.
    round_cost(width index) -> [] the drafted round's cost, from the table.

    A probe is promising when its drafts advanced the batch's finish (the largest remaining
    budget of a row), beyond the one token a plain step gives, by at least half of what plain
    steps would have in the probe's extra time: probing stays frequent while drafting is
    near paying (on the built-in pair's main job, probes that accepted one draft in four at
    first kept finding the stretch where lookup accepts everything), and backs off in a
    large batch, where one drafted round moves the slowest row about one token however many
    the others accept. A probe also ends a plain stretch, after which a drafter that skips
    rounds catches up (catch_up_cost, charged as a propose of gamma_max drafts): at 64 rows
    of the built-in pair, probes of one draft that the slowest row accepted kept coming every
    8 steps, each with a catch-up of the draft model, and `auto` read 0.89-0.90x."""
    rules = self.config.rules
    zeros_B = jnp.zeros_like(s.pending_B)
    outputs = (s, zeros_B, zeros_B, jnp.int32(0), jnp.int32(0), jnp.int32(0),
               jnp.zeros_like(s.done_B))
    new, admitted_B, num_accepted_B, w_idx, steps, plain_row_rounds, empty_B = cond_in_place(
        draft_now, lambda o: drafted_round(o[0]), lambda o: plain_steps(o[0]), outputs)
    # (a tree round has already updated its node estimates in new's stats)
    promising = probe_was_promising(
        budget_B - s.num_generated_B, budget_B - new.num_generated_B, ~s.done_B,
        round_cost(0), round_cost(w_idx) - round_cost(0) + catch_up_cost)
    stats = new.metrics.adaptive.update(
        ~s.done_B, admitted_B, num_accepted_B, w_idx, draft_now, probe,
        learning_rate=rules.learning_rate, schedule=schedule, probe_every=rules.probe_every,
        probe_growth=rules.probe_growth, rounds=steps, plain_row_rounds=plain_row_rounds,
        empty_B=empty_B, prior=rules.prior, forget=rules.forget, promising=promising)
    return new.replace(metrics=new.metrics.replace(adaptive=stats))

  def plain_steps(self, target, drafter, gamma, sampling, verifier, params, draft_params,
                  lengths_B, budget_B, eos_id, can_probe, last_probe, s):
    """Nobody's draft pays: plain steps up to the next probe (or to the end, where the cost
    table rules drafting out), in an inner loop, so that an undrafted stretch costs what
    autoregressive decoding does and not a whole round's bookkeeping (two conditionals, the
    rules) per token, nor one per probe_every tokens (capped there, a useless draft ran at
    0.74-0.88x autoregressive on stories260K). Nothing the plan reads changes in a stretch,
    so ending it earlier would only plan no drafts again. A drafter that can skip rounds
    catches up once per CATCH_UP_WIDTHS[-1] steps, not in every step.
    -> (state, admitted_B, num_accepted_B, width index, steps, row-steps, empty_B)."""
    stats: AdaptiveStats = s.metrics.adaptive
    n = steps_to_probe(stats, remaining_tokens(s.done_B, s.num_generated_B, budget_B),
                       last_probe, can_probe)
    zeros_B = jnp.zeros_like(s.pending_B)
    if drafter.skips_rounds:
      return self.plain_stretch(target, drafter, gamma, sampling, params, draft_params,
                                lengths_B, budget_B, eos_id, n, s)

    def one(c):
      i, row_rounds, s = c
      new = self.plain_step(target, drafter, gamma, sampling, verifier, params, draft_params,
                            lengths_B, budget_B, eos_id, s)
      return i + 1, row_rounds + jnp.sum(~s.done_B), new

    steps, row_rounds, s = jax.lax.while_loop(lambda c: (c[0] < n) & jnp.any(~c[2].done_B),
                                              one, (jnp.int32(0), jnp.int32(0), s))
    return s, zeros_B, zeros_B, jnp.int32(0), steps, row_rounds, jnp.zeros_like(s.done_B)

  def plain_stretch(self, target, drafter, gamma, sampling, params, draft_params, lengths_B,
                    budget_B, eos_id, n, s):
    """Up to n plain steps for a drafter that skips rounds: each is generate's loop body
    (one target token, no drafter, no round bookkeeping at gamma_max's shapes), the metrics
    are added once, and the drafter catches up after every CATCH_UP_WIDTHS[-1] steps and at
    the end (Drafter.catch_up_after, whose window is static), unless the stretch ends the
    generation (AdaptiveConfig.final_draft_state). -> plain_steps' tuple."""
    window = CATCH_UP_WIDTHS[-1]
    from spec_jax.speculative import round_inputs  # (imports this module lazily)

    def one(c):
      i, active_steps_B, s = c
      new = self.plain_token(target, drafter, sampling, params, draft_params, lengths_B,
                             budget_B, eos_id, s)
      return i + 1, active_steps_B + (~s.done_B).astype(jnp.int32), new

    # a stretch to the end: nothing drafts after it, so its catch-ups are skipped unless the
    # final drafter state is wanted (AdaptiveConfig.final_draft_state)
    skip_catch_up = False if self.config.final_draft_state else n == _TO_THE_END

    def chunk(c):  # up to `window` steps, then the drafter's catch-up over them
      start, active_steps_B, s = c
      stop = jnp.minimum(start + window, n)
      i, active_steps_B, s = jax.lax.while_loop(
          lambda c: (c[0] < stop) & jnp.any(~c[2].done_B), one, (start, active_steps_B, s))
      ctx = round_inputs(s, sampling, eos_id)[0]
      # the narrowest compiled window that covers the chunk's steps (a short stretch between
      # drafted rounds must not pay a 33-token pass of a real draft model); 0: none
      pick = jnp.searchsorted(jnp.asarray(CATCH_UP_WIDTHS, jnp.int32), i - start) + 1
      catch_up = [functools.partial(drafter.catch_up_after, draft_params, ctx=ctx, rounds=w,
                                    gamma=gamma) for w in CATCH_UP_WIDTHS]
      return i, active_steps_B, s.replace(draft_state=switch_in_place(
          jnp.where(skip_catch_up, 0, pick), [lambda state: state] + catch_up, s.draft_state))

    zeros_B = jnp.zeros_like(s.pending_B)
    steps, active_steps_B, new = jax.lax.while_loop(
        lambda c: (c[0] < n) & jnp.any(~c[2].done_B), chunk, (jnp.int32(0), zeros_B, s))
    new = new.replace(metrics=new.metrics.after_plain_steps(
        steps, active_steps_B, new.num_generated_B - s.num_generated_B))
    return (new, zeros_B, zeros_B, jnp.int32(0), steps, jnp.sum(active_steps_B),
            jnp.zeros_like(s.done_B))

  @staticmethod
  def plain_step(target, drafter, gamma, sampling, verifier, params, draft_params, lengths_B,
                 budget_B, eos_id, s):
    """One plain step as the loops run it -> the new state: generate's loop body for a
    drafter that skips rounds (plain_token; its catch-up comes once per stretch), else a
    width-1 step in which the drafter catches up itself."""
    if drafter.skips_rounds:
      return AdaptiveRound.plain_token(target, drafter, sampling, params, draft_params,
                                       lengths_B, budget_B, eos_id, s)
    return AdaptiveRound.step(target, drafter, gamma, sampling, verifier, params, draft_params,
                              lengths_B, budget_B, eos_id, s, 1, jnp.zeros_like(s.pending_B),
                              None, None, draft_state=None)[0]

  @staticmethod
  def plain_token(target, drafter, sampling, params, draft_params, lengths_B, budget_B, eos_id,
                  s):
    """One plain step of a stretch for a drafter that skips rounds: generate's loop body (one
    target token, no drafter, no round bookkeeping at gamma_max's shapes) -> the new state
    (its metrics untouched: plain_stretch adds them once)."""
    # the key outlives the stretch, so a greedy step's split would not be dropped as dead
    key, step_key = split_unless_greedy(s.key, 2, sampling)
    (seq_BS, pending_B, num_generated_B, done_B, bad_B, count_B, cache, counts,
     hidden_BD) = decode_token(
        target, params, sampling, lengths_B, budget_B, eos_id, step_key, s.seq_BS, s.pending_B,
        s.num_generated_B, s.done_B, s.cache, s.counts)
    # drafters that read the target's hidden states keep the pending token's (rows that fed
    # it: those that emitted); dead code for the others
    draft_state = drafter.record_plain_step(draft_params, s.draft_state, hidden_BD,
                                            s.cache.length_B, count_B > 0)
    # the pending token's position, as commit_round keeps it: a row that emitted moves on
    cache = cache.with_length(cache.length_B + (count_B > 0).astype(jnp.int32))
    return s.replace(seq_BS=seq_BS, pending_B=pending_B, num_generated_B=num_generated_B,
                     done_B=done_B, cache=cache, key=key, failed_B=s.failed_B | bad_B,
                     counts=counts, draft_state=draft_state)

  def drafted_round(self, step, drafter, gamma, sampling, verifier, draft_params, eos_id,
                    cost_G1, probe, planned, s, useful_B=None):
    """Drafts up to `planned`, admits a prefix per row (at most useful_B: drafts its budget
    could keep), verifies at the width the scheduler picks."""
    cfg, rules = self.config, self.config.rules
    stats: AdaptiveStats = s.metrics.adaptive
    from spec_jax.speculative import round_inputs  # speculative.py imports this module lazily
    active_B = ~s.done_B
    ctx, _, draft_key, _ = round_inputs(s, sampling, eos_id, verifier)
    if rules.admit is None:
      # nothing past the planned length is admitted: drafters may stop there (a draft
      # model's sequential steps are most of a round's drafting cost)
      ctx = ctx.replace(max_drafts=planned)
    drafts_BG, probs_BGV, draft_state = drafter.propose(draft_params, s.draft_state, ctx, gamma,
                                                        sampling, draft_key)
    if probs_BGV is None:
      q_BG = top_BG = jnp.ones(drafts_BG.shape, jnp.float32)
    else:
      q_BG = jnp.take_along_axis(probs_BGV, drafts_BG[..., None], axis=-1)[..., 0]
      top_BG = jnp.max(probs_BGV, axis=-1)
    conf_BG = drafter.acceptance_estimates(draft_state)  # may be wider than gamma
    conf_BG = top_BG if conf_BG is None else conf_BG[:, :gamma].astype(jnp.float32)
    survival_BG = jnp.cumprod(jnp.minimum(conf_BG, stats.estimate_BG), axis=1)
    inputs = AdmitInputs(q_BG, top_BG, survival_BG, stats.gamma_B, drafts_BG)
    admitted_B = (rules.admit or functools.partial(row_rule, rules))(inputs)
    admitted_B = jnp.where(probe, jnp.maximum(admitted_B, 1), admitted_B)
    empty_B = drafter.empty_rows(draft_state)
    if empty_B is not None:
      admitted_B = jnp.where(empty_B, 0, admitted_B)
    admitted_B = jnp.where(active_B, admitted_B, 0)
    if rules.admit is None:
      admitted_B = jnp.minimum(admitted_B, planned)
    if useful_B is not None:
      admitted_B = jnp.minimum(admitted_B, useful_B)
    # past-only caps on each row's length, for the scan's look-ahead
    limit_B = jnp.full_like(admitted_B, gamma)
    if useful_B is not None:
      limit_B = jnp.minimum(limit_B, useful_B)
    if rules.admit is None:
      limit_B = jnp.minimum(limit_B, planned)
    if rules.schedule:
      limit_B = jnp.minimum(limit_B, stats.gamma_B)
    k = schedule_length(survival_BG, admitted_B, active_B, cost_G1,
                        stats.estimate_BG if rules.lookahead else None, limit_B)
    k = jnp.where(probe, jnp.max(admitted_B), k)
    admitted_B = jnp.minimum(admitted_B, k)
    if self.forced:  # (still a function of the rules' lengths: their cost is timed too)
      admitted_B = jnp.where(active_B, jnp.maximum(jnp.minimum(admitted_B, planned), planned), 0)
    # propose's state rides in the carry, so the branches commit it in place (closed over,
    # it would be a loop invariant that each branch copies to return)
    def branch(width):
      return lambda c: step(c[0], width=width, admitted_B=admitted_B, drafts_BG=drafts_BG,
                            probs_BGV=probs_BGV, draft_state=c[0].draft_state)

    w_idx = width_index(cfg.widths, jnp.max(admitted_B))  # 0, a plain step, when none
    new, num_accepted_B = switch_in_place(
        w_idx, [branch(w) for w in cfg.widths],
        (s.replace(draft_state=draft_state), jnp.zeros_like(s.pending_B)))
    empty_B = jnp.zeros_like(active_B) if empty_B is None else empty_B
    return new, admitted_B, num_accepted_B, w_idx, jnp.int32(1), jnp.int32(0), empty_B

  @staticmethod
  def step(target, drafter, gamma, sampling, verifier, params, draft_params, lengths_B, budget_B,
           eos_id, s, width, admitted_B, drafts_BG, probs_BGV, *, draft_state):
    """One target pass of `width` tokens (the pending one + width - 1 drafts) and the commit.
    width 1 is a plain step; then, with draft_state None, the drafter catches up itself.
    -> (new state, num_accepted_B)."""
    from spec_jax.speculative import commit_round, round_inputs  # (imports this module lazily)
    ctx, key, draft_key, verify_key = round_inputs(s, sampling, eos_id, verifier)
    if draft_state is None:
      draft_state = drafter.catch_up(draft_params, s.draft_state, ctx, gamma, sampling, draft_key)
      drafts_BG = jnp.zeros((s.pending_B.shape[0], gamma), jnp.int32)
    block_BW = jnp.concatenate([s.pending_B[:, None], drafts_BG[:, :width - 1]], axis=1)
    positions_BW = ctx.position_B[:, None] + jnp.arange(width, dtype=jnp.int32)[None, :]
    logits_BWV, hidden_BWD, cache = target.apply(params, block_BW, positions_BW, s.cache)
    if width == 1:  # no drafts, nothing to reject
      logits_BV = process_logits(logits_BWV[:, 0], sampling, ctx.history)
      num_accepted_B, next_B = jnp.zeros_like(s.pending_B), sample(verify_key, logits_BV, sampling)
    else:
      logits_BWV = process_logits(logits_BWV, sampling, None if ctx.history is None
                                  else ctx.history.along_chain(block_BW))
      probs = None if probs_BGV is None else probs_BGV[:, :width - 1]
      num_accepted_B, next_B = verify_admitted(
          verifier, drafts_BG[:, :width - 1], probs, logits_BWV, sampling, verify_key,
          jnp.minimum(admitted_B, width - 1))
    hidden_BG1D = jnp.pad(hidden_BWD, ((0, 0), (0, gamma + 1 - width), (0, 0)))  # never read
    new = commit_round(drafter=drafter, draft_params=draft_params, lengths_B=lengths_B,
                       budget_B=budget_B, eos_id=eos_id, state=s, key=key, ctx=ctx, cache=cache,
                       draft_state=draft_state, draft_tokens_BG=drafts_BG,
                       num_accepted_B=num_accepted_B, next_B=next_B, hidden_BG1D=hidden_BG1D,
                       # rows whose logits were not finite stop there, failed
                       num_finite_B=finite_prefix(nonfinite_rows(logits_BWV)))
    return new, num_accepted_B


@dataclasses.dataclass(frozen=True)
class AdaptiveTreeRound(AdaptiveRound):
  """gamma="auto" for a tree drafter: each round verifies the tree cut to its first k nodes,
  for k among the widths, or runs plain steps.

  The budget is chosen before anything is drawn, from past rounds only (so it is lossless,
  as planned_drafts is for chains; first_nodes says why a cut tree is): each row carries
  P(node i is on the accepted path) for every drafted node (AdaptiveStats.node_estimate_BZ),
  so a tree cut to k nodes is expected to yield one token per active row plus the sum of
  its first k - 1 nodes' estimates. That sum is exact for the cut tree, not an
  approximation: whether node i is accepted depends on its own path and on the siblings
  tried before it, which all come earlier in the node order and so survive every cut that
  keeps i. Each budget is charged its target pass plus propose_tree (the whole tree is
  always drafted); the best rate against a plain step's decides, as for chains. When no
  budget pays, plain steps run until the next probe, which verifies the whole tree. The
  chain's row rules (confidence, survival, schedule, admit) do not apply."""

  def __call__(self, target, drafter, gamma, sampling, verifier, params, draft_params,
               lengths_B, budget_B, eos_id, s):
    stats: AdaptiveStats = s.metrics.adaptive
    budgets = self.config.widths[1:]
    plan = self.plan(stats, remaining_tokens(s.done_B, s.num_generated_B, budget_B))

    def tree_round(s):
      return self.tree_round(target, drafter, gamma, sampling, verifier, params, draft_params,
                             lengths_B, budget_B, eos_id, budgets, plan.size, s)

    plain_steps = functools.partial(self.plain_steps, target, drafter, gamma, sampling,
                                    verifier, params, draft_params, lengths_B, budget_B, eos_id,
                                    plan.can_probe, plan.last_probe)
    cost_W = jnp.asarray(self.tree_costs, jnp.float32)
    return self.drafted_or_plain(s, plan.drafts, plan.probe, tree_round, plain_steps,
                                 schedule=False, round_cost=lambda w_idx: cost_W[w_idx],
                                 budget_B=budget_B)

  @functools.cached_property
  def tree_costs(self) -> np.ndarray:
    """[W] a plain step's cost, then each node budget's (its target pass + propose_tree);
    derived once per round function, as the chain's AdaptiveConfig.cost_table."""
    cost_W = np.asarray(self.config.target_cost_table(), np.float64)
    cost_W[1:] += float(self.config.draft_cost or 0.0)  # propose_tree, timed once
    return cost_W

  def plan(self, stats: AdaptiveStats, remaining_B) -> RoundPlan:
    """What a tree round decides before drafting: its size is the index of the node budget
    (a probe verifies the whole tree)."""
    gamma, budgets = self.config.gamma_max, self.config.widths[1:]
    cost_W = self.tree_costs
    # static: whether some cut tree whose deepest path were always accepted would beat a
    # plain step (a cut to k nodes reaches at most depth k - 1)
    best_case_K = np.array([1 + min(k - 1, gamma) for k in budgets])
    can_probe = bool(np.any(best_case_K / cost_W[1:] > 1 / cost_W[0]))
    last_probe = probe_window(self.config.rules, cost_W[0], cost_W[-1])
    probe = probe_due(stats, remaining_B, last_probe, can_probe)
    budget_idx, tree_now = choose_tree_budget(stats.node_estimate_BZ, remaining_B > 0, budgets,
                                              jnp.asarray(cost_W, jnp.float32))
    return RoundPlan(can_probe, last_probe, probe, tree_now | probe,
                     jnp.where(probe, len(budgets) - 1, budget_idx))

  def tree_round(self, target, drafter, gamma, sampling, verifier, params, draft_params,
                 lengths_B, budget_B, eos_id, budgets, budget_idx, s):
    """propose_tree, then the target pass and verdict over the first budgets[budget_idx]
    nodes (one compiled branch per budget, all with the accepted path's shapes), then one
    commit. -> drafted_or_plain's tuple."""
    from spec_jax.tree_speculative import (commit_tree_round, first_nodes, propose_tree_round,
                                           verify_tree_round)
    rules = self.config.rules
    active_B = ~s.done_B
    ctx, key, verify_key, tree, draft_state = propose_tree_round(
        drafter, gamma, sampling, verifier, draft_params, eos_id, s)

    def verify(k):
      return lambda c: verify_tree_round(target, sampling, verifier, params, ctx,
                                         first_nodes(tree, k), c[0], verify_key)

    shapes = jax.eval_shape(lambda cache: verify(budgets[-1])((cache,)), s.cache)
    carry = (s.cache,) + jax.tree.map(lambda x: jnp.zeros(x.shape, x.dtype), shapes[1:])
    verified = switch_in_place(budget_idx, [verify(k) for k in budgets], carry)
    num_verified = jnp.asarray(budgets, jnp.int32)[budget_idx]
    # the deepest draft a row's cut tree holds: its verified length
    reach_B = jnp.max(jnp.where(jnp.arange(tree.num_nodes) < num_verified, tree.depth_BN, 0),
                      axis=1)
    new = commit_tree_round(drafter, draft_params, lengths_B, budget_B, eos_id, s, key, ctx, tree,
                            draft_state, verified)
    _, path_BR1, num_accepted_B, *_ = verified
    stats = new.metrics.adaptive.update_nodes(
        active_B, num_verified, path_BR1, num_accepted_B,
        learning_rate=rules.learning_rate, prior=rules.prior, forget=rules.forget)
    new = new.replace(metrics=new.metrics.replace(adaptive=stats))
    admitted_B = jnp.where(active_B, reach_B, 0).astype(jnp.int32)
    return (new, admitted_B, num_accepted_B, budget_idx + 1, jnp.int32(1), jnp.int32(0),
            jnp.zeros_like(active_B))


def choose_tree_budget(node_estimate_BZ, active_B, budgets, cost_W):
  """From past rounds only: (index into budgets of the best cut, whether it beats a plain
  step), by expected tokens per second. cost_W [W]: a plain step's cost, then each budget's
  (target pass + drafting)."""
  rows = jnp.sum(active_B).astype(jnp.float32)
  cum_Z = jnp.cumsum(jnp.sum(jnp.where(active_B[:, None], node_estimate_BZ, 0.0), axis=0))
  tokens_K = rows + cum_Z[jnp.asarray(budgets) - 2]  # the first k - 1 drafted nodes
  rate_K = tokens_K / cost_W[1:]
  best = jnp.argmax(rate_K).astype(jnp.int32)
  return best, rate_K[best] > rows / cost_W[0]


def _adaptive_program_class():
  from spec_jax.speculative import SpeculativeProgram

  @dataclasses.dataclass(frozen=True)
  class AdaptiveProgram(SpeculativeProgram):
    """A SpeculativeProgram whose rounds are AdaptiveRound (gamma = config.gamma_max) or, for
    a tree drafter, AdaptiveTreeRound (gamma = the tree's depth); the loop's carry holds the
    adaptive state in metrics.adaptive."""
    adaptive: AdaptiveConfig | None = None

    def init(self, params, draft_params, tokens_BP, lengths_B, budget_B, eos_id, key):
      state = super().init(params, draft_params, tokens_BP, lengths_B, budget_B, eos_id, key)
      stats = self.initial_stats(tokens_BP.shape[0])
      return state.replace(metrics=state.metrics.replace(adaptive=stats))

    def initial_stats(self, batch: int) -> AdaptiveStats:
      r = self.adaptive.rules
      return AdaptiveStats.zeros(batch, self.gamma, self.adaptive.widths, r.initial_gamma,
                                 r.prior, r.probe_every, self.adaptive.tree_nodes)

    def init_drafter(self, draft_params, prompt, remaining_tokens_B):
      """A drafter that skips rounds is not read in a plain stretch to the end; where the
      first round will be one (the plan drafts nothing and no probe can come: a useless
      draft, or a budget too short to repay one), its prefill is skipped too, and its state
      left zero: a 12-of-30-layer skip of SmolLM2 otherwise spent ~10% of a 32-token answer
      prefilling a draft cache nothing read."""
      init = functools.partial(self.drafter.init, draft_params)
      if (self.drafter.is_tree or not self.drafter.skips_rounds
          or self.adaptive.final_draft_state):
        return init(prompt)
      stats = self.initial_stats(prompt.tokens_BP.shape[0])
      never = self.round_fn.never_drafts(stats, remaining_tokens_B)
      return cond_in_place(never, lambda state: state, lambda _: init(prompt),
                           zeros_like_outputs(init, prompt))

  return AdaptiveProgram


@functools.cache
def adaptive_program_class():
  return _adaptive_program_class()


def configure(program, config: AdaptiveConfig):
  """A program running adaptive rounds: a chain program prepared with gamma =
  config.gamma_max, or a tree program (its rounds then verify the tree cut to a node budget,
  or run plain steps: AdaptiveTreeRound)."""
  drafter = program.drafter
  if drafter.is_tree:
    config = dataclasses.replace(config, gamma_max=drafter.max_depth,
                                 tree_nodes=drafter.num_nodes).resolved()
    round_fn = AdaptiveTreeRound(config)
  else:  # (a config taken from a tree program drops its node budget)
    config = dataclasses.replace(config, tree_nodes=None).resolved()
    round_fn = AdaptiveRound(config)
  if program.gamma != config.gamma_max:
    raise ValueError(f"the program drafts {program.gamma}, the config's gamma_max is "
                     f"{config.gamma_max}")
  fields = {f.name: getattr(program, f.name) for f in dataclasses.fields(program)
            if f.name != "adaptive"}
  fields["round_fn"] = round_fn
  return adaptive_program_class()(**fields, adaptive=config)


def keeping_draft_state(program):
  """The program with AdaptiveConfig.final_draft_state on, for callers that read the final
  drafter state; a program that does not run adaptive rounds, unchanged."""
  cfg = getattr(program, "adaptive", None)
  if cfg is None or cfg.final_draft_state:
    return program
  return configure(program, dataclasses.replace(cfg, final_draft_state=True))


# --- the cost table ---------------------------------------------------------------------------

_MEASURED: dict = {}


LOOP_PASSES = 16  # most passes per timed call: a call's dispatch is spread thin
CALL_SECONDS = 0.02  # a timed call this long spreads it thin enough (a pass: ~0.1-2 ms small)
MEASURE_SECONDS = 4.0  # the timed repeats' budget: large batches of large models repeat less


def timing_plan(pass_seconds: list[float], repeats: int,
                call_seconds: list[float] | None = None) -> tuple[list[int], int]:
  """(passes per timed call for each thunk, repeats) from one pass of each (pass_seconds)
  and what a call costs besides its passes (call_seconds, timed as a call of none, which
  every repeat also takes).

  A small model's pass (~0.1 ms) is timed as LOOP_PASSES passes a call, or dispatch would
  dominate; a large batch of a large model on a CPU (a 292M target's 9-token pass at 64
  rows: seconds) needs no more than one or two a call, and fewer repeats, so the start-up
  table takes seconds, not the quarter of an hour 16 passes x 6 calls x 5 widths would."""
  passes = [int(min(LOOP_PASSES, max(1, math.ceil(CALL_SECONDS / max(t, 1e-9)))))
            for t in pass_seconds]
  per_round = sum(p * t for p, t in zip(passes, pass_seconds)) + 2 * sum(call_seconds or ())
  return passes, int(max(1, min(repeats, MEASURE_SECONDS // max(per_round, 1e-9))))


def _interleaved_seconds(thunks, repeats: int) -> list[float]:
  """The fastest of `repeats` timings of each thunk, taken in turn (round robin; each thunk
  compiled and warmed up by the caller).

  The table's decisions compare costs with each other (tokens per second of one plan
  against another), so what matters is their ratios. Taking the thunks in turn puts a burst
  of another process's load on all of them alike; the minimum is the estimate least moved
  by such bursts (on this shared 2-core CPU one-off medians swung 1.2-1.6x)."""
  best = [math.inf] * len(thunks)
  for _ in range(repeats):
    for i, thunk in enumerate(thunks):
      best[i] = min(best[i], _seconds(thunk))
  return best


def _seconds(thunk) -> float:
  t0 = time.perf_counter()
  jax.block_until_ready(thunk())
  return time.perf_counter() - t0


def measure_costs(program, params, draft_params, args, repeats: int = 15,
                  signatures: tuple | None = None):
  """Times what a round costs at each width, and one propose of gamma_max drafts and of one,
  at this program's batch size and cache length -> (target_costs, draft_cost,
  first_draft_cost), in seconds.

  A chain's width w > 1 is charged what the adaptive round runs at w, less its drafting: the
  round is timed whole, forced to plan, admit and verify w - 1 drafts (propose, the rules,
  the scheduler, the switch, the target pass, verification and commit), and the drafting
  of w - 1 drafts (the line through the two propose points, drafting_costs) is taken off,
  since planned_drafts adds back the drafting of however many it plans. Width 1 is a plain
  step as the loop runs it (a drafter that skips rounds: generate's loop body; else a step
  with the drafter's catch_up). Charging the target pass alone left out 15-20% of a
  drafted round at 16 and 64 rows on the built-in pair (verification over [B, w, V]
  logits, the commits, the round's planning) against nearly nothing of a plain step, so
  auto drafted where every fixed gamma lost (0.86-0.90x autoregressive). A tree's widths
  are timed as chain passes over that many nodes, without the tree mask, path compaction
  and tree verification (so a tree round is undercharged, as its plain step is).

  Each is timed as the loop runs it: passes in a `lax.fori_loop` that carries the state
  (cache, drafter state), each pass fed from the one before, less a call of no passes, so
  neither a call's dispatch nor its copy of the state is charged to a pass (timed one call
  a pass, a small model's one-token pass cost 2-3x the loop's step). How many passes a call
  and how many repeats follow from one timed pass of each (`timing_plan`): up to 15, as time
  allows. With 5, six measurements put the built-in pair's 5-token round (less its drafting)
  at 1.98-2.62 plain steps at batch 1, and its dearer readings ruled drafting out where
  gamma 4 gained 1.2-1.3x; with 15, four in one process at 1.89-2.04. Cached per program,
  batch shape and params' shapes and dtypes (int8 and float32 params of one model are
  different programs: `signatures`, the params_signature of both, when the caller has
  them); start-up cost: a few small compiles."""
  cfg = program.adaptive.resolved()
  tokens_BP, lengths_B, budgets_B, eos, _, key = args
  if signatures is None:
    signatures = params_signature(params), params_signature(draft_params)
  cache_key = (program.target, program.drafter, program.sampling, program.verifier,
               program.cache_len, cfg.widths, tokens_BP.shape, signatures)
  if cache_key in _MEASURED:
    return _MEASURED[cache_key]
  state = jax.jit(program.init)(params, draft_params, tokens_BP, lengths_B, budgets_B, eos, key)
  target, drafter, sampling = program.target, program.drafter, program.sampling

  @functools.partial(jax.jit, static_argnums=0)
  def target_passes(w, params, cache, length_B, passes):
    positions_BW = length_B[:, None] + jnp.arange(w, dtype=jnp.int32)[None, :]

    def one(_, c):
      cache, token_B = c
      tokens_BW = jnp.broadcast_to(token_B[:, None], positions_BW.shape)
      logits_BWV, _, cache = target.apply(params, tokens_BW, positions_BW, cache)
      return cache, jnp.argmax(logits_BWV[:, -1], axis=-1).astype(jnp.int32)

    return jax.lax.fori_loop(0, passes, one, (cache, jnp.zeros_like(length_B)))[1]

  g = cfg.gamma_max
  forced = AdaptiveRound(cfg, forced=True)  # verifies `planned` drafts on every row

  @jax.jit
  def drafted_rounds(params, draft_params, s, planned, passes):
    step = functools.partial(AdaptiveRound.step, target, drafter, g, sampling,
                             program.verifier, params, draft_params, lengths_B, budgets_B, eos)
    one = lambda _, s: forced.drafted_round(step, drafter, g, sampling, program.verifier,
                                            draft_params, eos, jnp.ones(g + 1), jnp.bool_(True),
                                            planned, s)[0]
    return jax.lax.fori_loop(0, passes, one, s).pending_B

  @jax.jit
  def plain_steps(params, draft_params, s, passes):
    # (a drafter that skips rounds catches up once per stretch: not charged here)
    one = lambda _, s: AdaptiveRound.plain_step(target, drafter, g, sampling, program.verifier,
                                                params, draft_params, lengths_B, budgets_B, eos,
                                                s)
    return jax.lax.fori_loop(0, passes, one, s).pending_B

  @jax.jit
  def draft_passes(draft_params, s, key, max_drafts, passes):
    def one(_, c):
      draft_state, pending_B = c
      ctx = DraftContext(s.seq_BS, s.cache.length_B, pending_B, None, max_drafts)
      if drafter.is_tree:  # (trees draft whole: max_drafts is not read)
        tree, draft_state = drafter.propose_tree(draft_params, draft_state, ctx, sampling,
                                                 key)
        return draft_state, tree.tokens_BN[:, -1]
      drafts_BG, _, draft_state = drafter.propose(draft_params, draft_state, ctx, g, sampling,
                                                  key)
      return draft_state, drafts_BG[:, -1]

    return jax.lax.fori_loop(0, passes, one, (s.draft_state, s.pending_B))[1]

  # one program for both points (max_drafts is traced): the drafts it stops making; a tree
  # drafts whole (one point)
  points = (cfg.gamma_max,) if drafter.is_tree else (cfg.gamma_max, 1)
  # each a function of the number of passes (traced: one compile whatever the plan)
  if drafter.is_tree:
    runs = [functools.partial(target_passes, w, params, state.cache, state.cache.length_B)
            for w in cfg.widths]
  else:  # (one program for every drafted width: planned is traced)
    runs = [functools.partial(plain_steps, params, draft_params, state)]
    runs += [functools.partial(drafted_rounds, params, draft_params, state, jnp.int32(w - 1))
             for w in cfg.widths[1:]]
  runs += [functools.partial(draft_passes, draft_params, state, key, jnp.int32(m))
           for m in points]
  one, none = [], []
  for run in runs:
    jax.block_until_ready(run(jnp.int32(1)))  # compile and warm up
    none.append(_seconds(functools.partial(run, jnp.int32(0))))
    one.append(_seconds(functools.partial(run, jnp.int32(1))))
  passes, repeats = timing_plan([max(t - z, 0.0) for t, z in zip(one, none)], repeats, none)
  thunks = [functools.partial(run, jnp.int32(n)) for run, n in zip(runs, passes)]
  thunks += [functools.partial(run, jnp.int32(0)) for run in runs]
  timed = _interleaved_seconds(thunks, repeats)
  # A call also copies the state it is given (the loop's carry cannot overwrite its
  # arguments) and dispatches: 28-30 ms a call at 64 rows on the built-in pair, where a
  # plain step costs 35 ms. Charged to a pass, it made a plain step look 1.8x as dear and
  # drafting cheap; a call of no passes pays exactly that, so it is taken off.
  seconds = [max(t - z, 1e-3 * t) / n for t, z, n in zip(timed, timed[len(runs):], passes)]
  draft = seconds[len(cfg.widths)]
  first = seconds[-1] if len(points) == 2 else draft
  if not drafter.is_tree:
    # a chain's drafted round drafted w - 1: the table keeps the rest (planned_drafts adds
    # the drafting of however many it plans, on the line through the two points)
    drafting_G = drafting_costs(g, draft, first)
    seconds[1:len(cfg.widths)] = [t - float(drafting_G[w - 2])
                                  for t, w in zip(seconds[1:], cfg.widths[1:])]
  # a wider pass does at least a narrower one's work: a dip in the timings (noise on a
  # shared machine) must not make a verification look cheaper than a plain step, or a
  # useless draft would look worth trying in every round
  costs = tuple(itertools.accumulate(seconds[:len(cfg.widths)], max))
  _MEASURED[cache_key] = costs, draft, first
  return costs, draft, first


def with_measured_costs(program, params, draft_params, args, signatures=None):
  """The program with its cost table measured, unless the config already supplies one
  (signatures: as measure_costs)."""
  cfg = getattr(program, "adaptive", None)
  if cfg is None or cfg.target_costs is not None:
    return program
  measured = measure_costs(program, params, draft_params, args, signatures=signatures)
  return _with_costs(program, *measured)


@functools.lru_cache(maxsize=64)
def _with_costs(program, costs, draft, first):
  # memoised: a call's host time matters when a generation takes ~10 ms (stories260K)
  cfg = program.adaptive
  if cfg.draft_cost is None:
    cfg = dataclasses.replace(cfg, draft_cost=draft, first_draft_cost=first)
  return configure(program, dataclasses.replace(cfg, target_costs=costs))
