"""Shared fixtures: the real stories260K model from ../shared. The small random models and the
paths live in spec_jax.testing (scripts use them too); re-exported here for the test modules."""

from __future__ import annotations

import os
from pathlib import Path

import jax
import pytest

# The tests check results, not speed, and most of their time is XLA compiling: with LLVM's
# optimisations off, XLA:CPU compiles about a third faster, and a third faster again with its
# legacy emitters instead of the fusion emitters (the suite's programs run a little slower,
# which they can afford; checks of compiled programs compile as users do:
# spec_jax.testing.compiled_text). Set before jax makes its backend; the xdist workers and
# the subprocesses the tests start inherit it. SPEC_JAX_TEST_OPTIMIZED=1 keeps XLA's defaults.
_FAST_COMPILE_FLAGS = ("--xla_backend_optimization_level=0 --xla_llvm_disable_expensive_passes=true"
                       " --xla_cpu_use_fusion_emitters=false")
if (os.environ.get("SPEC_JAX_TEST_OPTIMIZED") != "1"
    and "xla_backend_optimization_level" not in os.environ.get("XLA_FLAGS", "")):
  os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} {_FAST_COMPILE_FLAGS}".strip()

# the command lines the tests run (in subprocesses too) keep no compiled programs in the
# user's cache folder (scripts/generate.py --compile-cache); one test checks that cache itself
os.environ.setdefault("SPEC_JAX_COMPILE_CACHE", "off")
os.environ.setdefault("SPEC_JAX_COST_TABLES", "off")  # likewise (spec_jax.adaptive.cost_store)

from spec_jax.testing import (  # noqa: F401  re-exported for the test modules
    REFERENCE_DIR, REFERENCE_STEM, REPO, SHARED, STORIES_DIR, perturbed, tiny_llama)


@pytest.fixture(autouse=True, scope="module")
def _release_compiled_programs():
  """Drops jax's compiled programs after each test module. Each XLA:CPU executable keeps its
  own memory mappings, and the whole suite in one process passes the kernel's
  vm.max_map_count (65530 by default): a later compile then aborts or segfaults."""
  yield
  jax.clear_caches()


def _max_mappings() -> int:
  try:
    return int(Path("/proc/sys/vm/max_map_count").read_text())
  except (OSError, ValueError):
    return 65530  # Linux's default


MAX_MAPPINGS = _max_mappings()


def _memory_mappings() -> int | None:
  try:
    with open("/proc/self/maps", "rb") as f:
      return sum(1 for _ in f)
  except OSError:  # (not Linux)
    return None


@pytest.fixture(autouse=True)
def _release_compiled_programs_within_a_module():
  """Drops them after a test, too, once this process holds half the mappings the kernel
  allows: test_adaptive.py alone compiles enough programs to abort a compile near its end
  (LLVM, "Fatal Python error: Aborted")."""
  yield
  mappings = _memory_mappings()
  if mappings is not None and mappings > MAX_MAPPINGS // 2:
    jax.clear_caches()


def require_shared(path: Path) -> Path:
  if not path.exists():
    pytest.skip(f"needs {path} (the ../shared folder beside the repository)")
  return path


@pytest.fixture(scope="session")
def stories():
  """(model, params) of stories260K, read from ../shared."""
  from spec_jax.models.llama2c import load_llama2c
  return load_llama2c(str(require_shared(STORIES_DIR / "stories260K.bin")))


@pytest.fixture(scope="session")
def reference_tokens() -> list[int]:
  path = require_shared(REFERENCE_DIR / f"{REFERENCE_STEM}.tokens.txt")
  return [int(t) for t in path.read_text().split()]


@pytest.fixture(scope="session")
def story_prompts(reference_tokens) -> list[list[int]]:
  """A batch of prompts of different lengths (BOS first), from the reference and elsewhere."""
  return [reference_tokens[:5], [1, 403, 407], reference_tokens[:11], [1, 300, 263, 400, 271],
          [1, 413, 409, 416, 327, 263, 415, 294]]
