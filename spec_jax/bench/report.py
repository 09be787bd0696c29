"""Results as strict JSON, Markdown tables and PNG plots.

matplotlib is imported inside the plot functions only; `require_plotting` checks for it up
front, so a long run fails before computing rather than after.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Callable

import numpy as np

INSTALL_HINT = 'pip install -e ".[bench]"'
Section = Callable[[dict], list[str]]  # a scenario's result -> its Markdown lines

ROW_COLS = [("row", "label"), ("batch", "batch"), ("tok/s", "tokens_per_s"),
            ("speed-up", "speedup"), ("run s", "run_s"), ("compile s", "compile_s"),
            ("accepted", "mean_accepted"), ("+bonus", "mean_accepted_with_bonus"),
            ("accept rate", "acceptance_rate"), ("identical", "identical"),
            ("recompiles", "recompilations")]
PLOTS = {"speedup_vs_gamma.png": "speed-up vs gamma", "accepted_lengths.png": "accepted lengths"}


def require_plotting() -> None:
  """Raises ImportError with a one-line install hint when matplotlib is missing."""
  try:
    import matplotlib  # noqa: F401
  except ImportError as e:
    raise ImportError(f"the benchmark's plots need matplotlib ({e}); {INSTALL_HINT}") from None


def clean_json(x):
  """NaN/inf -> None, numpy scalars -> Python, so the JSON is strict."""
  if isinstance(x, dict):
    return {str(k): clean_json(v) for k, v in x.items()}
  if isinstance(x, (list, tuple)):
    return [clean_json(v) for v in x]
  if isinstance(x, (np.integer,)):
    return int(x)
  if isinstance(x, (float, np.floating)):
    return float(x) if math.isfinite(x) else None
  if isinstance(x, np.bool_):
    return bool(x)
  return x


def write_json(results: dict, path: Path) -> None:
  """Writes strict JSON, atomically (a crash mid-write keeps the previous file)."""
  path.parent.mkdir(parents=True, exist_ok=True)
  tmp = path.with_name(path.name + ".tmp")
  tmp.write_text(json.dumps(clean_json(results), indent=2, allow_nan=False))
  tmp.replace(path)


def cell(v) -> str:
  if v is None:
    return "-"
  if isinstance(v, bool):
    return "yes" if v else "**NO**"
  if isinstance(v, float):
    return f"{v:.3g}" if abs(v) < 1000 else f"{v:.0f}"
  return str(v)


def md_table(rows: list[dict], cols: list[tuple[str, str]]) -> list[str]:
  """A Markdown table of rows: cols are (header, record key); error rows say so."""
  lines = ["| " + " | ".join(h for h, _ in cols) + " |", "|" + "---|" * len(cols)]
  for r in rows:
    if "error" in r:
      lines.append(f"| {r['label']} | ERROR: {r['error'][:120]} |" + " |" * (len(cols) - 2))
      continue
    cells = ["cached" if k == "compile_s" and r.get("compile_cached") else cell(r.get(k))
             for _, k in cols]
    lines.append("| " + " | ".join(cells) + " |")
  return lines


def rows_section(s: dict) -> list[str]:
  """The default section: the scenario's rows as a table."""
  return md_table(s["rows"], ROW_COLS)


def markdown(results: dict, sections: dict[str, Section] | None = None) -> str:
  """results.md: the machine, then one section per scenario (sections[key], else its rows)."""
  sections = sections or {}
  m = results["machine"]
  lines = ["# spec_jax benchmark", "",
           f"{m['date']} · {m['cpu_model']} · {m['cpu_count']} cores · jax {m['jax']} "
           f"({m['jax_backend']}: {', '.join(m['jax_devices'])}) · {m['dtype']} · "
           f"{'quick' if results['config']['quick'] else 'full'} mode, "
           f"{results['config']['repeats']} repeats (medians)"
           + (f", medians over {results['processes']} processes"
              if results.get("processes", 1) > 1 else ""), "",
           f"Load average at start {m['load_average_start']}, at end "
           f"{results.get('load_average_end')}. {m['note']}.", "",
           f"Recompilations after warm-up: **{results['recompilations']}**; compiled programs: "
           f"{results['compile_counts']}.", ""]
  for key, s in results["scenarios"].items():
    lines += [f"## Scenario {key}: {s.get('name', '')}", ""]
    if s["status"] != "ok":
      lines += [f"*{s['status']}*: {s.get('note', '')}", ""]
      continue
    lines += sections.get(key, rows_section)(s)
    lines += [""] + [f"- {n}" for n in s.get("notes", [])] + [""]
  lines += ["## Plots", ""]
  for name, alt in PLOTS.items():
    lines += [f"![{alt}]({name})", ""]
  return "\n".join(lines)


def plot_groups(results: dict, keys) -> list[tuple[str, list[dict]]]:
  """(title, speculative rows) per panel: each of the scenarios `keys`, per batch size."""
  panels = []
  scen = results["scenarios"]
  for key in keys:
    s = scen.get(key, {})
    rows = [r for r in s.get("rows", []) if r.get("method") == "speculative" and "speedup" in r]
    for batch in sorted({r["batch"] for r in rows}):
      panels.append((f"S{key} batch {batch}", [r for r in rows if r["batch"] == batch]))
  return panels


def _panels_figure(panels):
  """A figure with a panel per group. A bare Figure, not pyplot: no GUI backend, no global
  state touched (a notebook's pyplot keeps its own)."""
  from matplotlib.figure import Figure
  fig = Figure(figsize=(5 * max(1, len(panels)), 4))
  axes = fig.subplots(1, max(1, len(panels)), squeeze=False)
  if not panels:
    axes[0][0].text(0.5, 0.5, "no speculative rows", ha="center")
  return fig, axes[0]


def _save(fig, path: Path) -> None:
  fig.tight_layout()
  fig.savefig(path, dpi=100)


def plot_speedup(results: dict, path: Path, keys) -> None:
  """Speed-up against gamma, a line per drafter (and its prediction, where there is one)."""
  panels = plot_groups(results, keys)
  fig, axes = _panels_figure(panels)
  for ax, (title, rows) in zip(axes, panels):
    for name in dict.fromkeys(r["drafter"] for r in rows):
      pts = sorted((r["gamma"], r["speedup"], r.get("predicted_speedup")) for r in rows
                   if r["drafter"] == name and isinstance(r["gamma"], int))
      line, = ax.plot([p[0] for p in pts], [p[1] for p in pts], "o-", label=name)
      if pts and all(p[2] is not None for p in pts):
        ax.plot([p[0] for p in pts], [p[2] for p in pts], "x--", color=line.get_color(),
                label=f"{name}: predicted")
      for r in rows:  # gamma="auto" picks its own lengths: a level line across the gammas
        if r["drafter"] == name and r["gamma"] == "auto":
          ax.axhline(r["speedup"], ls=":", color=line.get_color(), label=f"{name}: auto")
    ax.axhline(1.0, color="gray", lw=0.8)
    ax.set(title=title, xlabel="gamma", ylabel="speed-up vs autoregressive")
    ax.legend(fontsize=6)
  _save(fig, path)


def plot_accepted(results: dict, path: Path, keys) -> None:
  """Histograms of drafts accepted per round at each panel's largest gamma."""
  panels = plot_groups(results, keys)
  fig, axes = _panels_figure(panels)
  for ax, (title, rows) in zip(axes, panels):
    gamma = max((r["gamma"] for r in rows if isinstance(r["gamma"], int)), default=0)
    rows = [r for r in rows if r["gamma"] == gamma and r.get("accept_hist")]
    width = 0.8 / max(1, len(rows))
    for i, r in enumerate(rows):
      hist = np.asarray(r["accept_hist"], float)
      offset = (i - (len(rows) - 1) / 2) * width  # the group of bars centred on each k
      ax.bar(np.arange(len(hist)) + offset, hist / max(hist.sum(), 1), width,
             label=r["drafter"])
    ax.set_xticks(range(gamma + 1))
    ax.set(title=f"{title}, gamma {gamma}", xlabel="drafts accepted per round",
           ylabel="fraction of rounds")
    ax.legend(fontsize=6)
  _save(fig, path)


def plot_batch_sweep(sweep: dict, path: Path) -> None:
  """Scenario 7: speed-up over autoregressive against batch size, a panel per target and a
  line per row (dotted: gamma="auto")."""
  models = list(dict.fromkeys(r.get("model") for r in sweep["rows"]))
  panels = [(m, [r for r in sweep["rows"] if r.get("model") == m and "error" not in r])
            for m in models]
  fig, axes = _panels_figure(panels)
  for ax, (model, rows) in zip(axes, panels):
    for label in dict.fromkeys(r["label"] for r in rows if r["method"] != "autoregressive"):
      pts = sorted((r["batch"], r["speedup"]) for r in rows if r["label"] == label)
      ax.plot([p[0] for p in pts], [p[1] for p in pts],
              ":o" if label.endswith("auto") else "o-", label=label)
    ax.axhline(1.0, color="gray", lw=0.8)
    ax.set_xscale("log", base=2)
    ax.set_title(model or "built-in pair", fontsize=9)
    ax.set(xlabel="batch size", ylabel="speed-up vs autoregressive")
    ax.legend(fontsize=6)
  _save(fig, path)


def write_reports(results: dict, json_path: Path, *, sections: dict[str, Section] | None = None,
                  plot_keys=()) -> None:
  """results.json, then results.md, then the plots (last: the likeliest to fail) beside it."""
  folder = json_path.parent
  write_json(results, json_path)
  (folder / "results.md").write_text(markdown(clean_json(results), sections))
  names = list(PLOTS)
  plot_speedup(results, folder / names[0], plot_keys)
  plot_accepted(results, folder / names[1], plot_keys)
  sweep = results["scenarios"].get("7", {})
  if sweep.get("status") == "ok":
    plot_batch_sweep(sweep, folder / "batch_sweep.png")
