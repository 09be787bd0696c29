"""Runs a list of scenarios into one results dict, saving results.json after each.

A scenario is a function (plan, ctx) -> result dict with at least "status" ("ok" or
"skipped") and "rows" (records from run_group/finish_rows); "groups" (run_group's group
infos) and "notes" are optional. ctx is shared by the scenarios of one run, for models built
once and used by several.
"""

from __future__ import annotations

import dataclasses
import os
import time
import traceback
from pathlib import Path
from typing import Any, Callable

from spec_jax.bench.recompiles import process_counter
from spec_jax.bench.report import Section, write_json
from spec_jax.bench.timing import log

COUNTED_FUNCTIONS = ("generate_jit", "speculative_jit")  # results["compile_counts"]


@dataclasses.dataclass(frozen=True)
class Scenario:
  name: str
  run: Callable[[Any, dict], dict]  # (plan, ctx) -> result
  section: Section | None = None  # its results.md section; None: its rows as a table
  plotted: bool = False  # its speculative rows go into the speed-up and acceptance plots


def skipped(note: str) -> dict:
  """The result of a scenario that cannot run here (a missing file or optional package)."""
  log(f"  skipped: {note}")
  return {"status": "skipped", "note": note, "rows": [], "notes": [note]}


def run_scenarios(scenarios: dict[str, Scenario], plan, results: dict,
                  json_path: Path | None = None) -> list[str]:
  """Runs each scenario in order into results["scenarios"][key]; one that raises is recorded
  with status "error" and the others still run. With json_path, results.json is written
  first and after each scenario, so a later crash loses nothing. Returns the keys that
  failed."""
  process_counter()  # count every compilation from here on
  results.setdefault("scenarios", {})
  if json_path is not None:
    write_json(results, json_path)  # an unwritable --out fails now, not after the first scenario
  ctx, failed = {}, []
  for key, scenario in scenarios.items():
    log(f"== scenario {key} ==")
    t0 = time.perf_counter()
    try:
      result = scenario.run(plan, ctx)
    except Exception as e:  # noqa: BLE001  report it, run the others
      traceback.print_exc()
      result = {"status": "error", "note": f"{type(e).__name__}: {e}", "rows": [], "notes": []}
      failed.append(key)
    result = {"name": scenario.name, **result, "wall_s": time.perf_counter() - t0}
    results["scenarios"][key] = result
    if json_path is not None:
      write_json(results, json_path)
  return failed


def add_totals(results: dict, start: float) -> dict:
  """Adds the run's errors, recompilations after warm-up, compile counts, load and wall time
  (since `start`, a time.perf_counter())."""
  scenarios = results["scenarios"].values()
  rows = [r for s in scenarios for r in s.get("rows", [])]
  results["errors"] = [f"{r['label']}: {r['error']}" for r in rows if "error" in r]
  results["recompilations"] = (
      sum(r.get("recompilations") or 0 for r in rows) +
      sum(g.get("recompilations_timed", 0) for s in scenarios for g in s.get("groups", [])))
  counter = process_counter()
  results["compile_counts"] = {name: counter.count(name) for name in COUNTED_FUNCTIONS}
  results["load_average_end"] = list(os.getloadavg())
  results["wall_s"] = time.perf_counter() - start
  return results
