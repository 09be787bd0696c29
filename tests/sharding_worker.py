"""The 8-device half of tests/test_sharding.py, run in a process of its own.

`python tests/sharding_worker.py PART OUT.json` simulates 8 CPU devices (possible only
before JAX's backend starts, hence a fresh process), runs generation on one device and
under the meshes 1x8, 2x4 and 8x1, and writes tokens and shardings to OUT.json for the
test to check. `build_case` is shared with tests/distributed_worker.py.
"""

from __future__ import annotations

import json
import re
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE), str(HERE.parent)]

MESHES = ((1, 8), (2, 4), (8, 1))
NEW, GAMMA = 12, 3  # 8-token prompts + 12 = 20 cache slots, a size nothing else has
STORIES_BIN = HERE.parent.parent / "shared" / "models" / "stories260K" / "stories260K.bin"


def build_case():
  """Target (8 query / 4 KV heads of 8, mlp 128, vocab 128), a noisy draft, 8 prompts."""
  import jax
  from conftest import perturbed, tiny_llama
  from spec_jax.generate import pad_prompts
  from spec_jax.core.sampling import SamplingConfig
  target, params = tiny_llama(vocab_size=128, dim=64, n_layers=1, n_heads=8, n_kv_heads=4,
                              hidden_dim=128, seed=3)
  draft_params = perturbed(params, 0.3, seed=4)  # agrees with the target part of the time
  rng = np.random.default_rng(0)
  prompts = [rng.integers(1, 128, size=n).tolist() for n in (3, 5, 7, 2, 6, 4, 8, 1)]
  return dict(target=target, params=params, draft_params=draft_params,
              prompts=pad_prompts(prompts, width=8), sampling=SamplingConfig(0.8, top_k=16),
              key=jax.random.key(7))


def tokens_of(out) -> dict:
  """Tokens, counts, and for speculative runs how many drafts each row-round accepted."""
  from spec_jax.metrics import summarize
  report = {"tokens": np.asarray(out.tokens).tolist(),
            "num_tokens": np.asarray(out.num_tokens).tolist()}
  if out.metrics is not None:
    summary = summarize(out.metrics)
    report["accept_hist"] = summary["accept_hist"]
    if "adaptive" in summary:  # gamma="auto": rounds per verification width
      report["width_rounds"] = {str(w): n for w, n in summary["adaptive"]["width_rounds"].items()}
  return report


def run_all(case, gen, spec) -> dict:
  """Greedy and sampled, autoregressive and speculative, through the given entry points."""
  from spec_jax.adaptive import AdaptiveConfig, AdaptiveRules
  from spec_jax.drafters.draft_model import DraftModelDrafter
  t, tp, dp = case["target"], case["params"], case["draft_params"]
  drafter = DraftModelDrafter(t)
  sampled = dict(sampling=case["sampling"], key=case["key"])
  # adaptive rounds with a fixed cost table (flat, free drafts: every width gets used), so
  # sharded and single-device runs make the same decisions
  # (no look at the prompt: on these random-token prompts the noisy draft agrees with the
  # target at 9 of 36 positions, and the estimates it leaves keep 12 tokens at few widths)
  auto = AdaptiveConfig(GAMMA, target_costs=(1.0, 1.0, 1.0, 1.0), draft_cost=0.0,
                        rules=AdaptiveRules(prompt_look=False))
  return {
      "sp_auto_greedy": tokens_of(spec(t, tp, drafter, dp, *case["prompts"], gamma=auto,
                                       max_new_tokens=NEW)),
      "ar_greedy": tokens_of(gen(t, tp, *case["prompts"], max_new_tokens=NEW)),
      "ar_sampled": tokens_of(gen(t, tp, *case["prompts"], max_new_tokens=NEW, **sampled)),
      "sp_greedy": tokens_of(spec(t, tp, drafter, dp, *case["prompts"], gamma=GAMMA,
                                  max_new_tokens=NEW)),
      "sp_sampled": tokens_of(spec(t, tp, drafter, dp, *case["prompts"], gamma=GAMMA,
                                   max_new_tokens=NEW, **sampled)),
  }


def layout(x) -> list:
  """[spec padded to the array's rank, shape of one shard]."""
  spec = list(x.sharding.spec) + [None] * (x.ndim - len(x.sharding.spec))
  return [spec, list(x.addressable_shards[0].data.shape)]


def layouts(tree) -> dict:
  import jax
  from spec_jax.models.params_io import path_to_name
  return {path_to_name(p): layout(x) for p, x in jax.tree_util.tree_leaves_with_path(tree)}


def loop_report(program, args) -> dict:
  """The while loops' carried types, and every collective inside a loop body (from the HLO)."""
  from spec_jax.testing import compiled_text
  hlo = compiled_text(program.lower(*args))  # as users compile it
  carries = [m.group(1) for m in re.finditer(r"= \((.*?)\) while\(", hlo)]
  collectives = []
  for line in hlo.splitlines():
    m = re.search(r"= (\w+\[[\d,]*\])\S* (all-gather|all-reduce|all-to-all|collective-permute"
                  r"|reduce-scatter)\(", line)
    where = re.search(r'op_name="([^"]*)"', line)
    if m and where and "while/body" in where.group(1):
      collectives.append([m.group(2), m.group(1)])
  return {"carries": carries, "collectives": collectives}


def mesh_checks(case, mesh) -> dict:
  from spec_jax import sharding as sh
  from spec_jax.drafters.draft_model import DraftModelDrafter
  head_dim = case["target"].config.resolved_head_dim
  params = sh.shard_params(case["params"], mesh, head_dim=head_dim)
  draft_params = sh.replicate(case["draft_params"], mesh)
  placed = dict(case, params=params, draft_params=draft_params)
  gen = lambda *a, **k: sh.sharded_generate(*a, mesh=mesh, **k)
  spec = lambda *a, **k: sh.sharded_speculative_generate(*a, mesh=mesh, **k)
  report = {"outputs": run_all(placed, gen, spec), "params": layouts(params),
            "draft_params": layouts(draft_params)}
  # the same speculative program again (compiled already): final caches and its loops
  program, args = sh.prepare_speculative(case["target"], params, DraftModelDrafter(case["target"]),
                                         draft_params, *case["prompts"], mesh=mesh, gamma=GAMMA,
                                         max_new_tokens=NEW)
  out, cache, draft_state = program(*args)
  if mesh.shape["data"] == 2:  # gamma="auto" with its cost table measured on the mesh
    report["auto_measured"] = tokens_of(spec(case["target"], params, DraftModelDrafter(
        case["target"]), draft_params, *case["prompts"], gamma="auto", max_new_tokens=NEW))
  report.update(cache=layout(cache.k_LBKES), cache_v=layout(cache.v_LBKES),
                draft_cache=layout(draft_state.cache.k_LBKES),
                draft_cache_v=layout(draft_state.cache.v_LBKES),
                tokens_out=layout(out.tokens), loops=loop_report(program, args))
  return report


def stories_check(mesh) -> dict | None:
  """stories260K (4 KV heads, mlp 172) on 1x8 with the mlp replicated: KV heads replicated."""
  if not STORIES_BIN.exists():
    return None
  from spec_jax.models.llama2c import load_llama2c
  from spec_jax import sharding as sh
  from spec_jax.generate import generate, pad_prompts
  model, params = load_llama2c(str(STORIES_BIN))
  prompts = pad_prompts([[1, 403, 407], [1, 300, 263, 400, 271], [1, 413, 409, 416, 327],
                         [1, 263], [1, 415, 294, 300]], width=6)
  rules = sh.DEFAULT_RULES.replace(mlp=None)
  placed = sh.shard_params(params, mesh, rules, head_dim=model.config.resolved_head_dim)
  out, cache = sh.sharded_generate(model, placed, *prompts, mesh=mesh, rules=rules,
                                   max_new_tokens=NEW, return_cache=True)
  return {"single": tokens_of(generate(model, params, *prompts, max_new_tokens=NEW)),
          "sharded": tokens_of(out), "params": layouts(placed), "cache": layout(cache.k_LBKES),
          "cache_v": layout(cache.v_LBKES)}


def checkpoint_check(case, mesh) -> dict:
  """Native checkpoint restored straight into the 2x4 sharding; 5 prompts (batch % 2 != 0)."""
  import jax
  from spec_jax.models.native import save_native
  from spec_jax import sharding as sh
  from spec_jax.generate import generate
  target, params = case["target"], case["params"]
  tokens, lengths = (x[:5] for x in case["prompts"])
  with tempfile.TemporaryDirectory() as folder:
    save_native(folder, target, params, overwrite=True)
    model, restored = sh.load_sharded(folder, mesh, expect=target)
  same = all(np.array_equal(np.asarray(a), np.asarray(b))
             for a, b in zip(jax.tree.leaves(params), jax.tree.leaves(restored)))
  out = sh.sharded_generate(model, restored, tokens, lengths, mesh=mesh, max_new_tokens=NEW)
  return {"same_model": model == target, "same_values": same, "params": layouts(restored),
          "single": tokens_of(generate(target, params, tokens, lengths, max_new_tokens=NEW)),
          "sharded": tokens_of(out)}


def quantized_check(case, mesh) -> dict:
  """Where int8 leaves (values [in, out], scale [out]) go; layouts only."""
  from spec_jax import sharding as sh
  from spec_jax.core.quantize import quantize_params
  qparams = quantize_params(case["params"])
  head_dim = case["target"].config.resolved_head_dim
  return {"params": layouts(sh.shard_params(qparams, mesh, head_dim=head_dim))}


def main(part: str, out_path: str) -> None:
  """Part "a": the single-device reference, meshes 1x8 and 8x1; part "b": the rest.

  Two parts so that the test can run them side by side (compiling takes one core).
  """
  import jax
  jax.config.update("jax_num_cpu_devices", 8)  # before anything starts the backend
  from spec_jax import sharding as sh
  from spec_jax.generate import generate
  from spec_jax.speculative import speculative_generate
  start = time.perf_counter()
  case = build_case()
  results = {"devices": jax.device_count(), "meshes": {}}
  if part == "a":
    results["single"] = run_all(case, generate, speculative_generate)
  for data, model in (MESHES[0], MESHES[2]) if part == "a" else (MESHES[1],):
    results["meshes"][f"{data}x{model}"] = mesh_checks(case, sh.make_mesh(data, model))
  if part == "b":
    results["stories"] = stories_check(sh.make_mesh(1, 8))
    results["checkpoint"] = checkpoint_check(case, sh.make_mesh(2, 4))
    results["quantized"] = quantized_check(case, sh.make_mesh(2, 4))
  results["seconds"] = time.perf_counter() - start
  Path(out_path).write_text(json.dumps(results))


if __name__ == "__main__":
  main(sys.argv[1], sys.argv[2])
