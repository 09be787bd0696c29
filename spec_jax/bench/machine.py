"""What a benchmark ran on: CPU, jax backend and devices, package versions, load."""

from __future__ import annotations

import datetime
import os
import platform
from pathlib import Path

import jax

PACKAGES = ("jaxlib", "flax", "numpy", "torch", "transformers", "matplotlib")
SHARED_MACHINE_NOTE = ("shared machine: other processes may have used the CPU; compare ratios "
                       "measured side by side, not absolute times across runs")


def cpu_model() -> str:
  try:
    for line in Path("/proc/cpuinfo").read_text().splitlines():
      if line.startswith("model name"):
        return line.split(":", 1)[1].strip()
  except OSError:
    pass
  return platform.processor() or "unknown"


def package_versions(names=PACKAGES) -> dict[str, str | None]:
  versions = {}
  for name in names:
    try:
      versions[name] = __import__(name).__version__
    except Exception:  # noqa: BLE001  absent or broken: reported as None
      versions[name] = None
  return versions


def describe_machine(dtype: str = "float32") -> dict:
  """The machine, for results.json; `dtype` says what precision the benchmark used."""
  return {
      "cpu_model": cpu_model(), "cpu_count": os.cpu_count(),
      "cpus_usable": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None,
      "load_average_start": list(os.getloadavg()), "platform": platform.platform(),
      "python": platform.python_version(), "jax": jax.__version__,
      "jax_backend": jax.default_backend(), "jax_devices": [str(d) for d in jax.devices()],
      "dtype": dtype,
      "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
      "xla_flags": os.environ.get("XLA_FLAGS", ""), "packages": package_versions(),
      "note": SHARED_MACHINE_NOTE,
  }
