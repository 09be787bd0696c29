"""The cost table timed in the executable that runs it.

The start-up table (costs.measure_costs) times each width in small programs of its own, and
on XLA:CPU an executable has a speed of its own for the same loop, set by what else it holds:
on the built-in pair that table priced a 5-token round 8-19% cheap and a plain step 5-12%
dear against the `auto` program that runs them (docs/adaptive_log.md, stop 55), and `auto`'s
choices between widths followed the error. Here the program's rounds plan from a table that
is an argument of the program (CostTable, carried in AdaptiveStats.costs), so the very
executable that will run can be timed, each width forced in turn by the table's `force`, and
the table it then runs with is a new argument, not a new program.
"""

from __future__ import annotations

import itertools

import jax
import numpy as np

from spec_jax.adaptive import cost_store, timing
from spec_jax.adaptive.config import CostTable, cost_of_lengths
from spec_jax.core.pytree_names import params_signature
from spec_jax.generate import NO_EOS

IN_PROGRAM_SECONDS = 4.0  # the timed repeats' budget (each repeat: two runs per width)
IN_PROGRAM_REPEATS = 7  # the most repeats (the fastest of them is kept), and the least 3
# The two budgets: MAX_BUDGET tokens (or max_new_tokens, if fewer) and a quarter of that. A
# round costs the same at any position (attention reads the whole cache), so a longer run
# would only take longer; a generation of fewer than MIN_TOKENS between them is not timed.
MAX_BUDGET = 64
MIN_TOKENS = 8
MIN_ROUNDS = 2  # fewer rounds between the two budgets than this: the width keeps its old cost
# The timed runs draw from a stream of their own (fold_in of the caller's key): the table
# they give steers which drafts the generation that follows admits, and admission must not
# depend on that generation's own coins and drafts, which the same key would reproduce
# round by round in the timed runs (their round counts go into the table).
TIMING_STREAM = 0x7A11ED

_MEASURED: dict = {}


def run_costs(program, tokens_shape) -> CostTable | None:
  """The table `program` runs with at this prompt shape (CostTable.arguments), once
  measure_in_program has timed it; None: the program's own (static) table."""
  return _MEASURED.get((program, tuple(tokens_shape)))


def measure_in_program(program, params, draft_params, args, signatures=None,
                       repeats: int = IN_PROGRAM_REPEATS) -> CostTable | None:
  """Times each width of a chain `auto` program in its own executable (the jitted
  speculative_jit that `speculate` then calls: one compile for both) -> the table to run
  with, as the program's argument; None where nothing is timed (trees, a program that can
  never draft, one too short to time rounds in).

  Width w is the whole generation with every round forced to verify w - 1 drafts on every
  active row (CostTable.force; width 1: one plain stretch to the end), at two budgets
  (MAX_BUDGET tokens and a quarter of it: the drafter's prefill is skipped where a budget
  is too short to repay drafting, so not the first token alone), with no EOS: the
  difference in time over the difference in rounds (metrics.rounds) is a round's cost, the
  prefill and the first token cancelling out. A drafted width's entry is that less its
  drafting (the start-up table's, which planned_drafts adds back), so a round of w - 1
  drafts is charged exactly what it was timed at. That split is attributed, not timed: a
  drafter with sources drafts from its model in a forced round, so its primary's (lookup's)
  rounds are charged any extra cost of the model's drafting as verification. Each run is
  timed on its second call in a row, the fastest of up to IN_PROGRAM_REPEATS repeats taken
  in turn. Cached per program and prompt shape (and on disk with keep_cost_tables)."""
  from spec_jax.speculative import passed_draft_params, speculative_jit  # (imports adaptive)
  cfg = program.adaptive
  tokens_BP, lengths_B, _, eos_E, pad, key = args
  batch = tokens_BP.shape[0]
  cache_key = (program, tuple(tokens_BP.shape))
  if cache_key in _MEASURED:
    return _MEASURED[cache_key]
  big = min(program.max_new_tokens, MAX_BUDGET)
  small = big // 4
  if program.drafter.is_tree or program.drafts_never(batch) or big - small < MIN_TOKENS:
    return None
  static = cfg.cost_table
  disk_key = None  # (a shortened measurement is neither read nor stored)
  if cost_store.cost_table_folder() is not None and repeats >= IN_PROGRAM_REPEATS:
    if signatures is None:
      signatures = params_signature(params), params_signature(draft_params)
    disk_key = cost_store.params_key(cache_key + (signatures, "in_program"), params)
  stored = cost_store.load(disk_key, len(cfg.widths))
  if stored is not None:
    table = _table(cfg, static, stored[0])
    _MEASURED[cache_key] = table
    return table
  passed = passed_draft_params(params, draft_params)
  no_eos_E = np.full_like(eos_E, NO_EOS)
  timing_key = jax.random.fold_in(key, TIMING_STREAM)

  def run(force, budget):
    budgets_B = np.full((batch,), budget, np.int32)
    costs = static.arguments(force)
    return lambda: speculative_jit(program, params, passed, tokens_BP, lengths_B, budgets_B,
                                   no_eos_E, pad, timing_key, costs, keep_state=False)[0]

  thunks = [run(w - 1, budget) for w in cfg.widths for budget in (small, big)]
  # (the first call compiles: the program speculate then runs)
  rounds = [int(jax.block_until_ready(thunk()).metrics.rounds) for thunk in thunks]
  once = sum(timing.seconds(thunk) for thunk in thunks)
  # (each repeat calls every run twice: warm, then timed)
  repeats = int(max(min(3, repeats),
                    min(repeats, IN_PROGRAM_SECONDS // max(2 * once, 1e-9))))
  best = timing.fastest_in_turn(thunks, repeats)
  round_seconds = []
  charged = _round_costs(cfg.widths, static)  # (kept where too few rounds were timed)
  for t_small, t_big, r_small, r_big, old in zip(best[::2], best[1::2], rounds[::2],
                                                 rounds[1::2], charged):
    timed = r_big - r_small >= MIN_ROUNDS and t_big > t_small
    round_seconds.append((t_big - t_small) / (r_big - r_small) if timed else old)
  target_W = _target_costs(cfg.widths, static, round_seconds)
  table = _table(cfg, static, target_W)
  _MEASURED[cache_key] = table
  if disk_key is not None:
    cost_store.save(disk_key, target_W, float(static.drafting_G[-1]) or 1e-9,
                    float(static.drafting_G[0]) or 1e-9)
  return table


def _drafting_W(widths, static: CostTable) -> np.ndarray:
  """[W] the drafting of a forced round at each width: none at width 1, else w - 1 drafts'
  (the start-up table's line through its two propose points)."""
  drafting_G = np.asarray(static.drafting_G, np.float64)
  return np.array([0.0] + [drafting_G[w - 2] for w in widths[1:]])


def _round_costs(widths, static: CostTable) -> list[float]:
  """[W] what the start-up table charges each forced round (a width's pass and drafting)."""
  return list(np.asarray(static.target_W, np.float64) + _drafting_W(widths, static))


def _target_costs(widths, static: CostTable, round_seconds) -> tuple[float, ...]:
  """[W] the table's target costs from whole rounds' seconds: less the drafting of w - 1
  drafts (planned_drafts adds back what it plans), never below a narrower width's (a wider
  pass does at least its work: a dip in the timings must not make verifying look cheaper
  than a plain step)."""
  rounds_W = np.asarray(round_seconds, np.float64)
  target_W = np.maximum(rounds_W - _drafting_W(widths, static), 1e-3 * rounds_W)
  return tuple(float(c) for c in itertools.accumulate(target_W, max))


def _table(cfg, static: CostTable, target_W) -> CostTable:
  target_W = np.asarray(target_W, np.float32)
  verify_G1 = cost_of_lengths(cfg.widths, target_W)
  return CostTable(target_W, verify_G1, static.drafting_G).arguments()

