"""Several benchmark processes' results.json merged into one (scripts/benchmark.py
--processes K).

Why processes, not more repeats: each process compiles its own programs, lays out its own
buffers and, for gamma="auto", times its own cost table at start-up. On this shared 2-core
CPU those vary between processes more than repeats vary within one: the same compiled
`auto` program of a useless draft read 0.92x, 0.93x, 0.95x, 0.98x and 1.00x autoregressive
in five processes, while three compiles of it within one process agreed to 1%. A figure
from one process is one draw of that spread; the median over K is the program's own.

Rows match by scenario, label, batch size and model. Numbers take the median over the
processes, lists of numbers the median per element (per-prompt speed-ups), booleans must
hold in every process (identical output), choices (a best gamma, a batch size, what a
start-up table decided) stay one value where every process agrees and become the list of
them where not, anything else comes from the first process.
Each merged row also keeps its per-process speed-ups (speedup_processes), and the worst
prompt is recomputed from the per-prompt medians. A scenario's list of per-prompt records
(scenario 2's per_prompt: auto against the best fixed gamma) merges record by record alike.
"""

from __future__ import annotations

import math
import statistics
from numbers import Real
from typing import Any


def _is_number(x) -> bool:
  return isinstance(x, Real) and not isinstance(x, bool)


def _median_or_none(values):
  """The median of the finite numbers among values; None when there is none (a row whose
  speed-up had no baseline, a NaN statistic)."""
  finite = [float(v) for v in values if _is_number(v) and math.isfinite(v)]
  return statistics.median(finite) if finite else None


# fields that name a choice, not a count: a median of gammas 2, 4 and 6 is no gamma, and
# tables that decided differently (drafts_never, check_every) should show it
CHOICES = ("gamma", "best_fixed_gamma", "batch", "prompt", "drafts_never", "check_every")


def merge_field(values: list, key: str = "") -> Any:
  """One field of the same record over processes: see the module docstring."""
  first = values[0]
  if key in CHOICES:
    return first if all(v == first for v in values) else list(values)
  if all(isinstance(v, bool) for v in values):
    return all(values)
  if all(v is None or _is_number(v) for v in values) and any(_is_number(v) for v in values):
    return _median_or_none(values)
  if (all(isinstance(v, list) for v in values) and len({len(v) for v in values}) == 1
      and all(x is None or _is_number(x) for v in values for x in v)):
    return [_median_or_none(column) for column in zip(*values)]
  return first


def merge_records(records: list[dict]) -> dict:
  """The same record from each process -> one, field by field (merge_field)."""
  keys = dict.fromkeys(k for record in records for k in record)
  return {k: merge_field([record.get(k) for record in records], k) for k in keys}


def merge_rows(rows: list[dict]) -> dict:
  """One row (the same row_key in each process) -> the merged row."""
  merged = merge_records(rows)
  merged["speedup_processes"] = [row.get("speedup") for row in rows]
  per_prompt = merged.get("speedup_per_prompt")
  if isinstance(per_prompt, list) and per_prompt and all(_is_number(x) for x in per_prompt):
    merged["speedup_worst_prompt"] = min(per_prompt)
  errors = [row["error"] for row in rows if "error" in row]
  if errors:  # a row that failed anywhere failed
    merged["error"] = errors[0]
  return merged


def row_key(row: dict) -> tuple:
  """What names a row within a scenario: its label, batch size and model (scenario 1 has a
  row of each label per batch; the batch sweep one per model)."""
  return row["label"], repr(row.get("batch")), repr(row.get("model"))


def merge_scenario(results: list[dict]) -> dict:
  """One scenario's results from each process -> merged (rows matched by row_key; a row
  missing from some process is kept from those that have it)."""
  base = dict(results[0])
  if any(r.get("status") != "ok" for r in results):
    bad = next(r for r in results if r.get("status") != "ok")
    return {**bad, "processes": len(results)}
  by_key: dict[tuple, list[dict]] = {}
  for r in results:
    for row in r.get("rows", []):
      by_key.setdefault(row_key(row), []).append(row)
  base["rows"] = [merge_rows(rows) for rows in by_key.values()]
  per_prompt = [r.get("per_prompt") for r in results]
  if all(isinstance(p, list) and p for p in per_prompt) and len({len(p) for p in per_prompt}) == 1:
    base["per_prompt"] = [merge_records(list(entries)) for entries in zip(*per_prompt)]
  base["wall_s"] = sum(r.get("wall_s", 0.0) for r in results)
  base["processes"] = len(results)
  base["notes"] = list(base.get("notes", [])) + [
      f"figures are medians over {len(results)} processes (speedup_processes: each "
      f"process's own)"]
  return base


def merge_results(results: list[dict]) -> dict:
  """Each process's results.json (same scenarios and plan) -> one, as if from one run:
  scenarios merged (merge_scenario), errors collected, recompilations and wall time summed."""
  if not results:
    raise ValueError("no results to merge")
  keys = list(dict.fromkeys(k for r in results for k in r.get("scenarios", {})))
  merged = dict(results[0])
  merged["scenarios"] = {
      k: merge_scenario([r["scenarios"][k] for r in results if k in r.get("scenarios", {})])
      for k in keys}
  merged["errors"] = [e for r in results for e in r.get("errors", [])]
  merged["recompilations"] = sum(r.get("recompilations", 0) or 0 for r in results)
  merged["wall_s"] = sum(r.get("wall_s", 0.0) or 0.0 for r in results)
  counts = [r.get("compile_counts") or {} for r in results]
  merged["compile_counts"] = {name: sum(c.get(name, 0) for c in counts)
                              for name in dict.fromkeys(n for c in counts for n in c)}
  merged["processes"] = len(results)
  merged["config"] = {**results[0].get("config", {}), "processes": len(results)}
  return merged
