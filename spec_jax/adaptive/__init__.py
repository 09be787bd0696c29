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
  - the per-row gamma schedule (opt-in: AdaptiveRules.schedule) reads past rounds only (HF:
    +2 after a fully accepted block, -1 otherwise);
  - a row's remaining budget caps its plan and its admitted length (drafts it could never
    keep are worth nothing, and the budget is known before anything is drawn);
  - the width scheduler scans positions in order and stops at the first one past which no
    length raises the expected tokens per second (DSpark's early break, looking ahead with
    past rounds' estimates only): a later position's value (which depends on x_i) never
    decides whether x_i is verified.
tests/test_adaptive.py checks this with the distribution test, and keeps two leaky rules
(one peeks at the verdict, one drops drafts whose own probability is low) that fail it.

Modules: `config` (widths, rules, the cost table's shape), `planning` (what a round decides,
from past rounds only), `rounds` (the chain and tree round functions), `program` (programs
that run them), `costs` (timing the cost table at start-up), `in_program` (timing it again
in the executable that runs it, whose argument it is), `timing` (what both time with),
`cost_store` (measured tables kept on disk for later processes: `keep_cost_tables`).
"""

from spec_jax.adaptive.config import (DEFAULT_GAMMA_MAX, AdaptiveConfig, AdaptiveRules,
                                      CostTable, as_config, check_costs, cost_of_lengths,
                                      default_costs, default_widths, drafting_costs,
                                      tree_widths)
from spec_jax.adaptive.planning import (AdmitInputs, RoundPlan, choose_tree_budget,
                                        drafting_can_pay, finishing_rounds, planned_drafts,
                                        probe_due, probe_was_promising, probe_window, row_rule,
                                        schedule_length, steps_to_probe, verify_admitted,
                                        width_index)
from spec_jax.adaptive.rounds import CATCH_UP_WIDTHS, AdaptiveRound, AdaptiveTreeRound
from spec_jax.adaptive.program import (adaptive_program_class, configure,
                                       keeping_draft_state, with_max_stretch)
from spec_jax.adaptive.cost_store import keep_cost_tables
from spec_jax.adaptive.costs import (LOOP_PASSES, MEASURE_SECONDS, measure_costs, timing_plan,
                                     with_measured_costs)
from spec_jax.adaptive.in_program import measure_in_program, run_costs

__all__ = [
    "adaptive_program_class",
    "AdaptiveConfig",
    "AdaptiveRound",
    "AdaptiveRules",
    "AdaptiveTreeRound",
    "AdmitInputs",
    "as_config",
    "CATCH_UP_WIDTHS",
    "check_costs",
    "choose_tree_budget",
    "configure",
    "cost_of_lengths",
    "CostTable",
    "default_costs",
    "DEFAULT_GAMMA_MAX",
    "default_widths",
    "drafting_can_pay",
    "drafting_costs",
    "finishing_rounds",
    "keep_cost_tables",
    "keeping_draft_state",
    "LOOP_PASSES",
    "measure_costs",
    "measure_in_program",
    "run_costs",
    "MEASURE_SECONDS",
    "planned_drafts",
    "probe_due",
    "probe_was_promising",
    "probe_window",
    "RoundPlan",
    "row_rule",
    "schedule_length",
    "steps_to_probe",
    "timing_plan",
    "tree_widths",
    "verify_admitted",
    "width_index",
    "with_max_stretch",
    "with_measured_costs",
]
