"""The benchmark harness (spec_jax.bench), scripts/benchmark.py --quick end to end, and the
synthetic (engine-only) drafter's pieces."""

from __future__ import annotations

import json
import subprocess
import sys
import warnings
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from spec_jax.bench import (CompileCounter, Scenario, random_model, run_scenarios, skipped,
                            weight_matmuls)
from spec_jax.core.sampling import SamplingConfig
from spec_jax.drafters.synthetic import (CoinVerifier, expected_tokens_per_round,
                                         predicted_speedup)

REPO = Path(__file__).resolve().parents[1]
TIMEOUT_S = 600  # ~60 s on a quiet 2-core machine; far more under many pytest-xdist workers
ROW_FIELDS = ("label", "method", "tokens_per_s", "speedup", "compile_s", "run_s", "warmup_s",
              "identical", "recompilations")
SPEC_FIELDS = ("mean_accepted", "mean_accepted_with_bonus", "acceptance_rate", "accept_hist")
S3_FIELDS = ("alpha", "alpha_measured", "expected_tokens_per_round", "predicted_speedup",
             "engine_efficiency", "t_target_s", "t_draft_s", "t_verify_s")


def _strict_json(text: str):
  def reject(constant):
    raise ValueError(f"non-standard JSON constant {constant}")
  return json.loads(text, parse_constant=reject)


@pytest.fixture(scope="module")
def quick_run(tmp_path_factory):
  out = tmp_path_factory.mktemp("bench")
  proc = subprocess.run([sys.executable, "scripts/benchmark.py", "--quick", "--out", str(out)],
                        cwd=REPO, capture_output=True, text=True, timeout=TIMEOUT_S)
  assert proc.returncode == 0, f"stdout:\n{proc.stdout[-4000:]}\nstderr:\n{proc.stderr[-4000:]}"
  return out, _strict_json((out / "results.json").read_text()), proc.stdout


def _ok_rows(scenario: dict) -> list[dict]:
  return [r for r in scenario["rows"] if "error" not in r]


def _check_rows(rows: list[dict]):
  for row in rows:
    for field in ROW_FIELDS:
      assert field in row, f"{row['label']}: no {field}"
    assert row["tokens_per_s"] > 0 and row["run_s"] > 0 and row["speedup"] > 0, row["label"]
    if row.get("engine") == "hf":
      continue  # eager PyTorch: no compile, no acceptance statistics
    assert row["compile_s"] > 0 and row["recompilations"] == 0, row["label"]
    if row["method"] == "speculative":
      for field in SPEC_FIELDS:
        assert field in row, f"{row['label']}: no {field}"


@pytest.mark.slow
def test_quick_benchmark_writes_json_markdown_and_plots(quick_run):
  out, data, stdout = quick_run
  machine = data["machine"]
  for field in ("cpu_model", "cpu_count", "jax", "jax_backend", "jax_devices", "dtype", "date"):
    assert machine[field], field
  assert data["config"]["quick"] is True
  assert set(data["scenarios"]) == {"1", "2", "3", "4", "5"}
  assert data["recompilations"] == 0
  for key, scenario in data["scenarios"].items():
    assert scenario["status"] in ("ok", "skipped"), (key, scenario.get("note"))
    if scenario["status"] == "skipped":
      assert scenario["note"], key
      assert key in ("1", "2", "4"), f"scenario {key} needs nothing optional; it must run"
      continue
    _check_rows(_ok_rows(scenario))
  if data["errors"]:  # a broken drafter is its own tests' business; say so, don't hide it
    warnings.warn(f"benchmark rows that failed: {data['errors']}")
  for name in ("results.md", "speedup_vs_gamma.png", "accepted_lengths.png"):
    assert (out / name).stat().st_size > 0, name
  assert (out / "results.md").read_text().startswith("# spec_jax benchmark")


@pytest.mark.slow
def test_quick_benchmark_scenario_contents(quick_run):
  _, data, _ = quick_run
  s = data["scenarios"]
  if s["1"]["status"] == "ok":
    rows = _ok_rows(s["1"])
    assert any(r["method"] == "speculative" for r in rows)
    assert all(r["identical"] is True for r in rows), "greedy speculative must equal autoregressive"
    sanity = [r for r in rows if "target itself" in r["label"]]
    assert all(r["acceptance_rate"] == 1.0 for r in sanity)
    auto = [r for r in rows if r["gamma"] == "auto"]  # the quick plan: prompt lookup's
    assert len(auto) == 1 and auto[0]["speedup"] > 0
    # what the start-up table decided, recorded with the row
    assert isinstance(auto[0]["drafts_never"], bool) and auto[0]["check_every"] >= 1
  spec = [r for r in _ok_rows(s["3"]) if r["method"] == "speculative"]
  assert spec
  for row in spec:
    for field in S3_FIELDS:
      assert row[field] is not None, field
    assert row["identical"] is None  # lossy by design
  assert s["3"]["costs"]["target_step"]["step_s"] > 0
  roofline = s["5"]["roofline"]
  assert roofline["ratio"] > 0 and isinstance(roofline["meets_target"], bool)
  from spec_jax.models.params_io import LAYOUTS
  assert set(roofline["layouts"]) == set(LAYOUTS)  # every params layout, side by side
  for layout in roofline["layouts"].values():
    assert layout["step_s"] > 0 and layout["pass_5_tokens_s"] > 0 and layout["ratio"] > 0
  assert roofline["step_s"] == min(v["step_s"] for v in roofline["layouts"].values())
  # the step's weight matmuls alone: a step also runs attention, norms and the cache update
  assert 0 < roofline["matmul_chain_s"] and roofline["step_over_chain"] > 0
  sweep = roofline["matmul_count_sweep"]  # the same bytes as more, smaller matmuls
  assert sweep["counts"] == [1, 4] and len(sweep["s_per_round"]) == 2
  assert all(t > 0 for t in sweep["s_per_round"]) and isinstance(sweep["per_matmul_s"], float)
  if s["4"]["status"] == "ok":
    for model in s["4"]["models"]:
      assert set(model["ours_over_hf"]) == {"plain", "draft_model", "prompt_lookup"}
      assert all(v is True for v in model["identical_to_hf"].values()), model["identical_to_hf"]
      bound = model["bound"]
      assert bound["matmuls"] == 5 * 4 + 1  # stories-shaped, fused: 4 per layer and the head
      for field in ("step_s", "matmul_chain_s", "matvec_s", "hf_plain_s_per_token",
                    "hf_over_matmul_chain"):
        assert bound[field] > 0, field


def test_coin_verifier_keeps_a_truncated_geometric_prefix():
  alpha, gamma, batch = 0.7, 4, 20000
  drafts = jnp.zeros((batch, gamma), jnp.int32)
  logits = jax.random.normal(jax.random.key(1), (batch, gamma + 1, 11))
  n, nxt = CoinVerifier(alpha)(drafts, None, logits, SamplingConfig(), jax.random.key(0))
  n = np.asarray(n)
  freq = np.bincount(n, minlength=gamma + 1) / batch
  want = np.array([alpha ** k * (1 - alpha) for k in range(gamma)] + [alpha ** gamma])
  np.testing.assert_allclose(freq, want, atol=0.015)
  np.testing.assert_allclose(n.mean() + 1, expected_tokens_per_round(alpha, gamma), atol=0.03)
  argmax = np.asarray(jnp.argmax(logits, -1))
  np.testing.assert_array_equal(np.asarray(nxt), argmax[np.arange(batch), n])


def test_predicted_speedup_formula():
  assert expected_tokens_per_round(1.0, 3) == 4.0
  assert expected_tokens_per_round(0.0, 3) == 1.0
  # free drafts and a verify as cheap as a step: the speed-up is E itself
  assert predicted_speedup(0.5, 2, 1.0, 0.0, 1.0) == pytest.approx(1.75)
  with pytest.raises(ValueError):
    CoinVerifier(1.5)


@pytest.mark.parametrize("layout", ["checkpoint", "fused", "fused_out_in"])
@pytest.mark.parametrize("tied", [True, False])
def test_weight_matmuls_are_the_steps_products(layout, tied):
  """The roofline's matmul chain multiplies exactly what a step does: every projection (in
  its layout's orientation) and the head, not the gathered-from embedding table."""
  from spec_jax.models.llama import LAYOUTS
  vocab, dim, hidden, layers = 100, 32, 48, 2
  model, params = random_model(0, vocab_size=vocab, dim=dim, n_layers=layers, n_heads=4,
                               n_kv_heads=2, hidden_dim=hidden, tie_embeddings=tied,
                               **LAYOUTS[layout])
  matmuls = weight_matmuls(model, params)
  per_layer = 7 if layout == "checkpoint" else 4
  assert len(matmuls) == layers * per_layer + 1
  assert all(w.shape[k] in (dim, hidden) for w, k in matmuls)  # contracts a token's features
  assert sum(w.shape[1 - k] == vocab for w, k in matmuls) == 1  # one head, over the vocabulary
  embed_bytes = 0 if tied else vocab * dim * 4  # an untied table is only gathered from
  want = sum(x.nbytes for x in jax.tree.leaves(params) if x.ndim == 2) - embed_bytes
  assert sum(w.nbytes for w, _ in matmuls) == want


def test_compile_counter_counts_a_compile_not_a_cache_hit():
  @jax.jit
  def double_plus_one(x_N):
    return 2 * x_N + 1

  x3, x4 = jnp.ones(3), jnp.ones(4)  # made outside: eager ops on new shapes compile too
  with CompileCounter() as counter:
    double_plus_one(x3).block_until_ready()
    assert counter.count("double_plus_one") == 1 == counter.count("jit(double_plus_one)")
    double_plus_one(x3 + 0).block_until_ready()  # same shape: jit's cache
    assert counter.count("double_plus_one") == 1
    double_plus_one.lower(x4).compile()  # a new shape, compiled ahead of time
    double_plus_one(x4).block_until_ready()  # runs that program
    assert counter.count("double_plus_one") == 2
    assert counter.by_name()["double_plus_one"] == 2
  double_plus_one(jnp.ones(5)).block_until_ready()
  assert counter.count("double_plus_one") == 2  # stopped: no longer listening


def test_results_json_is_written_after_each_scenario(tmp_path):
  """A crash in a later scenario keeps the earlier scenarios' results on disk."""
  path = tmp_path / "results.json"
  seen = []

  def first(plan, ctx):
    ctx["shared"] = 1
    return {"status": "ok", "rows": [{"label": "a", "method": "autoregressive"}]}

  def second(plan, ctx):
    seen.append(_strict_json(path.read_text()))  # what was on disk when this one started
    assert ctx["shared"] == 1
    raise RuntimeError("boom")

  results = {"scenarios": {}}
  failed = run_scenarios({"a": Scenario("first", first), "b": Scenario("second", second),
                          "c": Scenario("third", lambda plan, ctx: skipped("nothing here"))},
                         None, results, path)
  assert failed == ["b"]
  assert list(seen[0]["scenarios"]) == ["a"] and seen[0]["scenarios"]["a"]["name"] == "first"
  on_disk = _strict_json(path.read_text())["scenarios"]
  assert [on_disk[k]["status"] for k in "abc"] == ["ok", "error", "skipped"]
  assert "boom" in on_disk["b"]["note"]


def test_benchmark_without_matplotlib_fails_before_computing(tmp_path):
  code = ("import runpy, sys; sys.modules['matplotlib'] = None; "  # None: import raises
          f"sys.argv = ['benchmark.py', '--quick', '--out', {str(tmp_path)!r}]; "
          "runpy.run_path('scripts/benchmark.py', run_name='__main__')")
  proc = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True,
                        timeout=TIMEOUT_S)
  assert proc.returncode == 1
  assert proc.stderr.strip().splitlines()[-1].endswith('pip install -e ".[bench]"'), proc.stderr
  assert "== scenario" not in proc.stdout and not list(tmp_path.iterdir())


def test_a_case_runs_the_program_it_compiled_ahead_of_time():
  """compile_s times the very program the timed runs use: running a case after compile_case
  compiles no generation program again (warm-up is not a hidden second compile). With
  gamma="auto" that program carries the cost table its prepare step measured (engine.lower
  measures it as speculate does)."""
  from spec_jax.bench import ar_case, compile_case, spec_case
  from spec_jax.drafters.prompt_lookup import PromptLookupDrafter
  from spec_jax.generate import pad_prompts
  from spec_jax.testing import tiny_llama
  model, params = tiny_llama()
  tokens, lengths = pad_prompts([[1, 2, 3], [1, 5]], width=8)
  common = dict(max_new_tokens=4, cache_len=16)
  lookup = PromptLookupDrafter(3, 1)
  auto = spec_case(model, params, lookup, None, gamma="auto", label="lookup, auto", **common)
  assert auto.prepare is not None
  auto.prepare(tokens, lengths)
  for case in (ar_case(model, params, **common),
               spec_case(model, params, lookup, None, gamma=2, label="lookup", **common), auto):
    with CompileCounter() as counter:
      compile_case(case, tokens, lengths)
      compiled = counter.count("generate_jit", "speculative_jit")
      case.run(tokens, lengths)
      assert compiled == 1 == counter.count("generate_jit", "speculative_jit"), case.label


def test_batch_sweep_and_auto_tables_from_records(tmp_path):
  # scenarios 2 and 7 report from their records alone: per-prompt auto vs the best fixed
  # gamma, speed-ups by batch with the widths auto chose, and the sweep's plot
  from spec_jax.bench import report, sections
  from spec_jax.bench.scenarios import auto_vs_best_fixed
  rows = [{"label": "autoregressive", "method": "autoregressive", "batch": 1,
           "run_s_sets": [1.0, 2.0], "tokens_per_s": 10.0},
          {"label": "d, gamma 2", "method": "speculative", "drafter": "d", "gamma": 2,
           "batch": 1, "run_s_sets": [0.5, 2.5], "speedup": 1.2},
          {"label": "d, gamma 4", "method": "speculative", "drafter": "d", "gamma": 4,
           "batch": 1, "run_s_sets": [0.8, 1.0], "speedup": 1.3},
          {"label": "d, gamma auto", "method": "speculative", "drafter": "d", "gamma": "auto",
           "batch": 1, "run_s_sets": [0.6, 1.25], "speedup": 1.5,
           "width_rounds": {"1": 3, "2": 5}}]
  per_prompt = auto_vs_best_fixed(rows)
  assert [(p["best_fixed_gamma"], p["auto_over_best"]) for p in per_prompt] == [
      (2, 0.5 / 0.6), (4, 1.0 / 1.25)]
  sweep = {"batches": [1, 4], "rows": rows + [dict(r, batch=4, speedup=2.0) for r in rows]}
  text = "\n".join(sections.batch_sweep(sweep))
  assert "| d, gamma auto | 1.5 | 2 |" in text, text
  assert "batch 4: {'1': 3, '2': 5}" in text
  report.plot_batch_sweep(sweep, tmp_path / "sweep.png")
  assert (tmp_path / "sweep.png").stat().st_size > 1000
  # two targets: a table each, with the mean width auto verified
  two = {"batches": [1, 4], "models": ["a", "b"],
         "rows": [dict(r, model=m) for m in ("a", "b") for r in sweep["rows"]]}
  text = "\n".join(sections.batch_sweep(two))
  assert text.count("| d, gamma auto | 1.5 | 2 |") == 2 and "**a**" in text and "**b**" in text
  assert "batch 4: {'1': 3, '2': 5} (1.62)" in text, text
  report.plot_batch_sweep(two, tmp_path / "two.png")
  assert (tmp_path / "two.png").stat().st_size > 1000


@pytest.mark.slow
def test_batch_sweep_runs_the_synthetic_target_with_auto():
  # scenario 7's memory-bound part on a tiny plan: autoregressive, a fixed gamma and auto at
  # a batch of two, timed against autoregressive at that batch, auto's widths reported
  import dataclasses
  from spec_jax.bench import sections
  from spec_jax.bench.scenarios import QUICK, batch_sweep
  plan = dataclasses.replace(QUICK, sw_kinds=(), sw_batches=(2,), sw_synthetic_new=6,
                             repeats=1)
  result = batch_sweep(plan, {})
  assert result["status"] == "ok" and len(result["models"]) == 1, result.get("notes")
  rows = _ok_rows(result)
  assert len(rows) == len(result["rows"]) == 3  # AR, gamma 2, auto
  for r in rows:
    assert r["speedup"] > 0 and r["model"] == result["models"][0]
    if r["gamma"] == "auto":
      assert sum(r["width_rounds"].values()) == r["rounds"] > 0
  assert "rounds per width (mean width)" in "\n".join(sections.batch_sweep(result))


def test_batch_baseline_scenario_reports_steps_per_batch():
  # scenario 8 on the quick plan: one autoregressive row per batch size, its per-step and
  # per-row-step costs consistent with its tokens/s, and the section's table
  from spec_jax.bench import sections
  from spec_jax.bench.scenarios import QUICK, STORIES_DIR, batch_baseline
  if not (STORIES_DIR / "stories260K.bin").exists():
    pytest.skip(f"needs {STORIES_DIR}/stories260K.bin (../shared beside the repository)")
  result = batch_baseline(QUICK, {})
  assert result["status"] == "ok"
  rows = _ok_rows(result)
  assert [r["batch"] for r in rows] == list(QUICK.bb_batches)
  for r in rows:
    assert r["tokens"] == r["batch"] * QUICK.bb_new  # greedy, no EOS: every row runs out
    np.testing.assert_allclose(r["ms_per_step"] * 1e-3 * QUICK.bb_new, r["run_s"])
    np.testing.assert_allclose(r["us_per_row_step"] * r["batch"], 1e3 * r["ms_per_step"])
    assert r["over_batch_16"] is None  # the quick plan has no batch 16
  text = "\n".join(sections.batch_baseline(result))
  assert "| batch | tok/s | ms per step |" in text and text.count("\n| ") >= 3, text


def test_plan_fields_are_set_from_the_command_line():
  from spec_jax.bench.scenarios import Plan, override_plan
  plan = override_plan(Plan(), ["sw_batches=1,16,64", "s1_auto=draft model: random,layer skip",
                                "sw_kinds=", "sw_synthetic_alpha=none", "s2_auto=false",
                                "s3_dtype=bfloat16", "repeats=3", "s3_alphas=0.5,0.9",
                                "rm_hf=0", "s2_block_gammas="])
  assert plan.sw_batches == (1, 16, 64) and plan.sw_kinds == () and plan.repeats == 3
  assert plan.s1_auto == ("draft model: random", "layer skip")
  assert plan.sw_synthetic_alpha is None and plan.s2_auto is False
  assert plan.s3_dtype == "bfloat16" and plan.s3_alphas == (0.5, 0.9)
  assert plan.s2_block_gammas == ()  # no DSpark rows
  for bad, says in [("nope=1", "expected FIELD=VALUE"), ("repeats", "expected FIELD=VALUE"),
                    ("repeats=many", "'many' is not an int"), ("s2_auto=maybe", "true or false"),
                    ("s3_target=1", "not settable"), ("repeats=none", "not an int"),
                    ("repeats=0", "needs a positive int"), ("sw_gammas=", "at least one value"),
                    ("sw_batches=0,1", "'0' is not a positive"), ("s3_alphas=nan", "finite"),
                    ("layout=bogus", "not one of"), ("s3_dtype=float16", "not one of")]:
    with pytest.raises(ValueError, match=says):
      override_plan(Plan(), [bad])


def test_benchmark_refuses_a_bad_plan_field_in_one_line():
  proc = subprocess.run([sys.executable, "scripts/benchmark.py", "--set", "sw_batches=1,x"],
                        cwd=REPO, capture_output=True, text=True, timeout=TIMEOUT_S)
  assert proc.returncode == 2 and "Traceback" not in proc.stderr
  assert proc.stderr.strip().splitlines()[-1] == "error: --set 'sw_batches=1,x': 'x' is not an int"


def test_the_accelerator_check_parses_and_sets_only_real_plan_fields(tmp_path):
  """scripts/device_check.sh runs on a lent GPU, where a typo costs a lease: the script
  parses (bash -n), an unknown mode is refused with exit 2, and every `--set` it passes the
  benchmark (shell defaults filled in) is a plan field with a valid value."""
  import os
  import re
  import shlex
  from spec_jax.bench.scenarios import Plan, override_plan
  script = REPO / "scripts" / "device_check.sh"
  assert subprocess.run(["bash", "-n", str(script)]).returncode == 0
  sets = []
  for line in script.read_text().splitlines():
    line = re.sub(r"\$\{[A-Z_]+:-([^}]*)\}", r"\1", line)  # ${VAR:-default} -> default
    tokens = shlex.split(line.rstrip().removesuffix("\\"), comments=True)
    sets += [nxt.rstrip(")") for tok, nxt in zip(tokens, tokens[1:]) if tok.endswith("--set")]
  fields = {s.split("=", 1)[0] for s in sets}
  assert {"sw_batches", "sw_kinds", "s1_only", "s1_batches", "s1_auto"} <= fields, sets
  for s in sets:
    override_plan(Plan(), [s])  # raises ValueError naming a bad field or value
  proc = subprocess.run(["bash", str(script), "nope"], cwd=REPO, capture_output=True,
                        text=True, timeout=TIMEOUT_S,
                        env={**os.environ, "OUT": str(tmp_path)})
  assert proc.returncode == 2 and "unknown mode nope" in proc.stdout, proc.stdout + proc.stderr


def _process_result(speedups, per_prompt, identical=True, status="ok", error=None):
  """A results.json as one benchmark process writes it, with one speculative row."""
  row = {"label": "auto", "method": "speculative", "speedup": speedups, "run_s": 1.0 / speedups,
         "drafts_never": not identical,
         "identical": identical, "speedup_per_prompt": per_prompt,
         "speedup_worst_prompt": min(per_prompt), "width_rounds": {"1": 3}, "gamma": "auto"}
  if error:
    row = {"label": "auto", "error": error}
  base = {"label": "autoregressive", "method": "autoregressive", "speedup": 1.0,
          "run_s": 1.0, "identical": True}
  other_batch = {**row, "batch": 16, "speedup": 2 * speedups}  # the same label, batch 16
  return {"machine": {"date": "d"}, "config": {"quick": True, "repeats": 3},
          "scenarios": {"1": {"name": "s", "status": status, "rows": [base, row, other_batch],
                              "notes": ["a note"], "wall_s": 2.0}},
          "errors": [f"auto: {error}"] if error else [], "recompilations": 0,
          "compile_counts": {"speculative_jit": 2}, "wall_s": 3.0}


def test_merged_processes_report_medians_per_row_and_per_prompt():
  """--processes K: each number is the median over processes, per-prompt lists per prompt,
  the worst prompt recomputed from those medians (not the median of the worst), identity
  must hold in every process, and each row keeps every process's own speed-up."""
  from spec_jax.bench.merge import merge_results
  runs = [_process_result(0.92, [0.90, 1.00]), _process_result(1.00, [1.02, 0.94]),
          _process_result(0.96, [0.96, 0.97], identical=False)]
  merged = merge_results(runs)
  rows = {r["label"]: r for r in merged["scenarios"]["1"]["rows"] if r.get("batch") != 16}
  auto = rows["auto"]
  (batch_16,) = [r for r in merged["scenarios"]["1"]["rows"] if r.get("batch") == 16]
  assert batch_16["speedup"] == pytest.approx(1.92)  # rows match by label and batch
  assert auto["speedup"] == pytest.approx(0.96) and auto["speedup_processes"] == [0.92, 1.0, 0.96]
  assert auto["speedup_per_prompt"] == pytest.approx([0.96, 0.97])
  assert auto["speedup_worst_prompt"] == pytest.approx(0.96)  # median of the worst: 0.94
  assert auto["identical"] is False and rows["autoregressive"]["identical"] is True
  assert auto["gamma"] == "auto" and auto["width_rounds"] == {"1": 3}  # the first process's
  assert auto["drafts_never"] == [False, False, True]  # tables that decided differently
  assert merged["processes"] == 3 and merged["config"]["processes"] == 3
  assert merged["compile_counts"] == {"speculative_jit": 6} and merged["wall_s"] == 9.0
  assert "medians over 3 processes" in merged["scenarios"]["1"]["notes"][-1]
  # scenario 2's per-prompt records: numbers by median, a best gamma kept as a choice
  entries = [[{"drafter": "d", "prompt": 0, "best_fixed_gamma": g, "auto_over_best": x}]
             for g, x in ((4, 0.9), (6, 1.0), (4, 0.95))]
  for run, entry in zip(runs, entries):
    run["scenarios"]["1"]["per_prompt"] = entry
  (entry,) = merge_results(runs)["scenarios"]["1"]["per_prompt"]
  assert entry == {"drafter": "d", "prompt": 0, "best_fixed_gamma": [4, 6, 4],
                   "auto_over_best": pytest.approx(0.95)}


def test_merged_processes_keep_errors_and_failed_scenarios():
  from spec_jax.bench.merge import merge_results
  merged = merge_results([_process_result(0.9, [0.9]), _process_result(0.9, [0.9], error="boom")])
  auto = next(r for r in merged["scenarios"]["1"]["rows"] if r["label"] == "auto")
  assert auto["error"] == "boom" and merged["errors"] == ["auto: boom"]
  skipped_run = _process_result(0.9, [0.9], status="skipped")
  merged = merge_results([_process_result(0.9, [0.9]), skipped_run])
  assert merged["scenarios"]["1"]["status"] == "skipped"
  with pytest.raises(ValueError, match="no results"):
    merge_results([])


def test_each_benchmark_process_gets_its_own_out_folder():
  sys.path.insert(0, str(REPO / "scripts"))
  try:
    import benchmark
  finally:
    sys.path.pop(0)
  argv = ["--scenarios", "1", "--processes", "3", "--out=/x", "--set", "repeats=3",
          "--processes=2", "--out", "/y", "--quick"]
  assert benchmark.child_argv(argv) == ["--scenarios", "1", "--set", "repeats=3", "--quick"]
