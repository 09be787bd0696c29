"""Sharding: sharded == unsharded on 8 simulated devices, two processes as one mesh, errors.

This pytest process already runs a 1-device CPU backend, and the device count can only be
set before a backend starts, so the 8-device checks run in subprocesses
(tests/sharding_worker.py, two parts side by side) and so does the two-process mesh
(tests/distributed_worker.py). They all start with the first test that needs them, run
concurrently, and are killed at the end or past their deadline. The checks of errors run
here, on abstract meshes.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path
from unittest.mock import ANY

import numpy as np
import pytest
from jax.sharding import AbstractMesh, AxisType, PartitionSpec as P

from conftest import tiny_llama
from spec_jax import sharding as sh

HERE = Path(__file__).resolve().parent
DEADLINE_S = 300  # all subprocesses together; ~50 s on 2 idle cores, more when others run
MESHES = ("1x8", "2x4", "8x1")
RUNS = ("ar_greedy", "ar_sampled", "sp_greedy", "sp_sampled", "sp_auto_greedy")
HEAD_DIM = 8


def abstract_mesh(data: int, model: int) -> AbstractMesh:
  return AbstractMesh((data, model), (sh.DATA, sh.MODEL), axis_types=(AxisType.Auto,) * 2)


def free_port() -> int:
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


class Jobs:
  """Subprocesses started together; each result is awaited under one shared deadline."""

  def __init__(self, folder: Path):
    self.folder = folder
    self.deadline = time.monotonic() + DEADLINE_S
    self.procs: dict[str, subprocess.Popen] = {}
    self.logs: dict[str, Path] = {}
    # unoptimised CPU code (same float32 semantics) compiles about twice as fast
    self.env = dict(os.environ, JAX_PLATFORMS="cpu",
                    XLA_FLAGS=(os.environ.get("XLA_FLAGS", "") +
                               " --xla_backend_optimization_level=0").strip())

  def start(self, name: str, script: str, *args) -> None:
    self.logs[name] = self.folder / f"{name}.log"
    with open(self.logs[name], "w") as log:
      self.procs[name] = subprocess.Popen(
          [sys.executable, str(HERE / script), *map(str, args), str(self.out(name))],
          stdout=log, stderr=subprocess.STDOUT, env=self.env, cwd=HERE.parent)

  def out(self, name: str) -> Path:
    return self.folder / f"{name}.json"

  def result(self, name: str) -> dict:
    proc = self.procs[name]
    try:
      proc.wait(timeout=max(1.0, self.deadline - time.monotonic()))
    except subprocess.TimeoutExpired:
      self.stop()
      pytest.fail(f"{name} still running after {DEADLINE_S} s: {self.tail(name)}")
    if proc.returncode != 0:
      pytest.fail(f"{name} exited with {proc.returncode}: {self.tail(name)}")
    return json.loads(self.out(name).read_text())

  def tail(self, name: str, chars: int = 3000) -> str:
    return self.logs[name].read_text()[-chars:]

  def stop(self) -> None:
    for proc in self.procs.values():
      if proc.poll() is None:
        proc.kill()
      proc.wait()


@pytest.fixture(scope="module")
def jobs(tmp_path_factory):
  jobs = Jobs(tmp_path_factory.mktemp("sharding"))
  try:
    jobs.start("part_a", "sharding_worker.py", "a")
    jobs.start("part_b", "sharding_worker.py", "b")
    port = free_port()
    for process_id in (0, 1):
      jobs.start(f"process_{process_id}", "distributed_worker.py", port, process_id)
    yield jobs
  finally:
    jobs.stop()


@pytest.fixture(scope="module")
def single(jobs):
  return jobs.result("part_a")["single"]


@pytest.fixture(scope="module")
def meshes(jobs):
  a, b = jobs.result("part_a"), jobs.result("part_b")
  assert a["devices"] == b["devices"] == 8
  return {**a["meshes"], **b["meshes"]}


# --- 8 simulated devices ------------------------------------------------------------------

@pytest.mark.parametrize("mesh", MESHES)
def test_sharded_tokens_identical_to_single_device(single, meshes, mesh):
  """Greedy and sampled (same key), autoregressive and speculative: the very same tokens."""
  outputs = meshes[mesh]["outputs"]
  for run in RUNS:
    assert outputs[run] == single[run], f"{mesh} {run}"
  assert single["sp_greedy"] == dict(single["ar_greedy"], accept_hist=ANY)  # lossless
  assert single["sp_auto_greedy"] == dict(single["ar_greedy"], accept_hist=ANY,
                                          width_rounds=ANY)
  assert sum(n > 0 for n in single["sp_auto_greedy"]["width_rounds"].values()) >= 2
  if mesh == "2x4":  # gamma="auto", its cost table measured on the mesh: still lossless
    assert meshes[mesh]["auto_measured"] == dict(single["ar_greedy"], accept_hist=ANY,
                                                 width_rounds=ANY)
  hist = single["sp_greedy"]["accept_hist"]  # rounds that accepted 0..gamma drafts
  assert sum(h > 0 for h in hist) >= 2, hist  # acceptance is ragged, not all or nothing


# [spec, shape of one shard] expected per mesh: the table written out by hand. The target
# has 8 query heads and 4 KV heads of 8, mlp 128, vocab 128, dim 64.
EXPECTED_PARAMS = {
    "1x8": {
        "embed": [["model", None], [16, 64]],
        "layers.0.attn.wq.kernel": [[None, "model"], [64, 8]],
        "layers.0.attn.wk.kernel": [[None, None], [64, 32]],  # 4 KV heads: replicated
        "layers.0.attn.wv.kernel": [[None, None], [64, 32]],
        "layers.0.attn.wo.kernel": [["model", None], [8, 64]],
        "layers.0.mlp.w_gate.kernel": [[None, "model"], [64, 16]],
        "layers.0.mlp.w_up.kernel": [[None, "model"], [64, 16]],
        "layers.0.mlp.w_down.kernel": [["model", None], [16, 64]],
        "layers.0.attn_norm.scale": [[None], [64]],
        "final_norm.scale": [[None], [64]],
    },
    "2x4": {
        "embed": [["model", None], [32, 64]],
        "layers.0.attn.wq.kernel": [[None, "model"], [64, 16]],
        "layers.0.attn.wk.kernel": [[None, "model"], [64, 8]],  # one KV head per shard
        "layers.0.attn.wv.kernel": [[None, "model"], [64, 8]],
        "layers.0.attn.wo.kernel": [["model", None], [16, 64]],
        "layers.0.mlp.w_gate.kernel": [[None, "model"], [64, 32]],
        "layers.0.mlp.w_up.kernel": [[None, "model"], [64, 32]],
        "layers.0.mlp.w_down.kernel": [["model", None], [32, 64]],
        "layers.0.mlp_norm.scale": [[None], [64]],
    },
    "8x1": {  # model axis of size 1: specs name it, every shard is whole
        "embed": [["model", None], [128, 64]],
        "layers.0.attn.wk.kernel": [[None, "model"], [64, 32]],
        "layers.0.mlp.w_down.kernel": [["model", None], [128, 64]],
    },
}
# batch 8, cache_len 8 + 12 new = 20 slots (a chain needs none past the budget), 4 KV
# heads of 8, one layer;
# spec (the same for k and v), k and v shards [L, B, K, E, S]
EXPECTED_CACHE = {
    "1x8": ([None, "data", None, None, None], [1, 8, 4, 8, 20], [1, 8, 4, 8, 20]),
    "2x4": ([None, "data", "model", None, None], [1, 4, 1, 8, 20], [1, 4, 1, 8, 20]),
    "8x1": ([None, "data", "model", None, None], [1, 1, 4, 8, 20], [1, 1, 4, 8, 20]),
}


@pytest.mark.parametrize("mesh", MESHES)
def test_params_and_caches_sharded_as_the_table_says(meshes, mesh):
  report = meshes[mesh]
  for name, expected in EXPECTED_PARAMS[mesh].items():
    assert report["params"][name] == expected, name
  assert len(report["params"]) == 11  # every leaf got a layout
  for name, (spec, _) in report["draft_params"].items():  # the draft: replicated
    assert spec == [None] * len(spec), name
  spec, shard, shard_v = EXPECTED_CACHE[mesh]
  assert report["cache"] == [spec, shard]
  assert report["cache_v"] == [spec, shard_v]
  # the draft cache is left to the compiler at the output, which drops size-1 axes
  for name, draft_shape in [("draft_cache", [1, shard[1], 4, 8, 20]),
                            ("draft_cache_v", [1, shard[1], 4, 8, 20])]:
    draft_spec, draft_shard = report[name]
    assert draft_spec == [None, "data" if mesh != "1x8" else None, None, None, None]
    assert draft_shard == draft_shape  # heads whole: the draft is replicated
  assert report["tokens_out"] == [[None, None], [8, 12]]  # outputs replicated


@pytest.mark.parametrize("mesh", MESHES)
def test_loop_carry_keeps_its_sharding(meshes, mesh):
  """In the compiled per-device program the rounds loop carries the caches as shards, and
  nothing with a cache-slot axis (caches, token buffer, attention) crosses devices inside
  any loop: the carry is never resharded."""
  loops = meshes[mesh]["loops"]
  _, target_shard, target_shard_v = EXPECTED_CACHE[mesh]
  batch = target_shard[1]
  # k and v: target shards, and the draft's whole-head caches
  carried = ["f32[{}]".format(",".join(map(str, shape))) for shape in
             (target_shard, target_shard_v, [1, batch, 4, 8, 20])]
  rounds = [c for c in loops["carries"] if f"s32[{batch},20]" in c]
  assert len(rounds) == 1, loops["carries"]
  assert all(rounds[0].count(shape) >= 1 for shape in carried), rounds[0]
  slots = 20
  for op, shape in loops["collectives"]:
    dims = [int(d) for d in shape[shape.index("[") + 1:-1].split(",") if d]
    assert slots not in dims, (op, shape)


def test_stories260k_with_kv_heads_replicated(jobs):
  stories = jobs.result("part_b")["stories"]
  if stories is None:
    pytest.skip("needs ../shared/models/stories260K")
  assert stories["sharded"] == stories["single"]
  params = stories["params"]
  assert params["layers.0.attn.wq.kernel"] == [[None, "model"], [64, 8]]  # 8 heads / 8
  assert params["layers.0.attn.wk.kernel"] == [[None, None], [64, 32]]  # 4 KV heads: whole
  assert params["layers.0.mlp.w_gate.kernel"] == [[None, None], [64, 172]]  # rules: mlp=None
  assert params["embed"] == [["model", None], [64, 64]]
  assert stories["cache"] == [[None, "data", None, None, None], [5, 5, 4, 8, 18]]
  assert stories["cache_v"] == [[None, "data", None, None, None], [5, 5, 4, 8, 18]]


def test_checkpoint_restores_into_the_sharding(jobs):
  ckpt = jobs.result("part_b")["checkpoint"]
  assert ckpt["same_model"] and ckpt["same_values"]
  assert ckpt["params"]["layers.0.attn.wq.kernel"] == [[None, "model"], [64, 16]]
  assert ckpt["params"]["embed"] == [["model", None], [32, 64]]
  assert ckpt["sharded"] == ckpt["single"]  # 5 prompts: the batch stays whole on `data`


def test_int8_quantized_leaves_follow_their_kernels(jobs):
  params = jobs.result("part_b")["quantized"]["params"]
  assert params["layers.0.attn.wq.kernel.values_IO"] == [[None, "model"], [64, 16]]
  assert params["layers.0.attn.wq.kernel.scale_O"] == [["model"], [16]]
  assert params["layers.0.mlp.w_down.kernel.values_IO"] == [["model", None], [32, 64]]
  assert params["layers.0.mlp.w_down.kernel.scale_O"] == [[None], [64]]


# --- two processes, one mesh --------------------------------------------------------------

def test_two_processes_form_one_mesh_with_the_same_tokens(jobs, single):
  for process_id in (0, 1):
    report = jobs.result(f"process_{process_id}")
    assert report["process_index"] == process_id and report["process_count"] == 2
    assert report["devices"] == 8 and report["local_devices"] == 4
    assert report["mesh"] == {"data": 2, "model": 4}
    assert report["wq_local_shards"] == [[64, 16]] * 4
    assert report["global_batch_roundtrip"] and report["global_batch_local_rows"] == [4] * 4
    for run, out in report["outputs"].items():
      assert out == single[run], (process_id, run)


# --- errors, here on abstract meshes ------------------------------------------------------

def test_indivisible_dimension_names_parameter_dimension_axis_and_sizes(stories):
  model, params = stories  # mlp 172, 8 heads, 4 KV heads of 8
  mesh = abstract_mesh(1, 8)
  with pytest.raises(ValueError, match=r"parameter layers\.0\.mlp\.w_(down|gate|up)\.kernel, "
                     r"dimension [01] \(size 172\): mlp of size 172 is not divisible by mesh "
                     r"axis 'model' of size 8"):
    sh.param_specs(params, mesh, head_dim=HEAD_DIM)
  with pytest.raises(ValueError, match=r"parameter layers\.0\.mlp\.w_gate\.kernel, dimension 1 "
                     r"\(size 172\): mlp of size 172 is not divisible by mesh axis 'model' "
                     r"of size 8"):
    sh.param_spec("layers.0.mlp.w_gate.kernel", (64, 172), mesh, head_dim=HEAD_DIM)
  # heads are counted whole: 32 columns divide by 8, 4 heads do not
  with pytest.raises(ValueError, match=r"parameter layers\.0\.attn\.wq\.kernel, dimension 1 "
                     r"\(size 32 = 4 heads of 8\): q_heads of size 4 is not divisible by mesh "
                     r"axis 'model' of size 8"):
    sh.param_spec("layers.0.attn.wq.kernel", (32, 32), mesh, head_dim=HEAD_DIM)
  # fewer KV heads than shards: replicated (GQA), as the rules allow by default
  assert sh.param_spec("layers.0.attn.wk.kernel", (64, 32), mesh, head_dim=HEAD_DIM) == \
      P(None, None)
  strict = sh.DEFAULT_RULES.replace(replicate_if_indivisible=frozenset())
  with pytest.raises(ValueError, match=r"kv_heads of size 4 is not divisible"):
    sh.param_spec("layers.0.attn.wk.kernel", (64, 32), mesh, strict, head_dim=HEAD_DIM)
  with pytest.raises(ValueError, match=r"parameter embed, dimension 0 \(size 32\): vocab of size "
                     r"32 is not divisible by mesh axis 'model' of size 3"):
    sh.param_spec("embed", (32, 16), abstract_mesh(1, 3))
  with pytest.raises(ValueError, match="needs a head_dim"):
    sh.param_spec("layers.0.attn.wq.kernel", (32, 32), abstract_mesh(1, 2))


def test_rules_and_mesh_errors():
  _, params = tiny_llama()
  with pytest.raises(ValueError, match=r"maps mlp to mesh axis 'tensor', but the mesh has "
                     r"axes \('data', 'model'\)"):
    sh.param_specs(params, abstract_mesh(1, 2), sh.DEFAULT_RULES.replace(mlp="tensor"),
                   head_dim=HEAD_DIM)
  with pytest.raises(ValueError, match="mesh axis used twice"):
    sh.param_specs(params, abstract_mesh(1, 2), sh.DEFAULT_RULES.replace(embed="model"),
                   head_dim=HEAD_DIM)
  with pytest.raises(ValueError, match="no sharding rule matches"):
    sh.param_logical_axes("layers.0.attn.rotary.kernel")
  with pytest.raises(ValueError, match=r"data=3 x model=3 does not match the 1 devices"):
    sh.make_mesh(3, 3)
  model, params = tiny_llama()
  with pytest.raises(ValueError, match="not placed on the mesh"):
    sh.sharded_generate(model, {"w": np.zeros(2)}, [[1, 2]], [2], mesh=sh.make_mesh(1, 1),
                        max_new_tokens=2)


def test_checkpoint_that_does_not_match_the_model(tmp_path):
  from spec_jax.models.native import save_native
  from spec_jax.models.params_io import CheckpointError
  model, params = tiny_llama(hidden_dim=48)
  save_native(str(tmp_path), model, params)
  mesh = sh.make_mesh(1, 1)
  other, _ = tiny_llama(hidden_dim=64)
  with pytest.raises(ValueError, match=r"checkpoint .*: parameter "
                     r"layers\.0\.mlp\.w_down\.kernel has shape \(48, 32\), the model expects "
                     r"\(64, 32\)"):
    sh.load_sharded(str(tmp_path), mesh, expect=other)
  deeper, _ = tiny_llama(hidden_dim=48, n_layers=3)
  with pytest.raises(ValueError, match=r"missing \['layers\.2\."):
    sh.load_sharded(str(tmp_path), mesh, expect=deeper)
  # config.json saying other than the saved arrays: refused before any array is read (a width
  # below the file's largest dimension, so the shape check, not the size bound, catches it)
  config = json.loads((tmp_path / "config.json").read_text())
  (tmp_path / "config.json").write_text(json.dumps(dict(config, hidden_dim=40)))
  with pytest.raises(CheckpointError,
                     match=r"w_down\.kernel has shape \(48, 32\), config\.json expects"):
    sh.load_sharded(str(tmp_path), mesh)
  # restored into a 1x1 mesh when it matches
  (tmp_path / "config.json").write_text(json.dumps(config))
  loaded, restored = sh.load_sharded(str(tmp_path), mesh, expect=model)
  assert loaded == model
  leaf = restored["embed"][...]
  assert leaf.sharding.mesh.shape == {"data": 1, "model": 1}
