"""spec_jax's own benchmark scenarios (scripts/benchmark.py lists and runs them).

  stories260k           stories260K (../shared): autoregressive vs every drafter, batch 1 and 16
  builtin_pair          the built-in pair on code prompts: draft model (gamma 2..6), prompt lookup
  synthetic_acceptance  a ~300M random target, synthetic acceptance alpha (LOSSY, engine only):
                        measured speed-up next to the one predicted from measured step costs
  versus_hf             against HF transformers (PyTorch, CPU): plain, assistant, prompt lookup
  step_roofline         streaming the target's weights once vs one autoregressive step
  real_model            SmolLM2-135M-Instruct (zoo GGUF): chat prompts, every drafter at its best
                        gamma, HF transformers on the same file (spec_jax.bench.real_model)

Each is a function (plan, ctx) -> result (see spec_jax.bench.runner); `Plan` holds the sizes.
"""

from __future__ import annotations

import dataclasses
import math
import os
import tempfile
from typing import Any, Callable

import jax
import numpy as np

from spec_jax.adaptive import DEFAULT_GAMMA_MAX
from spec_jax.generate import pad_prompts
from spec_jax.models.llama import LAYOUTS
from spec_jax.models.params_io import to_layout
from spec_jax.testing import STORIES_DIR

from spec_jax.bench.cases import ar_case, pad_width, prompt_sets, run_group, spec_case
from spec_jax.bench.random_models import param_bytes, param_count, random_model
from spec_jax.bench.roofline import (matmul_chain_loop, matmul_count_sweep, matvec_over,
                                     step_bound, step_loop, tree_sum, weight_matmuls)
from spec_jax.bench.rows import finish_rows, same_tokens
from spec_jax.bench.runner import skipped
from spec_jax.bench.timing import interleaved_medians, log, timed
from spec_jax.bench.real_model import real_model  # noqa: F401  (scenario 6)

STORY_TEXTS = [
    "Once upon a time", "One day, a little girl named Lily", "Tom and his dog",
    "The sun was shining", "There was a big red ball", "Sam wanted to play", "A little bird",
    "Mom said", "The cat was sad because", "Ben found a shiny stone", "It was a cold winter day",
    "The boy saw a big tree", "Anna liked to", "In the park, there was", "The little fish",
    "Max had a toy car"]
CODE_PROMPTS = ["def fibonacci(n):", "class Stack:", "import os\n\ndef ", "def quicksort(arr):",
                "for i in range(10):", 'if __name__ == "__main__":']


# ---- settings --------------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class Plan:
  """Sizes of every scenario; `QUICK` is the tiny one."""
  repeats: int = 5
  compile_workers: int = 1  # >1 compiles in threads: faster, but each compile_s is contended
  s1_batches: tuple[int, ...] = (1, 16)
  s1_gammas: tuple[int, ...] = (2, 4, 6)
  # drafters (row labels' starts) that also get a gamma="auto" row; None: every drafter
  s1_auto: tuple[str, ...] | None = None
  # drafters (row labels' starts) to run at all; None: every one (e.g. no sanity row)
  s1_only: tuple[str, ...] | None = None
  s1_new: int = 128
  # factory kinds of scenario 1's drafters; None: every one (stories_drafters)
  s1_kinds: tuple[str, ...] | None = None
  s2_gammas: tuple[int, ...] = (2, 3, 4, 5, 6)
  s2_prompts: int = 6
  s2_new: int = 128
  s2_auto: bool = True  # gamma="auto" rows for the draft model and lookup + draft model
  # the shipped DSpark block drafter (models/builtin/dspark) at these gammas (and auto)
  s2_block_gammas: tuple[int, ...] = (4, 6, 8)
  # scenario 7, the batch sweep on the built-in pair: batch sizes, fixed gammas, new tokens
  sw_batches: tuple[int, ...] = (1, 4, 16, 64)
  sw_gammas: tuple[int, ...] = (2, 4)
  sw_new: int = 128
  sw_kinds: tuple[str, ...] = ("draft_model", "lookup+draft_model")
  # ... and scenario 3's memory-bound target with its draft at this synthetic acceptance
  # (None: not swept); fewer new tokens: at 64 rows its CPU step takes most of a second
  sw_synthetic_alpha: float | None = 0.8
  sw_synthetic_new: int = 32
  # scenario 8, the batch baseline: stories260K autoregressive at these batch sizes
  bb_batches: tuple[int, ...] = (1, 4, 16, 64, 256)
  bb_new: int = 128
  s3_target: dict = dataclasses.field(default_factory=lambda: dict(
      vocab_size=32000, dim=1024, n_layers=22, n_heads=16, n_kv_heads=8, hidden_dim=2816))
  s3_draft: dict = dataclasses.field(default_factory=lambda: dict(
      vocab_size=32000, dim=256, n_layers=2, n_heads=4, n_kv_heads=4, hidden_dim=688))
  s3_dtype: str = "float32"  # bfloat16 on GPU/TPU (bf16 matmuls are slow on CPU)
  s3_alphas: tuple[float, ...] = (0.6, 0.8, 0.9)
  s3_gammas: tuple[int, ...] = (2, 4, 6)
  s3_new: int = 128
  loop_steps: int = 16
  # scenario 5's launch sweep: the same bytes (more than a 32 MB L3) as 1..50 chained matmuls
  sweep_bytes: int = 64 << 20
  sweep_counts: tuple[int, ...] = (1, 6, 12, 25, 50)
  s4_models: tuple[str, ...] = ("stories260K-shaped", "20M")
  s4_gamma: int = 4
  s4_new: int = 128
  prompt_width: int = 16
  layout: str = "fused"  # spec_jax.models.llama.LAYOUTS: how our models' params are laid out
  # the real model (spec_jax.bench.real_model): prompts, new tokens, batches, drafter kinds
  # (None: all), HF rows (plain, prompt lookup, early exit: the first rm_hf of them)
  rm_prompts: int = 12
  rm_new: int = 32
  rm_batches: tuple[int, ...] = (1, 8)
  rm_drafters: tuple[str, ...] | None = None
  rm_batched_drafters: tuple[str, ...] | None = ("prompt_lookup", "eagle")  # at batch > 1
  rm_hf: int = 3


QUICK = Plan(
    repeats=3, compile_workers=2, s1_batches=(1,), s1_gammas=(3,), s1_new=16,
    s1_auto=("prompt lookup",), s1_kinds=("draft_model", "prompt_lookup"), s2_gammas=(3,),
    s2_prompts=2, s2_new=16, s2_auto=False, s2_block_gammas=(3,), sw_batches=(1, 2), sw_gammas=(2,), sw_new=8,
    sw_synthetic_new=8,
    bb_batches=(1, 4), bb_new=8,
    s3_target=dict(vocab_size=8000, dim=256, n_layers=2, n_heads=4, n_kv_heads=4, hidden_dim=688),
    s3_draft=dict(vocab_size=8000, dim=64, n_layers=1, n_heads=2, n_kv_heads=2, hidden_dim=172),
    s3_alphas=(0.8,), s3_gammas=(3,), s3_new=16, loop_steps=4, sweep_bytes=2 << 20,
    sweep_counts=(1, 4),
    s4_models=("stories260K-shaped",), s4_gamma=3, s4_new=16,
    rm_prompts=1, rm_new=4, rm_batches=(1,), rm_drafters=("prompt_lookup",), rm_hf=1)

def override_plan(plan: Plan, assignments: list[str]) -> Plan:
  """`plan` with FIELD=VALUE assignments (scripts/benchmark.py --set) -> a new Plan. Tuples
  are comma-separated ("" is empty), "none" clears an optional field; a field of dict type
  (model shapes) is not settable here. Raises ValueError naming the bad assignment."""
  hints = {f.name: str(f.type) for f in dataclasses.fields(Plan)}
  changes = {}
  for item in assignments:
    name, eq, text = item.partition("=")
    name, text = name.strip(), text.strip()
    if not eq or name not in hints:
      raise ValueError(f"--set {item!r}: expected FIELD=VALUE with FIELD one of "
                       f"{sorted(n for n, t in hints.items() if 'dict' not in t)}")
    hint = hints[name]
    try:
      changes[name] = value = _parse_field(hint, text, may_be_empty=name in _MAY_BE_EMPTY)
      if hint == "int" and value == 0 and name not in _MAY_BE_ZERO:
        raise ValueError("needs a positive int")
      if name in _CHOICES and value not in _CHOICES[name]:
        raise ValueError(f"{value!r} is not one of {sorted(_CHOICES[name])}")
    except ValueError as e:
      raise ValueError(f"--set {item!r}: {e}") from None
  return dataclasses.replace(plan, **changes)


_CHOICES = {"layout": set(LAYOUTS), "s3_dtype": {"float32", "bfloat16"}}
# counts that may be 0 (every other int, and every number in a tuple, must be positive)
_MAY_BE_ZERO = {"rm_hf"}
# number tuples that may be empty: rows a scenario can leave out ("s2_block_gammas=": no
# DSpark rows)
_MAY_BE_EMPTY = {"s2_block_gammas"}


def _parse_field(hint: str, text: str, *, may_be_empty: bool = False):
  if "None" in hint and text.lower() == "none":
    return None
  if hint.startswith("dict"):
    raise ValueError("model shapes are not settable from the command line")
  if hint.startswith("tuple"):
    parts = [p.strip() for p in text.split(",") if p.strip()]
    scalar = "str" if "tuple[str" in hint else ("float" if "tuple[float" in hint else "int")
    if not parts and scalar != "str" and not may_be_empty:
      raise ValueError("needs at least one value")
    return tuple(_parse_scalar(scalar, p, positive=True) for p in parts)
  return _parse_scalar(hint.split(" ")[0], text)


def _parse_scalar(kind: str, text: str, positive: bool = False):
  if kind == "bool":
    if text.lower() not in ("true", "false", "1", "0"):
      raise ValueError(f"{text!r} is not true or false")
    return text.lower() in ("true", "1")
  if kind == "str":
    return text
  try:
    value = int(text) if kind == "int" else float(text)
  except ValueError:
    raise ValueError(f"{text!r} is not {'an int' if kind == 'int' else 'a number'}") from None
  if not math.isfinite(value) or value < 0 or (positive and value == 0):
    raise ValueError(f"{text!r} is not a {'positive' if positive else 'non-negative'} "
                     "finite number")
  return value


# --target-size presets for scenarios 3 and 5 (a few billion parameters is for accelerators)
TARGET_SIZES = {
    "300M": dict(vocab_size=32000, dim=1024, n_layers=22, n_heads=16, n_kv_heads=8,
                 hidden_dim=2816),
    "1B": dict(vocab_size=32000, dim=2048, n_layers=16, n_heads=16, n_kv_heads=8,
               hidden_dim=5632),
    "3B": dict(vocab_size=32000, dim=3072, n_layers=26, n_heads=24, n_kv_heads=8,
               hidden_dim=8192),
}

S4_MODELS = {  # name: (target config, draft config); vocab shared
    "stories260K-shaped": (dict(vocab_size=512, dim=64, n_layers=5, n_heads=8, n_kv_heads=4,
                                hidden_dim=172),
                           dict(vocab_size=512, dim=32, n_layers=1, n_heads=4, n_kv_heads=2,
                                hidden_dim=64)),
    "20M": (dict(vocab_size=8000, dim=512, n_layers=6, n_heads=8, n_kv_heads=8, hidden_dim=1376),
            dict(vocab_size=8000, dim=128, n_layers=2, n_heads=4, n_kv_heads=4, hidden_dim=344)),
}


def group_kw(plan: Plan, tag: str) -> dict:
  """run_group's settings from the plan."""
  return dict(repeats=plan.repeats, workers=plan.compile_workers, tag=tag)


def build_drafter(kind: str, target, params, **opts):
  """-> (drafter, draft params) of any registered kind (spec_jax.drafters.make_drafter)."""
  from spec_jax.drafters.factory import make_drafter
  return make_drafter(kind, target, params, **opts)


# ---- scenario 1: stories260K -----------------------------------------------------------------

def stories_drafters(model, params) -> list[tuple[str, str, dict]]:
  """(row label, factory kind, options)."""
  small = random_model(7, max_seq_len=model.max_seq_len, vocab_size=model.vocab_size, dim=32,
                       n_layers=1, n_heads=4, n_kv_heads=2, hidden_dim=64, **model.config.layout)
  k = max(1, model.config.n_layers // 2)
  n = model.config.n_layers
  return [
      ("draft model: random 1-layer dim 32", "draft_model",
       dict(draft_model=small[0], draft_params=small[1])),
      ("draft model: the target itself (sanity row)", "draft_model",
       dict(draft_model=model, draft_params=params)),
      ("prompt lookup (n 3..1)", "prompt_lookup", {}),
      (f"layer skip k={k}/{n}", "layer_skip", dict(num_layers=k)),
      ("int8 quantized target", "quantized", {}),
      (f"combined: lookup (n 3..2) + layer skip k={k}", "lookup+layer_skip", dict(num_layers=k)),
  ]


def stories_setup(plan: Plan):
  """stories260K in the plan's layout and the story prompts (token ids), for scenarios 1
  and 8 -> (model, params, prompts), or a skipped result when ../shared is missing."""
  path = STORIES_DIR / "stories260K.bin"
  if not path.exists():
    return skipped(f"{path} not found (the ../shared folder beside the repository)")
  from spec_jax.models.llama2c import load_llama2c
  from spec_jax.models.tokenizer import load_tokenizer
  model, params = to_layout(*load_llama2c(str(path)), plan.layout)
  tokenizer = load_tokenizer(str(STORIES_DIR / "tok512.bin"))
  return model, params, [tokenizer.encode(t, add_bos=True) for t in STORY_TEXTS]


def stories260k(plan: Plan, ctx: dict) -> dict:
  setup = stories_setup(plan)
  if isinstance(setup, dict):
    return setup
  model, params, prompts = setup
  width = pad_width(prompts, plan.prompt_width)
  cache_len = width + plan.s1_new + max(*plan.s1_gammas, DEFAULT_GAMMA_MAX) + 1
  drafters, notes = [], []
  for label, kind, opts in stories_drafters(model, params):
    if (plan.s1_kinds is not None and kind not in plan.s1_kinds
        or plan.s1_only is not None and not label.startswith(plan.s1_only)):
      continue
    try:
      drafters.append((label, kind) + build_drafter(kind, model, params, **opts))
    except ImportError as e:
      notes.append(f"skipped {label}: {e}")
      log(f"[S1] skipped {label}: {e}")
  rows, groups = [], []
  for batch in plan.s1_batches:
    measured, check = prompt_sets(prompts, batch, width)
    common = dict(max_new_tokens=plan.s1_new, cache_len=cache_len, batch=batch)
    cases = [ar_case(model, params, **common)]
    cases += [spec_case(model, params, d, dp, gamma=g, label=f"{label}, gamma {g}",
                        drafter=label, kind=kind, **common)
              for label, kind, d, dp in drafters for g in plan.s1_gammas]
    cases += [spec_case(model, params, d, dp, gamma="auto", label=f"{label}, gamma auto",
                        drafter=label, kind=kind, **common)
              for label, kind, d, dp in drafters
              if plan.s1_auto is None or label.startswith(plan.s1_auto)]
    records, outs, group = run_group(cases, [measured], [check], **group_kw(plan, f"S1 b{batch}"))
    rows += finish_rows(records, outs, "autoregressive")
    groups.append({"batch": batch, **group})
  return {"status": "ok", "model": "stories260K", "params": param_count(params),
          "max_new_tokens": plan.s1_new, "prompt_width": width, "cache_len": cache_len,
          "rows": rows, "groups": groups, "notes": notes}


# ---- scenario 2: the built-in pair ------------------------------------------------------------

def builtin_setup(plan: Plan, num_prompts: int, max_drafts: int, want_new: int):
  """The built-in pair in the plan's layout and its first code prompts, for scenarios 2 and
  7 -> (target, params, draft, draft params, tokenizer, prompts, width, new tokens, cache
  length), or a skipped result when the pair cannot load. New tokens are capped so that the
  prompt, the tokens and a round of max_drafts fit both models."""
  try:
    from spec_jax.models.builtin import load_builtin
    target, params, draft, draft_params, tokenizer = load_builtin()
  except Exception as e:  # noqa: BLE001  e.g. the checkpoint is still being trained
    return skipped(f"load_builtin() failed: {type(e).__name__}: {e}")
  target, params = to_layout(target, params, plan.layout)
  draft, draft_params = to_layout(draft, draft_params, plan.layout)
  bos = tokenizer.bos_id is not None
  prompts = [tokenizer.encode(p, add_bos=bos) for p in CODE_PROMPTS[:num_prompts]]
  width = pad_width(prompts, plan.prompt_width)
  extra = max_drafts + 1
  new = max(1, min(want_new, target.max_seq_len - width - extra,
                   draft.max_seq_len - width - extra))
  return target, params, draft, draft_params, tokenizer, prompts, width, new, width + new + extra


def builtin_pair(plan: Plan, ctx: dict) -> dict:
  setup = builtin_setup(plan, plan.s2_prompts,
                        max(plan.s2_gammas + plan.s2_block_gammas
                            + ((DEFAULT_GAMMA_MAX,) if plan.s2_auto else ())),
                        plan.s2_new)
  if isinstance(setup, dict):
    return setup
  target, params, draft, draft_params, tokenizer, prompts, width, new, cache_len = setup
  bos = tokenizer.bos_id is not None
  pl_gamma = 4 if 4 in plan.s2_gammas else plan.s2_gammas[-1]
  measure_sets = [pad_prompts([p], width=width) for p in prompts]
  other = tokenizer.encode("def main():", add_bos=bos)
  check_sets = [pad_prompts([other], width=width)] if len(other) <= width else []
  common = dict(max_new_tokens=new, cache_len=cache_len, batch=1)
  cases = [ar_case(target, params, **common)]
  drafter, dp = build_drafter("draft_model", target, params, draft_model=draft,
                              draft_params=draft_params)
  cases += [spec_case(target, params, drafter, dp, gamma=g, label=f"draft model, gamma {g}",
                      drafter="draft model (built-in)", kind="draft_model", **common)
            for g in plan.s2_gammas]
  if plan.s2_auto:
    cases.append(spec_case(target, params, drafter, dp, gamma="auto",
                           label="draft model, gamma auto", drafter="draft model (built-in)",
                           kind="draft_model", **common))
  notes = []
  cases += builtin_block_cases(plan, target, params, common, notes)
  try:
    pl, pl_params = build_drafter("prompt_lookup", target, params)
    cases.append(spec_case(target, params, pl, pl_params, gamma=pl_gamma,
                           label=f"prompt lookup, gamma {pl_gamma}", drafter="prompt lookup",
                           kind="prompt_lookup", **common))
    both, both_params = build_drafter("lookup+draft_model", target, params, draft_model=draft,
                                      draft_params=draft_params)
    cases.append(spec_case(target, params, both, both_params, gamma=pl_gamma,
                           label=f"lookup (n 3..2), else draft model, gamma {pl_gamma}",
                           drafter="prompt lookup + draft model", kind="lookup+draft_model",
                           **common))
    if plan.s2_auto:
      cases.append(spec_case(target, params, both, both_params, gamma="auto",
                             label="lookup (n 3..2), else draft model, gamma auto",
                             drafter="prompt lookup + draft model", kind="lookup+draft_model",
                             **common))
  except ImportError as e:
    notes.append(f"skipped prompt lookup: {e}")
  records, outs, group = run_group(cases, measure_sets, check_sets, **group_kw(plan, "S2"))
  rows = finish_rows(records, outs, "autoregressive")
  return {"status": "ok", "prompts": CODE_PROMPTS[:plan.s2_prompts], "max_new_tokens": new,
          "target_params": param_count(params), "draft_params": param_count(draft_params),
          "rows": rows, "per_prompt": auto_vs_best_fixed(rows), "groups": [group],
          "notes": notes}


def builtin_block_cases(plan: Plan, target, params, common: dict, notes: list) -> list:
  """Rows of the DSpark drafter shipped for the built-in target, at the plan's block gammas
  (those its block holds) and with gamma="auto"; none, with a note, where it is not shipped."""
  from spec_jax.models.builtin import builtin_drafter
  if not plan.s2_block_gammas:
    return []
  folder = builtin_drafter("dspark")
  if folder is None:
    notes.append("no DSpark drafter shipped in models/builtin/dspark: no DSpark rows")
    return []
  drafter, dp = build_drafter("dspark", target, params, checkpoint=folder)
  gammas = [g for g in plan.s2_block_gammas if g <= drafter.model.num_drafts]
  info = dict(drafter="DSpark (built-in)", kind="dspark", **common)
  cases = [spec_case(target, params, drafter, dp, gamma=g, label=f"DSpark, gamma {g}", **info)
           for g in gammas]
  if plan.s2_auto:
    cases.append(spec_case(target, params, drafter, dp, gamma="auto", label="DSpark, gamma auto",
                           **info))
  return cases


def auto_vs_best_fixed(rows: list[dict]) -> list[dict]:
  """Per drafter with a gamma="auto" row, per prompt (each prompt is its own measured set):
  the best fixed gamma's speed-up over autoregressive, auto's, and auto / best."""
  ok = [r for r in rows if "error" not in r and "run_s_sets" in r]
  base = next((r for r in ok if r["method"] == "autoregressive"), None)
  out = []
  for auto in (r for r in ok if r.get("gamma") == "auto"):
    fixed = [r for r in ok if r.get("drafter") == auto["drafter"]
             and isinstance(r.get("gamma"), int)]
    if base is None or not fixed:
      continue
    for i, base_s in enumerate(base["run_s_sets"]):
      best = min(fixed, key=lambda r: r["run_s_sets"][i])
      out.append({"drafter": auto["drafter"], "prompt": i, "best_fixed_gamma": best["gamma"],
                  "best_fixed_speedup": base_s / best["run_s_sets"][i],
                  "auto_speedup": base_s / auto["run_s_sets"][i],
                  "auto_over_best": best["run_s_sets"][i] / auto["run_s_sets"][i]})
  return out


# ---- scenario 7: the batch sweep ---------------------------------------------------------------

def batch_sweep(plan: Plan, ctx: dict) -> dict:
  """Speculation against autoregressive decoding at each batch size, fixed gammas and
  gamma="auto", on two targets: the built-in pair (draft model, lookup + draft model; the
  code prompts repeated to fill the batch) and the memory-bound random target of scenario 3
  with its draft at synthetic acceptance `sw_synthetic_alpha` (LOSSY: a coin decides each
  draft; engine only). Speed-ups over autoregressive at the same batch and target, and the
  widths auto chose (rows carry `model`)."""
  parts = [_builtin_sweep(plan)]
  if plan.sw_synthetic_alpha is not None:
    parts.append(_synthetic_sweep(plan, ctx))
  done = [p for p in parts if p["status"] == "ok"]
  if not done:
    return parts[0]
  return {"status": "ok", "batches": list(plan.sw_batches),
          "models": [p["model"] for p in done],
          "max_new_tokens": {p["model"]: p["max_new_tokens"] for p in done},
          "rows": [r for p in done for r in p["rows"]],
          "groups": [g for p in done for g in p["groups"]],
          "notes": [f"{p.get('model', 'a part')}: {p['status']}: {p.get('note', '')}"
                    for p in parts if p["status"] != "ok"]}


def _sweep_groups(plan: Plan, model: str, cases_at, measure_and_check, *, lossy: bool) -> tuple:
  """Runs cases_at(batch) at each batch size -> (rows tagged with `model`, groups)."""
  rows, groups = [], []
  for batch in plan.sw_batches:
    measured, check = measure_and_check(batch)
    records, outs, group = run_group(cases_at(batch), [measured], [check],
                                     **group_kw(plan, f"S7 {model} b{batch}"))
    rows += [dict(r, model=model) for r in finish_rows(records, outs, "autoregressive",
                                                       lossy=lossy)]
    groups.append({"model": model, "batch": batch, **group})
    # drop the group's compiled programs: each XLA:CPU executable keeps its own memory
    # mappings, and a whole sweep's (a large target's among them) passes the kernel's
    # vm.max_map_count (65530 by default), where LLVM aborts the process mid-compile
    jax.clear_caches()
  return rows, groups


def _builtin_sweep(plan: Plan) -> dict:
  if not plan.sw_kinds:
    return skipped("no built-in pair drafters in the plan (sw_kinds)")
  setup = builtin_setup(plan, len(CODE_PROMPTS), max(*plan.sw_gammas, DEFAULT_GAMMA_MAX),
                        plan.sw_new)
  if isinstance(setup, dict):
    return setup
  target, params, draft, draft_params, _, prompts, width, new, cache_len = setup
  drafters = [("draft model (built-in)", "draft_model"),
              ("prompt lookup + draft model", "lookup+draft_model")]
  built = [(label, kind) + build_drafter(kind, target, params, draft_model=draft,
                                         draft_params=draft_params)
           for label, kind in drafters if kind in plan.sw_kinds]

  def cases_at(batch):
    common = dict(max_new_tokens=new, cache_len=cache_len, batch=batch)
    cases = [ar_case(target, params, **common)]
    for label, kind, d, dp in built:
      cases += [spec_case(target, params, d, dp, gamma=g, label=f"{label}, gamma {g}",
                          drafter=label, kind=kind, **common)
                for g in (*plan.sw_gammas, "auto")]
    return cases

  rows, groups = _sweep_groups(plan, "built-in pair", cases_at,
                               lambda batch: prompt_sets(prompts, batch, width), lossy=False)
  return {"status": "ok", "model": "built-in pair", "max_new_tokens": new, "rows": rows,
          "groups": groups}


def _synthetic_sweep(plan: Plan, ctx: dict) -> dict:
  (target, params), (draft, draft_params) = memory_bound_pair(plan, ctx)
  alpha, new = plan.sw_synthetic_alpha, plan.sw_synthetic_new
  model = f"{param_count(params) / 1e6:.0f}M random target, synthetic alpha {alpha}"
  width = plan.prompt_width
  cache_len = width + new + max(*plan.sw_gammas, DEFAULT_GAMMA_MAX) + 1
  rng = np.random.default_rng(0)
  prompts = [rng.integers(1, target.vocab_size, width - i % 4).tolist() for i in range(8)]

  def cases_at(batch):
    common = dict(max_new_tokens=new, cache_len=cache_len, batch=batch)
    return [ar_case(target, params, **common)] + [
        synthetic_case(target, params, draft, draft_params, alpha, g, **common)
        for g in (*plan.sw_gammas, "auto")]

  rows, groups = _sweep_groups(plan, model, cases_at,
                               lambda batch: prompt_sets(prompts, batch, width), lossy=True)
  return {"status": "ok", "model": model, "max_new_tokens": new, "rows": rows,
          "groups": groups}


# ---- scenario 8: the batch baseline ----------------------------------------------------------------

def batch_baseline(plan: Plan, ctx: dict) -> dict:
  """stories260K autoregressive decoding (greedy, the story prompts repeated to fill the
  batch) at each batch size: what batching buys before any speculation. Each row: tokens/s,
  ms per decoding step and us per row-step; `over_batch_16`: tokens/s over batch 16's."""
  setup = stories_setup(plan)
  if isinstance(setup, dict):
    return setup
  model, params, prompts = setup
  width = pad_width(prompts, 8)
  cache_len = width + plan.bb_new
  rows, groups = [], []
  for batch in plan.bb_batches:
    measured, check = prompt_sets(prompts, batch, width)
    cases = [ar_case(model, params, max_new_tokens=plan.bb_new, cache_len=cache_len,
                     batch=batch)]
    records, outs, group = run_group(cases, [measured], [check], **group_kw(plan, f"S8 b{batch}"))
    rows += finish_rows(records, outs, "autoregressive")
    groups.append({"batch": batch, **group})
  for r in rows:
    if "error" not in r:
      r["ms_per_step"] = 1e3 * r["run_s"] / plan.bb_new
      r["us_per_row_step"] = 1e3 * r["ms_per_step"] / r["batch"]
  by_batch = {r["batch"]: r for r in rows if "error" not in r}
  for r in by_batch.values():
    r["over_batch_16"] = (r["tokens_per_s"] / by_batch[16]["tokens_per_s"]
                          if 16 in by_batch else None)
  return {"status": "ok", "model": "stories260K", "max_new_tokens": plan.bb_new,
          "prompt_width": width, "cache_len": cache_len, "batches": list(plan.bb_batches),
          "rows": rows, "groups": groups, "notes": []}


# ---- the memory-bound pair, shared by scenarios 3 and 5 ----------------------------------------

def memory_bound_pair(plan: Plan, ctx: dict):
  """The ~300M target and its small draft (built once per run, kept in ctx)."""
  if "s3_pair" not in ctx:
    log(f"building random target {plan.s3_target} and draft {plan.s3_draft} ...")
    layout = dict(dtype=plan.s3_dtype, **LAYOUTS[plan.layout])
    target = random_model(0, **layout, **plan.s3_target)
    draft = random_model(1, **layout, **plan.s3_draft)
    jax.block_until_ready((target[1], draft[1]))
    ctx["s3_pair"] = (target, draft)
  return ctx["s3_pair"]


def s3_geometry(plan: Plan) -> tuple[int, int, int]:
  """(prompt width, cache length, mid-generation position) for scenarios 3 and 5."""
  width = plan.prompt_width
  cache_len = width + plan.s3_new + max(plan.s3_gammas) + 1
  return width, cache_len, width + plan.s3_new // 2


def target_step_loop(plan: Plan, ctx: dict) -> tuple[Callable[[], Any], dict]:
  """The target's one-token step loop (compiled once per run, kept in ctx)."""
  if "target_step" not in ctx:
    (target, params), _ = memory_bound_pair(plan, ctx)
    _, cache_len, position = s3_geometry(plan)
    ctx["target_step"] = step_loop(target, params, tokens=1, cache_len=cache_len,
                                   position=position, steps=plan.loop_steps)
  return ctx["target_step"]


# ---- scenario 3: memory-bound target, synthetic acceptance -------------------------------------

def synthetic_case(target, params, draft, draft_params, alpha: float, gamma, **common):
  """A speculative Case whose draft is accepted with probability alpha (a coin per draft,
  LOSSY: spec_jax.drafters.synthetic), for scenarios 3 and 7."""
  from spec_jax.drafters.synthetic import synthetic_pair
  drafter, verifier = synthetic_pair(draft, alpha)
  return spec_case(target, params, drafter, draft_params, gamma=gamma, verifier=verifier,
                   label=f"synthetic alpha {alpha}, gamma {gamma}",
                   drafter=f"synthetic alpha {alpha} (LOSSY)", kind="synthetic", alpha=alpha,
                   **common)


def synthetic_acceptance(plan: Plan, ctx: dict) -> dict:
  from spec_jax.drafters.synthetic import expected_tokens_per_round, predicted_speedup
  (target, params), (draft, draft_params) = memory_bound_pair(plan, ctx)
  width, cache_len, position = s3_geometry(plan)
  rng = np.random.default_rng(0)
  prompt = rng.integers(1, target.vocab_size, width).tolist()
  other = rng.integers(1, target.vocab_size, width - 3).tolist()
  measured, check = pad_prompts([prompt], width=width), pad_prompts([other], width=width)
  common = dict(max_new_tokens=plan.s3_new, cache_len=cache_len, batch=1)
  cases = [ar_case(target, params, **common)]
  cases += [synthetic_case(target, params, draft, draft_params, alpha, g, **common)
            for alpha in plan.s3_alphas for g in plan.s3_gammas]
  log("[S3] compiling the step-cost loops (jitted loops of apply) ...")
  loop = dict(cache_len=cache_len, position=position, steps=plan.loop_steps)
  loops = {"target_step": target_step_loop(plan, ctx),
           "draft_step": step_loop(draft, draft_params, tokens=1, **loop)}
  loops.update({f"verify_{g}": step_loop(target, params, tokens=g + 1, **loop)
                for g in plan.s3_gammas})
  records, outs, group = run_group(cases, [measured], [check], **group_kw(plan, "S3"),
                                   extras={k: thunk for k, (thunk, _) in loops.items()})
  costs = {k: {**info, "step_s": group["extras_s"][k] / info["steps"]}
           for k, (_, info) in loops.items()}
  rows = finish_rows(records, outs, "autoregressive", lossy=True)
  t_target, t_draft = costs["target_step"]["step_s"], costs["draft_step"]["step_s"]
  for rec in rows:
    if rec.get("method") != "speculative" or "error" in rec:
      continue
    g, a = rec["gamma"], rec["alpha_measured"]
    t_verify = costs[f"verify_{g}"]["step_s"]
    rec["t_target_s"], rec["t_draft_s"], rec["t_verify_s"] = t_target, t_draft, t_verify
    rec["expected_tokens_per_round"] = expected_tokens_per_round(a, g)
    rec["predicted_speedup"] = predicted_speedup(a, g, t_target, t_draft, t_verify)
    rec["engine_efficiency"] = rec["speedup"] / rec["predicted_speedup"]
  return {"status": "ok", "target_params": param_count(params),
          "draft_params": param_count(draft_params), "target_config": plan.s3_target,
          "draft_config": plan.s3_draft, "max_new_tokens": plan.s3_new, "cache_len": cache_len,
          "costs": costs, "rows": rows, "groups": [group],
          "notes": ["synthetic rows are lossy by design (coin acceptance): identical is null",
                    "predicted = E(alpha_measured) * t_target / (gamma * t_draft + t_verify)"]}


# ---- scenario 4: HF transformers ---------------------------------------------------------------

def versus_hf_model(name: str, plan: Plan, tmp: str) -> dict:
  """One model pair of S4_MODELS: HF's three modes and ours, and our step's bound."""
  from spec_jax.bench.hf import hf_case, to_hf
  from spec_jax.drafters.draft_model import DraftModelDrafter
  from spec_jax.drafters.prompt_lookup import PromptLookupDrafter
  target_cfg, draft_cfg = S4_MODELS[name]
  target, params = random_model(10, **target_cfg)
  draft, draft_params = random_model(11, **draft_cfg)
  hf_target = to_hf(target, params, os.path.join(tmp, f"{name}-target"))
  hf_draft = to_hf(draft, draft_params, os.path.join(tmp, f"{name}-draft"))
  target, params = to_layout(target, params, plan.layout)  # HF got the checkpoint layout
  draft, draft_params = to_layout(draft, draft_params, plan.layout)
  g, new = plan.s4_gamma, plan.s4_new
  # a fixed number of drafts per round: HF's dynamic schedules off
  hf_draft.generation_config.num_assistant_tokens = g
  hf_draft.generation_config.num_assistant_tokens_schedule = "constant"
  hf_draft.generation_config.assistant_confidence_threshold = 0.0
  rng = np.random.default_rng(3)
  width = plan.prompt_width
  measured = pad_prompts([rng.integers(1, target.vocab_size, width).tolist()], width=width)
  check = pad_prompts([rng.integers(1, target.vocab_size, width - 2).tolist()], width=width)
  cache_len = width + new + g + 1
  common = dict(max_new_tokens=new, cache_len=cache_len, batch=1)
  cases = [
      hf_case(hf_target, "hf: plain", {}, new, method="autoregressive", drafter=None, gamma=None),
      hf_case(hf_target, "hf: assistant_model", {"assistant_model": hf_draft}, new,
              method="speculative", drafter="draft model", gamma=g),
      hf_case(hf_target, "hf: prompt_lookup", {"prompt_lookup_num_tokens": g,
                                                "max_matching_ngram_size": 3}, new,
              method="speculative", drafter="prompt lookup (n 3..1)", gamma=g),
      ar_case(target, params, label="ours: autoregressive", engine="ours", **common),
      spec_case(target, params, DraftModelDrafter(draft), draft_params, gamma=g,
                label="ours: draft model", drafter="draft model", engine="ours", **common),
      spec_case(target, params, PromptLookupDrafter(3, 1), None, gamma=g,
                label="ours: prompt lookup", drafter="prompt lookup (n 3..1)", engine="ours",
                **common),
  ]
  records, outs, group = run_group(cases, [measured], [check], **group_kw(plan, f"S4 {name}"))
  by = {r["label"]: (r, o) for r, o in zip(records, outs)}
  bound = step_bound(target, params, cache_len=cache_len, position=width + new // 2,
                     steps=plan.loop_steps, repeats=plan.repeats)
  hf_plain = by["hf: plain"][0]
  if "error" not in hf_plain:
    bound["hf_plain_s_per_token"] = 1.0 / hf_plain["tokens_per_s"]
    bound["hf_over_matmul_chain"] = bound["hf_plain_s_per_token"] / bound["matmul_chain_s"]
  for engine, base in (("hf", "hf: plain"), ("ours", "ours: autoregressive")):
    part = [(r, o) for r, o in zip(records, outs) if r.get("engine") == engine]
    finish_rows([r for r, _ in part], [o for _, o in part], base)
  pairs = {"plain": ("ours: autoregressive", "hf: plain"),
           "draft_model": ("ours: draft model", "hf: assistant_model"),
           "prompt_lookup": ("ours: prompt lookup", "hf: prompt_lookup")}
  ratios, identical = {}, {}
  for key, (ours, hf) in pairs.items():
    (r_o, o_o), (r_h, o_h) = by[ours], by[hf]
    ok = "error" not in r_o and "error" not in r_h
    ratios[key] = r_o["tokens_per_s"] / r_h["tokens_per_s"] if ok else None
    identical[key] = same_tokens(o_o, o_h) if ok else None
    r_o["ours_over_hf"] = ratios[key]
    r_o["identical_to_hf"] = identical[key]
  for rec in records:
    rec["model"] = name
  return {"model": name, "target_params": param_count(params),
          "draft_params": param_count(draft_params), "gamma": g, "max_new_tokens": new,
          "ours_over_hf": ratios, "identical_to_hf": identical,
          "min_ratio": min((v for v in ratios.values() if v is not None), default=None),
          "bound": bound,
          "rows": records, "group": group}


def versus_hf(plan: Plan, ctx: dict) -> dict:
  try:
    import torch
    import transformers
  except ImportError as e:
    return skipped(f"torch / transformers not importable ({e})")
  torch.set_num_threads(2)
  transformers.logging.set_verbosity_error()
  models, rows = [], []
  with tempfile.TemporaryDirectory() as tmp:
    for name in plan.s4_models:
      result = versus_hf_model(name, plan, tmp)
      rows += result.pop("rows")
      models.append(result)
  return {"status": "ok", "models": models, "rows": rows, "target_ratio": 3.0,
          "groups": [m["group"] for m in models],
          "notes": ["HF: generate(); assistant with num_assistant_tokens fixed "
                    "(schedule 'constant', assistant_confidence_threshold 0); prompt lookup with "
                    "max_matching_ngram_size 3; ours: prompt lookup n 3..1",
                    f"torch threads: {torch.get_num_threads()}"]}


# ---- scenario 5: roofline ----------------------------------------------------------------------

def step_roofline(plan: Plan, ctx: dict) -> dict:
  (target, params), _ = memory_bound_pair(plan, ctx)
  nbytes = param_bytes(params)
  matvec, matvec_shape = matvec_over(nbytes, plan.s3_dtype)
  step_thunk, step_info = target_step_loop(plan, ctx)
  thunks = {"matvec": matvec, "tree_sum": lambda: tree_sum(params),
            "matmul_chain": matmul_chain_loop(target, params, plan.loop_steps),
            f"step {plan.layout}": step_thunk}
  _, cache_len, position = s3_geometry(plan)
  loop = dict(cache_len=cache_len, position=position, steps=plan.loop_steps)
  pass_tokens = 5  # a gamma-4 verification: the pass speculation's target runs
  for layout in LAYOUTS:  # the same shapes in every params layout, side by side
    other = (target, params) if layout == plan.layout else random_model(
        0, dtype=plan.s3_dtype, **LAYOUTS[layout], **plan.s3_target)
    if layout != plan.layout:
      thunks[f"step {layout}"], _ = step_loop(*other, tokens=1, **loop)
    thunks[f"pass {layout}"], _ = step_loop(*other, tokens=pass_tokens, **loop)
    del other
  for thunk in thunks.values():
    timed(thunk)  # compile, warm up
  t = interleaved_medians(thunks, plan.repeats)
  del thunks, matvec
  sweep = matmul_count_sweep(plan.sweep_bytes, plan.sweep_counts, plan.s3_dtype,
                             steps=plan.loop_steps, repeats=plan.repeats)
  roofline_s = min(t["matvec"], t["tree_sum"])
  chain_s = t["matmul_chain"] / plan.loop_steps
  layouts = {layout: {"step_s": t[f"step {layout}"] / step_info["steps"],
                      f"pass_{pass_tokens}_tokens_s": t[f"pass {layout}"] / step_info["steps"]}
             for layout in LAYOUTS}
  for rec in layouts.values():
    rec["ratio"] = roofline_s / rec["step_s"]
  best = min(layouts, key=lambda k: layouts[k]["step_s"])
  step_s, ratio = layouts[best]["step_s"], layouts[best]["ratio"]
  notes = ["roofline = the faster of a [N] x [N, M] matvec over the same bytes and a sum of "
           "all params; step = one token, batch 1, in a fori_loop of "
           f"{step_info['steps']} steps; timed interleaved",
           "step in each params layout (spec_jax.models.llama.LAYOUTS): checkpoint = 7 matmuls per "
           "layer, kernels [in, out]; fused = 4 (QKV, gate/up fused); fused_out_in = 4, "
           f"kernels [out, in]. The headline is the fastest ({best}); pass_{pass_tokens}_tokens_s: "
           f"one {pass_tokens}-token pass (a gamma-{pass_tokens - 1} verification) per layout"]
  notes.append(f"matmul chain = only the step's {len(weight_matmuls(target, params))} weight "
               "matmuls, one row each, each fed the one before: what XLA's separate matmuls "
               "cost before anything else a step does")
  if nbytes < 64 << 20:
    notes.append(f"the target is only {nbytes / 2**20:.0f} MiB: it may sit in the CPU caches, "
                 "so this roofline is not DRAM-bound (quick mode)")
  return {"status": "ok", "rows": [], "param_bytes": nbytes, "params": param_count(params),
          "roofline": {"matvec_shape": matvec_shape, "matvec_s": t["matvec"],
                       "matmul_chain_s": chain_s, "matmul_chain_layout": plan.layout,
                       "step_over_chain": layouts[plan.layout]["step_s"] / chain_s,
                       "matmul_count_sweep": sweep,
                       "tree_sum_s": t["tree_sum"], "roofline_s": roofline_s,
                       "bandwidth_GBps": nbytes / roofline_s / 1e9, "step_s": step_s,
                       "step_layout": best, "layouts": layouts,
                       "step_GBps": nbytes / step_s / 1e9, "ratio": ratio, "target_ratio": 0.8,
                       "meets_target": bool(ratio >= 0.8)},
          "notes": notes}
