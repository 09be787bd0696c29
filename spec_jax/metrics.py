"""Speculative decoding metrics, accumulated on device inside the loop, summarised on the host."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct


def _learn(estimate, seen, hit, learning_rate, unseen, prior, forget):
  """The online estimates' step: where seen, an exponential moving average towards hit;
  where unseen, `forget` of the way back to the prior."""
  estimate = jnp.where(seen, estimate + learning_rate * (hit - estimate), estimate)
  return jnp.where(unseen, estimate + forget * (prior - estimate), estimate)


# the longest wait before a probe, in probe_every's (AdaptiveRules.probe_growth, give_up)
MAX_PROBE_WAIT = 64


@struct.dataclass
class SourceRecord:
  """The acceptance record of a drafter's primary source, kept apart from the secondary's
  (AdaptiveStats' own fields) for a drafter with sources (Drafter.has_sources)."""
  estimate_BG: jax.Array  # [B, G] as AdaptiveStats.estimate_BG
  first_seen_B: jax.Array  # [B] as AdaptiveStats.first_seen_B
  first_accepted_B: jax.Array  # [B] as AdaptiveStats.first_accepted_B
  # [B] as AdaptiveStats.gamma_B: each source its own schedule. Shared, the model's misses
  # held lookup's rounds to one draft where the text repeated itself and lookup's estimates
  # stood at 0.83-0.98 (the built-in pair's main job)
  gamma_B: jax.Array


@struct.dataclass
class AdaptiveStats:
  """Adaptive speculation's per-row state and counters (spec_jax.adaptive), carried in the
  metrics: the rounds read the estimates and schedule, the summary reports them."""
  widths: tuple = struct.field(pytree_node=False)  # the compiled verification widths
  gamma_B: jax.Array  # [B] int32 the schedule's draft length (HF: +2 full block, -1 otherwise)
  estimate_BG: jax.Array  # [B, G] float32 P(draft i accepted | reached and verified), online
  idle_rounds: jax.Array  # [] rounds since the last drafted round (or look in hindsight)
  probe_interval: jax.Array  # [] idle rounds before a probe drafts anyway
  width_rounds_W: jax.Array  # [W] rounds verified at each width (plain steps at width 1)
  undrafted_rounds: jax.Array  # [] rounds that did not draft at all
  admitted_hist_G1: jax.Array  # [G + 1] row-rounds per admitted length
  admitted_B: jax.Array  # [B] drafts verified, summed over the row's rounds
  # [B] int32: first drafts whose fate the row has seen (verified, or in hindsight) and
  # [B] float32 how many of them were accepted (a sampled run's hindsight adds estimated
  # acceptances: drafters.SampledHindsight): the evidence under estimate_BG[:, 0]
  # (AdaptiveRules.give_up)
  first_seen_B: jax.Array
  first_accepted_B: jax.Array
  # trees: [B, N - 1] float32 P(drafted node i + 1 is on the accepted path), online; None
  # for chains. Their sum over the first k - 1 nodes is what a tree cut to k nodes yields
  node_estimate_BZ: jax.Array | None = None
  # a drafter with sources: the primary's record; the fields above are the secondary's
  # (with_source swaps them per row for a round that drafts from the primary)
  primary: SourceRecord | None = None
  # the cost table the rounds plan from (spec_jax.adaptive.CostTable of arrays): an argument
  # of the program, carried unchanged (None: the config's static table)
  costs: object = None
  # [] float32: plain steps the run's drafting has gained (+) or lost (-) against plain
  # decoding so far, by the cost table: each drafted round's advance of the batch's finish
  # less its cost, each catch-up after plain steps its cost (AdaptiveRules.loss_budget)
  account: jax.Array | None = None
  # sampled chain programs (AdaptiveRules.exact_acceptance): [B, G] float32, the probability
  # sum_x min(p_i, q_i) that the last drafted round's draft i would be accepted given the
  # drafts before it, from both distributions, which its target pass has in hand: what
  # update learns at each position the round reached in place of its 0/1 outcome (the same
  # mean, without the draw's variance). None: greedy runs (there it is the outcome), trees,
  # verifiers whose acceptance is another rule
  round_accept_BG: jax.Array | None = None
  # whether the rounds move gamma_B (AdaptiveRules.schedule); off, it stays initial_gamma
  # and the summary leaves it out
  scheduled: bool = struct.field(pytree_node=False, default=False)

  @classmethod
  def zeros(cls, batch_size: int, gamma: int, widths, initial_gamma: int, prior: float,
            probe_every: int, tree_nodes: int | None = None,
            sources: bool = False, costs=None, scheduled: bool = False,
            exact_acceptance: bool = False) -> "AdaptiveStats":
    nodes = None if tree_nodes is None else jnp.full((batch_size, tree_nodes - 1), prior,
                                                     jnp.float32)
    record = lambda: (jnp.full((batch_size, gamma), prior, jnp.float32),
                      jnp.zeros(batch_size, jnp.int32), jnp.zeros(batch_size, jnp.float32),
                      jnp.full((batch_size,), min(initial_gamma, gamma), jnp.int32))
    estimate_BG, first_seen_B, first_accepted_B, gamma_B = record()
    return cls(tuple(widths), gamma_B, estimate_BG, jnp.int32(0),
               jnp.int32(probe_every), jnp.zeros(len(widths), jnp.int32), jnp.int32(0),
               jnp.zeros(gamma + 1, jnp.int32), jnp.zeros(batch_size, jnp.int32),
               first_seen_B, first_accepted_B, nodes,
               SourceRecord(*record()) if sources else None, costs,
               account=jnp.float32(0.0), scheduled=scheduled,
               round_accept_BG=(jnp.zeros((batch_size, gamma), jnp.float32)
                                if exact_acceptance else None))

  def with_source(self, primary_B) -> "AdaptiveStats":
    """The record (and schedule) each row reads and writes swapped to its primary source's
    where primary_B ([B] bool); the same call again swaps it back. Stats without sources:
    unchanged."""
    if self.primary is None:
      return self
    p = self.primary
    pick = lambda a, b: (jnp.where(primary_B.reshape(primary_B.shape + (1,) * (a.ndim - 1)),
                                   b, a))
    return self.replace(
        estimate_BG=pick(self.estimate_BG, p.estimate_BG),
        first_seen_B=pick(self.first_seen_B, p.first_seen_B),
        first_accepted_B=pick(self.first_accepted_B, p.first_accepted_B),
        gamma_B=pick(self.gamma_B, p.gamma_B),
        primary=SourceRecord(pick(p.estimate_BG, self.estimate_BG),
                             pick(p.first_seen_B, self.first_seen_B),
                             pick(p.first_accepted_B, self.first_accepted_B),
                             pick(p.gamma_B, self.gamma_B)))

  def update_nodes(self, active_B, num_verified, path_BR1, num_accepted_B, *,
                   learning_rate: float, prior: float, forget: float) -> "AdaptiveStats":
    """After a tree round that verified the first num_verified nodes (traced []): each
    verified node's estimate moves towards whether it is on the row's accepted path; the
    unverified ones move `forget` of the way back to `prior`."""
    num_drafted = self.node_estimate_BZ.shape[1]
    node_Z = jnp.arange(1, num_drafted + 1)
    taken_BR = jnp.arange(path_BR1.shape[1] - 1)[None, :] < num_accepted_B[:, None]
    on_path_BZ = jnp.any((path_BR1[:, 1:, None] == node_Z[None, None, :]) & taken_BR[..., None],
                         axis=1).astype(jnp.float32)
    verified_BZ = active_B[:, None] & (node_Z < num_verified)[None, :]
    return self.replace(node_estimate_BZ=_learn(
        self.node_estimate_BZ, verified_BZ, on_path_BZ, learning_rate,
        active_B[:, None] & ~verified_BZ, prior, forget))

  @property
  def record_rate_B(self) -> jax.Array:
    """[B] float32: the share of each row's first drafts (verified or guessed in hindsight)
    that were accepted; 0 with none seen."""
    return self.first_accepted_B / jnp.maximum(self.first_seen_B, 1)

  def grown_probe_interval(self, probe_growth: int, probe_every: int) -> jax.Array:
    """The wait before the next probe after one that was not promising (up to 64x)."""
    return jnp.minimum(probe_growth * self.probe_interval, MAX_PROBE_WAIT * probe_every)

  def out_of_budget(self, loss_budget: float, loss_share: float) -> jax.Array:
    """[] bool: the run's account (plain steps gained or lost by drafting) is below
    -(loss_budget + loss_share * rounds so far, plain steps counted as rounds)."""
    return self.account < -(loss_budget + loss_share * jnp.sum(self.width_rounds_W))

  def charged(self, steps) -> "AdaptiveStats":
    """The account less `steps` plain steps (a catch-up's cost, or what a drafted round
    lost: negative where it gained)."""
    return self.replace(account=(self.account - steps).astype(jnp.float32))

  def given_up(self, hopeless, probe_every: int) -> "AdaptiveStats":
    """Where hopeless ([] bool), the wait before the next probe at its longest (the rounds
    found drafting past paying even at the optimistic end of their evidence)."""
    return self.replace(probe_interval=jnp.where(hopeless, MAX_PROBE_WAIT * probe_every,
                                                 self.probe_interval).astype(jnp.int32))

  def learn_hindsight(self, agree_BA, valid_BA, learning_rate: float, *,
                      later: bool = True) -> "AdaptiveStats":
    """After a plain stretch, from Drafter.catch_up_with_hindsight: agree_BA[b, a] whether
    the greedy draft from the a-th position was the token that followed (valid_BA: the
    stretch's positions, in order), or in a sampled run its estimated acceptance there. The
    first draft's estimate learns each row's agreement rate (a round started anywhere), the
    later ones' the rate of agreeing right after an agreement (a draft a round reaches
    follows accepted ones): each moves as the moving average would after that many
    observations of their mean. Misses come in runs, so the second rate is the higher one
    (on the built-in pair, taking the rate alone for every position left drafting plain on
    a prompt where probes found gamma 4's gains); assigning each agreement the depth a
    gamma_max-draft round would have met it at measured first drafts only just after misses
    (an estimate of 0.4 for a draft model that agreed 81% of the time). later=False: the
    first draft's estimate alone (the drafter's hindsight does not speak for its later
    drafts: Drafter.hindsight_speaks_for_later_drafts)."""
    # (sampled, agree_BA holds each position's acceptance estimate in [0, 1]: the same sums,
    # weighted, with an agreement's weight its estimate: drafters.SampledHindsight)
    agree_BA = jnp.where(valid_BA, agree_BA.astype(jnp.float32), 0.0)
    count_B = jnp.sum(valid_BA, axis=1)
    rate_B = jnp.sum(agree_BA, axis=1) / jnp.maximum(count_B, 1)
    after_BA = valid_BA[:, 1:] * agree_BA[:, :-1]  # positions after an agreement
    after_B = jnp.sum(after_BA, axis=1)
    run_B = jnp.sum(after_BA * agree_BA[:, 1:], axis=1) / jnp.maximum(after_B, 1e-6)
    step = lambda n_B: (1.0 - (1.0 - learning_rate) ** n_B)[:, None]  # 0 where nothing seen
    first_B1 = self.estimate_BG[:, :1] + step(count_B) * (rate_B[:, None]
                                                          - self.estimate_BG[:, :1])
    later_BG = self.estimate_BG[:, 1:]
    if later:
      later_BG = later_BG + step(after_B) * (run_B[:, None] - later_BG)
    estimate_BG = jnp.concatenate([first_B1, later_BG], axis=1)
    return self.replace(
        estimate_BG=estimate_BG.astype(self.estimate_BG.dtype),
        first_seen_B=self.first_seen_B + count_B.astype(jnp.int32),
        first_accepted_B=self.first_accepted_B
        + jnp.sum(agree_BA, axis=1).astype(self.first_accepted_B.dtype))

  def learn_primary_hindsight(self, agree_BA, valid_BA,
                              learning_rate: float) -> "AdaptiveStats":
    """learn_hindsight into the primary source's record (Drafter.primary_hindsight's
    agreements), on every row."""
    every_B = jnp.ones(self.gamma_B.shape, bool)
    return self.with_source(every_B).learn_hindsight(
        agree_BA, valid_BA, learning_rate).with_source(every_B)

  def update(self, active_B, admitted_B, num_accepted_B, width_idx, drafted, probe, *,
             learning_rate: float, probe_every: int, probe_growth: int,
             rounds=1, plain_row_rounds=None, empty_B=None, prior: float = 0.0,
             forget: float = 0.0, promising=False, looked=False,
             later_follow_first: bool = False,
             follow_accepted: bool = False) -> "AdaptiveStats":
    """After a drafted round, or after `rounds` plain steps run without drafting, in which
    rows were active `plain_row_rounds` times in all (each admitted nothing). In a drafted
    round, the estimates of a row's later positions (past the first) that it did not verify
    or reach move `forget` of the way back to `prior`. promising: the round, a probe, came
    near paying for itself (AdaptiveRound.drafted_or_plain says how near). looked: the
    plain steps ended with a look in hindsight that stands for a probe; the idle rounds
    restart from it, as from a drafted round (counted from the last drafted round instead,
    a watched run looked after every step once they passed the longest wait).
    later_follow_first: a later position's estimate moves back towards the larger of the prior
    and the row's first-draft estimate (a draft that follows an accepted one is accepted at
    least as often as a first draft: learn_hindsight), not to the prior alone: rounds of one
    draft verify no later draft, and a row whose later estimates stayed at the prior kept
    drafting one where its first drafts were accepted 95% of the time (the built-in pair's
    sixth code prompt: 63 rounds of one draft, 1.19x, where gamma 4 read 1.36x).
    follow_accepted (with later_follow_first): where the row's first draft was verified and
    accepted, the move is learning_rate of the way, not forget (AdaptiveRules
    .follow_accepted)."""
    gamma = self.estimate_BG.shape[1]
    j_G = jnp.arange(gamma)[None, :]
    seen_BG = (drafted & active_B)[:, None] & (j_G < admitted_B[:, None]) & (
        j_G <= num_accepted_B[:, None])
    if empty_B is not None:  # a row the drafter had nothing for: its first draft missed
      seen_BG |= (drafted & active_B & empty_B)[:, None] & (j_G == 0)
    hit_BG = (j_G < num_accepted_B[:, None]).astype(jnp.float32)
    if self.round_accept_BG is not None:  # a sampled round: each reached draft's exact odds
      hit_BG = self.round_accept_BG
      if empty_B is not None:  # (a row with nothing to draft missed, whatever it verified)
        hit_BG = jnp.where(empty_B[:, None], 0.0, hit_BG)
    unseen_BG = (drafted & active_B)[:, None] & ~seen_BG & (j_G >= 1)
    if later_follow_first:
      prior = jnp.maximum(prior, self.estimate_BG[:, :1])
      if follow_accepted:
        first_hit_B1 = (seen_BG[:, :1] & (num_accepted_B[:, None] > 0))
        forget = jnp.where(first_hit_B1, learning_rate, forget)
    estimate_BG = _learn(self.estimate_BG, seen_BG, hit_BG, learning_rate, unseen_BG, prior,
                         forget)
    gamma_B = self.gamma_B
    if self.scheduled:  # static: the program's rules
      verified_B = drafted & active_B & (admitted_B > 0)
      step_B = jnp.where(num_accepted_B >= admitted_B, 2, -1)
      gamma_B = jnp.where(verified_B, jnp.clip(gamma_B + step_B, 1, gamma), gamma_B)
    # a probe that was not promising multiplies the wait before the next one (up to 64x);
    # one that was, or a round that drafts because drafting pays, brings it back
    grown = self.grown_probe_interval(probe_growth, probe_every)
    interval = jnp.where(probe, jnp.where(promising, probe_every, grown),
                         jnp.where(drafted, probe_every, self.probe_interval))
    active_i = active_B.astype(jnp.int32)
    hist_G1 = jnp.sum(jax.nn.one_hot(admitted_B, gamma + 1, dtype=jnp.int32) * active_i[:, None],
                      axis=0)
    if plain_row_rounds is not None:  # plain steps: every active row admitted 0, each step
      hist_G1 = jnp.where(drafted, hist_G1,
                          jnp.zeros(gamma + 1, jnp.int32).at[0].set(plain_row_rounds))
    return self.replace(
        gamma_B=gamma_B, estimate_BG=estimate_BG,
        idle_rounds=jnp.where(drafted | looked, 0, self.idle_rounds + rounds),
        probe_interval=interval,
        width_rounds_W=self.width_rounds_W.at[width_idx].add(rounds),
        undrafted_rounds=self.undrafted_rounds + (~drafted).astype(jnp.int32) * rounds,
        admitted_hist_G1=self.admitted_hist_G1 + hist_G1,
        admitted_B=self.admitted_B + admitted_B * active_i,
        first_seen_B=self.first_seen_B + seen_BG[:, 0].astype(jnp.int32),
        first_accepted_B=self.first_accepted_B
        + jnp.where(seen_BG[:, 0], hit_BG[:, 0], 0.0).astype(self.first_accepted_B.dtype))


@struct.dataclass
class SpecMetrics:
  rounds: jax.Array  # [] loop iterations (draft + verify rounds)
  target_calls: jax.Array  # [] target forward passes, prefill included
  rounds_B: jax.Array  # [B] rounds in which the row was still generating
  accepted_B: jax.Array  # [B] drafted tokens accepted, summed over the row's rounds
  tokens_B: jax.Array  # [B] tokens generated (the first, from prefill, included)
  accept_hist_G1: jax.Array  # [gamma+1] count of row-rounds that accepted k drafts
  position_accepted_G: jax.Array  # [gamma] row-rounds whose draft i was accepted
  # [gamma] row-rounds whose drafts before i were all accepted and which verified a draft
  # at i (gamma="auto": not a plain step, nor past a block's cut)
  position_reached_G: jax.Array
  adaptive: AdaptiveStats | None = None  # gamma="auto" only (spec_jax.adaptive)

  @classmethod
  def zeros(cls, batch_size: int, gamma: int) -> "SpecMetrics":
    z = lambda *shape: jnp.zeros(shape, jnp.int32)
    return cls(z(), jnp.int32(1), z(batch_size), z(batch_size), z(batch_size), z(gamma + 1),
               z(gamma), z(gamma))

  def after_plain_steps(self, steps, active_steps_B, emitted_B) -> "SpecMetrics":
    """`update` summed over `steps` rounds without drafts (gamma="auto"'s plain steps), in
    which row b was active active_steps_B[b] times and emitted emitted_B[b] tokens."""
    row_rounds = jnp.sum(active_steps_B)
    return self.replace(rounds=self.rounds + steps, target_calls=self.target_calls + steps,
                        rounds_B=self.rounds_B + active_steps_B,
                        tokens_B=self.tokens_B + emitted_B,
                        accept_hist_G1=self.accept_hist_G1.at[0].add(row_rounds))

  def update(self, active_B, num_accepted_B, emitted_B, verified_B=None) -> "SpecMetrics":
    """After a round; verified_B ([B] int32, gamma="auto"): the drafts each row verified
    (a position past them was not reached: it was never drafted; all gamma without)."""
    gamma = self.position_reached_G.shape[0]
    active_i = active_B.astype(jnp.int32)
    i_G = jnp.arange(gamma, dtype=jnp.int32)
    reached_BG = (i_G[None, :] <= num_accepted_B[:, None]) * active_i[:, None]
    if verified_B is not None:
      reached_BG *= (i_G[None, :] < verified_B[:, None]).astype(jnp.int32)
    accepted_BG = (i_G[None, :] < num_accepted_B[:, None]) * active_i[:, None]
    hist_BG1 = jax.nn.one_hot(num_accepted_B, gamma + 1, dtype=jnp.int32) * active_i[:, None]
    return SpecMetrics(
        rounds=self.rounds + 1, target_calls=self.target_calls + 1,
        rounds_B=self.rounds_B + active_i, accepted_B=self.accepted_B + num_accepted_B * active_i,
        tokens_B=self.tokens_B + emitted_B, accept_hist_G1=self.accept_hist_G1 + hist_BG1.sum(0),
        position_accepted_G=self.position_accepted_G + accepted_BG.sum(0),
        position_reached_G=self.position_reached_G + reached_BG.sum(0), adaptive=self.adaptive)


def summarize(m: SpecMetrics) -> dict:
  """Host-side summary. 'mean_accepted' counts accepted drafts per row-round; 'with_bonus'
  adds the one target token every round yields (tokens per target pass, prefill aside)."""
  m = jax.tree.map(np.asarray, m)
  row_rounds = int(m.rounds_B.sum())
  accepted = int(m.accepted_B.sum())
  gamma = m.position_reached_G.shape[0]
  mean_accepted = accepted / row_rounds if row_rounds else 0.0
  drafted = row_rounds * gamma if m.adaptive is None else int(m.adaptive.admitted_B.sum())
  out = {
      "rounds": int(m.rounds),
      "target_calls": int(m.target_calls),
      "tokens_per_row": m.tokens_B.tolist(),
      "row_rounds": row_rounds,
      "mean_accepted": mean_accepted,
      "mean_accepted_with_bonus": mean_accepted + 1.0 if row_rounds else 0.0,
      "acceptance_rate": accepted / drafted if drafted else 0.0,
      "accept_hist": m.accept_hist_G1.tolist(),
      "position_acceptance": [float(a) / r if r else float("nan")
                              for a, r in zip(m.position_accepted_G, m.position_reached_G)],
  }
  if m.adaptive is not None:  # acceptance_rate above is then per verified (admitted) draft
    a = m.adaptive
    out["adaptive"] = {
        "width_rounds": dict(zip(a.widths, a.width_rounds_W.tolist())),
        "undrafted_rounds": int(a.undrafted_rounds),
        "admitted_hist": a.admitted_hist_G1.tolist(),
        "mean_admitted": int(a.admitted_B.sum()) / row_rounds if row_rounds else 0.0,
        "acceptance_estimate": np.round(a.estimate_BG.mean(0).astype(float), 3).tolist(),
        "acceptance_estimate_per_row": np.round(a.estimate_BG.astype(float), 3).tolist(),
        "account_plain_steps": round(float(a.account), 2),
    }
    if a.scheduled:  # the schedule's length per row (off, it never moves from initial_gamma)
      out["adaptive"]["gamma_per_row"] = a.gamma_B.tolist()
    if a.primary is not None:  # a drafter with sources: the fields above are the secondary's
      out["adaptive"]["primary_acceptance_estimate"] = np.round(
          a.primary.estimate_BG.mean(0).astype(float), 3).tolist()
      if a.scheduled:
        out["adaptive"]["primary_gamma_per_row"] = a.primary.gamma_B.tolist()
    if a.node_estimate_BZ is not None:  # a tree's: P(node i + 1 on the accepted path)
      out["adaptive"]["node_estimate"] = np.round(a.node_estimate_BZ.mean(0).astype(float),
                                                  3).tolist()
  return out
