"""scripts/generate.py end to end, in a subprocess, on stories260K from ../shared."""

from __future__ import annotations

import json
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
