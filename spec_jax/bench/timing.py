"""Wall-clock timing of jax work: one call, AOT compilation, interleaved medians."""

from __future__ import annotations

import time
from typing import Any, Callable

import jax
import numpy as np


def log(msg: str) -> None:
  print(msg, flush=True)


def timed(fn: Callable[[], Any]) -> tuple[Any, float]:
  """(fn(), seconds), waiting for the result's device work to finish."""
  start = time.perf_counter()
  out = fn()
  jax.block_until_ready(out)
  return out, time.perf_counter() - start


def timed_compile(lower: Callable[[], Any]) -> tuple[Any, dict]:
  """(compiled, {"lower_s", "compile_s", "compile_cached"}) of `lower()`'s jax Lowered.

  An identical program compiled earlier in this process comes back from jax's in-memory
  cache in microseconds: compile_cached says so.
  """
  start = time.perf_counter()
  lowered = lower()
  lower_s = time.perf_counter() - start
  start = time.perf_counter()
  compiled = lowered.compile()
  compile_s = time.perf_counter() - start
  return compiled, {"lower_s": lower_s, "compile_s": compile_s,
                    "compile_cached": compile_s < 0.01}


def interleaved_medians(thunks: dict[str, Callable[[], Any]], repeats: int) -> dict[str, float]:
  """Median seconds of each (warmed-up) thunk, timed in interleaved rounds (at least 5), so
  a shared machine's drift hits every thunk alike."""
  times = {name: [] for name in thunks}
  for _ in range(max(repeats, 5)):
    for name, thunk in thunks.items():
      times[name].append(timed(thunk)[1])
  return {name: float(np.median(t)) for name, t in times.items()}
