"""results.md sections of the scenarios whose results are more than a table of rows."""

from __future__ import annotations

from spec_jax.bench.report import cell, md_table

S3_COLS = [("row", "label"), ("tok/s", "tokens_per_s"), ("speed-up", "speedup"),
           ("predicted", "predicted_speedup"), ("efficiency", "engine_efficiency"),
           ("alpha measured", "alpha_measured"), ("E tokens/round", "expected_tokens_per_round"),
           ("+bonus measured", "mean_accepted_with_bonus"), ("compile s", "compile_s"),
           ("recompiles", "recompilations")]
S4_COLS = [("model", "model"), ("row", "label"), ("tok/s", "tokens_per_s"),
           ("speed-up (same engine)", "speedup"), ("ours/HF", "ours_over_hf"),
           ("identical to HF", "identical_to_hf"), ("identical to own AR", "identical"),
           ("compile s", "compile_s"), ("accepted", "mean_accepted")]


def synthetic_acceptance(s: dict) -> list[str]:
  c = s["costs"]
  return [f"Target {s['target_params'] / 1e6:.1f} M params, draft "
          f"{s['draft_params'] / 1e6:.2f} M. Step costs: target "
          f"{c['target_step']['step_s'] * 1e3:.2f} ms, draft "
          f"{c['draft_step']['step_s'] * 1e3:.2f} ms, verify "
          + ", ".join(f"gamma {k.split('_')[1]}: {v['step_s'] * 1e3:.2f} ms"
                      for k, v in c.items() if k.startswith("verify_")), ""
          ] + md_table(s["rows"], S3_COLS)


def _ratios(d: dict) -> str:
  return ", ".join(f"{k} {cell(v)}x" for k, v in d.items())


def versus_hf(s: dict) -> list[str]:
  lines = []
  for mod in s["models"]:
    b = mod["bound"]
    hf = (f"HF plain {b['hf_plain_s_per_token'] * 1e3:.2f} ms, "
          if "hf_plain_s_per_token" in b else "")  # absent when HF's plain row failed
    ceiling = (f": HF / matmuls alone = **{b['hf_over_matmul_chain']:.2f}x**, the most "
               "plain decoding built from these XLA matmuls could reach"
               if "hf_over_matmul_chain" in b else "")
    lines.append(f"- {mod['model']}: ours/HF tokens/s {_ratios(mod['ours_over_hf'])}; "
                 f"identical to HF {mod['identical_to_hf']}. Per token: {hf}our step "
                 f"{b['step_s'] * 1e3:.2f} ms, its weight matmuls alone "
                 f"{b['matmul_chain_s'] * 1e3:.2f} ms ({b['matmuls']} of them), one matvec "
                 f"over the same {b['streamed_bytes'] / 2**20:.0f} MiB "
                 f"{b['matvec_s'] * 1e3:.2f} ms{ceiling}")
  return lines + [""] + md_table(s["rows"], S4_COLS)


def step_roofline(s: dict) -> list[str]:
  r = s["roofline"]
  sweep = r["matmul_count_sweep"]
  return [f"Weights {s['param_bytes'] / 2**20:.0f} MiB. Stream once: matvec "
          f"{r['matvec_s'] * 1e3:.2f} ms, tree sum {r['tree_sum_s'] * 1e3:.2f} ms "
          f"({r['bandwidth_GBps']:.1f} GB/s). One autoregressive step "
          f"({r['step_layout']} layout) {r['step_s'] * 1e3:.2f} ms "
          f"({r['step_GBps']:.1f} GB/s). Ratio **{r['ratio']:.2f}** of roofline (target "
          f"{r['target_ratio']}: {'met' if r['meets_target'] else 'NOT met'}). By layout, "
          "one step (ratio) and one 5-token pass: " + ", ".join(
              f"{k} {v['step_s'] * 1e3:.2f} ms ({v['ratio']:.2f}) and "
              f"{v['pass_5_tokens_s'] * 1e3:.2f} ms" for k, v in r["layouts"].items())
          + f". The step's weight matmuls alone ({r['matmul_chain_layout']}): "
          f"{r['matmul_chain_s'] * 1e3:.2f} ms; the whole step takes "
          f"{r['step_over_chain']:.2f}x that. The same "
          f"{sweep['bytes'] / 2**20:.0f} MiB as "
          + ", ".join(f"{c} matmuls {v * 1e3:.2f} ms"
                      for c, v in zip(sweep["counts"], sweep["s_per_round"]))
          + f": **{sweep['per_matmul_s'] * 1e6:.0f} us per matmul**."]


def builtin_pair(s: dict) -> list[str]:
  """The rows, then per prompt the best fixed gamma against gamma="auto"."""
  from spec_jax.bench.report import ROW_COLS
  lines = md_table(s["rows"], ROW_COLS)
  if s.get("per_prompt"):
    lines += ["", "Per prompt, speed-up over autoregressive: the best fixed gamma (chosen "
              "after the fact) against `gamma=\"auto\"` (no tuning).", "",
              "| drafter | prompt | best fixed gamma | its speed-up | auto | auto / best |",
              "|---|---|---|---|---|---|"]
    lines += [f"| {p['drafter']} | {p['prompt']} | {p['best_fixed_gamma']} | "
              f"{cell(p['best_fixed_speedup'])} | {cell(p['auto_speedup'])} | "
              f"{cell(p['auto_over_best'])} |" for p in s["per_prompt"]]
  return lines


def batch_baseline(s: dict) -> list[str]:
  """Autoregressive throughput by batch size: tokens/s, ms per step, us per row-step."""
  cols = [("batch", "batch"), ("tok/s", "tokens_per_s"), ("ms per step", "ms_per_step"),
          ("us per row-step", "us_per_row_step"), ("tok/s over batch 16", "over_batch_16"),
          ("error", "error")]
  return [f"stories260K, greedy, {s['max_new_tokens']} new tokens, prompts padded to "
          f"{s['prompt_width']}, cache {s['cache_len']} slots.", ""] + md_table(s["rows"], cols)


def mean_width(width_rounds: dict | None) -> float | None:
  """The mean verification width over rounds (width 1: plain steps), from {width: rounds}."""
  if not width_rounds or not sum(width_rounds.values()):
    return None
  return sum(int(w) * n for w, n in width_rounds.items()) / sum(width_rounds.values())


def batch_sweep(s: dict) -> list[str]:
  """Per target: speed-up over autoregressive by batch size, a row per drafter and gamma,
  then the widths gamma="auto" chose (rounds at each verification width; width 1: plain
  steps) and their mean."""
  batches = s["batches"]
  lines = ["Speed-up over autoregressive decoding at the same batch and target (the plot: "
           "batch_sweep.png).", ""]
  models = s.get("models") or list(dict.fromkeys(r.get("model") for r in s["rows"]))
  for model in models:
    rows = [r for r in s["rows"] if r.get("model") == model]
    by = {}
    for r in rows:
      if "error" not in r and r["method"] != "autoregressive":
        by.setdefault(r["label"], {})[r["batch"]] = r
    if model is not None:
      lines += [f"**{model}**", ""]
    lines += ["| row | " + " | ".join(f"batch {b}" for b in batches) + " |",
              "|---|" + "---|" * len(batches)]
    lines += [f"| {label} | " + " | ".join(cell(rs[b]["speedup"]) if b in rs else "-"
                                           for b in batches) + " |" for label, rs in by.items()]
    ar = {r["batch"]: r for r in rows if r["method"] == "autoregressive" and "error" not in r}
    lines += ["", "Autoregressive tokens/s: " + ", ".join(
        f"batch {b} {cell(ar[b]['tokens_per_s'])}" for b in batches if b in ar), ""]
    for label, rs in by.items():
      if label.endswith("auto"):
        lines.append(f"- {label}, rounds per width (mean width): " + "; ".join(
            f"batch {b}: {rs[b].get('width_rounds')} "
            f"({cell(mean_width(rs[b].get('width_rounds')))})" for b in batches if b in rs))
    lines.append("")
  errors = [r for r in s["rows"] if "error" in r]
  return lines + ["![speed-up vs batch size](batch_sweep.png)"] + (
      [""] + md_table(errors, [("row", "label"), ("error", "error")]) if errors else [])
