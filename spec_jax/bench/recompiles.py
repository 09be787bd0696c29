"""Counting XLA compilations through jax's public monitoring events.

jax records `/jax/core/compile/backend_compile_duration` (with the jitted function's name,
e.g. fun_name="jit(generate_jit)") each time XLA compiles a program: a first call, a new
shape, an AOT `.lower().compile()`, and eager ops on new shapes too. A call that hits a
cache (jit's dispatch cache or the in-memory executable cache) records nothing. Checked on
jax 0.10.2.
"""

from __future__ import annotations

import collections
import threading

from jax import monitoring

BACKEND_COMPILE_EVENT = "/jax/core/compile/backend_compile_duration"


def _bare_name(fun_name: str) -> str:
  """'jit(generate_jit)' -> 'generate_jit'."""
  return fun_name[4:-1] if fun_name.startswith("jit(") and fun_name.endswith(")") else fun_name


class CompileCounter:
  """Counts compilations by function name while started (or inside a `with` block).

  Thread-safe: programs compiled in worker threads are counted too.
  """

  def __init__(self):
    self._counts: collections.Counter[str] = collections.Counter()
    self._lock = threading.Lock()
    self._listening = False

  def _listener(self, event: str, duration_secs: float, **kwargs) -> None:
    del duration_secs
    if event == BACKEND_COMPILE_EVENT:
      with self._lock:
        self._counts[_bare_name(str(kwargs.get("fun_name", "?")))] += 1

  def start(self) -> "CompileCounter":
    if not self._listening:
      monitoring.register_event_duration_secs_listener(self._listener)
      self._listening = True
    return self

  def stop(self) -> None:
    if self._listening:
      monitoring.unregister_event_duration_listener(self._listener)
      self._listening = False

  def __enter__(self) -> "CompileCounter":
    return self.start()

  def __exit__(self, *exc) -> None:
    self.stop()

  def count(self, *names: str) -> int:
    """Compilations so far of the functions named (bare or as 'jit(name)'), or of all."""
    with self._lock:
      if not names:
        return sum(self._counts.values())
      return sum(self._counts[_bare_name(n)] for n in names)

  def by_name(self) -> dict[str, int]:
    with self._lock:
      return dict(self._counts)


_PROCESS: CompileCounter | None = None


def process_counter() -> CompileCounter:
  """The process-wide counter, started on first use: counts compilations from then on."""
  global _PROCESS
  if _PROCESS is None:
    _PROCESS = CompileCounter().start()
  return _PROCESS
