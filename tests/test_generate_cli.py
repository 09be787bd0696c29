"""scripts/generate.py end to end, in a subprocess, on stories260K from ../shared."""

from __future__ import annotations

import json
import re
import subprocess
import sys

import pytest

from conftest import REFERENCE_DIR, REFERENCE_STEM, REPO, STORIES_DIR, require_shared


def run_cli(*args: str, timeout: int = 300) -> subprocess.CompletedProcess:
  return subprocess.run([sys.executable, str(REPO / "scripts" / "generate.py"), *args],
                        capture_output=True, text=True, timeout=timeout, cwd=REPO)


def test_generate_matches_reference_text_and_compare_is_identical():
  model = str(require_shared(STORIES_DIR / "stories260K.bin"))
  expected = require_shared(REFERENCE_DIR / f"{REFERENCE_STEM}.txt").read_text()
  proc = run_cli("Once upon a time", "--model", model, "--draft", "draft_model",
                 "--draft-model", model, "--gamma", "5", "--max-new-tokens", "196",
                 "--compare", "--json")
  assert proc.returncode == 0, proc.stderr
  report = json.loads(proc.stdout)
  assert report["texts"][0] + "\n" == expected
  assert report["identical_to_autoregressive"] is True
  assert report["mean_accepted"] == pytest.approx(5.0)  # the target drafting for itself
  for key in ("tokens_per_s", "autoregressive_tokens_per_s", "speedup", "acceptance_rate"):
    assert report[key] > 0


def test_stream_prints_the_same_text_as_a_plain_run():
  model = str(require_shared(STORIES_DIR / "stories260K.bin"))
  args = ("Once upon a time", "--model", model, "--max-new-tokens", "40", "--temperature", "0.9",
          "--seed", "3", "--draft", "prompt_lookup")
  streamed, plain = run_cli(*args, "--stream"), run_cli(*args, "--json")
  assert streamed.returncode == 0 and plain.returncode == 0, streamed.stderr + plain.stderr
  text = json.loads(plain.stdout)["texts"][0]
  assert streamed.stdout.startswith(text + "\n")


def test_a_sampled_compare_does_not_call_different_draws_an_error():
  """Sampled, speculation keeps the target's distribution, not autoregressive decoding's
  draws: --compare says so instead of flagging the outputs as DIFFERENT (the word a greedy
  mismatch, which would be a bug, prints)."""
  model = str(require_shared(STORIES_DIR / "stories260K.bin"))
  proc = run_cli("Once upon a time", "--model", model, "--draft", "layer_skip", "--draft-layers",
                 "2", "--gamma", "3", "--max-new-tokens", "40", "--temperature", "1.0",
                 "--seed", "3", "--compare")
  assert proc.returncode == 0, proc.stderr
  last = proc.stdout.strip().splitlines()[-1]
  assert last.startswith("autoregressive:") and "DIFFERENT" not in last
  assert "identical" in last or "different draws (sampled" in last


def test_gamma_auto_reports_what_its_rounds_chose(tmp_path):
  """--gamma auto (adaptive speculation) through the CLI: greedy output identical to
  autoregressive decoding, and the report holds what the rounds chose (rounds per verified
  width, admitted lengths) and the acceptance estimates they learned, in JSON and in text."""
  model = str(require_shared(STORIES_DIR / "stories260K.bin"))
  args = ("Once upon a time", "--model", model, "--draft", "prompt_lookup", "--gamma", "auto",
          "--max-new-tokens", "40", "--compare", "--compile-cache", str(tmp_path / "xla"),
          "--cost-tables", str(tmp_path / "costs"))
  proc = run_cli(*args, "--json")
  assert proc.returncode == 0, proc.stderr
  report = json.loads(proc.stdout)
  assert report["gamma"] == "auto" and report["identical_to_autoregressive"] is True
  auto = report["adaptive"]
  assert sum(auto["width_rounds"].values()) == report["rounds"]
  assert sum(auto["admitted_hist"]) == report["rounds"]  # one row
  # (a drafted round whose rows found nothing to verify runs at width 1 too)
  assert auto["undrafted_rounds"] <= auto["width_rounds"]["1"] <= report["rounds"]
  assert len(auto["acceptance_estimate"]) == 8  # gamma_max
  assert all(0.0 <= e <= 1.0 for e in auto["acceptance_estimate"])
  text = run_cli(*args)  # (the first run's table and programs, from the two folders)
  assert text.returncode == 0, text.stderr
  line, = [ln for ln in text.stdout.splitlines() if ln.startswith("auto: ")]
  assert re.fullmatch(r"auto: rounds per verified width \{1: \d+(, \d+: \d+)+\} \(\d+ plain\); "
                      r"admitted drafts per row-round \[[\d, ]+\]; acceptance estimates "
                      r"\[[\d., ]+\]", line), line
  # the same table, so the same rounds: the text reports what the JSON did
  assert f"({auto['undrafted_rounds']} plain)" in line, line
  assert text.stdout.rstrip().endswith("outputs identical")


def test_bad_flags_fail_clearly():
  model = str(require_shared(STORIES_DIR / "stories260K.bin"))
  proc = run_cli("hi", "--model", model, "--gamma", "0")
  assert proc.returncode != 0 and "gamma" in proc.stderr
  proc = run_cli("hi", "--model", model, "--top-p", "1.5")
  assert proc.returncode == 2 and "top-p" in proc.stderr


def test_main_job_on_the_builtin_pair():
  """The README's first command: the built-in pair, speculative, compared with autoregressive."""
  proc = run_cli("def fibonacci(n):", "--compare", "--json", "--max-new-tokens", "48")
  assert proc.returncode == 0, proc.stderr
  report = json.loads(proc.stdout)
  assert report["drafter"] == "lookup+draft_model"  # the pair's draft behind prompt lookup
  assert report["identical_to_autoregressive"] is True
  assert report["texts"][0].startswith("def fibonacci(n):")
  assert report["mean_accepted"] > 0.5  # the distilled draft does agree with its target
  assert 1 <= report["tokens"] <= 48  # EOS may end the row early


def test_compile_cache_keeps_programs_for_the_next_run(tmp_path):
  # --compile-cache DIR: the first run writes its compiled programs there, a second run
  # loads them (jax's persistent cache: hits counted by jax.monitoring), same output
  import os
  model = str(require_shared(STORIES_DIR / "stories260K.bin"))
  env = {k: v for k, v in os.environ.items() if k != "JAX_COMPILATION_CACHE_DIR"}
  env["JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"] = "0"  # the test's programs compile fast
  probe = ("import sys, runpy, jax; hits = []; "
           "jax.monitoring.register_event_listener("
           "lambda e, **k: hits.append(e) if e.endswith('cache_hits') else None); "
           "sys.argv = ['generate.py'] + sys.argv[1:]; "
           "code = runpy.run_path('scripts/generate.py', run_name='not_main'); "
           "from spec_jax import cli; status = cli.run(code['main'], sys.argv[1:]); "
           "print('HITS', len(hits)); sys.exit(status)")
  cache = tmp_path / "xla"
  args = ["Once upon a time", "--model", model, "--draft", "prompt_lookup", "--gamma", "3",
          "--max-new-tokens", "8", "--json", "--compile-cache", str(cache)]
  runs = [subprocess.run([sys.executable, "-c", probe, *args], capture_output=True, text=True,
                         timeout=300, cwd=REPO, env=env) for _ in range(2)]
  for proc in runs:
    assert proc.returncode == 0, proc.stderr
  first, second = (json.loads(p.stdout[:p.stdout.rindex("HITS")]) for p in runs)
  assert first["texts"] == second["texts"]
  assert runs[0].stdout.rstrip().endswith("HITS 0") and any(cache.iterdir())
  assert not runs[1].stdout.rstrip().endswith("HITS 0"), runs[1].stdout[-200:]
