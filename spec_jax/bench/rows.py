"""A group's records as comparison rows: speed-up over a baseline row, identical output,
acceptance statistics."""

from __future__ import annotations

import jax
import numpy as np

from spec_jax.metrics import summarize


def same_tokens(outs_a, outs_b) -> bool:
  """Whether two cases produced the same tokens (and counts) on every prompt set."""
  return all(np.array_equal(np.asarray(a.tokens), np.asarray(b.tokens)) and
             np.array_equal(np.asarray(a.num_tokens), np.asarray(b.num_tokens))
             for a, b in zip(outs_a, outs_b))


def spec_summary(outs) -> dict:
  """Acceptance statistics over all measured prompt sets (metrics summed); {} without any."""
  metrics = [o.metrics for o in outs if o.metrics is not None]
  if not metrics:
    return {}
  total = jax.tree.map(lambda *xs: sum(np.asarray(x) for x in xs), *metrics)
  s = summarize(total)
  reached = int(np.asarray(total.position_reached_G).sum())
  adaptive = {"width_rounds": s["adaptive"]["width_rounds"]} if "adaptive" in s else {}
  return {**adaptive, "mean_accepted": s["mean_accepted"],
          "mean_accepted_with_bonus": s["mean_accepted_with_bonus"],
          "acceptance_rate": s["acceptance_rate"], "accept_hist": s["accept_hist"],
          "position_acceptance": s["position_acceptance"], "rounds": s["rounds"],
          "alpha_measured": (int(np.asarray(total.position_accepted_G).sum()) / reached
                             if reached else None)}


def finish_rows(records, outputs, baseline_label: str, *, lossy: bool = False) -> list[dict]:
  """Adds speed-up vs the baseline row, identity with its output, acceptance statistics.

  `lossy`: non-autoregressive rows are not expected to match (identical is None).
  """
  by_label = {r["label"]: (r, o) for r, o in zip(records, outputs)}
  base, base_out = by_label.get(baseline_label, (None, None))
  for rec, outs in zip(records, outputs):
    if "error" in rec:
      continue
    rec["speedup"] = base["run_s"] / rec["run_s"] if base and "run_s" in base else None
    if lossy and rec["method"] != "autoregressive":
      rec["identical"] = None  # by design
    else:
      rec["identical"] = same_tokens(outs, base_out) if base_out is not None else None
    rec.update(spec_summary(outs))
  return records
