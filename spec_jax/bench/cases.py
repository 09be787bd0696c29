"""Cases: programs to compile (AOT, timed apart), warm up, then time in interleaved repeats.

A Case is a run function over a padded prompt batch plus, for jax programs, its AOT
lowering. `run_group` compiles every case of a comparison first, warms each up (checking
that other prompts of the same padded shape compile nothing new), then times all of them
round-robin, so drift on a shared machine hits every row alike.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

import jax.numpy as jnp
import numpy as np

from spec_jax.core.sampling import SamplingConfig
from spec_jax.generate import (budgets_array, check_generation_args, generate, generate_jit,
                               key_and_eos, pad_prompts)
from spec_jax.speculative import prepare, speculative_generate, speculative_jit
from spec_jax.verify import verify

from spec_jax.bench.recompiles import process_counter
from spec_jax.bench.timing import log, timed, timed_compile

GREEDY = SamplingConfig()
PromptSet = tuple[np.ndarray, np.ndarray]  # (tokens [B, P], lengths [B]), as pad_prompts gives


@dataclasses.dataclass
class Case:
  label: str
  run: Callable[[np.ndarray, np.ndarray], Any]  # (tokens, lengths) -> output with .tokens
  lower: Callable[[np.ndarray, np.ndarray], Any] | None  # AOT lowering; None: not JAX
  info: dict  # copied into the case's record (method, drafter, gamma, batch, ...)
  # run once before any case compiles, one case at a time (gamma="auto": measures the cost
  # table, whose timings must not share the cores with other cases' compiles); a dict it
  # returns goes into the case's record
  prepare: Callable[[np.ndarray, np.ndarray], dict | None] | None = None


def ar_case(model, params, *, max_new_tokens: int, cache_len: int, label="autoregressive",
            **info) -> Case:
  """Greedy autoregressive decoding (spec_jax.generate), the usual baseline row."""
  kw = dict(max_new_tokens=max_new_tokens, cache_len=cache_len)

  def run(tokens, lengths):
    return generate(model, params, tokens, lengths, **kw)

  def lower(tokens, lengths):  # generate()'s own steps: it must run this very program
    tokens, lengths, _ = check_generation_args(model, tokens, lengths, **kw)
    budgets = budgets_array(max_new_tokens, None, tokens.shape[0])
    key, eos = key_and_eos(GREEDY, None, None)
    return generate_jit.lower(model, params, tokens, lengths, budgets,
                              jnp.asarray(np.asarray(eos, np.int32)), jnp.int32(0), key,
                              sampling=GREEDY, **kw)

  return Case(label, run, lower, {"method": "autoregressive", "drafter": None, "gamma": None,
                                  **info})


def spec_case(model, params, spec_drafter, draft_params, *, gamma,
              max_new_tokens: int, cache_len: int, label: str, verifier=verify, **info) -> Case:
  """Greedy speculative decoding. info["drafter"] is the row's label for the drafter;
  spec_drafter is the drafter itself. gamma="auto" or an AdaptiveConfig: adaptive
  speculation (spec_jax.adaptive); its cost table is measured by the case's `prepare`,
  before any case compiles (run_group), or else by `lower`."""
  adaptive = not isinstance(gamma, int)
  kw = dict(gamma=gamma, max_new_tokens=max_new_tokens, cache_len=cache_len, verifier=verifier)

  def run(tokens, lengths):
    if adaptive:
      from spec_jax.engine import speculate
      return speculate(model, params, spec_drafter, draft_params, tokens, lengths, **kw)
    return speculative_generate(model, params, spec_drafter, draft_params, tokens, lengths, **kw)

  def measure_costs(tokens, lengths):
    # what the start-up table decided, for the row: a program that can never draft runs
    # generate's loop alone, one that can pays its checks (the table is timed per process,
    # so runs of one benchmark may differ here, and their speed with it)
    from spec_jax.engine import measured_program
    program, _ = measured_program(model, params, spec_drafter, draft_params, tokens, lengths,
                                  **kw)
    return {"drafts_never": program.drafts_never(int(np.shape(tokens)[0])),
            "check_every": program.probe_every}

  def lower(tokens, lengths):
    if adaptive:
      from spec_jax.engine import lower as lower_auto  # (the table measured: a cache hit)
      return lower_auto(model, params, spec_drafter, draft_params, tokens, lengths, **kw)
    program, args = prepare(model, spec_drafter, tokens, lengths, sampling=GREEDY, eos_id=None,
                            key=None, budgets_B=None, pad_id=0, **kw)
    return speculative_jit.lower(program, params, draft_params, *args, keep_state=False)

  return Case(label, run, lower, {"method": "speculative", "gamma": gamma, **info},
              prepare=measure_costs if adaptive else None)


def prompt_sets(prompts: list[list[int]], batch: int, width: int) -> tuple[PromptSet, PromptSet]:
  """(measured set, check set): two batches of different prompts padded to the same width."""
  rows = [prompts[i % len(prompts)] for i in range(batch)]
  other = [prompts[(i + batch) % len(prompts)] if len(prompts) > batch else
           prompts[(i + 1) % len(prompts)] for i in range(batch)]
  return pad_prompts(rows, width=width), pad_prompts(other, width=width)


def pad_width(prompts: list[list[int]], minimum: int) -> int:
  """The longest prompt rounded up to a multiple of 8, at least `minimum`."""
  longest = max(len(p) for p in prompts)
  return max(minimum, -(-longest // 8) * 8)


def compile_case(case: Case, tokens, lengths) -> dict:
  """AOT lowering and compilation of the case's program, each timed; Nones for non-JAX cases."""
  if case.lower is None:
    return {"lower_s": None, "compile_s": None, "compile_cached": None}
  return timed_compile(lambda: case.lower(tokens, lengths))[1]


def prepare_case(case: Case, tokens, lengths, tag: str) -> dict | Exception:
  """Runs the case's `prepare` (timed: {"prepare_s"}; None where it has none), with the facts
  it returns (a dict, or None) about the program it prepared, or returns the exception it
  raised."""
  if case.prepare is None:
    return {"prepare_s": None}
  try:
    facts, seconds = timed(lambda: case.prepare(tokens, lengths))
    return {"prepare_s": seconds, **(facts or {})}
  except Exception as e:  # noqa: BLE001  one broken drafter must not sink the benchmark
    log(f"[{tag}] {case.label}: FAILED to prepare ({type(e).__name__}: {e})")
    return e


def compile_all(cases: list[Case], tokens, lengths, workers: int, tag: str) -> list:
  """Compiles every case (`workers` at a time; XLA compiles outside the GIL).

  Returns per case its timing dict or the exception it raised.
  """
  def one(case):
    try:
      return compile_case(case, tokens, lengths)
    except Exception as e:  # noqa: BLE001  one broken drafter must not sink the benchmark
      log(f"[{tag}] {case.label}: FAILED ({type(e).__name__}: {e})")
      return e
  if workers <= 1:
    return [one(c) for c in cases]
  from concurrent.futures import ThreadPoolExecutor
  with ThreadPoolExecutor(workers) as pool:
    return list(pool.map(one, cases))


def warm_up(case: Case, measure_sets: list[PromptSet], check_sets: list[PromptSet]) -> dict:
  """First run (compile cache hit), then the other prompt sets once: any XLA compilation
  there (same padded shapes) is a recompilation."""
  first = measure_sets[0]
  _, warmup_s = timed(lambda: case.run(*first))
  counter = process_counter()
  before = counter.count()
  for tokens, lengths in list(check_sets) + list(measure_sets[1:]):
    timed(lambda: case.run(tokens, lengths))  # other prompts, same padded shape
  return {"warmup_s": warmup_s,
          "recompilations": counter.count() - before if case.lower is not None else None}


def _fmt(x) -> str:
  return "-" if x is None else f"{x:.2f}"


def run_group(cases: list[Case], measure_sets: list[PromptSet], check_sets: list[PromptSet], *,
              repeats: int, workers: int = 1, tag: str = "",
              extras: dict[str, Callable[[], Any]] | None = None
              ) -> tuple[list[dict], list[list | None], dict]:
  """Compiles and warms up every case, then times them in `repeats` interleaved rounds.

  Each case runs every measured prompt set per round; its run_s is the sum over sets of the
  median seconds. `extras` are warmed-up thunks (e.g. step-cost loops) timed once per round
  too, so drift on a shared machine hits them and the cases alike; group["extras_s"] has
  their medians. Returns (records, outputs per case per measure set, group info). A case
  that fails to build or run keeps an error record and no outputs (None).
  """
  records, live = [], []
  prepared = [prepare_case(case, *measure_sets[0], tag) for case in cases]
  compiled = compile_all([c for c, p in zip(cases, prepared) if not isinstance(p, Exception)],
                         *measure_sets[0], workers, tag)
  compiled_by_case = iter(compiled)
  for case, prep in zip(cases, prepared):
    rec = {"label": case.label, **case.info}
    timing = prep if isinstance(prep, Exception) else next(compiled_by_case)
    try:
      if isinstance(timing, Exception):
        raise timing
      rec.update(prep)
      rec.update(timing, compile_workers=workers if case.lower is not None else None)
      rec.update(warm_up(case, measure_sets, check_sets))
    except Exception as e:  # noqa: BLE001  one broken drafter must not sink the benchmark
      records.append({**rec, "error": f"{type(e).__name__}: {e}"})
      continue
    cached = " (in-process cache hit)" if rec["compile_cached"] else ""
    table = (f"cost table {rec['prepare_s']:.2f} s, " if rec["prepare_s"] is not None
             else "")
    log(f"[{tag}] {case.label}: {table}compile {_fmt(rec['compile_s'])} s{cached}, warm-up "
        f"{rec['warmup_s']:.3f} s")
    records.append(rec)
    live.append((case, rec))
  times = {id(c): [[] for _ in measure_sets] for c, _ in live}
  outputs = {id(c): [None] * len(measure_sets) for c, _ in live}
  extras = extras or {}
  extra_times = {name: [] for name in extras}
  counter = process_counter()
  before = counter.count()
  for _ in range(repeats):
    for case, _ in live:
      for i, (tokens, lengths) in enumerate(measure_sets):
        outputs[id(case)][i], seconds = timed(lambda: case.run(tokens, lengths))
        times[id(case)][i].append(seconds)
    for name, thunk in extras.items():
      extra_times[name].append(timed(thunk)[1])
  group = {"recompilations_timed": counter.count() - before,
           "extras_s": {k: float(np.median(v)) for k, v in extra_times.items()}}
  outs = []
  for case, rec in live:
    medians = [float(np.median(t)) for t in times[id(case)]]
    rec["run_s"] = sum(medians)
    rec["run_s_sets"] = medians  # per measured prompt set (batch 1: per prompt)
    rec["run_s_repeats"] = [sum(r) for r in zip(*times[id(case)])]
    rec["run_s_min"] = sum(min(t) for t in times[id(case)])  # least disturbed by other load
    rec["tokens"] = sum(int(np.asarray(o.num_tokens).sum()) for o in outputs[id(case)])
    rec["tokens_per_s"] = rec["tokens"] / rec["run_s"]
    outs.append(outputs[id(case)])
  out_by_label = dict(zip([c.label for c, _ in live], outs))
  return records, [out_by_label.get(r["label"]) for r in records], group
