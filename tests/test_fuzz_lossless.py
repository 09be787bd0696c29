"""scripts/fuzz_lossless.py: it passes a lossless engine, and it catches a lost token."""

from __future__ import annotations

import importlib.util
import sys

import numpy as np
import pytest

from conftest import STORIES_DIR, require_shared
from spec_jax.testing import REPO


@pytest.fixture(scope="module")
def fuzz():
  spec = importlib.util.spec_from_file_location("fuzz_lossless",
                                                REPO / "scripts" / "fuzz_lossless.py")
  module = importlib.util.module_from_spec(spec)
  sys.modules[spec.name] = module  # (its dataclass looks its module up)
  spec.loader.exec_module(module)
  yield module
  sys.modules.pop(spec.name, None)


def test_the_fuzz_passes_the_engine(fuzz, capsys):
  require_shared(STORIES_DIR / "stories260K.bin")
  assert fuzz.main(["--seed", "5", "--cases", "1", "--kinds", "prompt_lookup"]) == 0
  out = capsys.readouterr().out
  assert "case 0: ok prompt_lookup" in out and "0 of 1 cases failed" in out, out


def test_the_fuzz_catches_a_lost_token(fuzz, capsys, monkeypatch):
  require_shared(STORIES_DIR / "stories260K.bin")
  real = fuzz.speculate

  def one_token_off(*args, **kwargs):  # a speculative engine that loses the last token
    out = real(*args, **kwargs)
    tokens = np.asarray(out.tokens).copy()
    last = int(np.asarray(out.num_tokens)[0]) - 1
    tokens[0, last] = (tokens[0, last] + 1) % 512
    return out.replace(tokens=tokens)

  monkeypatch.setattr(fuzz, "speculate", one_token_off)
  assert fuzz.main(["--seed", "5", "--cases", "1", "--kinds", "prompt_lookup"]) == 1
  out = capsys.readouterr().out
  assert "case 0: FAILED prompt_lookup" in out and "row 0 differs at generated token" in out
  assert "top-2 margin" in out and "--seed 5 --only 0 --kinds prompt_lookup" in out and "1 of 1 cases failed" in out


def test_the_fuzz_refuses_unknown_kinds(fuzz, capsys):
  assert fuzz.main(["--kinds", "prompt_lookup,nonsense"]) == 2
  err = capsys.readouterr().err
  assert err.count("\n") == 1 and "unknown drafter kinds ['nonsense']" in err, err
