"""Multi-host helpers: plain `jax.distributed`, the same program in every process.

Every process runs the same script. After `initialize`, `jax.devices()` lists the devices
of all processes; a mesh over them (`global_mesh`) is one global mesh, and each process
holds the shards on its own devices. Host data given identically to every process is
placed with `spec_jax.sharding.put` (each process fills its own shards); data that differs
per process (each reads its own part of a batch) becomes one global array with
`global_batch`. See docs/sharding.md for TPU pod slices and multi-GPU hosts.
"""

from __future__ import annotations

import argparse
import os

import jax
import numpy as np
from jax.experimental import multihost_utils
from jax.sharding import Mesh, NamedSharding

# our own variables; JAX itself also reads JAX_COORDINATOR_ADDRESS and detects TPU, Slurm
# and Open MPI clusters when nothing is given
ENV_COORDINATOR = "SPEC_JAX_COORDINATOR"
ENV_NUM_PROCESSES = "SPEC_JAX_NUM_PROCESSES"
ENV_PROCESS_ID = "SPEC_JAX_PROCESS_ID"


def _env_int(name: str) -> int | None:
  value = os.environ.get(name)
  return None if value in (None, "") else int(value)


def initialize(coordinator_address: str | None = None, num_processes: int | None = None,
               process_id: int | None = None, *, local_device_ids=None,
               cpu_devices: int | None = None, cpu_collectives: str = "gloo",
               timeout_s: int = 300) -> None:
  """Joins this process to the others; call before anything touches a JAX backend.

  Unset arguments come from SPEC_JAX_COORDINATOR / _NUM_PROCESSES / _PROCESS_ID, then
  from JAX's own cluster detection (TPU pod slices, Slurm, Open MPI need no arguments).
  `cpu_devices` simulates that many CPU devices per process, with `cpu_collectives`
  ("gloo") so that collectives cross processes: for tests and laptops.
  """
  if cpu_devices is not None:
    jax.config.update("jax_num_cpu_devices", int(cpu_devices))
    jax.config.update("jax_cpu_collectives_implementation", cpu_collectives)
  coordinator_address = coordinator_address or os.environ.get(ENV_COORDINATOR) or None
  num_processes = num_processes if num_processes is not None else _env_int(ENV_NUM_PROCESSES)
  process_id = process_id if process_id is not None else _env_int(ENV_PROCESS_ID)
  jax.distributed.initialize(coordinator_address, num_processes, process_id,
                             local_device_ids=local_device_ids,
                             initialization_timeout=int(timeout_s))


def add_arguments(parser: argparse.ArgumentParser) -> None:
  """--coordinator HOST:PORT, --num-processes, --process-id for a script's command line."""
  group = parser.add_argument_group("multi-host (jax.distributed)")
  group.add_argument("--coordinator", default=None, help="HOST:PORT of process 0")
  group.add_argument("--num-processes", type=int, default=None)
  group.add_argument("--process-id", type=int, default=None)


def initialize_from_args(args: argparse.Namespace, **kw) -> bool:
  """Initializes when the command line (or the environment) asks for several processes.

  Returns whether it did; a single process needs no initialization.
  """
  wanted = (args.coordinator or args.num_processes or os.environ.get(ENV_COORDINATOR)
            or os.environ.get(ENV_NUM_PROCESSES))
  if not wanted:
    return False
  initialize(args.coordinator, args.num_processes, args.process_id, **kw)
  return True


def global_mesh(data: int | None = None, model: int | None = None) -> Mesh:
  """The (data, model) mesh over every process's devices (see sharding.make_mesh)."""
  from spec_jax.sharding import make_mesh  # imported late: nothing may start JAX early
  return make_mesh(data, model, devices=jax.devices())


def is_coordinator() -> bool:
  return jax.process_index() == 0


def global_batch(local_BX, mesh: Mesh, rules=None) -> jax.Array:
  """This process's rows of a batch -> one global array, batch split over `data`.

  Processes hold consecutive, equal parts of the batch, in process order; the global
  batch must divide over `data`.
  """
  from spec_jax.sharding import DEFAULT_RULES, batch_spec
  rules = DEFAULT_RULES if rules is None else rules
  local = np.asarray(local_BX)
  global_shape = (local.shape[0] * jax.process_count(),) + local.shape[1:]
  spec = batch_spec(global_shape, mesh, rules.replace(replicate_if_indivisible=frozenset()))
  sharding = NamedSharding(mesh, spec)
  return jax.make_array_from_process_local_data(sharding, local, global_shape)


def to_host(x: jax.Array) -> np.ndarray:
  """The whole value of a global array, in every process (a gather when sharded)."""
  if x.is_fully_replicated or x.is_fully_addressable:
    return np.asarray(x)
  return np.asarray(multihost_utils.process_allgather(x, tiled=True))


def sync(name: str) -> None:
  """A barrier across processes (e.g. before reading a file another process wrote)."""
  multihost_utils.sync_global_devices(name)


def shutdown() -> None:
  jax.distributed.shutdown()
