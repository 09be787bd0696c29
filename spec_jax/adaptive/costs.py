"""The cost table: what a round costs at each width and what drafting costs, timed once per
program, batch shape and params' dtypes, as the loop runs them."""

from __future__ import annotations

import dataclasses
import functools
import itertools
import math
import warnings

import jax
import jax.numpy as jnp
import numpy as np

from spec_jax.adaptive import cost_store, timing
from spec_jax.adaptive.config import drafting_costs
from spec_jax.adaptive.in_program import measure_in_program
from spec_jax.adaptive.program import configure
from spec_jax.adaptive.rounds import AdaptiveRound
from spec_jax.core.pytree_names import params_signature
from spec_jax.core.sampling import greedy
from spec_jax.drafters.base import DraftContext

_MEASURED: dict = {}


LOOP_PASSES = 16  # most passes per timed call: a call's dispatch is spread thin
CALL_SECONDS = 0.02  # a timed call this long spreads it thin enough (a pass: ~0.1-2 ms small)
MEASURE_SECONDS = 4.0  # the timed repeats' budget: large batches of large models repeat less
REPEATS = 15  # the most timed repeats of each pass (timing_plan may take fewer)


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
  # each thunk is called twice a repeat (timing.fastest_in_turn), with and without its passes
  per_round = 2 * (sum(p * t for p, t in zip(passes, pass_seconds))
                   + 2 * sum(call_seconds or ()))
  return passes, int(max(1, min(repeats, MEASURE_SECONDS // max(per_round, 1e-9))))


def measure_costs(program, params, draft_params, args, repeats: int = REPEATS,
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
  # measured by an earlier process? (a shortened measurement is neither read nor stored)
  disk_key = cost_store.params_key(cache_key, params) if repeats >= REPEATS else None
  stored = cost_store.load(disk_key, len(cfg.widths))
  if stored is not None:
    _MEASURED[cache_key] = stored
    return stored
  if not _concrete((params, draft_params)):  # (checked past the caches: not per call)
    raise _AbstractParams("params without values (e.g. jax.ShapeDtypeStruct): a cost table "
                          "cannot be timed")
  state = jax.jit(program.init)(params, draft_params, tokens_BP, lengths_B, budgets_B, eos, key)
  target, drafter, sampling = program.target, program.drafter, program.sampling

  def target_passes(w, params, cache, length_B, passes):
    positions_BW = length_B[:, None] + jnp.arange(w, dtype=jnp.int32)[None, :]

    def one(_, c):
      cache, token_B = c
      tokens_BW = jnp.broadcast_to(token_B[:, None], positions_BW.shape)
      logits_BWV, _, cache = target.apply(params, tokens_BW, positions_BW, cache)
      return cache, greedy(logits_BWV[:, -1])

    return jax.lax.fori_loop(0, passes, one, (cache, jnp.zeros_like(length_B)))[1]

  g = cfg.gamma_max
  forced = AdaptiveRound(cfg, forced=True)  # verifies `planned` drafts on every row

  @jax.jit
  def drafted_rounds(params, draft_params, s, planned, passes):
    # the whole round as the loop runs it (its plan, the branch between drafting and plain
    # steps, the statistics' update), forced to draft `planned`: on stories260K that
    # bookkeeping is 0.2-0.5 plain steps a round that timing drafted_round alone left out
    one = lambda _, s: forced(target, drafter, g, sampling, program.verifier, params,
                              draft_params, lengths_B, budgets_B, eos, s, force_drafts=planned)
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
      drafts_BG, _, draft_state = drafter.propose_for_timing(draft_params, draft_state, ctx, g,
                                                             sampling, key)
      return draft_state, drafts_BG[:, -1]

    return jax.lax.fori_loop(0, passes, one, (s.draft_state, s.pending_B))[1]

  # one program for both points (max_drafts is traced): the drafts it stops making; a tree
  # drafts whole (one point)
  points = (cfg.gamma_max,) if drafter.is_tree else (cfg.gamma_max, 1)
  # each a function of the number of passes (traced: one compile whatever the plan)
  if drafter.is_tree:
    runs = [functools.partial(jax.jit(functools.partial(target_passes, w)), params,
                              state.cache, state.cache.length_B) for w in cfg.widths]
  else:  # (one program for every drafted width: planned is traced)
    runs = [functools.partial(plain_steps, params, draft_params, state)]
    runs += [functools.partial(drafted_rounds, params, draft_params, state, jnp.int32(w - 1))
             for w in cfg.widths[1:]]
  runs += [functools.partial(draft_passes, draft_params, state, key, jnp.int32(m))
           for m in points]
  runs = _compiled_at_once(runs)
  one, none = [], []
  for run in runs:
    jax.block_until_ready(run(jnp.int32(1)))  # warm up
    none.append(timing.seconds(functools.partial(run, jnp.int32(0))))
    one.append(timing.seconds(functools.partial(run, jnp.int32(1))))
  passes, repeats = timing_plan([max(t - z, 0.0) for t, z in zip(one, none)], repeats, none)
  thunks = [functools.partial(run, jnp.int32(n)) for run, n in zip(runs, passes)]
  thunks += [functools.partial(run, jnp.int32(0)) for run in runs]
  timed = timing.fastest_in_turn(thunks, repeats)
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
  if disk_key is not None:
    cost_store.save(disk_key, costs, draft, first)
  return costs, draft, first


def _compiled_at_once(runs):
  """The timing runs (each functools.partial(jitted, *arrays), called with the number of
  passes) compiled ahead of time, traced one after another and compiled in threads, one
  program per jitted function (runs of one function differ in traced arguments alone) ->
  the same runs on the compiled programs. XLA compiles outside the GIL: on the H200's
  16-core host the built-in pair's table took 48 s at batch 1 and 84 s at 16 rows compiling
  one after another, most of it compiles, and 28 s and 58 s so."""
  lowered = {}
  for run in runs:
    if run.func not in lowered:
      lowered[run.func] = run.func.lower(*run.args, jnp.int32(1))
  from concurrent.futures import ThreadPoolExecutor
  with ThreadPoolExecutor(len(lowered)) as pool:
    compiled = dict(zip(lowered, pool.map(lambda low: low.compile(), lowered.values())))
  return [functools.partial(compiled[run.func], *run.args) for run in runs]


def with_measured_costs(program, params, draft_params, args, signatures=None, *,
                        time_in_program: bool = True):
  """The program with its cost table measured, unless the config already supplies one
  (signatures: as measure_costs): the start-up table shapes the program (its static
  decisions) and, with AdaptiveConfig.in_program_costs, the table it runs with is then timed
  in its executable (in_program.measure_in_program; engine.speculate passes it).
  time_in_program=False: never (a caller that runs another executable: sharding)."""
  cfg = getattr(program, "adaptive", None)
  if cfg is None or cfg.target_costs is not None:
    return program
  try:
    measured = measure_costs(program, params, draft_params, args, signatures=signatures)
  except _AbstractParams:  # e.g. engine.lower with jax.ShapeDtypeStruct params
    warnings.warn("gamma='auto' with abstract params: its cost table cannot be measured, so "
                  "this program has the default table, not the one speculate would measure "
                  "and run (pass an AdaptiveConfig with target_costs)", stacklevel=3)
    return program
  program = _with_costs(program, *measured)
  if cfg.in_program_costs and time_in_program:  # the table it runs with, timed there
    measure_in_program(program, params, draft_params, args, signatures)
  return program


class _AbstractParams(ValueError):
  """measure_costs was given params without values: nothing can be timed."""


def _concrete(tree) -> bool:
  """Every leaf holds values (arrays or numbers, not jax.ShapeDtypeStruct or a tracer)."""
  return all(isinstance(x, (np.ndarray, np.generic, int, float))
             or (isinstance(x, jax.Array) and not isinstance(x, jax.core.Tracer))
             for x in jax.tree_util.tree_leaves(tree))


@functools.lru_cache(maxsize=64)
def _with_costs(program, costs, draft, first):
  # memoised: a call's host time matters when a generation takes ~10 ms (stories260K)
  cfg = program.adaptive
  if cfg.draft_cost is None:
    cfg = dataclasses.replace(cfg, draft_cost=draft, first_draft_cost=first)
  return configure(program, dataclasses.replace(cfg, target_costs=costs))
