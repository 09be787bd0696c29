"""Measured cost tables kept on disk, so a later process skips the start-up timing.

gamma="auto" times its cost table once per program, batch shape and params' shapes (costs.py):
on the built-in pair at batch 1 that is ~13 s on a 2-core CPU, most of it compiling the timing
programs, and the table is part of the compiled program (its costs are static), so a fresh
table each process also keeps jax's persistent compilation cache from ever serving the auto
program. With a folder set (`keep_cost_tables`; scripts/generate.py does, beside its
compilation cache), a table measured once is read back by every later process on the same
machine: same program, same jax, same devices.

A table only steers speed, never the output (every rule it feeds is lossless whatever the
costs), so a table from a busier moment costs speed at worst; delete the folder to measure
again. Files are JSON, one per key (its sha256); a file that cannot be read or does not fit
the program is reported on stderr and measured again, never used.
"""

from __future__ import annotations

import datetime
import hashlib
import json
import math
import os
import platform
import re
import sys
import tempfile

import jax

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


def stable_key(parts: tuple) -> str:
  """Text naming what a table was measured for, the same in every process: the program's
  parts (functions named without their addresses), the params' shapes and dtypes, the
  machine (backend, devices, host) and jax's version."""
  devices = jax.devices()
  machine = (jax.__version__, jax.default_backend(), len(devices), devices[0].device_kind,
             platform.machine(), platform.processor(), os.cpu_count())
  return re.sub(r" at 0x[0-9a-fA-F]+", "", repr((VERSION, machine, parts)))


def _path(key: str) -> str:
  return os.path.join(_FOLDER[0], hashlib.sha256(key.encode()).hexdigest()[:32] + ".json")


def load(key: str, widths: int):
  """The stored (target_costs, draft_cost, first_draft_cost) for key, or None."""
  if _FOLDER[0] is None:
    return None
  path = _path(key)
  if not os.path.exists(path):
    return None
  try:
    with open(path) as f:
      data = json.load(f)
    if data.get("key") != key:
      raise ValueError("it was written for another program (a hash collision)")
    costs = tuple(float(c) for c in data["target_costs"])
    draft, first = float(data["draft_cost"]), float(data["first_draft_cost"])
    if len(costs) != widths:
      raise ValueError(f"{len(costs)} target costs for {widths} widths")
    if not all(math.isfinite(c) and c > 0 for c in costs + (draft, first)):
      raise ValueError("a cost is not a positive finite number")
  except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
    print(f"warning: ignoring the stored cost table {path} ({e}); measuring it again",
          file=sys.stderr)
    return None
  return costs, draft, first


def save(key: str, costs: tuple, draft: float, first: float) -> None:
  """Stores a measured table (atomically: a reader never sees half a file); a folder that
  cannot be written is reported on stderr."""
  if _FOLDER[0] is None:
    return
  data = {"key": key, "target_costs": [float(c) for c in costs], "draft_cost": float(draft),
          "first_draft_cost": float(first),
          "measured": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")}
  try:
    fd, tmp = tempfile.mkstemp(dir=_FOLDER[0], suffix=".tmp")
    with os.fdopen(fd, "w") as f:
      json.dump(data, f, indent=1)
    os.replace(tmp, _path(key))
  except OSError as e:
    print(f"warning: the cost table was not stored ({e})", file=sys.stderr)
