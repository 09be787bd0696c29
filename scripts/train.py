"""Train the built-in model pair from scratch: tokenizer -> target -> distilled draft.

  python scripts/train.py --out models/builtin            # the shipped pair (~1 h on 2 cores)
  python scripts/train.py --out models/builtin --resume   # continue an interrupted run
  python scripts/train.py --out /tmp/pair --quick         # a seconds-long smoke version
  python scripts/train.py --out models/builtin --eval-only  # re-measure, rewrite README.md

Corpus: the Python standard library's own source (spec_jax.training.data), a fixed 5% of files held
out. Stages: a byte-level BPE tokenizer (`tokenizers`); a Llama target trained with
next-token cross-entropy; a much shallower draft distilled from the frozen target's logits
(forward KL, so its distribution covers the target's and acceptance rises). Both run
through spec_jax.training (AdamW, warm-up + cosine, clipping, orbax checkpoints in
--work-dir: rerun with --resume after an interruption); the params with the best held-out
loss are exported with int8 matrices (spec_jax.models.builtin; the draft is distilled from the
target as exported). Last, it measures held-out losses, greedy
acceptance for several gammas and the speed-up over autoregressive decoding, and writes
training.json and README.md beside the weights.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import platform
import re
import sys
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
  sys.path.insert(0, str(REPO))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from spec_jax import cli  # noqa: E402
from spec_jax.core.errors import BadArgument  # noqa: E402
from spec_jax.models import builtin  # noqa: E402
from spec_jax.models.llama import LlamaConfig, LlamaModel  # noqa: E402
from spec_jax.models.params_io import params_from_flat, params_to_flat, path_to_name  # noqa: E402
from spec_jax.training import data  # noqa: E402
from spec_jax.training import (TrainState, distillation_kl, make_optimizer,  # noqa: E402
                               make_train_step, next_token_cross_entropy, restore_best,
                               train_loop)

SEP = "<|endoftext|>"  # separates files; also BOS (prompts start like a file) and EOS


@dataclasses.dataclass(frozen=True)
class Recipe:
  vocab_size: int
  target: dict[str, int]  # LlamaConfig fields beyond vocab_size / max_seq_len
  draft: dict[str, int]
  seq_len: int  # training window; also the models' max_seq_len
  batch_size: int
  target_steps: int
  draft_steps: int
  target_lr: float = 3e-3
  draft_lr: float = 3e-3
  warmup_steps: int = 50
  weight_decay: float = 0.1
  clip: float = 1.0
  draft_ce_weight: float = 0.0  # KL(target || draft) + this * CE(data)
  eval_windows: int = 24
  eval_every: int = 150
  save_every: int = 50
  max_train_chars: int | None = None  # --quick: a small corpus
  max_heldout_files: int | None = None
  # measurements
  gammas: tuple[int, ...] = (2, 3, 4, 5, 6)
  num_prompts: int = 5
  new_tokens: int = 128
  repeats: int = 5


FULL = Recipe(
    vocab_size=2048,
    # The target's float32 weights (41 MB) exceed this CPU's 32 MB L3 on purpose: a step then
    # streams them from memory, as on accelerators, and verifying a few tokens costs little
    # more than one step. A target that fits in cache verifies 5 tokens at ~2x a step.
    target=dict(dim=384, n_layers=6, n_heads=6, n_kv_heads=2, hidden_dim=1024),
    draft=dict(dim=192, n_layers=3, n_heads=4, n_kv_heads=2, hidden_dim=512),
    seq_len=384, batch_size=4, target_steps=1500, draft_steps=1200, target_lr=2e-3,
    warmup_steps=60, eval_every=250)

QUICK = Recipe(
    vocab_size=320,
    target=dict(dim=32, n_layers=2, n_heads=2, n_kv_heads=1, hidden_dim=64),
    draft=dict(dim=16, n_layers=1, n_heads=2, n_kv_heads=1, hidden_dim=32),
    seq_len=64, batch_size=4, target_steps=6, draft_steps=4, warmup_steps=2, eval_windows=2,
    eval_every=0, save_every=3, max_train_chars=100_000, max_heldout_files=4, gammas=(2,),
    num_prompts=2, new_tokens=16, repeats=1)


# ---- params as plain nested dicts (robust in orbax checkpoints), NNX State for the model --------

def to_tree(params) -> dict[str, Any]:
  tree: dict[str, Any] = {}
  for name, leaf in params_to_flat(params).items():
    *parents, last = name.split(".")
    node = tree
    for p in parents:
      node = node.setdefault(p, {})
    node[last] = jnp.asarray(leaf)
  return tree


def to_state(model: LlamaModel, tree):
  flat = {path_to_name(p): leaf for p, leaf in jax.tree_util.tree_leaves_with_path(tree)}
  return params_from_flat(model, flat, source="training params")


def forward(model: LlamaModel, tree, tokens_BT):
  """Logits [B,T,V] of a causal pass over full windows (a cache of exactly T slots)."""
  batch, length = tokens_BT.shape
  positions_BT = jnp.broadcast_to(jnp.arange(length, dtype=jnp.int32), (batch, length))
  logits_BTV, _, _ = model.apply(to_state(model, tree), tokens_BT, positions_BT,
                                 model.init_cache(batch, length))
  return logits_BTV


def make_models(recipe: Recipe) -> tuple[LlamaModel, LlamaModel]:
  common = dict(vocab_size=recipe.vocab_size, max_seq_len=recipe.seq_len, tie_embeddings=True)
  return (LlamaModel(LlamaConfig(**recipe.target, **common)),
          LlamaModel(LlamaConfig(**recipe.draft, **common)))


# ---- corpus and tokenizer -----------------------------------------------------------------------

def corpus_texts(recipe: Recipe) -> tuple[list[str], list[str], dict[str, Any]]:
  root = data.stdlib_root()
  train_files, heldout_files = data.split_files(data.stdlib_files(root), root)
  if recipe.max_heldout_files is not None:
    heldout_files = heldout_files[:recipe.max_heldout_files]
  if recipe.max_train_chars is not None:  # the first files up to about that many characters
    sizes = np.cumsum([p.stat().st_size for p in train_files])
    train_files = train_files[:int(np.searchsorted(sizes, recipe.max_train_chars)) + 1]
  train = data.read_texts(train_files)
  info = {"stdlib": str(root), "python": platform.python_version(),
          "excluded_dirs": sorted(data.EXCLUDED_DIRS), "heldout_percent": data.HELDOUT_PERCENT,
          "train_files": len(train), "heldout_files": len(heldout_files),
          "train_chars": sum(map(len, train))}
  return train, data.read_texts(heldout_files), info


def train_tokenizer(texts: list[str], vocab_size: int):
  from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
  tok = Tokenizer(models.BPE())
  tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
  tok.decoder = decoders.ByteLevel()
  trainer = trainers.BpeTrainer(vocab_size=vocab_size, min_frequency=2, special_tokens=[SEP],
                                initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                show_progress=False)
  tok.train_from_iterator(texts, trainer)
  return tok


def write_tokenizer(tok, folder: Path) -> None:
  folder.mkdir(parents=True, exist_ok=True)
  tok.save(str(folder / "tokenizer.json"))
  (folder / "tokenizer_config.json").write_text(json.dumps(
      {"bos_token": SEP, "eos_token": SEP, "model_max_length": None}, indent=2) + "\n")


def load_or_train_tokenizer(train: list[str], recipe: Recipe, work: Path, resume: bool):
  from tokenizers import Tokenizer
  path = work / "tokenizer.json"
  if resume and path.is_file():  # BPE ties may break differently run to run: keep the ids
    return Tokenizer.from_file(str(path))
  tok = train_tokenizer(train, recipe.vocab_size)
  write_tokenizer(tok, work)
  return tok


def encode_batch_fn(tok):
  return lambda texts: [e.ids for e in tok.encode_batch(texts)]


# ---- training stages ----------------------------------------------------------------------------

def merge_stage_record(folder: Path, info: dict[str, Any], best_step: int) -> dict[str, Any]:
  """Adds this session's wall time and evals to `folder/record.json`, so a resumed run
  still reports the whole stage: total wall time, full eval history, training tokens/s."""
  path = folder / "record.json"
  record = json.loads(path.read_text()) if path.is_file() else {"wall_s": 0.0, "evals": []}
  record["wall_s"] += info["wall_s"]
  evals = {e["step"]: e for e in record["evals"]}
  evals.update({e["step"]: e for e in info["evals"]})
  record["evals"] = [evals[k] for k in sorted(evals)]
  if info.get("tokens_per_s"):  # sessions that trained; the last one wins
    record["tokens_per_s"] = info["tokens_per_s"]
  if info.get("train"):
    record["train"] = info["train"]
  record["best_step"] = best_step
  path.write_text(json.dumps(record, indent=2) + "\n")
  return record


def eval_windows(heldout_N: np.ndarray, recipe: Recipe) -> np.ndarray:
  return data.sequential_windows(heldout_N, recipe.seq_len, recipe.eval_windows)


def chunked_mean(fn, windows_NT: np.ndarray, chunk: int) -> dict[str, float]:
  """Mean over windows of fn(windows chunk) -> {name: mean}, chunk by chunk."""
  sums: dict[str, float] = {}
  for i in range(0, len(windows_NT), chunk):
    part = windows_NT[i:i + chunk]
    for k, v in jax.device_get(fn(jnp.asarray(part))).items():
      sums[k] = sums.get(k, 0.0) + float(v) * len(part)
  return {k: v / len(windows_NT) for k, v in sums.items()}


def train_target(model: LlamaModel, stream_N, windows_NT, recipe: Recipe, work: Path,
                 seed: int, progress: bool):
  def loss_fn(tree, tokens_BT, rng):
    return next_token_cross_entropy(forward(model, tree, tokens_BT), tokens_BT), {}

  @jax.jit
  def heldout(tree, tokens_BT):
    return {"heldout_ce": next_token_cross_entropy(forward(model, tree, tokens_BT), tokens_BT)}

  optimizer = make_optimizer(recipe.target_lr, recipe.warmup_steps, recipe.target_steps,
                             weight_decay=recipe.weight_decay, clip=recipe.clip)
  params = to_tree(model.init_params(jax.random.key(seed)))
  state = TrainState.create(params, optimizer, jax.random.key(seed + 1))
  batch_fn = lambda step: data.random_windows(stream_N, recipe.batch_size, recipe.seq_len,
                                              seed, step)
  state, info = train_loop(
      state, batch_fn, make_train_step(loss_fn, optimizer), num_steps=recipe.target_steps,
      checkpoint_dir=str(work / "target"), save_every=recipe.save_every,
      eval_fn=lambda p: chunked_mean(lambda w: heldout(p, w), windows_NT, recipe.batch_size),
      eval_every=recipe.eval_every, best_metric="heldout_ce",
      tokens_per_step=recipe.batch_size * recipe.seq_len, progress=progress, desc="target")
  best, best_step = restore_best(str(work / "target"), state.params)
  return best, merge_stage_record(work / "target", info, int(best_step))


def train_draft(draft: LlamaModel, target: LlamaModel, target_tree, stream_N, windows_NT,
                recipe: Recipe, work: Path, seed: int, progress: bool):
  def losses(tree, target_tree, tokens_BT):
    teacher_BTV = forward(target, target_tree, tokens_BT)
    student_BTV = forward(draft, tree, tokens_BT)
    agree = jnp.mean(jnp.argmax(student_BTV, -1) == jnp.argmax(teacher_BTV, -1))
    return {"kl": distillation_kl(student_BTV, teacher_BTV),
            "ce": next_token_cross_entropy(student_BTV, tokens_BT), "agree": agree}

  def loss_fn(tree, batch, rng):
    m = losses(tree, batch["target_params"], batch["tokens"])
    return m["kl"] + recipe.draft_ce_weight * m["ce"], m

  @jax.jit
  def heldout(tree, target_tree, tokens_BT):
    return {f"heldout_{k}": v for k, v in losses(tree, target_tree, tokens_BT).items()}

  optimizer = make_optimizer(recipe.draft_lr, recipe.warmup_steps, recipe.draft_steps,
                             weight_decay=recipe.weight_decay, clip=recipe.clip)
  params = to_tree(draft.init_params(jax.random.key(seed + 2)))
  state = TrainState.create(params, optimizer, jax.random.key(seed + 3))
  # other windows than the target saw first (seed + 1), from the same training stream
  batch_fn = lambda step: {
      "tokens": data.random_windows(stream_N, recipe.batch_size, recipe.seq_len, seed + 1, step),
      "target_params": target_tree}
  state, info = train_loop(
      state, batch_fn, make_train_step(loss_fn, optimizer), num_steps=recipe.draft_steps,
      checkpoint_dir=str(work / "draft"), save_every=recipe.save_every,
      eval_fn=lambda p: chunked_mean(lambda w: heldout(p, target_tree, w), windows_NT,
                                     recipe.batch_size),
      eval_every=recipe.eval_every, best_metric="heldout_kl",
      tokens_per_step=recipe.batch_size * recipe.seq_len, progress=progress, desc="draft")
  best, best_step = restore_best(str(work / "draft"), state.params)
  return best, merge_stage_record(work / "draft", info, int(best_step))


# ---- measurements -------------------------------------------------------------------------------

_DEF = re.compile(r"^\s*def \w+\(.*\):\s*$")


def code_prompts(heldout_texts: list[str], tokenizer, count: int, max_tokens: int
                 ) -> list[tuple[str, list[int]]]:
  """Up to `count` prompts from held-out files spread over the list: the first `def ...:`
  line of a file with the lines just before it, so the model continues a function body."""
  found = []
  for text in heldout_texts:
    lines = text.splitlines(keepends=True)
    hit = next((i for i, line in enumerate(lines) if _DEF.match(line)), None)
    if hit is not None:
      found.append("".join(lines[max(0, hit - 4):hit + 1]))
  picks = [found[i * len(found) // count] for i in range(min(count, len(found)))]
  prompts = []
  for text in picks:
    ids = tokenizer.encode(text, add_bos=False)[-(max_tokens - 1):]
    prompts.append((tokenizer.decode(ids), [tokenizer.bos_id] + ids))
  return prompts


def _median_time(fn, repeats: int) -> float:
  times = []
  for _ in range(repeats):
    t0 = time.perf_counter()
    jax.block_until_ready(fn())
    times.append(time.perf_counter() - t0)
  return float(np.median(times))


def step_costs(model: LlamaModel, params, tokens: int, *, cache_len: int, position: int,
               steps: int = 64, repeats: int = 5) -> float:
  """Seconds per forward pass over `tokens` tokens at batch 1, inside one jitted loop (as in
  generation: no per-call dispatch), each pass fed the previous pass's argmax."""
  @jax.jit
  def loop(params, cache, tokens_BT, positions_BT):
    def body(_, carry):
      cache, tokens_BT = carry
      logits_BTV, _, cache = model.apply(params, tokens_BT, positions_BT, cache)
      return cache, jnp.argmax(logits_BTV, axis=-1).astype(jnp.int32)
    return jax.lax.fori_loop(0, steps, body, (cache, tokens_BT))[1]

  args = (params, model.init_cache(1, cache_len), jnp.zeros((1, tokens), jnp.int32),
          position + jnp.arange(tokens, dtype=jnp.int32)[None])
  jax.block_until_ready(loop(*args))
  return _median_time(lambda: loop(*args), repeats) / steps


def measure(folder: Path, heldout_texts: list[str], recipe: Recipe) -> dict[str, Any]:
  """Held-out acceptance (greedy) per gamma, losslessness, and speed-up; batch 1, no EOS."""
  from spec_jax.drafters.draft_model import DraftModelDrafter
  from spec_jax.generate import generate, pad_prompts
  from spec_jax.metrics import summarize
  from spec_jax.speculative import speculative_generate

  target, target_params, draft, draft_params, tokenizer = builtin.load_builtin(folder)
  drafter = DraftModelDrafter(draft)
  width = min(64, recipe.seq_len // 4)
  prompts = code_prompts(heldout_texts, tokenizer, recipe.num_prompts, width)
  n = recipe.new_tokens

  def padded(ids):
    return pad_prompts([ids], width=width)

  def run_ar(ids):
    tokens, lengths = padded(ids)
    return generate(target, target_params, tokens, lengths, max_new_tokens=n)

  def run_spec(ids, gamma):
    tokens, lengths = padded(ids)
    return speculative_generate(target, target_params, drafter, draft_params, tokens, lengths,
                                gamma=gamma, max_new_tokens=n)

  result: dict[str, Any] = {"prompts": [text for text, _ in prompts], "new_tokens": n,
                            "gammas": {}, "lossless": True}
  ar_out = [np.asarray(run_ar(ids).tokens) for _, ids in prompts]  # also compiles
  ar_time = [_median_time(lambda ids=ids: run_ar(ids).tokens, recipe.repeats)
             for _, ids in prompts]
  result["autoregressive_s"] = ar_time
  for gamma in recipe.gammas:
    accepted, rounds, times = 0, 0, []
    for (_, ids), ref in zip(prompts, ar_out):
      out = run_spec(ids, gamma)  # compiles on the first prompt
      result["lossless"] &= bool(np.array_equal(np.asarray(out.tokens), ref))
      m = summarize(out.metrics)
      accepted += m["mean_accepted"] * m["row_rounds"]
      rounds += m["row_rounds"]
      times.append(_median_time(lambda ids=ids: run_spec(ids, gamma).tokens, recipe.repeats))
    result["gammas"][gamma] = {
        "mean_accepted": accepted / rounds, "tokens_per_round": accepted / rounds + 1,
        "speculative_s": times, "speedup": sum(ar_time) / sum(times)}
  best = max(result["gammas"], key=lambda g: result["gammas"][g]["speedup"])
  result["best_gamma"] = best
  result["best_speedup"] = result["gammas"][best]["speedup"]
  # where the time goes: one target step, a (gamma + 1)-token verify pass, one draft step
  cache_len, position = width + n + max(recipe.gammas) + 1, width + n // 2
  costs = {"target_1": step_costs(target, target_params, 1, cache_len=cache_len,
                                  position=position),
           "draft_1": step_costs(draft, draft_params, 1, cache_len=cache_len, position=position)}
  for gamma in recipe.gammas:
    costs[f"target_{gamma + 1}"] = step_costs(target, target_params, gamma + 1,
                                              cache_len=cache_len, position=position)
  result["step_s"] = costs
  result["sample"] = {"prompt": prompts[0][0],
                      "completion": tokenizer.decode(ar_out[0][0].tolist())}
  return result


def machine() -> dict[str, Any]:
  load = os.getloadavg() if hasattr(os, "getloadavg") else None
  return {"cpu": platform.processor() or platform.machine(), "cpu_count": os.cpu_count(),
          "load_average_1_5_15": load, "jax": jax.__version__, "backend": jax.default_backend(),
          "note": "2-core CPU shared with other jobs while training and measuring"}


# ---- report -------------------------------------------------------------------------------------

def size_mb(path: Path) -> float:
  return round(path.stat().st_size / 2 ** 20, 2)


def _load(machine_info: dict[str, Any]) -> str:
  load = machine_info.get("load_average_1_5_15")
  return "/".join(f"{x:.1f}" for x in load) if load else "unknown"


def write_readme(folder: Path, report: dict[str, Any]) -> None:
  r, m = report["recipe"], report.get("measurements")
  t, d = report["target"], report["draft"]
  lines = [
      "# Built-in model pair (target + distilled draft)", "",
      "Trained from scratch by `python scripts/train.py --out models/builtin` on the Python "
      "standard library's own source (`*.py` under `sysconfig.get_paths()['stdlib']`, "
      f"excluding {', '.join(report['corpus']['excluded_dirs'])}; "
      f"{report['corpus']['heldout_percent']}% of files held out by a hash of their path). "
      "Load with `spec_jax.models.builtin.load_builtin()`; matrices are stored in int8 with a float32 "
      "scale per output channel (vectors in bfloat16) and run in float32.", "",
      "| | target | draft |", "|---|---|---|",
      f"| layers x dim (heads/kv, mlp) | {r['target']['n_layers']} x {r['target']['dim']} "
      f"({r['target']['n_heads']}/{r['target']['n_kv_heads']}, {r['target']['hidden_dim']}) | "
      f"{r['draft']['n_layers']} x {r['draft']['dim']} ({r['draft']['n_heads']}/"
      f"{r['draft']['n_kv_heads']}, {r['draft']['hidden_dim']}) |",
      f"| parameters | {t['params'] / 1e6:.2f} M | {d['params'] / 1e6:.2f} M |",
      f"| file (int8) | {t['file_mb']} MiB | {d['file_mb']} MiB |",
      f"| steps x tokens/step | {r['target_steps']} x {r['batch_size'] * r['seq_len']} | "
      f"{r['draft_steps']} x {r['batch_size'] * r['seq_len']} |",
      f"| loss | cross-entropy | KL(target \\|\\| draft) + {r['draft_ce_weight']} CE |",
      f"| training wall time | {t['wall_s'] / 60:.1f} min ({t.get('tokens_per_s', 0):.0f} tok/s)"
      f" | {d['wall_s'] / 60:.1f} min ({d.get('tokens_per_s', 0):.0f} tok/s) |",
      f"| held-out | CE {t['heldout']['heldout_ce']:.3f} nats/token | KL "
      f"{d['heldout']['heldout_kl']:.3f}, CE {d['heldout']['heldout_ce']:.3f}, top-1 agreement "
      f"{d['heldout']['heldout_agree']:.3f} |", "",
      f"Vocabulary: byte-level BPE, {r['vocab_size']} tokens (`tokenizer.json`); `{SEP}` starts "
      "every file in training, so prompts begin with it (it is BOS and EOS). Context: "
      f"{r['seq_len']} tokens (the training window). Total wall time "
      f"{report['wall_s'] / 60:.1f} min on {report['machine']['cpu_count']} CPU cores shared "
      "with other jobs; tokens/s depend mostly on how much of the CPU they leave.", ""]
  if m:
    lines += [
        f"## Measured (greedy, batch 1, {m['new_tokens']} new tokens, "
        f"{len(m['prompts'])} held-out code prompts)", "",
        "| gamma | mean accepted drafts / round | tokens / target pass | speed-up vs "
        "autoregressive |", "|---|---|---|---|"]
    for g, v in m["gammas"].items():
      lines.append(f"| {g} | {v['mean_accepted']:.2f} | {v['tokens_per_round']:.2f} | "
                   f"{v['speedup']:.2f}x |")
    if "step_s" in m:
      c, g = m["step_s"], int(m["best_gamma"])
      best = {int(k): v for k, v in m["gammas"].items()}[g]  # JSON made the keys strings
      verify = c[f"target_{int(g) + 1}"] / c["target_1"]
      lines += [
          "", f"Where the time goes (forward passes inside a jitted loop, batch 1): a target "
          f"step {c['target_1'] * 1e3:.2f} ms, a draft step {c['draft_1'] * 1e3:.2f} ms "
          f"({c['draft_1'] / c['target_1']:.2f} of a target step), a {int(g) + 1}-token verify "
          f"pass {verify:.1f} target steps. " + ", ".join(
              f"{int(k.split('_')[1])} tokens {v / c['target_1']:.1f}x"
              for k, v in c.items() if k.startswith("target_") and k != "target_1") + ". "
          "The target's float32 weights (4 bytes x its parameters) are larger than this "
          "CPU's 32 MB L3 cache on purpose: every step streams them from memory, as on "
          "accelerators, so the extra tokens of a verify pass share that traffic and cost "
          "much less than extra steps (a target that fits in cache verifies 5 tokens at about "
          "2x a step: no memory traffic to share, and one token takes a faster "
          "matrix-vector path). The single measurements above vary with the CPU's other "
          "load (e.g. a 5-token pass can hit a slower matmul tiling). "
          "The speed-up is roughly "
          f"tokens per round / (verify cost + gamma x draft cost + bookkeeping), here "
          f"{best['tokens_per_round']:.2f} tokens per round at gamma {g}. Acceptance is the "
          "lever: the greedy per-token agreement of draft and target on held-out code is "
          f"{report['draft']['heldout']['heldout_agree']:.2f}."]
    lines += [
        "", f"Speculative output identical to autoregressive: {m['lossless']}. Timings are "
        "medians of repeated runs after compilation, in one process, on a "
        f"{report['machine']['cpu_count']}-core CPU shared with other jobs (load average "
        f"{_load(report['machine'])}); expect them to vary by +-20%.", "",
        "Sample (autoregressive, greedy; a model this small, trained this briefly, writes "
        "plausible-looking Python without meaning and often loops, which is easy to "
        "speculate on):", "", "```python",
        m["sample"]["prompt"] + m["sample"]["completion"], "```", ""]
  lines += ["Recipe, per-stage times and evaluation history: `training.json`.", ""]
  (folder / "README.md").write_text("\n".join(lines))


# ---- main ---------------------------------------------------------------------------------------

def parse_args(argv=None) -> argparse.Namespace:
  p = cli.ArgumentParser(description=__doc__.split("\n\n")[0])
  p.add_argument("--out", default=str(REPO / "models" / "builtin"), help="artefact folder")
  p.add_argument("--work-dir", default=None,
                 help="checkpoints and tokenizer (default: runs/builtin, git-ignored; "
                      "<out>/.work with --quick)")
  p.add_argument("--steps-target", type=cli.positive_int, default=None)
  p.add_argument("--steps-draft", type=cli.positive_int, default=None)
  p.add_argument("--resume", action="store_true", help="continue from the work dir")
  p.add_argument("--quick", action="store_true", help="a tiny, seconds-long version")
  p.add_argument("--seed", type=cli.int_range(0, 2 ** 63 - 4), default=0)
  p.add_argument("--no-measure", action="store_true", help="skip acceptance/speed measurement")
  p.add_argument("--eval-only", action="store_true",
                 help="re-measure the pair in --out and rewrite its README.md")
  p.add_argument("--no-progress", action="store_true")
  return p.parse_args(argv)


def main(argv=None) -> dict[str, Any]:
  args = parse_args(argv)
  recipe = QUICK if args.quick else FULL
  overrides = {k: v for k, v in (("target_steps", args.steps_target),
                                 ("draft_steps", args.steps_draft)) if v is not None}
  recipe = dataclasses.replace(recipe, **overrides)
  out = Path(args.out).resolve()
  if args.quick and out == builtin.BUILTIN_DIR:
    raise BadArgument("--quick would overwrite the shipped pair: pass --out elsewhere")
  work = Path(args.work_dir or (out / ".work" if args.quick else REPO / "runs" / "builtin"))
  progress = not args.no_progress

  if args.eval_only:
    report = json.loads((out / "training.json").read_text())
    _, heldout, _ = corpus_texts(recipe)
    report["measurements"] = measure(out, heldout, recipe)
    report["machine"] = machine()
    (out / "training.json").write_text(json.dumps(report, indent=2) + "\n")
    write_readme(out, report)
    print(json.dumps(report["measurements"], indent=2))
    return report

  if not args.resume and any((work / s).exists() for s in ("target", "draft")):
    raise BadArgument(f"{work} holds checkpoints of an earlier run: pass --resume to continue "
                      "it, or remove the folder to start over")
  work.mkdir(parents=True, exist_ok=True)
  stages: dict[str, float] = {}

  t0 = time.perf_counter()
  train_texts, heldout_texts, corpus_info = corpus_texts(recipe)
  tok = load_or_train_tokenizer(train_texts, recipe, work, args.resume)
  write_tokenizer(tok, out)
  sep_id = tok.token_to_id(SEP)
  vocab = tok.get_vocab_size()
  train_N = data.token_stream(encode_batch_fn(tok), train_texts, sep_id, vocab)
  heldout_N = data.token_stream(encode_batch_fn(tok), heldout_texts, sep_id, vocab)
  corpus_info.update(train_tokens=int(len(train_N)), heldout_tokens=int(len(heldout_N)),
                     chars_per_token=round(corpus_info["train_chars"] / len(train_N), 3))
  stages["tokenizer_s"] = time.perf_counter() - t0
  print(f"corpus: {corpus_info}", flush=True)

  target, draft = make_models(recipe)
  windows_NT = eval_windows(heldout_N, recipe)
  target_tree, target_info = train_target(target, train_N, windows_NT, recipe, work, args.seed,
                                          progress)
  builtin.save_model(out, "target", target, target_tree)
  # the draft learns the target as shipped (int8 matrices), not its float32 training copy
  target_tree = to_tree(builtin.stored_params(target, to_state(target, target_tree)))
  stages["target_s"] = target_info["wall_s"]
  draft_tree, draft_info = train_draft(draft, target, target_tree, train_N, windows_NT, recipe,
                                       work, args.seed, progress)
  builtin.save_model(out, "draft", draft, draft_tree)
  stages["draft_s"] = draft_info["wall_s"]

  def summary(model, info, name):
    best = next(e for e in info["evals"] if e["step"] == info["best_step"])
    return {"params": model.config.num_params(), "file_mb": size_mb(out / f"{name}.safetensors"),
            "wall_s": info["wall_s"], "tokens_per_s": info.get("tokens_per_s"),
            "best_step": info["best_step"], "heldout": {k: v for k, v in best.items() if k != "step"},
            "evals": info["evals"], "final_train": info.get("train")}

  report = {"recipe": dataclasses.asdict(recipe), "corpus": corpus_info, "seed": args.seed,
            "target": summary(target, target_info, "target"),
            "draft": summary(draft, draft_info, "draft"), "stages_s": stages,
            "machine": machine()}
  report["wall_s"] = stages["tokenizer_s"] + stages["target_s"] + stages["draft_s"]
  if not args.no_measure:
    t0 = time.perf_counter()
    report["measurements"] = measure(out, heldout_texts, recipe)
    stages["measure_s"] = time.perf_counter() - t0
  (out / "training.json").write_text(json.dumps(report, indent=2) + "\n")
  write_readme(out, report)
  print(json.dumps({"stages_s": stages, "target_heldout": report["target"]["heldout"],
                    "draft_heldout": report["draft"]["heldout"],
                    "measurements": {k: v for k, v in report.get("measurements", {}).items()
                                     if k in ("gammas", "lossless", "best_gamma",
                                              "best_speedup")}}, indent=2, default=str))
  return report


if __name__ == "__main__":
  sys.exit(cli.run(main))
