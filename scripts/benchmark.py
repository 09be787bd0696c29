"""Benchmarks: speculative against autoregressive decoding (and HF transformers), side by side.

  python scripts/benchmark.py --out runs/bench/results.json      # everything (tens of minutes)
  python scripts/benchmark.py --quick --out /tmp/bench           # tiny sizes, for the tests
  python scripts/benchmark.py --scenarios 1,3 --repeats 7 --out runs/bench

Scenarios:
  1  stories260K (../shared/models/stories260K): autoregressive vs every drafter, batch 1 and 16
  2  the built-in pair (spec_jax.models.builtin) on code prompts: draft model (gamma 2..6), prompt lookup
  3  a ~300M float32 random target, synthetic acceptance alpha (LOSSY, engine only): measured
     speed-up next to the one predicted from separately measured step costs
  4  against HF transformers (PyTorch, CPU): plain, assistant model, prompt lookup
  5  roofline: streaming the target's weights once vs one autoregressive step

Every comparison runs in one process: all programs are compiled first (AOT, timed apart),
warmed up, then timed in interleaved repeats (medians), so a shared machine's drift hits
every row alike. Writes results.json, results.md and PNG plots into the --out folder.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import functools
import json
import math
import os
import platform
import sys
import tempfile
import time
import traceback
from pathlib import Path
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from spec_jax.models.llama import LAYOUTS, LlamaConfig, LlamaModel  # noqa: E402
from spec_jax.models.params_io import to_layout  # noqa: E402
from spec_jax.generate import (NO_EOS, GenerationOutput, generate_jit, budgets_array,  # noqa: E402
                               check_generation_args, generate, pad_prompts)
from spec_jax.metrics import summarize  # noqa: E402
from spec_jax.core.sampling import SamplingConfig  # noqa: E402
from spec_jax.speculative import speculative_jit, prepare, speculative_generate  # noqa: E402
from spec_jax.verify import verify  # noqa: E402

STORIES = REPO.parent / "shared" / "models" / "stories260K"
GREEDY = SamplingConfig()
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
  """Sizes of every scenario; `--quick` picks the tiny one."""
  repeats: int = 5
  compile_workers: int = 1  # >1 compiles in threads: faster, but each compile_s is contended
  s1_batches: tuple[int, ...] = (1, 16)
  s1_gammas: tuple[int, ...] = (2, 4, 6)
  s1_new: int = 128
  s2_gammas: tuple[int, ...] = (2, 3, 4, 5, 6)
  s2_prompts: int = 6
  s2_new: int = 128
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


QUICK = Plan(
    repeats=3, compile_workers=2, s1_batches=(1,), s1_gammas=(3,), s1_new=16, s2_gammas=(3,),
    s2_prompts=2, s2_new=16,
    s3_target=dict(vocab_size=8000, dim=256, n_layers=2, n_heads=4, n_kv_heads=4, hidden_dim=688),
    s3_draft=dict(vocab_size=8000, dim=64, n_layers=1, n_heads=2, n_kv_heads=2, hidden_dim=172),
    s3_alphas=(0.8,), s3_gammas=(3,), s3_new=16, loop_steps=4, sweep_bytes=2 << 20,
    sweep_counts=(1, 4),
    s4_models=("stories260K-shaped",), s4_gamma=3, s4_new=16)

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


def log(msg: str) -> None:
  print(msg, flush=True)


def random_model(seed: int, max_seq_len: int = 512, **cfg) -> tuple[LlamaModel, Any]:
  model = LlamaModel(LlamaConfig(max_seq_len=max_seq_len, **cfg))
  return model, model.init_params(jax.random.key(seed))


def param_bytes(params) -> int:
  return int(sum(np.asarray(x).nbytes for x in jax.tree.leaves(params)))


def param_count(params) -> int:
  return int(sum(np.size(x) for x in jax.tree.leaves(params)))


def jit_cache_size() -> int:
  return generate_jit._cache_size() + speculative_jit._cache_size()


# ---- the machine -----------------------------------------------------------------------------

def cpu_model() -> str:
  try:
    for line in Path("/proc/cpuinfo").read_text().splitlines():
      if line.startswith("model name"):
        return line.split(":", 1)[1].strip()
  except OSError:
    pass
  return platform.processor() or "unknown"


def package_versions() -> dict[str, str | None]:
  versions = {}
  for name in ("jaxlib", "flax", "numpy", "torch", "transformers", "matplotlib"):
    try:
      versions[name] = __import__(name).__version__
    except Exception:  # noqa: BLE001  absent or broken: reported as None
      versions[name] = None
  return versions


def describe_machine() -> dict:
  return {
      "cpu_model": cpu_model(), "cpu_count": os.cpu_count(),
      "cpus_usable": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None,
      "load_average_start": list(os.getloadavg()), "platform": platform.platform(),
      "python": platform.python_version(), "jax": jax.__version__,
      "jax_backend": jax.default_backend(), "jax_devices": [str(d) for d in jax.devices()],
      "dtype": "float32 (scenarios 3 and 5: see config.plan.s3_dtype)", "date": datetime.datetime.now(datetime.timezone.utc).isoformat(
          timespec="seconds"),
      "xla_flags": os.environ.get("XLA_FLAGS", ""), "packages": package_versions(),
      "note": "shared machine: other processes may have used the CPU; compare ratios measured "
              "side by side, not absolute times across runs",
  }


# ---- cases: one program to compile, warm up and time -----------------------------------------

@dataclasses.dataclass
class Case:
  label: str
  run: Callable[[np.ndarray, np.ndarray], Any]  # (tokens, lengths) -> output with .tokens
  lower: Callable[[np.ndarray, np.ndarray], Any] | None  # AOT lowering; None: not JAX
  info: dict


@dataclasses.dataclass
class HFOutput:
  tokens: np.ndarray  # [B, N]
  num_tokens: np.ndarray  # [B]
  metrics: Any = None


def ar_case(model, params, *, max_new_tokens: int, cache_len: int, label="autoregressive",
            **info) -> Case:
  kw = dict(max_new_tokens=max_new_tokens, cache_len=cache_len)

  def run(tokens, lengths):
    return generate(model, params, tokens, lengths, **kw)

  def lower(tokens, lengths):
    tokens, lengths, _ = check_generation_args(model, tokens, lengths, **kw)
    budgets = budgets_array(max_new_tokens, None, tokens.shape[0])
    return generate_jit.lower(model, params, tokens, lengths, budgets, jnp.int32(NO_EOS),
                               jnp.int32(0), jax.random.key(0), sampling=GREEDY, **kw)

  return Case(label, run, lower, {"method": "autoregressive", "drafter": None, "gamma": None,
                                  **info})


def spec_case(model, params, spec_drafter, draft_params, *, gamma: int, max_new_tokens: int,
              cache_len: int, label: str, verifier=verify, **info) -> Case:
  """info["drafter"] is the row's label for the drafter; spec_drafter is the drafter itself."""
  kw = dict(gamma=gamma, max_new_tokens=max_new_tokens, cache_len=cache_len, verifier=verifier)

  def run(tokens, lengths):
    return speculative_generate(model, params, spec_drafter, draft_params, tokens, lengths, **kw)

  def lower(tokens, lengths):
    program, args = prepare(model, spec_drafter, tokens, lengths, sampling=GREEDY, eos_id=None,
                            key=None, budgets_B=None, pad_id=0, **kw)
    return speculative_jit.lower(program, params, draft_params, *args)

  return Case(label, run, lower, {"method": "speculative", "gamma": gamma, **info})


def _timed(fn) -> tuple[Any, float]:
  start = time.perf_counter()
  out = fn()
  jax.block_until_ready(out)
  return out, time.perf_counter() - start


def compile_case(case: Case, tokens, lengths) -> dict:
  """AOT lowering and compilation of the case's program, each timed; {} for non-JAX cases."""
  if case.lower is None:
    return {"lower_s": None, "compile_s": None, "compile_cached": None}
  start = time.perf_counter()
  lowered = case.lower(tokens, lengths)
  lower_s = time.perf_counter() - start
  start = time.perf_counter()
  lowered.compile()
  compile_s = time.perf_counter() - start
  # an identical program compiled earlier in this process comes back from XLA's cache in
  # microseconds (e.g. scenario 4's stories-shaped model in --quick is scenario 1's)
  return {"lower_s": lower_s, "compile_s": compile_s, "compile_cached": compile_s < 0.01}


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


def warm_up(case: Case, measure_sets, check_sets) -> dict:
  """First run (compile cache hit), then the other prompt sets once: recompilations."""
  first = measure_sets[0]
  _, warmup_s = _timed(lambda: case.run(*first))
  size = jit_cache_size()
  for tokens, lengths in list(check_sets) + list(measure_sets[1:]):
    _timed(lambda: case.run(tokens, lengths))  # other prompts, same padded shape
  return {"warmup_s": warmup_s,
          "recompilations": jit_cache_size() - size if case.lower is not None else None}


def run_group(cases: list[Case], measure_sets, check_sets, plan: "Plan", tag: str,
              extras: dict[str, Callable[[], Any]] | None = None
              ) -> tuple[list[dict], list[list], dict]:
  """Compiles and warms up every case, then times them in interleaved repeats.

  `extras` are warmed-up thunks (e.g. step-cost loops) timed once per repeat round too, so
  drift on a shared machine hits them and the cases alike; group["extras_s"] has medians.
  Returns (records, outputs per case per measure set, group info). A case that fails to
  build or run is dropped from the group with an error record.
  """
  records, live = [], []
  workers = plan.compile_workers
  compiled = compile_all(cases, *measure_sets[0], workers, tag)
  for case, timing in zip(cases, compiled):
    rec = {"label": case.label, **case.info}
    try:
      if isinstance(timing, Exception):
        raise timing
      rec.update(timing, compile_workers=workers if case.lower is not None else None)
      rec.update(warm_up(case, measure_sets, check_sets))
    except Exception as e:  # noqa: BLE001  one broken drafter must not sink the benchmark
      records.append({**rec, "error": f"{type(e).__name__}: {e}"})
      continue
    cached = " (in-process cache hit)" if rec["compile_cached"] else ""
    log(f"[{tag}] {case.label}: compile {_fmt(rec['compile_s'])} s{cached}, warm-up "
        f"{rec['warmup_s']:.3f} s")
    records.append(rec)
    live.append((case, rec))
  times = {id(c): [[] for _ in measure_sets] for c, _ in live}
  outputs = {id(c): [None] * len(measure_sets) for c, _ in live}
  extras = extras or {}
  extra_times = {name: [] for name in extras}
  size = jit_cache_size()
  for _ in range(plan.repeats):
    for case, _ in live:
      for i, (tokens, lengths) in enumerate(measure_sets):
        outputs[id(case)][i], seconds = _timed(lambda: case.run(tokens, lengths))
        times[id(case)][i].append(seconds)
    for name, thunk in extras.items():
      extra_times[name].append(_timed(thunk)[1])
  group = {"recompilations_timed": jit_cache_size() - size,
           "extras_s": {k: float(np.median(v)) for k, v in extra_times.items()}}
  outs = []
  for case, rec in live:
    medians = [float(np.median(t)) for t in times[id(case)]]
    rec["run_s"] = sum(medians)
    rec["run_s_repeats"] = [sum(r) for r in zip(*times[id(case)])]
    rec["run_s_min"] = sum(min(t) for t in times[id(case)])  # least disturbed by other load
    rec["tokens"] = sum(int(np.asarray(o.num_tokens).sum()) for o in outputs[id(case)])
    rec["tokens_per_s"] = rec["tokens"] / rec["run_s"]
    outs.append(outputs[id(case)])
  out_by_label = dict(zip([c.label for c, _ in live], outs))
  return records, [out_by_label.get(r["label"]) for r in records], group


def _fmt(x) -> str:
  return "-" if x is None else f"{x:.2f}"


def same_tokens(outs_a, outs_b) -> bool:
  return all(np.array_equal(np.asarray(a.tokens), np.asarray(b.tokens)) and
             np.array_equal(np.asarray(a.num_tokens), np.asarray(b.num_tokens))
             for a, b in zip(outs_a, outs_b))


def spec_summary(outs) -> dict:
  """Acceptance statistics over all measured prompt sets (metrics summed)."""
  metrics = [o.metrics for o in outs if o.metrics is not None]
  if not metrics:
    return {}
  total = jax.tree.map(lambda *xs: sum(np.asarray(x) for x in xs), *metrics)
  s = summarize(total)
  reached = int(np.asarray(total.position_reached_G).sum())
  return {"mean_accepted": s["mean_accepted"],
          "mean_accepted_with_bonus": s["mean_accepted_with_bonus"],
          "acceptance_rate": s["acceptance_rate"], "accept_hist": s["accept_hist"],
          "position_acceptance": s["position_acceptance"], "rounds": s["rounds"],
          "alpha_measured": (int(np.asarray(total.position_accepted_G).sum()) / reached
                             if reached else None)}


def finish_rows(records, outputs, baseline_label: str, *, lossy: bool = False) -> list[dict]:
  """Adds speed-up vs the baseline row, identity with its output, acceptance statistics."""
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


def drafter_factory():
  """spec_jax.drafters.factory.make_drafter, or None with a note if it is missing."""
  try:
    from spec_jax.drafters.factory import make_drafter
  except ImportError as e:
    log(f"note: spec_jax.drafters.factory unavailable ({e}); only draft_model and prompt_lookup")
    return None
  return make_drafter


def build_drafter(kind: str, target, params, **opts):
  """-> (drafter, draft params), or raises ImportError when the drafter's module is missing."""
  factory = drafter_factory()
  if factory is not None:
    return factory(kind, target, params, **opts)
  if kind == "draft_model":
    from spec_jax.drafters.draft_model import DraftModelDrafter
    return DraftModelDrafter(opts["draft_model"]), opts["draft_params"]
  if kind == "prompt_lookup":
    from spec_jax.drafters.prompt_lookup import PromptLookupDrafter
    return PromptLookupDrafter(opts.get("max_ngram", 3), opts.get("min_ngram") or 1), None
  raise ImportError(f"drafter kind {kind!r} needs spec_jax.drafters.factory")


def prompt_sets(prompts: list[list[int]], batch: int, width: int):
  """(measured set, check set): two batches of different prompts padded to the same width."""
  rows = [prompts[i % len(prompts)] for i in range(batch)]
  other = [prompts[(i + batch) % len(prompts)] if len(prompts) > batch else
           prompts[(i + 1) % len(prompts)] for i in range(batch)]
  return pad_prompts(rows, width=width), pad_prompts(other, width=width)


def pad_width(prompts, minimum: int) -> int:
  longest = max(len(p) for p in prompts)
  return max(minimum, -(-longest // 8) * 8)


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


def scenario_1(plan: Plan, ctx: dict) -> dict:
  path = STORIES / "stories260K.bin"
  if not path.exists():
    return skipped(f"{path} not found (the ../shared folder beside the repository)")
  from spec_jax.models.llama2c import load_llama2c
  from spec_jax.models.tokenizer import load_tokenizer
  model, params = to_layout(*load_llama2c(str(path)), plan.layout)
  tokenizer = load_tokenizer(str(STORIES / "tok512.bin"))
  prompts = [tokenizer.encode(t, add_bos=True) for t in STORY_TEXTS]
  width = pad_width(prompts, plan.prompt_width)
  cache_len = width + plan.s1_new + max(plan.s1_gammas) + 1
  drafters, notes = [], []
  for label, kind, opts in stories_drafters(model, params):
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
    records, outs, group = run_group(cases, [measured], [check], plan, f"S1 b{batch}")
    rows += finish_rows(records, outs, "autoregressive")
    groups.append({"batch": batch, **group})
  return {"name": NAMES["1"], "status": "ok",
          "model": "stories260K", "params": param_count(params), "max_new_tokens": plan.s1_new,
          "prompt_width": width, "cache_len": cache_len, "rows": rows, "groups": groups,
          "notes": notes}


def skipped(note: str) -> dict:
  log(f"  skipped: {note}")
  return {"status": "skipped", "note": note, "rows": [], "notes": [note]}


# ---- scenario 2: the built-in pair ------------------------------------------------------------

def scenario_2(plan: Plan, ctx: dict) -> dict:
  try:
    from spec_jax.models.builtin import load_builtin
  except ImportError as e:
    return skipped(f"spec_jax.models.builtin is not there yet ({e})")
  try:
    target, params, draft, draft_params, tokenizer = load_builtin()
  except Exception as e:  # noqa: BLE001  e.g. the checkpoint is still being trained
    return skipped(f"load_builtin() failed: {type(e).__name__}: {e}")
  target, params = to_layout(target, params, plan.layout)
  draft, draft_params = to_layout(draft, draft_params, plan.layout)
  bos = tokenizer.bos_id is not None
  prompts = [tokenizer.encode(p, add_bos=bos) for p in CODE_PROMPTS[:plan.s2_prompts]]
  width = pad_width(prompts, plan.prompt_width)
  pl_gamma = 4 if 4 in plan.s2_gammas else plan.s2_gammas[-1]
  extra = max(plan.s2_gammas) + 1
  new = max(1, min(plan.s2_new, target.max_seq_len - width - extra,
                   draft.max_seq_len - width - extra))
  cache_len = width + new + extra
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
  notes = []
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
  except ImportError as e:
    notes.append(f"skipped prompt lookup: {e}")
  records, outs, group = run_group(cases, measure_sets, check_sets, plan, "S2")
  return {"name": NAMES["2"], "status": "ok",
          "prompts": CODE_PROMPTS[:plan.s2_prompts], "max_new_tokens": new,
          "target_params": param_count(params), "draft_params": param_count(draft_params),
          "rows": finish_rows(records, outs, "autoregressive"), "groups": [group], "notes": notes}


# ---- step costs: small jitted loops of apply -------------------------------------------------

@functools.partial(jax.jit, static_argnames=("model", "steps"))
def _apply_loop(model, params, cache, tokens_BT, positions_BT, steps: int):
  """`steps` forward passes, each fed the previous pass's argmax (a true dependency)."""
  def body(_, carry):
    cache, tokens_BT = carry
    logits_BTV, _, cache = model.apply(params, tokens_BT, positions_BT, cache)
    return cache, jnp.argmax(logits_BTV, axis=-1).astype(jnp.int32)
  return jax.lax.fori_loop(0, steps, body, (cache, tokens_BT))[1]


def step_loop(model, params, *, tokens: int, cache_len: int, position: int,
              steps: int) -> tuple[Callable[[], Any], dict]:
  """A compiled, warmed-up thunk running `steps` forward passes over `tokens` tokens (batch 1)
  at a given position, and its info (compile_s, steps, tokens). Per step: time / steps."""
  cache = model.init_cache(1, cache_len)
  tokens_BT = jnp.ones((1, tokens), jnp.int32)
  positions_BT = position + jnp.arange(tokens, dtype=jnp.int32)[None, :]
  args = (model, params, cache, tokens_BT, positions_BT)
  start = time.perf_counter()
  compiled = _apply_loop.lower(*args, steps=steps).compile()
  info = {"compile_s": time.perf_counter() - start, "steps": steps, "tokens": tokens}
  thunk = lambda: compiled(*args[1:])  # noqa: E731
  _timed(thunk)
  return thunk, info


def weight_matmuls(model, params) -> list[tuple[jax.Array, int]]:
  """Every weight matrix one decoding step multiplies a token by, with its contracting axis:
  the 2-D kernels (`kernel` [in, out] -> 0, `kernel_OI` [out, in] -> 1) and the head (the
  embedding table [V, D] when tied; an untied table is only gathered from)."""
  matmuls = []
  for path, leaf in jax.tree_util.tree_flatten_with_path(params)[0]:
    name = jax.tree_util.keystr(path)
    if getattr(leaf, "ndim", 0) != 2:
      continue
    if name.startswith("['embed']"):
      if model.config.tie_embeddings:
        matmuls.append((leaf, 1))
      continue
    matmuls.append((leaf, 1 if "kernel_OI" in name else 0))
  return matmuls


@functools.partial(jax.jit, static_argnames=("axes", "steps"))
def _matmul_chain(weights, x_N, axes: tuple[int, ...], steps: int):
  """`steps` rounds of one-row products with each weight in turn, each fed the one before."""
  def body(_, x_N):
    for w, k in zip(weights, axes):
      y_1O = jax.lax.dot_general(x_N[None, :w.shape[k]], w, (((1,), (k,)), ((), ())))
      x_N = x_N.at[:y_1O.shape[1]].add(1e-3 * y_1O[0])
    return x_N
  return jax.lax.fori_loop(0, steps, body, x_N)


def chain_thunk(weights: list[jax.Array], axes: tuple[int, ...], steps: int
                ) -> Callable[[], Any]:
  """A compiled, warmed-up thunk of `_matmul_chain` over these weights. Per round: / steps."""
  x_N = jnp.zeros((max(max(w.shape) for w in weights),), weights[0].dtype)
  compiled = _matmul_chain.lower(weights, x_N, axes=axes, steps=steps).compile()
  thunk = functools.partial(compiled, weights, x_N)
  _timed(thunk)
  return thunk


def matmul_chain_loop(model, params, steps: int) -> Callable[[], Any]:
  """A warmed-up thunk running only the step's weight matmuls (one token, same shapes, same
  order of magnitude of launches) `steps` times: the fastest a step built from these separate
  XLA matmuls can be on this backend, whatever it does between them. Per step: time / steps."""
  matmuls = weight_matmuls(model, params)
  return chain_thunk([w for w, _ in matmuls], tuple(k for _, k in matmuls), steps)


def matmul_count_sweep(plan: Plan, dtype) -> dict:
  """One-row products over the same `plan.sweep_bytes` of weights split into `count` equal
  [512, M] matrices, chained, for each count, timed interleaved (seconds per round): how
  much a step pays per matmul on this backend, apart from the bytes it streams."""
  k, itemsize = 512, jnp.dtype(dtype).itemsize
  thunks = {}
  for count in plan.sweep_counts:
    m = max(1, plan.sweep_bytes // itemsize // k // count)
    weights = [jnp.full((k, m), 1e-3, dtype) for _ in range(count)]  # separate buffers
    thunks[count] = chain_thunk(weights, (0,) * count, plan.loop_steps)
  t = interleaved_medians(thunks, plan.repeats)
  counts = list(plan.sweep_counts)
  per_round = [t[c] / plan.loop_steps for c in counts]
  return {"bytes": plan.sweep_bytes, "counts": counts, "s_per_round": per_round,
          "per_matmul_s": float(np.polyfit(counts, per_round, 1)[0])}  # least-squares slope


@jax.jit
def _matvec(x_N, w_NM):
  return x_N @ w_NM


def matvec_over(nbytes: int, dtype) -> tuple[Callable[[], Any], list[int]]:
  """A thunk multiplying a vector by one [1024, M] matrix of `nbytes` (and that shape)."""
  n = 1024
  m = max(1, nbytes // jnp.dtype(dtype).itemsize // n)
  w_NM = jnp.ones((n, m), dtype) * 1e-3
  x_N = jnp.ones((n,), dtype)
  return (lambda: _matvec(x_N, w_NM)), [n, m]


def interleaved_medians(thunks: dict[str, Callable[[], Any]], repeats: int) -> dict[str, float]:
  """Median seconds of each (warmed-up) thunk, timed in interleaved rounds."""
  times = {name: [] for name in thunks}
  for _ in range(max(repeats, 5)):
    for name, thunk in thunks.items():
      times[name].append(_timed(thunk)[1])
  return {name: float(np.median(t)) for name, t in times.items()}


def memory_bound_pair(plan: Plan, ctx: dict):
  """The ~300M target and its small draft (shared by scenarios 3 and 5)."""
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
  """The target's one-token step loop (compiled once, shared by scenarios 3 and 5)."""
  if "target_step" not in ctx:
    (target, params), _ = memory_bound_pair(plan, ctx)
    _, cache_len, position = s3_geometry(plan)
    ctx["target_step"] = step_loop(target, params, tokens=1, cache_len=cache_len,
                                   position=position, steps=plan.loop_steps)
  return ctx["target_step"]


# ---- scenario 3: memory-bound target, synthetic acceptance -------------------------------------

def scenario_3(plan: Plan, ctx: dict) -> dict:
  from spec_jax.drafters.synthetic import (expected_tokens_per_round, predicted_speedup,
                                          synthetic_pair)
  (target, params), (draft, draft_params) = memory_bound_pair(plan, ctx)
  width, cache_len, position = s3_geometry(plan)
  rng = np.random.default_rng(0)
  prompt = rng.integers(1, target.vocab_size, width).tolist()
  other = rng.integers(1, target.vocab_size, width - 3).tolist()
  measured, check = pad_prompts([prompt], width=width), pad_prompts([other], width=width)
  common = dict(max_new_tokens=plan.s3_new, cache_len=cache_len, batch=1)
  cases = [ar_case(target, params, **common)]
  for alpha in plan.s3_alphas:
    for g in plan.s3_gammas:
      drafter, verifier = synthetic_pair(draft, alpha)
      cases.append(spec_case(target, params, drafter, draft_params, gamma=g, verifier=verifier,
                             label=f"synthetic alpha {alpha}, gamma {g}",
                             drafter=f"synthetic alpha {alpha} (LOSSY)", kind="synthetic",
                             alpha=alpha, **common))
  log("[S3] compiling the step-cost loops (jitted loops of apply) ...")
  loop = dict(cache_len=cache_len, position=position, steps=plan.loop_steps)
  loops = {"target_step": target_step_loop(plan, ctx),
           "draft_step": step_loop(draft, draft_params, tokens=1, **loop)}
  loops.update({f"verify_{g}": step_loop(target, params, tokens=g + 1, **loop)
                for g in plan.s3_gammas})
  records, outs, group = run_group(cases, [measured], [check], plan, "S3",
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
  return {"name": NAMES["3"],
          "status": "ok", "target_params": param_count(params),
          "draft_params": param_count(draft_params), "target_config": plan.s3_target,
          "draft_config": plan.s3_draft, "max_new_tokens": plan.s3_new, "cache_len": cache_len,
          "costs": costs, "rows": rows, "groups": [group],
          "notes": ["synthetic rows are lossy by design (coin acceptance): identical is null",
                    "predicted = E(alpha_measured) * t_target / (gamma * t_draft + t_verify)"]}


# ---- scenario 4: HF transformers ---------------------------------------------------------------

def hf_case(hf_model, label: str, gen_kwargs: dict, max_new: int, **info) -> Case:
  import torch

  def run(tokens, lengths):
    ids = torch.as_tensor(np.asarray(tokens)[:, :int(lengths[0])], dtype=torch.long)
    with torch.inference_mode():
      out = hf_model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new,
                              min_new_tokens=max_new, do_sample=False, pad_token_id=0,
                              eos_token_id=None, **gen_kwargs)
    new = out[:, ids.shape[1]:].numpy().astype(np.int32)
    return HFOutput(new, np.array([new.shape[1]], np.int32))

  return Case(label, run, None, {"engine": "hf", **info})


def to_hf(model, params, folder: str):
  import torch
  import transformers
  from spec_jax.models.hf import save_hf
  save_hf(folder, model, params)
  hf = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32,
                                                         attn_implementation="sdpa")
  hf.eval()
  hf.generation_config.eos_token_id = None
  hf.generation_config.pad_token_id = 0
  return hf


def step_bound(model, params, plan: Plan, *, cache_len: int, position: int) -> dict:
  """Our one-token step next to its weight matmuls alone and one matvec over the same bytes,
  timed interleaved (seconds per step): how close a step is to what this backend allows."""
  matmuls = weight_matmuls(model, params)
  streamed = sum(w.nbytes for w, _ in matmuls)
  matvec, _ = matvec_over(streamed, matmuls[0][0].dtype)
  step, _ = step_loop(model, params, tokens=1, cache_len=cache_len, position=position,
                      steps=plan.loop_steps)
  thunks = {"step_s": step, "matmul_chain_s": matmul_chain_loop(model, params, plan.loop_steps),
            "matvec_s": matvec}
  _timed(matvec)
  t = interleaved_medians(thunks, plan.repeats)
  per_step = {"step_s": plan.loop_steps, "matmul_chain_s": plan.loop_steps, "matvec_s": 1}
  return {"matmuls": len(matmuls), "streamed_bytes": streamed,
          **{k: v / per_step[k] for k, v in t.items()}}


def s4_model(name: str, plan: Plan, tmp: str) -> dict:
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
  records, outs, group = run_group(cases, [measured], [check], plan, f"S4 {name}")
  by = {r["label"]: (r, o) for r, o in zip(records, outs)}
  bound = step_bound(target, params, plan, cache_len=cache_len, position=width + new // 2)
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


def scenario_4(plan: Plan, ctx: dict) -> dict:
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
      result = s4_model(name, plan, tmp)
      rows += result.pop("rows")
      models.append(result)
  return {"name": NAMES["4"],
          "status": "ok", "models": models, "rows": rows, "target_ratio": 3.0,
          "groups": [m["group"] for m in models],
          "notes": ["HF: generate(); assistant with num_assistant_tokens fixed "
                    "(schedule 'constant', assistant_confidence_threshold 0); prompt lookup with "
                    "max_matching_ngram_size 3; ours: prompt lookup n 3..1",
                    f"torch threads: {torch.get_num_threads()}"]}


# ---- scenario 5: roofline ----------------------------------------------------------------------

@jax.jit
def _tree_sum(params):
  return sum(jnp.sum(x) for x in jax.tree.leaves(params))


def scenario_5(plan: Plan, ctx: dict) -> dict:
  (target, params), _ = memory_bound_pair(plan, ctx)
  nbytes = param_bytes(params)
  matvec, matvec_shape = matvec_over(nbytes, plan.s3_dtype)
  step_thunk, step_info = target_step_loop(plan, ctx)
  thunks = {"matvec": matvec, "tree_sum": lambda: _tree_sum(params),
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
    _timed(thunk)  # compile, warm up
  t = interleaved_medians(thunks, plan.repeats)
  del thunks, matvec
  sweep = matmul_count_sweep(plan, plan.s3_dtype)
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
  return {"name": NAMES["5"],
          "status": "ok", "rows": [], "param_bytes": nbytes, "params": param_count(params),
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


NAMES = {"1": "stories260K: autoregressive vs every drafter (greedy)",
         "2": "built-in pair on code prompts (greedy, batch 1 per prompt)",
         "3": "memory-bound random target, synthetic acceptance (LOSSY, engine only)",
         "4": "against HF transformers (PyTorch CPU, float32, sdpa), greedy, batch 1",
         "5": "roofline: stream the target's weights once vs one autoregressive step"}
SCENARIOS = {"1": scenario_1, "2": scenario_2, "3": scenario_3, "4": scenario_4, "5": scenario_5}


# ---- reports -----------------------------------------------------------------------------------

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


def _cell(v) -> str:
  if v is None:
    return "-"
  if isinstance(v, bool):
    return "yes" if v else "**NO**"
  if isinstance(v, float):
    return f"{v:.3g}" if abs(v) < 1000 else f"{v:.0f}"
  return str(v)


def md_table(rows: list[dict], cols: list[tuple[str, str]]) -> list[str]:
  lines = ["| " + " | ".join(h for h, _ in cols) + " |", "|" + "---|" * len(cols)]
  for r in rows:
    if "error" in r:
      lines.append(f"| {r['label']} | ERROR: {r['error'][:120]} |" + " |" * (len(cols) - 2))
      continue
    cells = ["cached" if k == "compile_s" and r.get("compile_cached") else _cell(r.get(k))
             for _, k in cols]
    lines.append("| " + " | ".join(cells) + " |")
  return lines


ROW_COLS = [("row", "label"), ("batch", "batch"), ("tok/s", "tokens_per_s"),
            ("speed-up", "speedup"), ("run s", "run_s"), ("compile s", "compile_s"),
            ("accepted", "mean_accepted"), ("+bonus", "mean_accepted_with_bonus"),
            ("accept rate", "acceptance_rate"), ("identical", "identical"),
            ("recompiles", "recompilations")]
S3_COLS = [("row", "label"), ("tok/s", "tokens_per_s"), ("speed-up", "speedup"),
           ("predicted", "predicted_speedup"), ("efficiency", "engine_efficiency"),
           ("alpha measured", "alpha_measured"), ("E tokens/round", "expected_tokens_per_round"),
           ("+bonus measured", "mean_accepted_with_bonus"), ("compile s", "compile_s"),
           ("recompiles", "recompilations")]
S4_COLS = [("model", "model"), ("row", "label"), ("tok/s", "tokens_per_s"),
           ("speed-up (same engine)", "speedup"), ("ours/HF", "ours_over_hf"),
           ("identical to HF", "identical_to_hf"), ("identical to own AR", "identical"),
           ("compile s", "compile_s"), ("accepted", "mean_accepted")]


def markdown(results: dict) -> str:
  m = results["machine"]
  lines = ["# spec_jax benchmark", "",
           f"{m['date']} · {m['cpu_model']} · {m['cpu_count']} cores · jax {m['jax']} "
           f"({m['jax_backend']}: {', '.join(m['jax_devices'])}) · {m['dtype']} · "
           f"{'quick' if results['config']['quick'] else 'full'} mode, "
           f"{results['config']['repeats']} repeats (medians)", "",
           f"Load average at start {m['load_average_start']}, at end "
           f"{results.get('load_average_end')}. {m['note']}.", "",
           f"Recompilations after warm-up: **{results['recompilations']}**; compiled programs: "
           f"{results['compile_counts']}.", ""]
  for key, s in results["scenarios"].items():
    lines += [f"## Scenario {key}: {s.get('name', '')}", ""]
    if s["status"] != "ok":
      lines += [f"*{s['status']}*: {s.get('note', '')}", ""]
      continue
    if key == "3":
      c = s["costs"]
      lines += [f"Target {s['target_params'] / 1e6:.1f} M params, draft "
                f"{s['draft_params'] / 1e6:.2f} M. Step costs: target "
                f"{c['target_step']['step_s'] * 1e3:.2f} ms, draft "
                f"{c['draft_step']['step_s'] * 1e3:.2f} ms, verify "
                + ", ".join(f"gamma {k.split('_')[1]}: {v['step_s'] * 1e3:.2f} ms"
                            for k, v in c.items() if k.startswith("verify_")), ""]
      lines += md_table(s["rows"], S3_COLS)
    elif key == "4":
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
      lines += [""] + md_table(s["rows"], S4_COLS)
    elif key == "5":
      r = s["roofline"]
      lines += [f"Weights {s['param_bytes'] / 2**20:.0f} MiB. Stream once: matvec "
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
                f"{r['matmul_count_sweep']['bytes'] / 2**20:.0f} MiB as "
                + ", ".join(f"{c} matmuls {v * 1e3:.2f} ms" for c, v in zip(
                    r["matmul_count_sweep"]["counts"], r["matmul_count_sweep"]["s_per_round"]))
                + f": **{r['matmul_count_sweep']['per_matmul_s'] * 1e6:.0f} us per matmul**."]
    else:
      lines += md_table(s["rows"], ROW_COLS)
    lines += [""] + [f"- {n}" for n in s.get("notes", [])] + [""]
  lines += ["## Plots", "", "![speed-up vs gamma](speedup_vs_gamma.png)", "",
            "![accepted lengths](accepted_lengths.png)", ""]
  return "\n".join(lines)


def _ratios(d: dict) -> str:
  return ", ".join(f"{k} {_cell(v)}x" for k, v in d.items())


def plot_groups(results: dict) -> list[tuple[str, list[dict]]]:
  """(title, speculative rows) per panel: scenario 1 per batch, 2, 3."""
  panels = []
  scen = results["scenarios"]
  for key in ("1", "2", "3"):
    s = scen.get(key, {})
    rows = [r for r in s.get("rows", []) if r.get("method") == "speculative" and "speedup" in r]
    for batch in sorted({r["batch"] for r in rows}):
      panels.append((f"S{key} batch {batch}", [r for r in rows if r["batch"] == batch]))
  return panels


def plot_speedup(results: dict, path: Path) -> None:
  import matplotlib.pyplot as plt
  panels = plot_groups(results)
  fig, axes = plt.subplots(1, max(1, len(panels)), figsize=(5 * max(1, len(panels)), 4),
                           squeeze=False)
  for ax, (title, rows) in zip(axes[0], panels):
    for name in dict.fromkeys(r["drafter"] for r in rows):
      pts = sorted((r["gamma"], r["speedup"], r.get("predicted_speedup")) for r in rows
                   if r["drafter"] == name)
      line, = ax.plot([p[0] for p in pts], [p[1] for p in pts], "o-", label=name)
      if all(p[2] is not None for p in pts):
        ax.plot([p[0] for p in pts], [p[2] for p in pts], "x--", color=line.get_color(),
                label=f"{name}: predicted")
    ax.axhline(1.0, color="gray", lw=0.8)
    ax.set(title=title, xlabel="gamma", ylabel="speed-up vs autoregressive")
    ax.legend(fontsize=6)
  if not panels:
    axes[0][0].text(0.5, 0.5, "no speculative rows", ha="center")
  fig.tight_layout()
  fig.savefig(path, dpi=100)
  plt.close(fig)


def plot_accepted(results: dict, path: Path) -> None:
  import matplotlib.pyplot as plt
  panels = plot_groups(results)
  fig, axes = plt.subplots(1, max(1, len(panels)), figsize=(5 * max(1, len(panels)), 4),
                           squeeze=False)
  for ax, (title, rows) in zip(axes[0], panels):
    gamma = max(r["gamma"] for r in rows)
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
  if not panels:
    axes[0][0].text(0.5, 0.5, "no speculative rows", ha="center")
  fig.tight_layout()
  fig.savefig(path, dpi=100)
  plt.close(fig)


def write_reports(results: dict, json_path: Path) -> None:
  import matplotlib
  matplotlib.use("Agg")
  folder = json_path.parent
  folder.mkdir(parents=True, exist_ok=True)
  json_path.write_text(json.dumps(clean_json(results), indent=2, allow_nan=False))
  plot_speedup(results, folder / "speedup_vs_gamma.png")
  plot_accepted(results, folder / "accepted_lengths.png")
  (folder / "results.md").write_text(markdown(clean_json(results)))


# ---- main --------------------------------------------------------------------------------------

def parse_args(argv=None) -> argparse.Namespace:
  p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  p.add_argument("--out", default="runs/bench",
                 help="a folder, or DIR/results.json; results.md and PNGs go beside it")
  p.add_argument("--scenarios", default="1,2,3,4,5", help="comma-separated, e.g. 1,3")
  p.add_argument("--quick", action="store_true", help="tiny sizes (the test suite's run)")
  p.add_argument("--repeats", type=int, default=None, help="timed repeats (default 5; quick 3)")
  p.add_argument("--layout", default=None, choices=tuple(LAYOUTS),
                 help="params layout of our models (spec_jax.models.llama.LAYOUTS; default fused)")
  p.add_argument("--dtype", default=None, choices=("float32", "bfloat16"),
                 help="dtype of the scenario 3/5 models (default float32; use bfloat16 on GPU/TPU)")
  p.add_argument("--target-size", default=None, choices=sorted(TARGET_SIZES),
                 help="scenario 3/5 target shape (default 300M; 1B/3B for accelerators)")
  p.add_argument("--compile-workers", type=int, default=None,
                 help="programs compiled at once (default 1; quick 2, whose compile_s are then "
                      "contended wall times)")
  args = p.parse_args(argv)
  args.scenarios = [s.strip() for s in args.scenarios.split(",") if s.strip()]
  unknown = [s for s in args.scenarios if s not in SCENARIOS]
  if unknown:
    p.error(f"unknown scenarios {unknown}; choose from {sorted(SCENARIOS)}")
  return args


def json_path_of(out: str) -> Path:
  path = Path(out)
  return path if path.suffix == ".json" else path / "results.json"


def main(argv=None) -> int:
  args = parse_args(argv)
  plan = QUICK if args.quick else Plan()
  if args.repeats is not None:
    plan = dataclasses.replace(plan, repeats=max(1, args.repeats))
  if args.compile_workers is not None:
    plan = dataclasses.replace(plan, compile_workers=max(1, args.compile_workers))
  if args.layout is not None:
    plan = dataclasses.replace(plan, layout=args.layout)
  if args.dtype is not None:
    plan = dataclasses.replace(plan, s3_dtype=args.dtype)
  if args.target_size is not None:
    plan = dataclasses.replace(plan, s3_target=TARGET_SIZES[args.target_size])
  start = time.perf_counter()
  results = {"machine": describe_machine(),
             "config": {"quick": args.quick, "repeats": plan.repeats, "scenarios": args.scenarios,
                        "plan": dataclasses.asdict(plan), "sampling": "greedy",
                        "eos": "none (every row generates max_new_tokens)"},
             "scenarios": {}}
  ctx, failed = {}, []
  for key in args.scenarios:
    log(f"== scenario {key} ==")
    t0 = time.perf_counter()
    try:
      result = SCENARIOS[key](plan, ctx)
    except Exception as e:  # noqa: BLE001  report it, run the others
      traceback.print_exc()
      result = {"status": "error", "note": f"{type(e).__name__}: {e}", "rows": [], "notes": []}
      failed.append(key)
    result.setdefault("name", NAMES[key])
    result["wall_s"] = time.perf_counter() - t0
    results["scenarios"][key] = result
  rows = [r for s in results["scenarios"].values() for r in s.get("rows", [])]
  results["errors"] = [f"{r['label']}: {r['error']}" for r in rows if "error" in r]
  results["recompilations"] = (
      sum(r.get("recompilations") or 0 for r in rows) +
      sum(g.get("recompilations_timed", 0) for s in results["scenarios"].values()
          for g in s.get("groups", [])))
  results["compile_counts"] = {"generate_jit": generate_jit._cache_size(),
                               "speculative_jit": speculative_jit._cache_size()}
  results["load_average_end"] = list(os.getloadavg())
  results["wall_s"] = time.perf_counter() - start
  path = json_path_of(args.out)
  write_reports(results, path)
  log(f"wrote {path}, {path.parent / 'results.md'} and plots in {results['wall_s']:.0f} s")
  for e in results["errors"]:
    log(f"ERROR {e}")
  return 1 if failed else 0


if __name__ == "__main__":
  sys.exit(main())
