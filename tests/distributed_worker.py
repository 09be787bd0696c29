"""One of two processes forming one 8-device mesh (4 CPU devices each), for test_sharding.

`python tests/distributed_worker.py PORT PROCESS_ID OUT.json`: joins the coordinator on
127.0.0.1:PORT, runs the case of sharding_worker.build_case on a global 2x4 mesh (data
across the processes, model within each) and writes the tokens it sees to OUT.json.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE), str(HERE.parent)]


def main(port: int, process_id: int, out_path: str) -> None:
  from spec_jax import distributed
  distributed.initialize(f"127.0.0.1:{port}", 2, process_id, cpu_devices=4, timeout_s=120)
  import jax
  from sharding_worker import GAMMA, NEW, build_case, tokens_of
  from spec_jax import sharding as sh
  from spec_jax.drafters.draft_model import DraftModelDrafter
  start = time.perf_counter()
  case = build_case()
  mesh = distributed.global_mesh()  # default: data over the 2 processes, model within each
  target = case["target"]
  params = sh.shard_params(case["params"], mesh, head_dim=target.config.resolved_head_dim)
  draft_params = sh.replicate(case["draft_params"], mesh)
  drafter = DraftModelDrafter(target)
  outputs = {
      "sp_greedy": sh.sharded_speculative_generate(
          target, params, drafter, draft_params, *case["prompts"], mesh=mesh, gamma=GAMMA,
          max_new_tokens=NEW),
      "sp_sampled": sh.sharded_speculative_generate(
          target, params, drafter, draft_params, *case["prompts"], mesh=mesh, gamma=GAMMA,
          max_new_tokens=NEW, sampling=case["sampling"], key=case["key"]),
  }
  from spec_jax.models.params_io import path_to_name
  wq = {path_to_name(p): x for p, x in jax.tree_util.tree_leaves_with_path(params)}[
      "layers.0.attn.wq.kernel"]
  # each process's half of the prompt rows -> one global batch, gathered back whole
  tokens = case["prompts"][0]
  half = tokens.shape[0] // 2
  batch = distributed.global_batch(tokens[process_id * half:(process_id + 1) * half], mesh)
  report = {
      "global_batch_roundtrip": bool((distributed.to_host(batch) == tokens).all()),
      "global_batch_local_rows": [s.data.shape[0] for s in batch.addressable_shards],
      "process_index": jax.process_index(), "process_count": jax.process_count(),
      "devices": jax.device_count(), "local_devices": jax.local_device_count(),
      "mesh": {k: int(v) for k, v in mesh.shape.items()},
      "wq_local_shards": [list(s.data.shape) for s in wq.addressable_shards],
      "outputs": {k: tokens_of(v) for k, v in outputs.items()},
      "seconds": time.perf_counter() - start,
  }
  distributed.sync("results")  # neither process leaves while the other still computes
  Path(out_path).write_text(json.dumps(report))
  distributed.shutdown()


if __name__ == "__main__":
  main(int(sys.argv[1]), int(sys.argv[2]), sys.argv[3])
