"""The real-model scenario: SmolLM2-135M-Instruct (the zoo's GGUF file), chat prompts.

12 chat prompts (4 code, 4 explanations, 4 summaries of a passage given in the prompt, where
prompt lookup shines), greedy, no EOS (every row generates the same number of tokens):
  batch 1 (each prompt alone) and batch 8: our autoregressive decoding, then each drafter at
  its best gamma (REAL_DRAFTERS: the gammas measured best when the drafters were trained,
  README "The real model"); the trained drafters are the zoo's shipped files;
  batch 1 only: HF transformers on the same GGUF file (dequantised to float32): plain,
  prompt_lookup_num_tokens, and assistant_early_exit (HF's layer-skip self-speculation, the
  one drafter here HF also has; it has no EAGLE or MTP heads for this model).
"""

from __future__ import annotations

import os

import jax

from spec_jax.bench.cases import ar_case, pad_width, spec_case
from spec_jax.bench.rows import finish_rows, same_tokens
from spec_jax.bench.runner import skipped
from spec_jax.bench.timing import log
from spec_jax.generate import pad_prompts

PASSAGE_1 = (
    "Speculative decoding speeds up text generation without changing its output. A small, "
    "fast drafter guesses the next few tokens, and the large target model checks all of the "
    "guesses in a single forward pass. Every guess that matches what the target would have "
    "produced is kept, and the first wrong guess is replaced by the target's own token. "
    "Because the target verifies every token, the text is exactly what the target alone would "
    "have written; only the time it takes changes.")
PASSAGE_2 = (
    "The Python standard library ships with every Python installation. It covers file and "
    "directory access, data compression, text processing, networking, concurrency and "
    "testing, so that many programs need no third-party packages at all. Its modules are "
    "documented in the official reference, and most of them are written in Python itself, "
    "which makes their source a good place to learn idiomatic code.")
PASSAGE_3 = (
    "Photosynthesis is the process by which green plants turn light into chemical energy. "
    "In the chloroplasts, chlorophyll absorbs sunlight, which drives the splitting of water "
    "into oxygen, protons and electrons. The energy captured this way is stored in ATP and "
    "NADPH, which the Calvin cycle then uses to fix carbon dioxide from the air into sugars. "
    "The oxygen released as a by-product is what most animals breathe.")
PASSAGE_4 = (
    "A hash table stores key-value pairs in an array of buckets. A hash function turns each "
    "key into an index, so that looking a key up, inserting it or deleting it takes constant "
    "time on average. When two keys land in the same bucket, the table resolves the "
    "collision, for example by chaining entries in a list or by probing for the next free "
    "slot. When the table fills up, it grows and rehashes every key into a larger array.")

REAL_PROMPTS = [  # (kind, user message)
    ("code", "Write a Python function that returns the n-th Fibonacci number."),
    ("code", "Write a Python function that checks whether a string is a palindrome."),
    ("code", "Write a Python class for a stack with push, pop and peek methods."),
    ("code", "Write a Python function that reads a CSV file and returns the sum of its "
             "second column."),
    ("chat", "What is the difference between a list and a tuple in Python?"),
    ("chat", "Give me three tips for writing readable code."),
    ("chat", "Explain what a recursive function is, with a short example."),
    ("chat", "Why is the sky blue?"),
    ("summarise", f"Summarise this passage in two sentences:\n\n{PASSAGE_1}"),
    ("summarise", f"Summarise this passage in two sentences:\n\n{PASSAGE_2}"),
    ("summarise", f"Summarise this passage in two sentences:\n\n{PASSAGE_3}"),
    ("summarise", f"Summarise this passage in two sentences:\n\n{PASSAGE_4}"),
]

LAYER_SKIP = 12  # of SmolLM2's 30 layers, for layer_skip and HF's assistant_early_exit
LOOKUP_GAMMA = 4  # prompt lookup's drafts per round, ours and HF's prompt_lookup_num_tokens

# (row label, make_drafter kind, options, gamma: the best fixed one, or "auto" for adaptive
# speculation); trained kinds load the zoo's files
REAL_DRAFTERS = [
    ("prompt lookup", "prompt_lookup", {}, LOOKUP_GAMMA),
    ("prompt lookup", "prompt_lookup", {}, "auto"),
    ("EAGLE (trained, int8)", "eagle", {}, 3),
    ("EAGLE (trained, int8)", "eagle", {}, "auto"),
    ("MTP (trained, int8)", "mtp", {}, 3),
    ("MTP (trained, int8)", "mtp", {}, "auto"),
    ("DFlash (trained, int8)", "dflash", {}, 3),
    ("DFlash (trained, int8)", "dflash", {}, "auto"),
    ("DSpark (trained, int8)", "dspark", {}, 3),
    ("DSpark (trained, int8)", "dspark", {}, "auto"),
    (f"layer skip {LAYER_SKIP}/30", "layer_skip", {"num_layers": LAYER_SKIP}, 3),
    (f"layer skip {LAYER_SKIP}/30", "layer_skip", {"num_layers": LAYER_SKIP}, "auto"),
    (f"lookup + layer skip {LAYER_SKIP}/30", "lookup+layer_skip", {"num_layers": LAYER_SKIP}, 4),
    (f"lookup + layer skip {LAYER_SKIP}/30", "lookup+layer_skip", {"num_layers": LAYER_SKIP},
     "auto"),
    ("lookup + DFlash (trained, int8)", "lookup+dflash", {}, 3),
    ("lookup + DFlash (trained, int8)", "lookup+dflash", {}, "auto"),
]


def drafts_per_round(gamma) -> int:
  """The most drafts a round verifies: gamma, or adaptive speculation's gamma_max."""
  from spec_jax.adaptive import DEFAULT_GAMMA_MAX
  return DEFAULT_GAMMA_MAX if gamma == "auto" else gamma


def real_drafters(target, params, labels=None) -> tuple[list, list[str]]:
  """[(label, kind, drafter, draft params, gamma)] for REAL_DRAFTERS (`labels`: only those),
  and notes on the ones skipped (a trained drafter whose file is not there)."""
  from spec_jax.drafters import registry
  from spec_jax.drafters.factory import make_drafter
  from spec_jax.models.zoo import zoo_drafter
  built, notes, made = [], [], {}
  for label, kind, opts, gamma in REAL_DRAFTERS:
    if labels is not None and kind not in labels:
      continue
    family = registry.model_family(kind).name  # "lookup+dflash": the shipped DFlash
    if family in registry.trained_kinds():
      path = zoo_drafter("smollm2", family)
      if path is None:
        notes.append(f"skipped {label}: no shipped drafter file")
        continue
      opts = dict(opts, checkpoint=path)
    key = (kind, tuple(sorted(opts.items())))  # fixed and auto rows share one drafter
    if key not in made:
      made[key] = make_drafter(kind, target, params, **opts)
    built.append((label, kind, *made[key], gamma))
  return built, notes


def hf_smollm2(path: str):
  """HF transformers' float32 model from the same GGUF file (EOS off, as our rows)."""
  import torch
  import transformers
  torch.set_num_threads(2)
  transformers.logging.set_verbosity_error()
  hf = transformers.AutoModelForCausalLM.from_pretrained(
      os.path.dirname(path), gguf_file=os.path.basename(path), dtype=torch.float32,
      attn_implementation="sdpa").eval()
  hf.generation_config.eos_token_id = None
  hf.generation_config.pad_token_id = 0
  return hf


def real_model(plan, ctx: dict) -> dict:
  from spec_jax.models.params_io import to_layout
  from spec_jax.models.zoo import ZooModelNotInstalled, load_zoo, zoo_path
  try:
    path = zoo_path("smollm2")
  except ZooModelNotInstalled as e:
    return skipped(str(e))
  target, params, tokenizer = load_zoo("smollm2")
  target, params = to_layout(target, params, plan.layout)
  chosen = REAL_PROMPTS[:plan.rm_prompts]
  prompts = [tokenizer.encode_chat(text) for _, text in chosen]
  width = pad_width(prompts, plan.prompt_width)
  new = plan.rm_new
  drafters, notes = real_drafters(target, params, plan.rm_drafters)
  cache_len = width + new + max([drafts_per_round(g) for *_, g in drafters] + [1]) + 1
  other = [tokenizer.encode_chat("Write a Python function that reverses a list.")]
  rows, groups = [], []
  for batch in plan.rm_batches:
    if batch == 1:
      measure_sets = [pad_prompts([p], width=width) for p in prompts]
      check_sets = [pad_prompts(other, width=width)]
    else:  # two batches covering every prompt, another for the recompilation check
      rows_of = lambda start: [prompts[(start + i) % len(prompts)] for i in range(batch)]
      measure_sets = [pad_prompts(rows_of(0), width=width),
                      pad_prompts(rows_of(batch), width=width)]
      check_sets = [pad_prompts(rows_of(batch // 2), width=width)]
    common = dict(max_new_tokens=new, cache_len=cache_len, batch=batch)
    cases = [ar_case(target, params, label=f"ours: autoregressive, batch {batch}",
                     engine="ours", **common)]
    cases += [spec_case(target, params, d, dp, gamma=g, label=f"ours: {label}, gamma {g}, "
                        f"batch {batch}", drafter=label, kind=kind, engine="ours", **common)
              for label, kind, d, dp, g in drafters
              if batch == 1 or plan.rm_batched_drafters is None
              or kind in plan.rm_batched_drafters]
    hf = []
    if batch == 1 and plan.rm_hf:
      try:
        from spec_jax.bench.hf import hf_case
        if "hf_smollm2" not in ctx:
          ctx["hf_smollm2"] = hf_smollm2(path)
        model = ctx["hf_smollm2"]
        pl_gamma = LOOKUP_GAMMA
        hf = [hf_case(model, "hf: plain, batch 1", {}, new, method="autoregressive",
                      drafter=None, gamma=None, batch=1),
              hf_case(model, f"hf: prompt_lookup_num_tokens={pl_gamma}, batch 1",
                      {"prompt_lookup_num_tokens": pl_gamma, "max_matching_ngram_size": 3}, new,
                      method="speculative", drafter="prompt lookup", gamma=pl_gamma, batch=1),
              hf_case(model, f"hf: assistant_early_exit={LAYER_SKIP}, batch 1",
                      {"assistant_early_exit": LAYER_SKIP, "num_assistant_tokens": 3,
                       "num_assistant_tokens_schedule": "constant",
                       "assistant_confidence_threshold": 0.0}, new,
                      method="speculative", drafter=f"layer skip {LAYER_SKIP}/30", gamma=3,
                      batch=1)][:plan.rm_hf]
      except ImportError as e:
        notes.append(f"skipped HF rows: {e}")
    from spec_jax.bench.cases import run_group
    records, outs, group = run_group(cases + hf, measure_sets, check_sets,
                                     repeats=plan.repeats, workers=plan.compile_workers,
                                     tag=f"RM b{batch}")
    base = f"ours: autoregressive, batch {batch}"
    finish_rows(records, outs, base)
    by = {r["label"]: (r, o) for r, o in zip(records, outs)}
    base_rec, base_out = by[base]
    hf_plain = by.get("hf: plain, batch 1")
    for rec, out in zip(records, outs):
      if "error" in rec or "error" in base_rec:
        continue
      if rec.get("engine") == "hf":  # HF rows: speed-up over HF plain, identity with ours
        rec["identical"] = same_tokens(out, base_out)
        if hf_plain and "error" not in hf_plain[0]:
          rec["speedup_vs_hf_plain"] = hf_plain[0]["run_s"] / rec["run_s"]
      if hf_plain and "error" not in hf_plain[0] and rec.get("engine") == "ours":
        rec["over_hf_plain"] = hf_plain[0]["run_s"] / rec["run_s"]
      if batch == 1 and rec.get("engine") == "ours":  # each prompt alone: the worst one
        per_prompt = [b / r for b, r in zip(base_rec["run_s_sets"], rec["run_s_sets"])]
        rec["speedup_per_prompt"] = per_prompt
        rec["speedup_worst_prompt"] = min(per_prompt)
    rows += records
    groups.append({"batch": batch, **group})
    # drop this batch's compiled programs before the next one compiles: each XLA:CPU
    # executable keeps its own memory mappings, and batch 1's ~15 SmolLM2 programs (with the
    # cost tables' timing programs) left batch 8's compile past vm.max_map_count (65530),
    # where LLVM aborts the process (as in the batch sweep, scenarios.py)
    jax.clear_caches()
    log(f"[RM b{batch}] " + "; ".join(
        f"{r['label']}: {r.get('tokens_per_s', 0):.1f} tok/s, x{r.get('speedup') or 0:.2f}"
        for r in records if "error" not in r))
  return {"status": "ok", "model": "SmolLM2-135M-Instruct (Q4_1 GGUF, float32)",
          "prompts": [k for k, _ in chosen], "max_new_tokens": new, "prompt_width": width,
          "rows": rows, "groups": groups,
          "notes": notes + ["greedy, no EOS; speed-up: over our autoregressive decoding at the "
                            "same batch; over_hf_plain: over HF's plain generate() (batch 1)"]}


RM_COLS = [("row", "label"), ("tok/s", "tokens_per_s"), ("speed-up", "speedup"),
           ("worst prompt", "speedup_worst_prompt"),
           ("vs HF plain", "over_hf_plain"), ("accepted", "mean_accepted"),
           ("+bonus", "mean_accepted_with_bonus"), ("identical", "identical"),
           ("compile s", "compile_s")]


def section(s: dict) -> list[str]:
  """results.md: the table of rows (speed-up over our autoregressive decoding at the same
  batch; HF rows over HF plain)."""
  from spec_jax.bench.report import md_table
  for r in s["rows"]:
    if r.get("engine") == "hf" and "speedup_vs_hf_plain" in r:
      r["speedup"] = r["speedup_vs_hf_plain"]
  return [f"{s['model']}, {len(s['prompts'])} prompts, {s['max_new_tokens']} new tokens each.",
          ""] + md_table(s["rows"], RM_COLS)
