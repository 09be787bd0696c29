"""Timing on a shared machine, for both cost tables (costs.measure_costs, timed in small
programs at start-up, and in_program.measure_in_program, timed in the executable that runs).

The tables' decisions compare costs with each other (tokens per second of one plan against
another), so what matters is their ratios. Taking the thunks in turn puts a burst of another
process's load on all of them alike, and the fastest of several repeats is the estimate such
bursts move least (on a shared 2-core CPU one-off medians swung 1.2-1.6x). Each thunk is
timed on its second call in a row: the first call after another program's runs slow (on the
built-in pair a call of 6 plain steps took 16.0 ms there against 11.0 ms called again, which
put a plain step at 2.5 ms against the 1.6-1.8 ms the generation loop spends on one), and
the loop runs each kind of pass in runs (plain stretches, drafted rounds).
"""

from __future__ import annotations

import math
import time
from typing import Callable, Sequence

import jax


def seconds(thunk: Callable) -> float:
  """Wall seconds of one call of thunk, until its results are ready."""
  t0 = time.perf_counter()
  jax.block_until_ready(thunk())
  return time.perf_counter() - t0


def fastest_in_turn(thunks: Sequence[Callable], repeats: int) -> list[float]:
  """The fastest of `repeats` timings of each thunk, taken in turn (round robin; each thunk
  compiled and warmed up by the caller), each timed on its second call in a row."""
  best = [math.inf] * len(thunks)
  for _ in range(repeats):
    for i, thunk in enumerate(thunks):
      jax.block_until_ready(thunk())
      best[i] = min(best[i], seconds(thunk))
  return best
