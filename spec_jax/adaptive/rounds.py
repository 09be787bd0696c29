"""The adaptive round functions: a chain round (AdaptiveRound) and a tree round
(AdaptiveTreeRound), each planning, then drafting and verifying at the chosen width or
running plain steps until the next probe; one jit, fixed shapes, every decision data."""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Callable, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from spec_jax.adaptive.config import AdaptiveConfig
from spec_jax.adaptive.planning import (_TO_THE_END, AdmitInputs, RoundPlan, choose_tree_budget,
                                        drafting_can_pay, finish_advance, planned_drafts,
                                        probe_due, probe_was_promising, probe_window, row_rule,
                                        scaled_probe_every, schedule_length, steps_to_probe,
                                        verify_admitted, width_index, wilson_upper)
from spec_jax.core.control import cond_in_place, switch_in_place
from spec_jax.core.sampling import (SamplingConfig, acceptance_probability, nonfinite_rows,
                                    process_logits, sample, split_unless_greedy,
                                    token_acceptance, warped_probs)
from spec_jax.drafters.base import HINDSIGHT_WIDTH, Drafter, SampledHindsight
from spec_jax.generate import decode_token, finite_prefix, remaining_tokens, write_tokens
from spec_jax.metrics import AdaptiveStats

# The catch-up passes compiled for a drafter that skips rounds: after at most the last
# (widest) many plain steps it catches up, in one pass over that many tokens (+1), through
# the narrowest width that covers the steps. Stretches run to the next probe (8, 16, 32, ...
# steps): a window of 8 cost a useless 1-layer draft of stories260K 15 catch-up passes in 128
# tokens, where 32 takes 5-6; a stretch of 2 steps between drafted rounds needs a 3-token
# pass, where a 33-token pass of the built-in draft model costs a few target steps.
CATCH_UP_WIDTHS = (2, 8, 32)


class Sources(NamedTuple):
  """A plain stretch's view of a drafter with sources (AdaptiveRound.sourced_plan)."""
  primary_pays: jax.Array  # [] bool: a round of the primary's drafts pays, at the stretch's start
  rows: Callable  # state -> [B] bool: the rows that would now draft from the primary
  costs: Callable  # (primary_B, done_B) -> [G] the drafting costs of a round from there
  # (stats, primary_B, remaining_B, watch) -> RoundPlan of a round in which only primary_B's
  # rows draft, at the primary's cost (the others: nothing, the model only catches up)
  alone: Callable
  copy_pays: Callable  # state -> [] bool: `alone` drafts there (a stretch ends)


@dataclasses.dataclass(frozen=True)
class AdaptiveRound:
  """A round_fn (speculative_round's signature) with adaptive lengths and widths."""
  config: AdaptiveConfig
  # measure_costs' timing round: every active row verifies exactly the planned drafts,
  # whatever the rules, the scheduler and the drafter's empty rows said (all still computed)
  forced: bool = False

  def __call__(self, target, drafter: Drafter, gamma: int, sampling: SamplingConfig, verifier,
               params, draft_params, lengths_B, budget_B, eos_id, s, *, force_drafts=None):
    """One round. force_drafts ([] int32 >= 1, measure_costs' timing of a drafted round as
    the loop runs it; with AdaptiveRound(forced=True)): draft and verify that many on every
    row whatever the plan says, the plan still computed (so its cost is timed: a where, not
    a replacement, keeps it alive)."""
    stats: AdaptiveStats = s.metrics.adaptive
    table = self.costs_of(stats)
    force = table.force  # None: no forcing compiled in; else a width timed in this program
    step = functools.partial(self.step, target, drafter, gamma, sampling, verifier, params,
                             draft_params, lengths_B, budget_B, eos_id)
    # a row can emit budget - generated more tokens, one of them the target's own: drafts
    # past that are never kept, so they are worth nothing (known before drafting: lossless)
    remaining_B = remaining_tokens(s.done_B, s.num_generated_B, budget_B)
    useful_B = jnp.maximum(remaining_B - 1, 0)
    watch = self.watches(drafter, sampling, verifier)
    probe_every = self.probe_every(drafter, sampling)
    drafting_G = jnp.asarray(table.drafting_G)
    primary_B = until = None
    view = stats
    if drafter.has_sources:  # see sourced_plan
      primary_B, view, drafting_G, until = self.sourced_plan(drafter, sampling, eos_id,
                                                             draft_params, s, remaining_B,
                                                             budget_B, probe_every, force)
      if self.forced:  # timed as propose_for_timing is: the model on every row
        primary_B, view = jnp.zeros_like(primary_B), stats
        drafting_G = jnp.asarray(table.drafting_G)
    # the estimates the plan reads; a drafted round admits by the same (a combination's lookup
    # rows unfloored: their acceptance comes in long runs)
    planned = self.floored(view, drafter, None if primary_B is None else ~primary_B)
    plan = self.plan(planned, remaining_B, watch=watch, probe_every=probe_every,
                     drafting_G=drafting_G)
    lookup_only = None
    if primary_B is not None:
      # where the model's drafting does not pay this round, rows the primary serves may still:
      # the others then draft nothing, and the model only catches up (the primary's cost)
      primary_G = jnp.asarray(table.primary_drafting_G)
      alone = until.alone(stats, primary_B, remaining_B, watch)
      lookup_only = ~plan.drafts & alone.drafts & jnp.any(primary_B & ~s.done_B)
      if force is not None:
        lookup_only &= force < 0
      plan = plan._replace(drafts=plan.drafts | lookup_only,
                           size=jnp.where(lookup_only, alone.size, plan.size))
      drafting_G = jnp.where(lookup_only, primary_G, drafting_G)
    if force_drafts is not None:
      forced = force_drafts >= 0  # (always: traced, so the plan stays alive)
      plan = plan._replace(drafts=forced | plan.drafts,
                           size=jnp.where(forced, force_drafts, plan.size))
    if force is not None:  # a timing of this executable: force drafts, or none at all
      plan = plan._replace(drafts=jnp.where(force < 0, plan.drafts, force > 0),
                           probe=plan.probe & (force < 0),
                           size=jnp.where(force > 0, force, plan.size))
    # a drafted round reads and writes each row's record of the source it drafts from
    source_B = None if primary_B is None else primary_B & plan.drafts

    def drafted_round(s):
      return self.drafted_round(step, drafter, gamma, sampling, verifier, draft_params, eos_id,
                                jnp.asarray(table.verify_G1), plan.probe, plan.size, s,
                                planned.estimate_BG, useful_B=useful_B, primary_B=primary_B,
                                force=force,
                                secondary_off=None if primary_B is None else
                                lookup_only | jnp.all(primary_B | s.done_B))

    plain_steps = functools.partial(self.plain_steps, target, drafter, gamma, sampling,
                                    verifier, params, draft_params, lengths_B, budget_B, eos_id,
                                    plan.can_probe, plan.last_probe, watch=watch,
                                    probe_every=probe_every, until=until)
    if force_drafts is not None:  # never taken: a stand-in spares the timing its compile
      plain_steps = self.no_plain_steps
    drafting = drafting_G[jnp.maximum(plan.size, 1) - 1]
    costs_W = jnp.asarray(table.target_W)
    new = self.drafted_or_plain(
        s, plan.drafts, plan.probe, drafted_round, plain_steps,
        round_cost=lambda w_idx: costs_W[w_idx] + jnp.where(w_idx > 0, drafting, 0.0),
        budget_B=budget_B, catch_up_cost=self.catch_up_cost(drafter), probe_every=probe_every,
        source_B=source_B, drafting_cost=drafting,
        later_follow_first=self.follows_first(drafter))
    if primary_B is not None and watch:
      new = self.primary_learns_from_round(drafter, sampling, eos_id, gamma, s, new,
                                           plan.drafts & ~source_B)
    return new

  def primary_learns_from_round(self, drafter: Drafter, sampling, eos_id, gamma: int, s, new,
                                other_B):
    """After a drafted round of a watching run (greedy, or sampled: the token each position
    emitted follows the target's p, so agreement with lookup's one-hot copy is an unbiased
    estimate of its acceptance p(copy)) of a drafter with sources: the primary's record
    learns in hindsight (primary_hindsight) whether it would have drafted, and drafted
    right, at each position the round emitted, on the rows that drafted from the other
    source (other_B [B] bool). Otherwise a record that fell behind the model's would never
    draft, and so never learn again, while the model drafted a loop that lookup copies at a
    fraction of the cost (the built-in pair's prompt 4: 1.17x against lookup alone's 2.17x).
    Only where some row drafted from the other source (its gamma + 1 searches over the
    buffer are skipped after a plain stretch)."""
    from spec_jax.speculative import round_inputs  # (imports this module lazily)
    width = gamma + 1  # the most tokens a drafted round emits

    def learn(new):
      emitted_B = new.num_generated_B - s.num_generated_B
      agree_BA, found_BA = drafter.primary_hindsight(round_inputs(new, sampling, eos_id)[0],
                                                     width)
      valid_BA = ((jnp.arange(width)[None, :] >= width - emitted_B[:, None])
                  & other_B[:, None] & found_BA)
      stats = new.metrics.adaptive.learn_primary_hindsight(agree_BA, valid_BA,
                                                           self.config.rules.learning_rate)
      return new.replace(metrics=new.metrics.replace(adaptive=stats))

    return cond_in_place(jnp.any(other_B), learn, lambda n: n, new)

  def sourced_plan(self, drafter: Drafter, sampling, eos_id, draft_params, s, remaining_B,
                   budget_B, probe_every: int, force=None):
    """For a drafter with two sources (Drafter.has_sources: lookup where it matches, else a
    model), what the round plans from -> (primary_B, the stats each row reads, the drafting
    costs, until).

    Which source a row drafts from this round is known from the context alone
    (primary_rows), so planning by it is lossless. Each row reads its source's record (the
    primary's is kept apart: AdaptiveStats.primary); a round whose active rows all take the
    primary is charged the primary's drafting (lookup's search and the model's catch-up, not
    its drafting steps). One record and the model's cost for every round kept prompt lookup +
    the built-in draft model below lookup alone (1.12x against 1.33x on its 6 code prompts).
    until (Sources): among others, whether a round in which only the rows that copy draft
    would pay at a state: a plain stretch ends there, so a match that appears during it is
    drafted from at once, not at the next probe. force (CostTable.force): where >= 0, no row
    takes the primary (a timed round drafts from the model, as measure_costs' do)."""
    from spec_jax.speculative import round_inputs  # (imports this module lazily)
    table = self.costs_of(s.metrics.adaptive)

    verify_G = jnp.asarray(table.verify_G1[1:])

    def best_rate(est_BG, drafting_G):  # [B] a row's best tokens per second alone
      tokens_BG = 1.0 + jnp.cumsum(jnp.cumprod(jnp.minimum(est_BG, 1.0), axis=1), axis=1)
      return jnp.max(tokens_BG / (verify_G + drafting_G)[None, :], axis=1)

    def rows(s):  # where lookup matches and its record, at its cost, beats the model's
      ctx = round_inputs(s, sampling, eos_id)[0]
      stats: AdaptiveStats = s.metrics.adaptive
      model_BG = self.floored(stats, drafter).estimate_BG  # as the plan reads the model's
      better_B = (best_rate(stats.primary.estimate_BG, jnp.asarray(table.primary_drafting_G))
                  >= best_rate(model_BG, jnp.asarray(table.drafting_G)))
      return drafter.primary_rows(draft_params, s.draft_state, ctx) & better_B

    def costs(primary_B, done_B):
      return jnp.where(jnp.all(primary_B | done_B), jnp.asarray(table.primary_drafting_G),
                       jnp.asarray(table.drafting_G))

    def alone(stats, primary_B, remaining_B, watch):
      view = stats.with_source(primary_B)
      view = view.replace(estimate_BG=jnp.where(primary_B[:, None], view.estimate_BG, 0.0))
      return self.plan(view, remaining_B, watch=watch, probe_every=probe_every,
                       drafting_G=jnp.asarray(table.primary_drafting_G))

    stats: AdaptiveStats = s.metrics.adaptive
    primary_B = rows(s)
    if force is not None:
      primary_B &= force < 0
    everywhere = stats.with_source(jnp.ones_like(primary_B))
    primary_pays = self.plan(everywhere, remaining_B, watch=True, probe_every=probe_every,
                             drafting_G=jnp.asarray(table.primary_drafting_G)).drafts

    def copy_pays(s):  # the search where lookup's record can pay; the plan where a row copies
      def search(_):
        primary_B = rows(s)
        left_B = remaining_tokens(s.done_B, s.num_generated_B, budget_B)
        return cond_in_place(
            jnp.any(primary_B & ~s.done_B),
            lambda _: alone(s.metrics.adaptive, primary_B, left_B, True).drafts,
            lambda _: jnp.bool_(False), jnp.bool_(False))
      return cond_in_place(primary_pays, search, lambda _: jnp.bool_(False), jnp.bool_(False))

    return (primary_B, stats.with_source(primary_B), costs(primary_B, s.done_B),
            Sources(primary_pays, rows, costs, alone, copy_pays))

  @staticmethod
  def no_plain_steps(s):
    """plain_steps' outputs for no steps (the branch a forced round never takes)."""
    zeros_B = jnp.zeros_like(s.pending_B)
    return (s, zeros_B, zeros_B, jnp.int32(0), jnp.int32(0), jnp.int32(0),
            jnp.zeros_like(s.done_B), jnp.bool_(False))

  def watches(self, drafter: Drafter, sampling: SamplingConfig, verifier) -> bool:
    """Static: whether plain stretches learn the estimates in hindsight (the drafter's
    catch-ups report how its drafts would have fared: Drafter.catch_up_with_hindsight)
    instead of probing. Greedy runs: agreement with the target's greedy token. Sampled runs,
    for drafters that can score them (Drafter.has_sampled_hindsight) under settings that
    warp each distribution alone (no penalties or min_new_tokens: a past position's q
    would need its history): min(1, q(y) / p(y)) for the token y each plain step drew,
    whose mean is the acceptance probability sum_x min(p, q) (drafters.SampledHindsight).
    Not under a verifier whose acceptance is neither (`agreement_is_acceptance = False`:
    the benchmarks' CoinVerifier, whose coins a random draft's guesses, agreeing nowhere,
    had made it give up on at the prompt)."""
    scored = sampling.is_greedy or (drafter.has_sampled_hindsight
                                    and not sampling.processes_logits)
    return (self.config.rules.hindsight and drafter.has_hindsight and scored
            and acceptance_is_the_rule(verifier) and not self.forced)

  def costs_of(self, stats: AdaptiveStats):
    """The cost table a round plans from: the program's argument, carried in the stats
    (AdaptiveStats.costs), else the config's (static). Static decisions (probe spacing, can
    drafting ever pay, catch-ups' price) read the config's alone."""
    return self.config.cost_table if stats.costs is None else stats.costs

  def catch_up_cost(self, drafter: Drafter) -> float:
    """What a drafter that skips rounds pays to catch up after plain steps (charged as a
    propose of gamma_max drafts); 0 for the others."""
    return float(self.config.cost_table.drafting_G[-1]) if drafter.skips_rounds else 0.0

  def probe_every(self, drafter: Drafter, sampling: SamplingConfig) -> int:
    """Static: the idle rounds between probes (AdaptiveRules.probe_share), or between the
    checks a watching stretch makes in their place (it runs as long as a probing one would:
    a drafter that could gain little watches as rarely, and stops recording its plain
    steps as early, as it would probe); the rules' own for a timing round."""
    rules = self.config.rules
    if self.forced:
      return rules.probe_every
    table = self.config.cost_table
    return scaled_probe_every(rules, table.verify_G1, table.drafting_G,
                              self.catch_up_cost(drafter))

  def plan(self, stats: AdaptiveStats, remaining_B, *, watch: bool = False,
           probe_every: int | None = None, drafting_G=None) -> RoundPlan:
    """What a chain round decides before drafting: its size is the drafts planned (0: a
    plain stretch). watch: no probes (the stretches learn in hindsight). probe_every: the
    round's (probe_every(); None: the rules'). drafting_G: what drafting m costs this round
    (None: the table's; sourced_plan's for a drafter with sources)."""
    rules = self.config.rules
    static, table = self.config.cost_table, self.costs_of(stats)
    # no probes where even drafts that were all accepted could not beat a plain step by
    # rules.min_gain: the cost table alone (static) rules drafting out, and probing would
    # only pay for drafts
    can_probe = drafting_can_pay(static.verify_G1, static.drafting_G, rules.min_gain)
    last_probe = probe_window(rules, static.plain, np.max(static.rounds_G), probe_every)
    spent = self.spent(stats)
    probe = (jnp.bool_(False) if watch else
             probe_due(stats, remaining_B, last_probe, can_probe) & ~spent)
    planned = planned_drafts(jnp.minimum(stats.estimate_BG, 1.0), stats.gamma_B,
                             remaining_B > 0, jnp.asarray(table.verify_G1),
                             jnp.asarray(table.drafting_G) if drafting_G is None else drafting_G,
                             rules, probe, remaining_B)
    planned = jnp.where(spent, 0, planned)
    return RoundPlan(can_probe, last_probe, probe, planned > 0, planned)

  def spent(self, stats: AdaptiveStats) -> jax.Array:
    """[] bool: the run's account is past its budget (AdaptiveRules.loss_budget): it drafts
    no more. Never for a timing round, nor with an infinite budget."""
    rules = self.config.rules
    if self.forced or rules.loss_budget == math.inf:
      return jnp.bool_(False)
    return stats.out_of_budget(rules.loss_budget, rules.loss_share)

  @functools.cached_property
  def least_first(self) -> float:
    """Host-side, from the table: the first-draft acceptance below which no round can pay,
    even with every later draft accepted: m drafts yield at most 1 + m * e1 tokens (each
    later draft's survival is at most the first's), so drafting needs e1 > min over m of
    (cost of m drafts / plain step - 1) / m."""
    table = self.config.cost_table
    m_G = np.arange(1, len(table.drafting_G) + 1)
    return float(np.min((table.rounds_G / table.plain - 1.0) / m_G))

  def watch_pays(self, stats: AdaptiveStats, remaining_B, drafting_G=None) -> jax.Array:
    """[] bool, after a catch-up in hindsight: whether the plan drafts now. The plan runs
    only where some row's first-draft estimate could pay (least_first): a useless draft's
    stretch then skips the plan's arithmetic at each of its catch-ups. drafting_G: this
    round's (a drafter with sources; the plan then always runs)."""
    if drafting_G is not None:
      return self.plan(stats, remaining_B, watch=True, drafting_G=drafting_G).drafts
    return cond_in_place(jnp.max(stats.estimate_BG[:, 0]) > self.least_first,
                         lambda _: self.plan(stats, remaining_B, watch=True).drafts,
                         lambda _: jnp.bool_(False), jnp.bool_(False))

  def hopeless(self, stats: AdaptiveStats, remaining_B) -> jax.Array:
    """[] bool, after a probe or a watched stretch that found nothing: no row that still
    has tokens to make could pay for a round even if its first drafts were accepted at the
    upper end of what their record allows (AdaptiveRules.give_up) and every later draft
    were accepted (least_first). Past rounds only (lossless)."""
    upper_B = wilson_upper(stats.first_accepted_B, stats.first_seen_B,
                           self.config.rules.give_up)
    return ~jnp.any((remaining_B > 1) & (upper_B > self.least_first))

  def record_pays(self, stats: AdaptiveStats, remaining_B) -> jax.Array:
    """[] bool: the plan would draft if each row's first-draft estimate were its whole
    record's acceptance rate (first drafts verified or guessed in hindsight; 0 with no
    record), its later estimates as they are: drafting pays on the whole, for the batch as
    the plan weighs it (a row alone: its rate beats a plain step with a round of one draft;
    rows apart: the slowest row's finish decides). AdaptiveRules.record_holds_wait. Past
    rounds only (lossless)."""
    rate_B = stats.record_rate_B
    estimate_BG = stats.estimate_BG.at[:, 0].set(rate_B.astype(stats.estimate_BG.dtype))
    return self.plan(stats.replace(estimate_BG=estimate_BG), remaining_B, watch=True).drafts

  def after_watched_stretch(self, stats: AdaptiveStats, found_nothing, remaining_B,
                            probe_every: int) -> AdaptiveStats:
    """stats after a watched stretch: where it ran to its end without finding drafting worth
    it (found_nothing, [] bool), it stands for a probe that was not promising, so the wait
    before the next check grows (probe_growth), unless the rows' whole records say drafting
    pays (record_pays, with AdaptiveRules.record_holds_wait: acceptance comes in runs, and
    a dip is not a useless draft); and it gives up where the records are hopeless."""
    stats = self.wait_grows(stats, found_nothing, remaining_B, probe_every)
    return self.give_up_if_hopeless(stats, found_nothing, remaining_B, probe_every)

  def wait_grows(self, stats: AdaptiveStats, found_nothing, remaining_B,
                 probe_every: int) -> AdaptiveStats:
    """stats with the wait before the next check grown (probe_growth) where found_nothing,
    unless the records say drafting pays (after_watched_stretch)."""
    rules = self.config.rules
    grows = found_nothing
    if rules.record_holds_wait:  # (the plan runs only after a stretch that found nothing)
      grows = jax.lax.cond(found_nothing, lambda: ~self.record_pays(stats, remaining_B),
                           lambda: jnp.bool_(False))
    grown = stats.grown_probe_interval(rules.probe_growth, probe_every)
    return stats.replace(probe_interval=jnp.where(grows, grown, stats.probe_interval))

  def floored(self, stats: AdaptiveStats, drafter: Drafter, rows_B=None) -> AdaptiveStats:
    """stats as the plan reads them: with AdaptiveRules.record_floor, for a drafter whose
    later drafts follow its first (follows_first), each row's first-draft estimate is at
    least its whole record's rate once that record holds HINDSIGHT_WIDTH first drafts.
    rows_B ([B] bool; None: all): the rows floored (a drafter with sources: those that
    read the model's record, not lookup's, whose acceptance comes in long runs)."""
    if not (self.config.rules.record_floor and self.follows_first(drafter)):
      return stats
    floor_B = stats.first_seen_B >= HINDSIGHT_WIDTH
    if rows_B is not None:
      floor_B &= rows_B
    rate_B = jnp.where(floor_B, stats.record_rate_B, 0.0)
    first_B = jnp.maximum(stats.estimate_BG[:, 0], rate_B.astype(stats.estimate_BG.dtype))
    return stats.replace(estimate_BG=stats.estimate_BG.at[:, 0].set(first_B))

  def follows_first(self, drafter: Drafter) -> bool:
    """Static: AdaptiveStats.update's later_follow_first for this drafter (its later drafts
    are teacher-forced continuations of its first: AdaptiveRules.later_follow_first)."""
    return bool(self.config.rules.later_follow_first and drafter.has_hindsight
                and drafter.hindsight_speaks_for_later_drafts)

  def give_up_if_hopeless(self, stats: AdaptiveStats, looked, remaining_B,
                          probe_every: int) -> AdaptiveStats:
    """stats with the longest wait before the next probe where `looked` ([] bool: a probe or
    a watched stretch found nothing) and the rounds are hopeless (the plan runs only then)."""
    if not self.config.rules.give_up:
      return stats
    hopeless = jax.lax.cond(looked, lambda: self.hopeless(stats, remaining_B),
                            lambda: jnp.bool_(False))
    return stats.given_up(hopeless, probe_every)

  def look_at_prompt(self, stats: AdaptiveStats, agree_BA, valid_BA, remaining_B,
                     drafter: Drafter, probe_every: int) -> AdaptiveStats:
    """The initial statistics after a look in hindsight at the prompt (AdaptiveProgram
    .prompt_look): the estimates learn from it as from a watched stretch's catch-up, and a
    run whose look finds drafting hopeless (give_up) waits its longest before the first
    check: a useless draft then runs generate's loop from its first token, without the
    check after probe_every steps, its catch-up and the rounds around it (a random draft
    model of stories260K paid ~6% of a 128-token run for them). A look after which the
    first round would not draft stands, as a watched stretch that found nothing does, for
    a check that was not promising (after_watched_stretch): the wait before the first
    check grows, unless the record says drafting pays (a drafter with sources, whose rows
    plan from two records, keeps its first wait). That holds only for a look whose drafts
    agreed nowhere: the prompt is the user's text, not the target's, and a draft model
    agrees less there than on the target's answer (built-in pair, a code prompt: 2 of 7
    positions, then 10 of the 16 its first two checks saw), so a look that agreed somewhere
    but did not pay is not a check that found nothing, and the first check comes after
    probe_every steps (growing the wait there cost the built-in draft model all drafting on
    two of six prompts: docs/adaptive_log.md, stop 70). Sampled, each position's score is
    an acceptance probability, and a look agreed somewhere where a row's scores sum to at
    least one expected acceptance (lookup's score is 0 where it has no match, a random
    draft model's ~1e-5 a position). Prompt and target only: lossless."""
    stats = stats.learn_hindsight(agree_BA, valid_BA, self.config.rules.learning_rate,
                                  later=drafter.hindsight_speaks_for_later_drafts)
    looked = jnp.any(valid_BA)
    if not drafter.has_sources:
      # agreed somewhere: some row's look expects at least one accepted first draft (greedy:
      # one agreement; sampled: scores summing to 1, as a useless draft's 1e-5 do not)
      agreed = jnp.any(jnp.sum(jnp.where(valid_BA, agree_BA, 0), axis=1) >= 1)
      found_nothing = (looked & ~agreed
                       & ~self.watch_pays(self.floored(stats, drafter), remaining_B))
      stats = self.wait_grows(stats, found_nothing, remaining_B, probe_every)
    return self.give_up_if_hopeless(stats, looked, remaining_B, probe_every)

  def never_drafts(self, stats: AdaptiveStats, remaining_B,
                   probe_every: int | None = None) -> jax.Array:
    """[] bool: the first round, from these stats, is a plain stretch to the end (nothing
    planned, no probe due now or later), so no round of this run drafts. (A watched run
    checks in hindsight where a probing one would probe: steps_to_probe decides for both.)
    probe_every: the round's (None: the rules')."""
    plan = self.plan(stats, remaining_B, probe_every=probe_every)
    return ~plan.drafts & (steps_to_probe(stats, remaining_B, plan.last_probe, plan.can_probe)
                           == _TO_THE_END)

  def drafted_or_plain(self, s, draft_now, probe, drafted_round, plain_steps, *, round_cost,
                       budget_B, probe_every: int, catch_up_cost=0.0,
                       source_B=None, later_follow_first: bool = False, drafting_cost=0.0):
    """The tail of a chain or tree round: `drafted_round(s)` or `plain_steps(s)` (each ->
    (state, admitted_B, num_accepted_B, width index, rounds, plain row-rounds, empty_B,
    looked), where looked ([] bool) says the round was a watched stretch that ended in a
    look standing for a probe: plain_stretch), then the acceptance statistics updated and
    written back into the metrics.
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
    8 steps, each with a catch-up of the draft model, and `auto` read 0.89-0.90x.
    probe_every: the round's (probe_every()). drafting_cost ([] or float): what the drafted
    round's drafting cost, charged to the account also where it verified nothing (width
    index 0: round_cost leaves drafting out there). source_B ([B] bool, a drafter with sources):
    the rows whose drafted round reads and writes the primary's record (all False when the
    round does not draft). later_follow_first: AdaptiveStats.update's (a chain drafter whose
    later drafts are teacher-forced continuations of its first: Drafter.has_hindsight and
    hindsight_speaks_for_later_drafts)."""
    rules = self.config.rules
    if source_B is not None:
      s = s.replace(metrics=s.metrics.replace(
          adaptive=s.metrics.adaptive.with_source(source_B)))
    zeros_B = jnp.zeros_like(s.pending_B)
    outputs = (s, zeros_B, zeros_B, jnp.int32(0), jnp.int32(0), jnp.int32(0),
               jnp.zeros_like(s.done_B), jnp.bool_(False))
    (new, admitted_B, num_accepted_B, w_idx, steps, plain_row_rounds, empty_B,
     looked) = cond_in_place(draft_now, lambda o: drafted_round(o[0]),
                             lambda o: plain_steps(o[0]), outputs)
    # (a tree round has already updated its node estimates in new's stats)
    before_B, after_B = budget_B - s.num_generated_B, budget_B - new.num_generated_B
    promising = probe_was_promising(before_B, after_B, ~s.done_B, round_cost(0),
                                    round_cost(w_idx) - round_cost(0) + catch_up_cost)
    stats = new.metrics.adaptive.update(
        ~s.done_B, admitted_B, num_accepted_B, w_idx, draft_now, probe,
        learning_rate=rules.learning_rate, probe_every=probe_every,
        probe_growth=rules.probe_growth, rounds=steps, plain_row_rounds=plain_row_rounds,
        empty_B=empty_B, prior=rules.prior, forget=rules.forget, promising=promising,
        looked=looked, later_follow_first=later_follow_first,
        follow_accepted=later_follow_first and rules.follow_accepted)
    if source_B is not None:  # back: the fields are the secondary's record again
      stats = stats.with_source(source_B)
    # the account: a drafted round's advance of the batch's finish less its cost
    cost = round_cost(w_idx) + jnp.where(w_idx == 0, drafting_cost, 0.0)
    net = finish_advance(before_B, after_B, ~s.done_B) - cost / round_cost(0)
    stats = stats.charged(jnp.where(draft_now, -net, 0.0))
    stats = self.give_up_if_hopeless(
        stats, probe & ~promising,
        remaining_tokens(new.done_B, new.num_generated_B, budget_B), probe_every)
    stats = stats.given_up(self.spent(stats), probe_every)
    return new.replace(metrics=new.metrics.replace(adaptive=stats))

  def plain_steps(self, target, drafter, gamma, sampling, verifier, params, draft_params,
                  lengths_B, budget_B, eos_id, can_probe, last_probe, s, *, probe_every: int,
                  watch=False, until=None):
    """Nobody's draft pays: plain steps up to the next probe (or to the end, where the cost
    table rules drafting out), in an inner loop, so that an undrafted stretch costs what
    autoregressive decoding does and not a whole round's bookkeeping (two conditionals, the
    rules) per token, nor one per probe_every tokens (capped there, a useless draft ran at
    0.74-0.88x autoregressive on stories260K). Nothing the plan reads changes in a stretch,
    so ending it earlier would only plan no drafts again. A drafter that can skip rounds
    catches up once per CATCH_UP_WIDTHS[-1] steps, not in every step. watch (see
    `watches`): the stretch learns from each catch-up in hindsight, and ends early when
    drafting pays. until (a drafter with sources: sourced_plan): the stretch also ends
    after the step at which until.copy_pays(state) holds.
    -> (state, admitted_B, num_accepted_B, width index, steps, row-steps, empty_B, looked)."""
    stats: AdaptiveStats = s.metrics.adaptive
    # (a run past its loss budget neither probes nor checks again: one stretch to the end)
    n = steps_to_probe(stats, remaining_tokens(s.done_B, s.num_generated_B, budget_B),
                       last_probe, can_probe & ~self.spent(stats))
    if stats.costs is not None and stats.costs.force is not None:  # timing plain steps
      n = jnp.where(stats.costs.force == 0, _TO_THE_END, n)
    zeros_B = jnp.zeros_like(s.pending_B)
    if drafter.skips_rounds:
      return self.plain_stretch(target, drafter, gamma, sampling, params, draft_params,
                                lengths_B, budget_B, eos_id, n, s, watch=watch,
                                probe_every=probe_every, until=until)
    ready = self.ready(until)

    def one(c):
      i, row_rounds, s = c
      new = self.plain_step(target, drafter, gamma, sampling, verifier, params, draft_params,
                            lengths_B, budget_B, eos_id, s)
      return i + 1, row_rounds + jnp.sum(~s.done_B), new

    n = self.capped(n)
    steps, row_rounds, s = jax.lax.while_loop(
        lambda c: (c[0] < n) & jnp.any(~c[2].done_B) & ((c[0] == 0) | ~ready(c[2])), one,
        (jnp.int32(0), jnp.int32(0), s))
    return (s, zeros_B, zeros_B, jnp.int32(0), steps, row_rounds, jnp.zeros_like(s.done_B),
            jnp.bool_(False))

  @staticmethod
  def ready(until: Sources | None):
    """state -> [] bool: a plain stretch ends here, where a round in which the rows that copy
    draft would pay (Sources.copy_pays; never without sources)."""
    if until is None:
      return lambda s: jnp.bool_(False)
    return until.copy_pays

  def capped(self, n):
    """n plain steps, at most AdaptiveConfig.max_stretch of them in this round (the rest
    come in the next rounds: idle rounds add up, so the wait is the same)."""
    cap = self.config.max_stretch
    return n if cap is None else jnp.minimum(n, cap)

  def plain_stretch(self, target, drafter, gamma, sampling, params, draft_params, lengths_B,
                    budget_B, eos_id, n, s, *, probe_every: int, watch: bool = False,
                    until=None):
    """Up to n plain steps for a drafter that skips rounds: each is generate's loop body
    (one target token, no round bookkeeping at gamma_max's shapes) plus the drafter's
    record_plain_step, the metrics are added once, and the drafter catches up after every
    CATCH_UP_WIDTHS[-1] steps and at the end (Drafter.catch_up_after, whose window is
    static). A stretch that ends the generation does neither, unless the drafter is kept in
    step (AdaptiveConfig.keeps_drafter_in_step: the caller reads the final drafter state,
    or stretches are capped, max_stretch, and the next round decides again).

    watch: each catch-up also says how the drafter's drafts would have fared over the steps
    it covers (catch_up_with_hindsight: greedy agreement, or a sampled run's scores); the
    estimates learn from that, as from verified drafts, and the stretch ends after the
    first catch-up whose plan drafts. It runs as long as a probing stretch would
    (steps_to_probe), and one that found nothing stands for a probe that was not
    promising: no probe verifies drafts only to reject them, and a useless draft's
    catch-ups stop where its probes would.
    -> plain_steps' tuple."""
    window = CATCH_UP_WIDTHS[-1]
    last = self.capped(n)  # this round's steps (n: the wait, which a cap may split)
    ready = self.ready(until)
    rules = self.config.rules
    from spec_jax.speculative import round_inputs  # (imports this module lazily)

    one = self.token_step(target, drafter, sampling, params, draft_params, lengths_B, budget_B,
                          eos_id, record=True)

    def catch_up_steps(stats):  # what a catch-up costs the account, in plain steps
      table = self.costs_of(stats)  # (the table the rounds run with, as their costs)
      return jnp.asarray(table.drafting_G)[-1] / jnp.asarray(table.target_W)[0]

    def catch_up(draft_state, ctx, steps, steps_B):
      # the narrowest compiled window that covers the chunk's steps (a short stretch between
      # drafted rounds must not pay a 33-token pass of a real draft model)
      pick = jnp.searchsorted(jnp.asarray(CATCH_UP_WIDTHS, jnp.int32), steps)
      if not watch:
        return switch_in_place(pick, [functools.partial(
            drafter.catch_up_after, draft_params, ctx=ctx, rounds=w, gamma=gamma)
            for w in CATCH_UP_WIDTHS], draft_state), None

      guessed = min(window + 1, HINDSIGHT_WIDTH)  # positions with guesses, the last ones

      def hindsight(w):  # agreements padded on the left to the widest window's
        def run(c):
          state, agree_BA = drafter.catch_up_with_hindsight(draft_params, c[0], ctx, w, gamma)
          return state, jnp.pad(agree_BA, ((0, 0), (guessed - agree_BA.shape[1], 0)))
        return run

      zeros_BA = jnp.zeros((steps_B.shape[0], guessed),
                           bool if ctx.sampled_hindsight is None else jnp.float32)
      draft_state, agree_BA = switch_in_place(pick, [hindsight(w) for w in CATCH_UP_WIDTHS],
                                              (draft_state, zeros_BA))
      # each row's own steps of this chunk are the last of the window
      valid_BA = jnp.arange(guessed)[None, :] >= guessed - steps_B[:, None]
      return draft_state, (agree_BA, valid_BA)

    def chunk(c):  # a stretch's steps up to its next catch-up, then the catch-up
      start, active_steps_B, s, _ = c
      stop = jnp.minimum(start + window, last)
      i, steps_B, s = jax.lax.while_loop(
          lambda c: (c[0] < stop) & jnp.any(~c[2].done_B) & ((c[0] == start) | ~ready(c[2])),
          one,
          (start, active_steps_B, s))
      ctx = round_inputs(s, sampling, eos_id)[0]
      if watch and not sampling.is_greedy:  # a sampled run's scores (watches)
        if s.followed_prob_BS is None:  # (static) greedy agreement would be a biased score
          raise ValueError("a sampled run that watches in hindsight needs the target's "
                           "probabilities (AdaptiveProgram.followed_probs)")
        ctx = ctx.replace(sampled_hindsight=SampledHindsight(s.followed_prob_BS, sampling))
      draft_state, seen = catch_up(s.draft_state, ctx, i - start, steps_B - active_steps_B)
      s = s.replace(draft_state=draft_state, metrics=s.metrics.replace(
          adaptive=s.metrics.adaptive.charged(catch_up_steps(s.metrics.adaptive))))
      pays = jnp.bool_(False)
      if watch:
        stats = s.metrics.adaptive.learn_hindsight(
            *seen, rules.learning_rate, later=drafter.hindsight_speaks_for_later_drafts)
        remaining_B = remaining_tokens(s.done_B, s.num_generated_B, budget_B)
        if until is None:
          pays = self.watch_pays(self.floored(stats, drafter), remaining_B)
        else:  # the primary's record learns too, and each row is planned by its source's
          agree_BA, found_BA = drafter.primary_hindsight(ctx, seen[1].shape[1])
          stats = stats.learn_primary_hindsight(agree_BA, seen[1] & found_BA,
                                                rules.learning_rate)
          s = s.replace(metrics=s.metrics.replace(adaptive=stats))  # (rows reads the records)
          primary_B = until.rows(s)
          pays = self.watch_pays(self.floored(stats.with_source(primary_B), drafter,
                                              ~primary_B), remaining_B,
                                 until.costs(primary_B, s.done_B))
        s = s.replace(metrics=s.metrics.replace(adaptive=stats))
      if until is not None:  # (a drafted round follows, caught up)
        pays |= ready(s)
      return i, steps_B, s, pays

    def chunks(c):
      return jax.lax.while_loop(lambda c: (c[0] < last) & jnp.any(~c[2].done_B) & ~c[3], chunk,
                                c)

    def to_the_end(c):
      return self.steps_to_the_end(target, drafter, sampling, params, draft_params, lengths_B,
                                   budget_B, eos_id, c[:3]) + (c[3],)

    zeros_B = jnp.zeros_like(s.pending_B)
    carry = (jnp.int32(0), zeros_B, s, jnp.bool_(False))
    if self.config.keeps_drafter_in_step:  # (see AdaptiveConfig)
      steps, active_steps_B, new, pays = chunks(carry)
    else:
      # (a stretch to the end does not look for the primary's matches either: a secondary
      # with no probe left is not kept in step, and a lookup round would need it caught up)
      steps, active_steps_B, new, pays = cond_in_place(n == _TO_THE_END, to_the_end, chunks,
                                                       carry)
    found_nothing = jnp.bool_(False)
    if watch:
      # a stretch that watched to its end without finding drafting worth it stands for a
      # probe that was not promising: the wait before the next check grows as it would, and
      # restarts from this look (`looked`), as a probe's does
      found_nothing = (steps >= n) & ~pays
      stats = self.after_watched_stretch(
          new.metrics.adaptive, found_nothing,
          remaining_tokens(new.done_B, new.num_generated_B, budget_B), probe_every)
      new = new.replace(metrics=new.metrics.replace(adaptive=stats))
    new = new.replace(metrics=new.metrics.after_plain_steps(
        steps, active_steps_B, new.num_generated_B - s.num_generated_B))
    return (new, zeros_B, zeros_B, jnp.int32(0), steps, jnp.sum(active_steps_B),
            jnp.zeros_like(s.done_B), found_nothing)

  def token_step(self, target, drafter, sampling, params, draft_params, lengths_B, budget_B,
                 eos_id, *, record: bool):
    """A plain stretch's loop body, carry = (steps, active steps [B], state): one
    plain_token, counting the rows it found active."""
    def one(c):
      i, active_steps_B, s = c
      new = self.plain_token(target, drafter, sampling, params, draft_params, lengths_B,
                             budget_B, eos_id, s, record=record)
      return i + 1, active_steps_B + (~s.done_B).astype(jnp.int32), new
    return one

  def steps_to_the_end(self, target, drafter, sampling, params, draft_params, lengths_B,
                       budget_B, eos_id, carry):
    """Plain steps until every row is done, carry as token_step's -> the same after them.
    Nothing drafts after them, so the drafter is neither told of its steps nor caught up:
    generate's loop body alone (recording the target's features cost an EAGLE or MTP
    drafter that never drafted ~20% of stories260K's step at batch 1)."""
    one = self.token_step(target, drafter, sampling, params, draft_params, lengths_B, budget_B,
                          eos_id, record=False)
    return jax.lax.while_loop(lambda c: jnp.any(~c[2].done_B), one, carry)

  def plain_to_the_end(self, target, drafter, gamma, sampling, verifier, params, draft_params,
                       lengths_B, budget_B, eos_id, s):
    """The round of a program in which no round can draft (AdaptiveProgram.drafts_never):
    the plain stretch to the end that its first round would plan and run, with the same
    statistics and metrics, but without the plan, the drafted branch or the drafter in the
    program at all (speculative_round's signature)."""
    del gamma, verifier

    def plain(s):
      zeros_B = jnp.zeros((s.pending_B.shape[0],), jnp.int32)
      steps, active_steps_B, new = self.steps_to_the_end(
          target, drafter, sampling, params, draft_params, lengths_B, budget_B, eos_id,
          (jnp.int32(0), zeros_B, s))
      new = new.replace(metrics=new.metrics.after_plain_steps(
          steps, active_steps_B, new.num_generated_B - s.num_generated_B))
      return (new, zeros_B, zeros_B, jnp.int32(0), steps, jnp.sum(active_steps_B),
              jnp.zeros_like(s.done_B), jnp.bool_(False))

    costs_W = jnp.asarray(self.config.cost_table.target_W)
    return self.drafted_or_plain(
        s, jnp.bool_(False), jnp.bool_(False), self.no_plain_steps, plain,
        round_cost=lambda w_idx: costs_W[w_idx],
        budget_B=budget_B, catch_up_cost=self.catch_up_cost(drafter),
        probe_every=self.probe_every(drafter, sampling))

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
                  s, *, record: bool = True):
    """One plain step of a stretch for a drafter that skips rounds: generate's loop body (one
    target token, no round bookkeeping at gamma_max's shapes) -> the new state (its metrics
    untouched: plain_stretch adds them once). The drafter is only told of the step
    (record_plain_step), and not at all with record=False, where its state is never read
    again."""
    # the key outlives the stretch, so a greedy step's split would not be dropped as dead
    key, step_key = split_unless_greedy(s.key, 2, sampling)
    (seq_BS, pending_B, num_generated_B, done_B, bad_B, count_B, cache, counts,
     hidden_BD, prob_B) = decode_token(
        target, params, sampling, lengths_B, budget_B, eos_id, step_key, s.seq_BS, s.pending_B,
        s.num_generated_B, s.done_B, s.cache, s.counts)
    # drafters that read the target's hidden states keep the pending token's (rows that fed
    # it: those that emitted); dead code for the others
    draft_state = s.draft_state if not record else drafter.record_plain_step(
        draft_params, s.draft_state, hidden_BD, s.cache.length_B, count_B > 0)
    # the pending token's position, as commit_round keeps it: a row that emitted moves on
    cache = cache.with_length(cache.length_B + (count_B > 0).astype(jnp.int32))
    followed_prob_BS = s.followed_prob_BS
    if record and followed_prob_BS is not None:  # what a sampled catch-up scores against
      followed_prob_BS = write_tokens(followed_prob_BS, lengths_B + s.num_generated_B,
                                      prob_B[:, None], count_B)
    return s.replace(seq_BS=seq_BS, pending_B=pending_B, num_generated_B=num_generated_B,
                     done_B=done_B, cache=cache, key=key, failed_B=s.failed_B | bad_B,
                     counts=counts, draft_state=draft_state, followed_prob_BS=followed_prob_BS)

  def drafted_round(self, step, drafter, gamma, sampling, verifier, draft_params, eos_id,
                    cost_G1, probe, planned, s, estimate_BG, useful_B=None, primary_B=None,
                    secondary_off=None, force=None):
    """Drafts up to `planned`, admits a prefix per row (at most useful_B: drafts its budget
    could keep), verifies at the width the scheduler picks. estimate_BG: the acceptance
    estimates the plan read (floored as it floored them). primary_B: a drafter with
    sources' rows that draft from the primary (sourced_plan); secondary_off ([] bool): the
    other rows draft nothing this round (admitted 0; not counted as misses). force
    (CostTable.force, traced): where > 0, every active row verifies `planned` whatever the
    rules said (as AdaptiveRound(forced=True) does statically)."""
    cfg, rules = self.config, self.config.rules
    stats: AdaptiveStats = s.metrics.adaptive
    from spec_jax.speculative import round_inputs  # speculative.py imports this module lazily
    active_B = ~s.done_B
    ctx, _, draft_key, _ = round_inputs(s, sampling, eos_id, verifier)
    if rules.admit is None:
      # nothing past the planned length is admitted: drafters may stop there (a draft
      # model's sequential steps are most of a round's drafting cost)
      ctx = ctx.replace(max_drafts=planned)
    if primary_B is not None:
      ctx = ctx.replace(primary_B=primary_B, secondary_off=secondary_off)
    drafts_BG, probs_BGV, draft_state = drafter.propose(draft_params, s.draft_state, ctx, gamma,
                                                        sampling, draft_key)
    if probs_BGV is None:
      q_BG = top_BG = jnp.ones(drafts_BG.shape, jnp.float32)
    else:
      q_BG = jnp.take_along_axis(probs_BGV, drafts_BG[..., None], axis=-1)[..., 0]
      top_BG = jnp.max(probs_BGV, axis=-1)
    if sampling.is_greedy:  # a greedy draft is accepted where it is the target's argmax
      default_BG = top_BG
    else:
      # a sampled draft is accepted with probability sum_x min(p(x), q(x)), which q's top
      # probability does not bound (a flat q equal to p is always accepted): the estimates
      # alone. With it, the built-in pair's draft model at temperature 0.8 drafted in 70
      # rounds of 107 and verified nothing in 50 of them (q's top probability below the
      # 0.85 its rounds were accepted at), paying their drafting for no token: 0.62x
      default_BG = jnp.ones_like(top_BG)
    conf_BG = drafter.acceptance_estimates(draft_state)  # may be wider than gamma
    if conf_BG is None:
      conf_BG = default_BG
    else:
      conf_BG = conf_BG[:, :gamma].astype(jnp.float32)
      if primary_B is not None:  # a head speaks for its own drafts, not for lookup's copies
        took_B = primary_B if secondary_off is None else primary_B | secondary_off
        conf_BG = jnp.where(took_B[:, None], default_BG, conf_BG)
    survival_BG = jnp.cumprod(jnp.minimum(conf_BG, estimate_BG), axis=1)
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
    if secondary_off is not None:
      admitted_B = jnp.where(secondary_off & ~primary_B, 0, admitted_B)
    # past-only caps on each row's length, for the scan's look-ahead
    limit_B = jnp.full_like(admitted_B, gamma)
    if useful_B is not None:
      limit_B = jnp.minimum(limit_B, useful_B)
    if rules.admit is None:
      limit_B = jnp.minimum(limit_B, planned)
    if stats.scheduled:
      limit_B = jnp.minimum(limit_B, stats.gamma_B)
    k = schedule_length(survival_BG, admitted_B, active_B, cost_G1,
                        estimate_BG if rules.lookahead else None, limit_B)
    k = jnp.where(probe, jnp.max(admitted_B), k)
    admitted_B = jnp.minimum(admitted_B, k)
    if self.forced:  # (still a function of the rules' lengths: their cost is timed too)
      admitted_B = jnp.where(active_B, jnp.maximum(jnp.minimum(admitted_B, planned), planned), 0)
    forcing = jnp.bool_(self.forced) if force is None else force > 0
    # propose's state rides in the carry, so the branches commit it in place (closed over,
    # it would be a loop invariant that each branch copies to return)
    def branch(width):
      return lambda c: step(c[0], width=width, admitted_B=admitted_B, drafts_BG=drafts_BG,
                            probs_BGV=probs_BGV, draft_state=c[0].draft_state)

    # 0, a plain step, when no row admits a draft; a forced round verifies `planned` even
    # once every row is done (a timed call whose rows all finish would time plain steps)
    if force is not None:
      admitted_B = jnp.where(forcing, jnp.where(active_B, planned, 0), admitted_B)
    w_idx = width_index(cfg.widths, jnp.where(forcing, planned, jnp.max(admitted_B)))
    new, num_accepted_B = switch_in_place(
        w_idx, [branch(w) for w in cfg.widths],
        (s.replace(draft_state=draft_state), jnp.zeros_like(s.pending_B)))
    if empty_B is None:
      empty_B = jnp.zeros_like(active_B)
    else:
      # Empty rows count as first drafts missed (update), for what they cost: verification
      # width that gives them one token. Where every active row is empty, the round ran one
      # plain step, which costs a plain step and says nothing of the drafts: the estimates
      # are then of acceptance given a draft. Counting those as misses too kept prompt
      # lookup alone plain at batch 1 between its matches (6 code prompts on the built-in
      # pair: 1.249x against gamma 4's 1.275x, 1.326x without).
      empty_B = empty_B & ~jnp.all(empty_B | ~active_B)
    return (new, admitted_B, num_accepted_B, w_idx, jnp.int32(1), jnp.int32(0), empty_B,
            jnp.bool_(False))

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
    verified_B = jnp.minimum(admitted_B, width - 1)  # each row's drafts in this pass
    if width == 1:  # no drafts, nothing to reject
      logits_BV = process_logits(logits_BWV[:, 0], sampling, ctx.history)
      num_accepted_B, next_B = jnp.zeros_like(s.pending_B), sample(verify_key, logits_BV, sampling)
    else:
      logits_BWV = process_logits(logits_BWV, sampling, None if ctx.history is None
                                  else ctx.history.along_chain(block_BW))
      probs = None if probs_BGV is None else probs_BGV[:, :width - 1]
      num_accepted_B, next_B = verify_admitted(
          verifier, drafts_BG[:, :width - 1], probs, logits_BWV, sampling, verify_key,
          verified_B)
    hidden_BG1D = jnp.pad(hidden_BWD, ((0, 0), (0, gamma + 1 - width), (0, 0)))  # never read
    new = commit_round(drafter=drafter, draft_params=draft_params, lengths_B=lengths_B,
                       budget_B=budget_B, eos_id=eos_id, state=s, key=key, ctx=ctx, cache=cache,
                       draft_state=draft_state, draft_tokens_BG=drafts_BG,
                       num_accepted_B=num_accepted_B, next_B=next_B, hidden_BG1D=hidden_BG1D,
                       # rows whose logits were not finite stop there, failed
                       num_finite_B=finite_prefix(nonfinite_rows(logits_BWV)),
                       verified_B=verified_B)
    stats = new.metrics.adaptive
    if stats is not None and stats.round_accept_BG is not None:  # (static: sampled chains)
      accept_BG = jnp.zeros_like(stats.round_accept_BG)
      if width > 1:
        # (warped whole, the same expression the verifier warps, which XLA can share)
        p_BWV = warped_probs(logits_BWV, sampling)
        accept_BG = accept_BG.at[:, :width - 1].set(exact_acceptance(
            drafts_BG[:, :width - 1], None if probs_BGV is None else probs_BGV[:, :width - 1],
            p_BWV[:, :width - 1]))
      new = new.replace(metrics=new.metrics.replace(
          adaptive=stats.replace(round_accept_BG=accept_BG)))
    return new, num_accepted_B


def acceptance_is_the_rule(verifier) -> bool:
  """Static: the verifier accepts by the library's rule (greedy agreement; sampled,
  rejection sampling), so agreement and sum_x min(p, q) are what it accepts at: not the
  benchmarks' CoinVerifier (`agreement_is_acceptance = False`)."""
  return getattr(verifier, "agreement_is_acceptance", True)


def exact_acceptance(drafts_BG, probs_BGV, p_BGV) -> jax.Array:
  """[B, G] float32: the probability that each draft would be accepted given the drafts
  before it, sum_x min(p, q) (core.sampling.acceptance_probability), with p_BGV the
  target's warped distribution at its position (from the logits as the verifier reads
  them) and q the draft's (one-hot at the draft where probs_BGV is None: a deterministic
  drafter's, p(draft)); 0 where either is not finite (a miss, as such a row's round counts
  it)."""
  if probs_BGV is None:
    return token_acceptance(p_BGV, drafts_BG)
  return acceptance_probability(p_BGV, probs_BGV)


@dataclasses.dataclass(frozen=True)
class AdaptiveTreeRound(AdaptiveRound):
  """gamma="auto" for a tree drafter: each round verifies the tree cut to its first k nodes,
  for k among the widths, or runs plain steps.

  The budget is chosen before anything is drawn, from past rounds only (so it is lossless,
  as planned_drafts is for chains; first_nodes says why a cut tree is): each row carries
  P(node i is on the accepted path) for every drafted node (AdaptiveStats.node_estimate_BZ),
  so a tree cut to k nodes is expected to yield one token per active row plus the sum of
  its first k - 1 nodes' estimates (at most what the row's budget has left). That sum is exact for the cut tree, not an
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

    probe_every = self.probe_every(drafter, sampling)
    plain_steps = functools.partial(self.plain_steps, target, drafter, gamma, sampling,
                                    verifier, params, draft_params, lengths_B, budget_B, eos_id,
                                    plan.can_probe, plan.last_probe, probe_every=probe_every)
    cost_W = jnp.asarray(self.tree_costs, jnp.float32)
    return self.drafted_or_plain(s, plan.drafts, plan.probe, tree_round, plain_steps,
                                 round_cost=lambda w_idx: cost_W[w_idx],
                                 budget_B=budget_B, probe_every=probe_every)

  def probe_every(self, drafter: Drafter, sampling: SamplingConfig) -> int:
    """The rules' own (AdaptiveRules.probe_share scales chains' probes only)."""
    return self.config.rules.probe_every

  def give_up_if_hopeless(self, stats, looked, remaining_B, probe_every: int):
    """stats unchanged: a tree's node estimates have no first-draft record (give_up is for
    chains)."""
    return stats

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
    # plain step by rules.min_gain (a cut to k nodes reaches at most depth k - 1)
    best_case_K = np.array([1 + min(k - 1, gamma) for k in budgets])
    can_probe = bool(np.any(best_case_K / cost_W[1:]
                            > (1 + self.config.rules.min_gain) / cost_W[0]))
    last_probe = probe_window(self.config.rules, cost_W[0], cost_W[-1])
    spent = self.spent(stats)
    probe = probe_due(stats, remaining_B, last_probe, can_probe) & ~spent
    budget_idx, tree_now = choose_tree_budget(stats.node_estimate_BZ, remaining_B > 0, budgets,
                                              jnp.asarray(cost_W, jnp.float32), remaining_B)
    tree_now &= ~spent
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
                            draft_state, verified, reach_B)
    _, path_BR1, num_accepted_B, *_ = verified
    stats = new.metrics.adaptive.update_nodes(
        active_B, num_verified, path_BR1, num_accepted_B,
        learning_rate=rules.learning_rate, prior=rules.prior, forget=rules.forget)
    new = new.replace(metrics=new.metrics.replace(adaptive=stats))
    admitted_B = jnp.where(active_B, reach_B, 0).astype(jnp.int32)
    return (new, admitted_B, num_accepted_B, budget_idx + 1, jnp.int32(1), jnp.int32(0),
            jnp.zeros_like(active_B), jnp.bool_(False))
