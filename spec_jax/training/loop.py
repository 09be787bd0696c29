"""The one training loop: optax optimiser, a jitted step, orbax checkpoints.

Model-agnostic: params are any pytree of arrays (plain nested dicts are the most robust
choice for checkpoints), the loss is a function of (params, batch, rng), and batches come
from a function of the step number, so a resumed run sees the same data as an
uninterrupted one and ends with identical params.

    opt = make_optimizer(3e-3, warmup_steps=100, total_steps=2000)
    state = TrainState.create(params, opt, jax.random.key(0))
    step = make_train_step(loss_fn, opt)
    state, info = train_loop(state, batch_fn, step, num_steps=2000, checkpoint_dir=...)
"""

from __future__ import annotations

import json
import os
import time
import warnings
import zlib
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
import optax
import orbax.checkpoint as ocp
from flax import struct

from spec_jax.core.pytree_names import flatten_with_names

Batch = Any
LossFn = Callable[[Any, Batch, jax.Array], tuple[jax.Array, dict[str, jax.Array]]]


# ---- optimiser and state ------------------------------------------------------------------------

def make_optimizer(learning_rate: float, warmup_steps: int, total_steps: int, *,
                   weight_decay: float = 0.1, clip: float = 1.0, b1: float = 0.9,
                   b2: float = 0.95, final_fraction: float = 0.1) -> optax.GradientTransformation:
  """AdamW with linear warm-up then cosine decay to `final_fraction * learning_rate`, after
  global-norm clipping. Weight decay applies to matrices only (not norms or biases)."""
  schedule = optax.warmup_cosine_decay_schedule(
      init_value=0.0, peak_value=learning_rate, warmup_steps=max(int(warmup_steps), 1),
      decay_steps=max(int(total_steps), int(warmup_steps) + 1),
      end_value=learning_rate * final_fraction)
  decay_mask = lambda params: jax.tree.map(lambda x: jnp.ndim(x) >= 2, params)
  return optax.chain(
      optax.clip_by_global_norm(clip),
      optax.adamw(schedule, b1=b1, b2=b2, weight_decay=weight_decay, mask=decay_mask))


@struct.dataclass
class TrainState:
  step: jax.Array  # [] int32: steps taken
  params: Any
  opt_state: Any
  rng: jax.Array  # a raw uint32 key (new-style typed keys do not checkpoint)

  @classmethod
  def create(cls, params, optimizer: optax.GradientTransformation, rng: jax.Array
             ) -> "TrainState":
    if jnp.issubdtype(rng.dtype, jax.dtypes.prng_key):
      rng = jax.random.key_data(rng)
    return cls(jnp.int32(0), params, optimizer.init(params), rng)


def make_train_step(loss_fn: LossFn, optimizer: optax.GradientTransformation):
  """-> jitted step(state, batch) -> (state, metrics); `state` is donated.

  `loss_fn(params, batch, rng) -> (loss, metrics)`; metrics gain `loss` and `grad_norm`.
  """
  def step(state: TrainState, batch: Batch) -> tuple[TrainState, dict[str, jax.Array]]:
    rng, step_rng = jax.random.split(state.rng)
    (loss, metrics), grads = jax.value_and_grad(loss_fn, has_aux=True)(
        state.params, batch, step_rng)
    updates, opt_state = optimizer.update(grads, state.opt_state, state.params)
    params = optax.apply_updates(state.params, updates)
    metrics = dict(metrics, loss=loss, grad_norm=optax.tree.norm(grads))
    return TrainState(state.step + 1, params, opt_state, rng), metrics

  return jax.jit(step, donate_argnames=("state",))


# ---- checkpoints ------------------------------------------------------------------------------
#
# Crash safety. Orbax writes a step into a temporary directory and renames it when done, so a
# run killed mid-save leaves a `*.orbax-checkpoint-tmp-*` directory (removed on the next
# start, cleanup_tmp_directories), never a finished-looking step. On top of that, after each
# save of `latest` the loop records the step with a crc32 of every leaf in
# `latest/complete.json` (written to a temporary file, then renamed). Resuming takes the
# newest step that is recorded there, restores, and matches its checksums; any other step
# (half-written, damaged, or saved but killed before it was recorded) is set aside as
# `incomplete-<step>-<time>` with a warning, and the next older one is tried. `latest` keeps
# two steps, so the step before the one being saved survives any kill.

COMPLETE_FILE = "complete.json"


def _manager(directory: str, *, max_to_keep: int | None, best_metric: str | None = None
             ) -> ocp.CheckpointManager:
  # Synchronous saves: the next (donating) step may reuse the buffers being written.
  options = ocp.CheckpointManagerOptions(
      max_to_keep=max_to_keep, enable_async_checkpointing=False, create=True,
      cleanup_tmp_directories=True,
      best_fn=(lambda m: m[best_metric]) if best_metric else None, best_mode="min",
      keep_checkpoints_without_metrics=best_metric is None)
  return ocp.CheckpointManager(os.path.abspath(directory), options=options)


def _abstract(tree):
  return jax.tree.map(ocp.utils.to_shape_dtype_struct, tree)


def _checksums(tree) -> dict[str, str]:
  """{leaf name: crc32 of its bytes}; leaves no single host holds whole are left out."""
  out = {}
  for name, leaf in flatten_with_names(tree).items():
    if isinstance(leaf, jax.Array) and not leaf.is_fully_addressable:
      continue
    host = np.ascontiguousarray(np.asarray(jax.device_get(leaf)))
    out[name] = f"{zlib.crc32(host.reshape(-1).view(np.uint8)):08x}"
  return out


def _read_complete(directory: str) -> dict[str, dict[str, str]] | None:
  """{step: checksums} of the finished saves, or None (a directory from before the record)."""
  path = os.path.join(directory, COMPLETE_FILE)
  if not os.path.isfile(path):
    return None
  try:
    with open(path) as f:
      record = json.load(f)
  except (OSError, ValueError):
    return {}  # a damaged record vouches for nothing
  return record if isinstance(record, dict) else {}


def _write_complete(directory: str, record: dict[str, dict[str, str]]) -> None:
  path = os.path.join(directory, COMPLETE_FILE)
  tmp = f"{path}.tmp-{os.getpid()}"
  with open(tmp, "w") as f:
    json.dump(record, f, sort_keys=True)
    f.flush()
    os.fsync(f.fileno())
  os.replace(tmp, path)


def _record_save(mgr: ocp.CheckpointManager, directory: str, step: int, state) -> None:
  """Marks `step` as completely saved (after mgr.save returned), forgetting deleted steps."""
  record = _read_complete(directory) or {}
  kept = {str(s) for s in mgr.all_steps()}
  record = {k: v for k, v in record.items() if k in kept}
  record[str(step)] = _checksums(state)
  _write_complete(directory, record)


def _set_aside(directory: str, step: int, why: str) -> None:
  warnings.warn(f"{directory}: skipping checkpoint step {step} ({why}); resuming from an "
                "older one", RuntimeWarning, stacklevel=3)
  src = os.path.join(directory, str(step))
  if os.path.isdir(src):
    os.replace(src, os.path.join(directory, f"incomplete-{step}-{int(time.time())}"))


def _restore_checked(directory: str, like) -> tuple[Any, int] | None:
  """(state, step) of the newest complete, undamaged checkpoint in `directory`, or None."""
  directory = os.path.abspath(directory)
  if not os.path.isdir(directory):
    return None
  record = _read_complete(directory)
  with _manager(directory, max_to_keep=None) as mgr:
    steps = sorted(mgr.all_steps(), reverse=True)
  for step in steps:
    if record is not None and str(step) not in record:
      _set_aside(directory, step, "never recorded as complete: written by a killed run?")
      continue
    try:
      with _manager(directory, max_to_keep=None) as mgr:
        restored = mgr.restore(step, args=ocp.args.StandardRestore(_abstract(like)))
    except Exception as e:  # orbax raises assorted types for damaged checkpoints
      _set_aside(directory, step, f"unreadable: {type(e).__name__}: {str(e)[:200]}")
      continue
    if record is not None and _checksums(restored) != record[str(step)]:
      _set_aside(directory, step, "its data do not match the checksums recorded when saved")
      continue
    return restored, step
  return None


def restore_latest(directory: str, like: TrainState) -> TrainState | None:
  """The newest complete checkpoint in `directory`/latest shaped like `like`, or None.
  Half-written or damaged steps are set aside (see the comment above)."""
  found = _restore_checked(os.path.join(directory, "latest"), like)
  return None if found is None else found[0]


def restore_best(directory: str, like_params) -> tuple[Any, int] | None:
  """(params, step) of the best checkpoint kept by a train_loop with `best_metric`."""
  path = os.path.join(directory, "best")
  if not os.path.isdir(path):
    return None
  with ocp.CheckpointManager(os.path.abspath(path)) as mgr:
    step = mgr.latest_step()  # only one is kept
    if step is None:
      return None
    return mgr.restore(step, args=ocp.args.StandardRestore(_abstract(like_params))), step


# ---- the loop ---------------------------------------------------------------------------------

def _host(metrics: dict[str, jax.Array]) -> dict[str, float]:
  return {k: float(v) for k, v in jax.device_get(metrics).items()}


def train_loop(state: TrainState, batch_fn: Callable[[int], Batch], train_step, *,
               num_steps: int, checkpoint_dir: str | None = None, save_every: int = 500,
               eval_fn: Callable[[Any], dict[str, float]] | None = None, eval_every: int = 0,
               best_metric: str | None = None, tokens_per_step: int | None = None,
               log_every: int = 10, progress: bool = True, desc: str = "train",
               max_to_keep: int = 1) -> tuple[TrainState, dict[str, Any]]:
  """Runs `train_step` until `state.step == num_steps`; returns (state, info).

  With `checkpoint_dir`, resumes from `checkpoint_dir/latest` if a checkpoint is there
  (the passed `state` then only provides shapes), and saves there every `save_every`
  steps and at the end. `eval_fn(params) -> {name: value}` runs every `eval_every` steps
  and at the end; with `best_metric` (lower is better) the params with the best value are
  also kept in `checkpoint_dir/best` (read them back with `restore_best`).
  `info` holds the last train metrics, the eval history, wall time and tokens/s.
  """
  if best_metric is not None and (eval_fn is None or checkpoint_dir is None):
    raise ValueError("best_metric needs eval_fn and checkpoint_dir")
  latest = best = None
  if checkpoint_dir is not None:
    restored = restore_latest(checkpoint_dir, state)
    if restored is not None:
      state = restored
    latest_dir = os.path.abspath(os.path.join(checkpoint_dir, "latest"))
    latest = _manager(latest_dir, max_to_keep=max(max_to_keep, 2))  # one survives any kill
    if not latest.all_steps() and _read_complete(latest_dir) is None:
      _write_complete(latest_dir, {})  # from now on, only recorded steps count
    if best_metric is not None:
      best = _manager(os.path.join(checkpoint_dir, "best"), max_to_keep=1,
                      best_metric=best_metric)
  start = int(state.step)
  info: dict[str, Any] = {"start_step": start, "evals": [], "train": {}}

  def evaluate(step: int):
    result = dict(eval_fn(state.params), step=step)
    info["evals"].append(result)
    if best is not None and step not in best.all_steps():  # a resumed, finished run re-evaluates
      best.save(step, args=ocp.args.StandardSave(state.params), metrics=result)
    return result

  bar = None
  if progress:
    from tqdm.auto import tqdm
    bar = tqdm(total=num_steps, initial=start, desc=desc, dynamic_ncols=True)
  t0 = last_t = time.perf_counter()
  last_step, metrics = start, None
  for step in range(start, num_steps):
    state, metrics = train_step(state, batch_fn(step))
    done = step + 1
    if done % log_every == 0 or done == num_steps:
      info["train"] = _host(metrics)  # the only host sync: once per log_every steps
      now = time.perf_counter()
      if bar is not None:
        postfix = {"loss": f"{info['train']['loss']:.3f}"}
        if tokens_per_step:
          postfix["tok/s"] = f"{tokens_per_step * (done - last_step) / (now - last_t):.0f}"
        bar.set_postfix(postfix, refresh=False)
        bar.update(done - last_step)
      last_step, last_t = done, now
    if eval_fn is not None and eval_every and done % eval_every == 0 and done != num_steps:
      result = evaluate(done)
      if bar is not None:
        bar.write(f"{desc} step {done}: " + ", ".join(
            f"{k}={v:.4f}" for k, v in result.items() if k != "step"))
    if latest is not None and (done % save_every == 0 or done == num_steps):
      latest.save(done, args=ocp.args.StandardSave(state), force=True)
      _record_save(latest, latest_dir, done, state)
  if eval_fn is not None and (not info["evals"] or info["evals"][-1]["step"] != num_steps):
    evaluate(num_steps)
  if bar is not None:
    bar.close()
  for mgr in (latest, best):
    if mgr is not None:
      mgr.wait_until_finished()
      mgr.close()
  info["wall_s"] = time.perf_counter() - t0
  if tokens_per_step and num_steps > start:
    info["tokens_per_s"] = tokens_per_step * (num_steps - start) / info["wall_s"]
  return state, info
