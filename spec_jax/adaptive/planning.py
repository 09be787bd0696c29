"""What a round decides, from past rounds and the cost table: each row's admitted length, the
drafts planned, the verification width, the probes and the tree's node budget.

Every function here reads only what exists before the drafts it governs are drawn (the
package docstring's lossless condition)."""

from __future__ import annotations

import math
import statistics
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from spec_jax.adaptive.config import AdaptiveRules
from spec_jax.core.sampling import sample
from spec_jax.metrics import MAX_PROBE_WAIT

# plain_steps' stretch length when no probe is left: until every row is done
_TO_THE_END = np.iinfo(np.int32).max


class RoundPlan(NamedTuple):
  """What a round decides before anything is drawn (AdaptiveRound.plan)."""
  can_probe: bool  # static: some drafted round could beat a plain step (the table alone)
  last_probe: float  # the probe window: fewest tokens left for a probe (probe_window)
  probe: jax.Array  # [] bool: draft whatever the estimates say (probe_due)
  drafts: jax.Array  # [] bool: this round drafts (planned, or a probe)
  size: jax.Array  # [] int32: chains: the drafts planned; trees: the node budget's index


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
    best_G = jnp.maximum(best_G, _best_ahead(survival_BG, live_BG, tokens_G1, cost_G1,
                                             jnp.minimum(estimate_BG, 1.0), limit_B))
  keep_G = best_G >= tokens_G1[:-1] / cost_G1[:-1]
  return jnp.minimum(_leading(keep_G[None])[0], jnp.max(jnp.where(active_B, admitted_B, 0)))


def _best_ahead(survival_BG, live_BG, tokens_G1, cost_G1, est_BG, limit_B) -> jax.Array:
  """[G] for each position k, the best rate over lengths m = j + 1 > k + 1: positions up to
  k by tokens_G1[k + 1], positions k < j < limit_B[b] by row b's survival at k times its
  estimates at k+1..j (live rows), -inf where no such length exists. All k at once, over a
  [B, K, J] triangle (a loop over k made ~30 small kernels a drafted round)."""
  gamma = survival_BG.shape[1]
  j_G = jnp.arange(gamma)
  ahead_KJ = j_G[None, :] > j_G[:, None]  # j > k
  limit_B = jnp.full(survival_BG.shape[:1], gamma) if limit_B is None else limit_B
  # est[b, k+1] * ... * est[b, j] for j > k (ones elsewhere multiply nothing in)
  factors_BKJ = jnp.where(ahead_KJ[None], est_BG[:, None, :], 1.0)
  proj_BKJ = survival_BG[:, :, None] * jnp.cumprod(factors_BKJ, axis=2)
  counted_BKJ = (ahead_KJ[None] & live_BG[:, :, None]
                 & (j_G[None, None, :] < limit_B[:, None, None]))
  gain_KJ = jnp.cumsum(jnp.sum(jnp.where(counted_BKJ, proj_BKJ, 0.0), axis=0), axis=1)
  rate_KJ = (tokens_G1[1:, None] + gain_KJ) / cost_G1[1:][None, :]
  return jnp.max(jnp.where(ahead_KJ, rate_KJ, -jnp.inf), axis=1)


def best_gain(cost_G1, draft_cost_G) -> float:
  """Host-side, from the cost table: the best speed-up over plain steps, less one, of a
  drafted round whose drafts were all accepted ((1 + m) tokens for the pass verifying m
  drafts and the drafting)."""
  m_G = np.arange(1, len(draft_cost_G) + 1)
  round_G = np.asarray(cost_G1[1:], np.float64) + np.asarray(draft_cost_G, np.float64)
  return float(np.max((1 + m_G) * float(cost_G1[0]) / round_G)) - 1.0


def drafting_can_pay(cost_G1, draft_cost_G, min_gain: float = 0.0) -> bool:
  """Host-side, from the cost table: whether some draft length m beats a plain step's tokens
  per second by more than min_gain (AdaptiveRules.min_gain) when every draft is accepted
  (best_gain > min_gain)."""
  return best_gain(cost_G1, draft_cost_G) > min_gain


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


def probe_window(rules, plain_cost, dearest_round_cost, probe_every: int | None = None) -> float:
  """Host-side: the fewest tokens a batch must still have to make, for a probe to run: the
  remaining budget's plain steps must take probe_every (default: the rules') times the
  dearest drafted round."""
  every = rules.probe_every if probe_every is None else probe_every
  return float(every * dearest_round_cost / plain_cost)


def scaled_probe_every(rules, cost_G1, draft_cost_G, catch_up_cost: float = 0.0) -> int:
  """Host-side, from the cost table: the idle rounds between probes of a chain drafter,
  rules.probe_every or more where a probe is dear against the most drafting could gain
  (AdaptiveRules.probe_share): loss / (probe_share * gain), at most 64 x probe_every.

  gain: the best speed-up over plain steps of a drafted round whose drafts were all
  accepted ((1 + m) tokens for the round of m drafts). loss: what the probe the plan would
  make at the prior costs beyond the tokens it is expected to yield, in plain steps (the
  round, plus catch_up_cost for a drafter that catches up after plain steps). Decided from
  the table and the rules alone, before anything is drawn (lossless). On stories260K a
  trained DSpark drafter's round of 4 drafts costs 4.3 plain steps, so even all accepted
  it would gain 17%, while probes every 8 idle steps cost `auto` 13% against never
  drafting (0.82x autoregressive against 0.955x); every 32 steps, none fitted and it read
  0.966x."""
  every = rules.probe_every
  if not rules.probe_share:
    return every
  gain = best_gain(cost_G1, draft_cost_G)
  if gain <= rules.min_gain:  # no probes (drafting_can_pay): nothing to space
    return every
  plain = float(cost_G1[0])
  cost_G = (np.asarray(cost_G1[1:], np.float64) + np.asarray(draft_cost_G, np.float64)) / plain
  m_G = np.arange(1, len(cost_G) + 1)
  # the plan's length at the prior: survival above rules.survival, within the schedule
  survival_G = rules.prior ** m_G.astype(np.float64)
  usable_G = survival_G >= rules.survival
  if rules.schedule:
    usable_G &= m_G <= rules.initial_gamma
  usable_G[0] = True  # (a probe drafts at least one)
  tokens_G = 1.0 + np.cumsum(survival_G)
  rate_G = np.where(usable_G, tokens_G / cost_G, -np.inf)
  m = int(np.argmax(rate_G))
  loss = cost_G[m] + catch_up_cost / plain - tokens_G[m]
  if loss <= 0:  # drafting pays at the prior: probe as often as the rules say
    return every
  return int(min(max(every, math.ceil(loss / (rules.probe_share * gain))),
                 MAX_PROBE_WAIT * every))


def wilson_upper(accepted_B, seen_B, confidence: float) -> jax.Array:
  """[B] float32: the Wilson score interval's upper end, at one-sided `confidence`, for a
  rate of accepted_B in seen_B trials (1 where nothing was seen). With no first draft
  accepted in 8 seen, 0.40 at 0.99; in 24, 0.18; one in 8, 0.54."""
  z = statistics.NormalDist().inv_cdf(confidence)
  n_B = jnp.maximum(seen_B, 1).astype(jnp.float32)
  p_B = accepted_B.astype(jnp.float32) / n_B
  centre_B = p_B + z * z / (2.0 * n_B)
  margin_B = z * jnp.sqrt(p_B * (1.0 - p_B) / n_B + z * z / (4.0 * n_B * n_B))
  return jnp.where(seen_B > 0, jnp.minimum((centre_B + margin_B) / (1.0 + z * z / n_B), 1.0),
                   1.0)


def probe_due(stats, remaining_B, last_probe, can_probe) -> jax.Array:
  """[] bool: draft this round whatever the plan says (AdaptiveRules.probe_every)."""
  return ((stats.idle_rounds >= stats.probe_interval) & can_probe
          & (jnp.max(remaining_B) >= last_probe))


def steps_to_probe(stats, remaining_B, last_probe, can_probe) -> jax.Array:
  """[] int32: the plain steps after which probe_due holds (each step counts as an idle
  round and takes a token from every row), or _TO_THE_END when it never will in this run."""
  wait = jnp.maximum(stats.probe_interval - stats.idle_rounds, 1)
  return jnp.where(can_probe & (jnp.max(remaining_B) - wait >= last_probe), wait, _TO_THE_END)


def finish_advance(remaining_before_B, remaining_after_B, active_B) -> jax.Array:
  """[] int32: how far a round moved the batch's finish: the largest remaining budget of
  the rows active before it, before less after (a plain step: 1)."""
  last = lambda r_B: jnp.max(jnp.where(active_B, r_B, 0))
  return last(remaining_before_B) - last(remaining_after_B)


def probe_was_promising(remaining_before_B, remaining_after_B, active_B, plain_cost,
                        extra_cost) -> jax.Array:
  """[] bool: a drafted round moved the batch's finish (finish_advance), beyond the one
  token a plain step gives, by at least half of what plain steps would in its extra_cost
  (its cost over a plain step's, with any catch-up)."""
  advance = finish_advance(remaining_before_B, remaining_after_B, active_B)
  return 2 * (advance - 1) * plain_cost >= extra_cost


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


def choose_tree_budget(node_estimate_BZ, active_B, budgets, cost_W, remaining_B=None):
  """From past rounds only: (index into budgets of the best cut, whether it beats a plain
  step), by expected tokens per second. cost_W [W]: a plain step's cost, then each budget's
  (target pass + drafting). remaining_B [B]: the tokens each row's budget has left; a row's
  expected tokens from a round are capped there (known before drafting, so lossless, as
  planned_drafts' cap for chains): near the end of a generation a deep tree is worth no more
  than the tokens its rows can still keep. None: no cap."""
  active_B1 = active_B[:, None]
  cum_BZ = jnp.cumsum(jnp.where(active_B1, node_estimate_BZ, 0.0), axis=1)
  tokens_BK = 1.0 + cum_BZ[:, jnp.asarray(budgets) - 2]  # the first k - 1 drafted nodes
  if remaining_B is not None:
    tokens_BK = jnp.minimum(tokens_BK, jnp.maximum(remaining_B, 1)[:, None].astype(jnp.float32))
  rows = jnp.sum(active_B).astype(jnp.float32)
  tokens_K = jnp.sum(jnp.where(active_B1, tokens_BK, 0.0), axis=0)
  rate_K = tokens_K / cost_W[1:]
  best = jnp.argmax(rate_K).astype(jnp.int32)
  return best, rate_K[best] > rows / cost_W[0]
