"""Measured cost tables kept on disk, so a later process skips the start-up timing.

gamma="auto" times its cost table once per program, batch shape and params' shapes (costs.py):
on the built-in pair at batch 1 that is ~13 s on a 2-core CPU, most of it compiling the timing
programs, and the table is part of the compiled program (its costs are static), so a fresh
table each process also keeps jax's persistent compilation cache from ever serving the auto
program. With a folder set (`keep_cost_tables`; scripts/generate.py does, beside its
compilation cache), a table measured once is read back by every later process on the same
machine: same program and spec_jax code, same jax, same devices and matmul settings.

A table only steers speed, never the output (every rule it feeds is lossless whatever the
costs), so a table from a busier moment costs speed at worst; delete the folder to measure
again. Files are JSON, one per key (its sha256); a file that cannot be read or does not fit
the program is reported on stderr and measured again, never used.
"""

from __future__ import annotations

import dataclasses
import datetime
import functools
import hashlib
import json
import os
import platform
import re
import sys
import tempfile
from pathlib import Path

import jax

from spec_jax.adaptive.config import check_cost

_FOLDER: list[str | None] = [None]
VERSION = 1  # of the file format and of what the key holds


def keep_cost_tables(folder: str | None) -> str | None:
  """Keep measured cost tables in `folder` (created if missing), or None to keep none (the
  default). Returns the folder in use; a folder that cannot be created is reported on stderr
  and none is used."""
  if folder is None:
    _FOLDER[0] = None
    return None
  path = os.path.expanduser(folder)
  try:
    os.makedirs(path, exist_ok=True)
  except OSError as e:
    print(f"warning: cost tables are not kept ({e})", file=sys.stderr)
    path = None
  _FOLDER[0] = path
  return path


def cost_table_folder() -> str | None:
  return _FOLDER[0]


def stable_key(parts: tuple) -> str | None:
  """Text naming what a table was measured for, the same in every process, or None where
  the parts hold something no text names across processes (a lambda, a local function, an
  object whose repr is its address): such a table is not stored. It holds the program's
  parts, each function they hold as module.qualname, spec_jax's own source (a hash: changed
  code measures again), the machine (backend, devices, host, the cores this process may
  use), jax's version and the settings that change what a matmul costs."""
  names = []
  _function_names(parts, names, set())
  text = re.sub(r" at 0x[0-9a-fA-F]+", "", repr(parts))
  if any("<lambda>" in n or "<locals>" in n for n in names) or " object>" in text:
    return None
  devices = jax.devices()
  try:
    cores = len(os.sched_getaffinity(0))
  except AttributeError:  # (not on every OS)
    cores = os.cpu_count()
  machine = (jax.__version__, jax.default_backend(), len(devices), devices[0].device_kind,
             platform.machine(), platform.processor(), cores,
             str(jax.config.jax_default_matmul_precision), jax.config.jax_enable_x64,
             os.environ.get("XLA_FLAGS", ""))
  return repr((VERSION, _source_hash(), machine, tuple(names), text))


def params_key(parts: tuple, params) -> str | None:
  """stable_key of parts and where params live (their first leaf's sharding: a table timed
  on one placement is not another's), or None where no folder is set."""
  if _FOLDER[0] is None:
    return None
  first_leaf = jax.tree_util.tree_leaves(params)[:1]
  placement = repr(getattr(first_leaf[0], "sharding", None)) if first_leaf else None
  return stable_key(parts + (placement,))


def _function_names(obj, names: list, seen: set, depth: int = 0) -> None:
  """module.qualname of each function reachable through dataclass fields, tuples, lists and
  partials (a function's repr names neither its module nor, for a closure, what it holds)."""
  if depth > 8 or id(obj) in seen:
    return
  seen.add(id(obj))
  if isinstance(obj, functools.partial):
    for x in (obj.func, obj.args, tuple(obj.keywords.items())):
      _function_names(x, names, seen, depth + 1)
  elif isinstance(obj, (tuple, list)):
    for x in obj:
      _function_names(x, names, seen, depth + 1)
  elif dataclasses.is_dataclass(obj) and not isinstance(obj, type):
    for f in dataclasses.fields(obj):
      _function_names(getattr(obj, f.name, None), names, seen, depth + 1)
  elif callable(obj) and hasattr(obj, "__qualname__") and not isinstance(obj, type):
    names.append(f"{getattr(obj, '__module__', '?')}.{obj.__qualname__}")


@functools.lru_cache(maxsize=1)
def _source_hash() -> str:
  """A hash of spec_jax's Python sources (its model code too): tables measured by other
  code are measured again."""
  import spec_jax
  import spec_jax.models
  digest = hashlib.sha256()
  for root in sorted({Path(spec_jax.__file__).parent, Path(spec_jax.models.__file__).parent}):
    for path in sorted(root.rglob("*.py")):
      digest.update(str(path.relative_to(root)).encode())
      digest.update(path.read_bytes())
  return digest.hexdigest()[:16]


def _path(folder: str, key: str) -> str:
  return os.path.join(folder, hashlib.sha256(key.encode()).hexdigest()[:32] + ".json")


def load(key: str | None, widths: int):
  """The stored (target_costs, draft_cost, first_draft_cost) for key, or None."""
  folder = _FOLDER[0]
  if folder is None or key is None:
    return None
  path = _path(folder, key)
  if not os.path.exists(path):
    return None
  try:
    with open(path) as f:
      data = json.load(f)
    if data.get("key") != key:
      raise ValueError("it was written for another program (a hash collision)")
    stored = data["target_costs"]
    if not isinstance(stored, list) or len(stored) != widths:
      raise ValueError(f"target_costs is {stored!r}, not a list of {widths} times")
    # (as measured: every time in range, drafting's too)
    costs = tuple(check_cost(c, f"target_costs[{i}]") for i, c in enumerate(stored))
    draft, first = (check_cost(data[name], name, drafting=True)
                    for name in ("draft_cost", "first_draft_cost"))
  except (OSError, ValueError, KeyError, TypeError, AttributeError, ArithmeticError) as e:
    print(f"warning: ignoring the stored cost table {path} ({e}); measuring it again",
          file=sys.stderr)
    return None
  return costs, draft, first


def save(key: str | None, costs: tuple, draft: float, first: float) -> None:
  """Stores a measured table (atomically: a reader never sees half a file); a folder that
  cannot be written is reported on stderr."""
  folder = _FOLDER[0]
  if folder is None or key is None:
    return
  data = {"key": key, "target_costs": [float(c) for c in costs], "draft_cost": float(draft),
          "first_draft_cost": float(first),
          "measured": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")}
  tmp = None
  try:
    fd, tmp = tempfile.mkstemp(dir=folder, suffix=".tmp")
    with os.fdopen(fd, "w") as f:
      json.dump(data, f, indent=1)
    os.replace(tmp, _path(folder, key))
    tmp = None
  except OSError as e:
    print(f"warning: the cost table was not stored ({e})", file=sys.stderr)
  finally:
    if tmp is not None and os.path.exists(tmp):
      os.unlink(tmp)
