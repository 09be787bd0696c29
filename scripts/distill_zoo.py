"""Distil drafters for a zoo chat model (SmolLM2-135M-Instruct) from its own answers.

  python scripts/distill_zoo.py corpus   --out runs/smollm2_distill     # prompts -> greedy answers
  python scripts/distill_zoo.py features --out runs/smollm2_distill     # target hidden states, once
                                                      # per feature layout (--kind dflash: 3 more)
  python scripts/distill_zoo.py train --kind eagle --minutes 20 --out runs/smollm2_distill \
      --export models/zoo/smollm2-135m-instruct.eagle --dtype int8

Prompts come from the Python standard library (spec_jax.training.chat_corpus: write this
function, explain this code, summarise this passage), put through the model's chat template;
the corpus rows are prompt + the model's greedy answer. The frozen target runs once over
the corpus ("features": its last hidden states, float16 on disk); training then never runs
the target's 30 layers again: the teacher logits are its tied head on those hidden states,
a fraction of a full pass. The loss is each family's own (spec_jax.drafters.registry),
the loop spec_jax.training's. At the end it prints mean accepted lengths on held-out prompts.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
  sys.path.insert(0, str(REPO))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402


def parse_args(argv=None):
  p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  p.add_argument("stage", choices=("corpus", "features", "train"))
  p.add_argument("--model", default="smollm2", help="zoo name")
  p.add_argument("--out", default="runs/smollm2_distill")
  p.add_argument("--prompts", type=int, default=320, help="training prompts")
  p.add_argument("--heldout", type=int, default=16, help="held-out prompts (stdlib's held-out files)")
  p.add_argument("--max-prompt", type=int, default=96, help="longer prompts are skipped")
  p.add_argument("--answer-tokens", type=int, default=96)
  p.add_argument("--gen-batch", type=int, default=32)
  p.add_argument("--kind", default="eagle")
  p.add_argument("--num-heads", type=int, default=3, help="MTP modules")
  p.add_argument("--draft-hidden", type=int, default=None, help="MLP width of the drafter's block")
  p.add_argument("--batch-size", type=int, default=6)
  p.add_argument("--lr", type=float, default=2e-3)
  p.add_argument("--minutes", type=float, default=20.0, help="training time budget")
  p.add_argument("--steps", type=int, default=None, help="instead of --minutes")
  p.add_argument("--feature-noise", type=float, default=0.1)
  p.add_argument("--token-positions", type=int, default=32,
                 help="token loss on this many random positions per row (0: every position)")
  p.add_argument("--anchors", type=int, default=16,
                 help="block drafters (dflash, dspark): blocks per row and step")
  p.add_argument("--export", default=None, help="write the drafter here")
  p.add_argument("--dtype", default="int8", choices=("float32", "float16", "int8"))
  p.add_argument("--gamma", type=int, default=3)
  return p.parse_args(argv)


def load(args):
  from spec_jax.models.zoo import load_zoo
  return load_zoo(args.model)


# --- corpus -----------------------------------------------------------------------------------

def chat_rows(model, params, tokenizer, items, args):
  """[(prompt ids, answer ids)] for (kind, instruction) items: the model's greedy answers."""
  from spec_jax.generate import generate, pad_prompts
  prompts = []
  for _, text in items:
    ids = tokenizer.encode_chat(text)
    if len(ids) <= args.max_prompt:
      prompts.append(ids)
  rows = []
  for start in range(0, len(prompts), args.gen_batch):
    chunk = prompts[start:start + args.gen_batch]
    # a fixed batch and width: one compile for every chunk
    padded = chunk + [chunk[0]] * (args.gen_batch - len(chunk))
    out = generate(model, params, *pad_prompts(padded, width=args.max_prompt),
                   max_new_tokens=args.answer_tokens, eos_id=tokenizer.eos_id)
    tokens, counts = np.asarray(out.tokens), np.asarray(out.num_tokens)
    rows += [(p, tokens[i, :counts[i]].tolist()) for i, p in enumerate(chunk)]
    print(f"  {len(rows)}/{len(prompts)} answers", flush=True)
  return rows


def pack(rows, width: int):
  tokens = np.zeros((len(rows), width), np.int32)
  mask = np.zeros((len(rows), width), bool)
  prompt_len = np.zeros(len(rows), np.int32)
  for i, (p, a) in enumerate(rows):
    seq = (p + a)[:width]
    tokens[i, :len(seq)], mask[i, :len(seq)], prompt_len[i] = seq, True, len(p)
  return tokens, mask, prompt_len


def stage_corpus(args):
  from spec_jax.training.chat_corpus import stdlib_instructions
  out = Path(args.out)
  out.mkdir(parents=True, exist_ok=True)
  model, params, tokenizer = load(args)
  # ask for more than needed: prompts longer than --max-prompt are skipped
  width = args.max_prompt + args.answer_tokens
  for name, items in (("heldout", stdlib_instructions(args.heldout * 2, heldout=True)),
                      ("train", stdlib_instructions(int(args.prompts * 1.6)))):
    t0 = time.perf_counter()
    count = args.heldout if name == "heldout" else args.prompts
    rows = chat_rows(model, params, tokenizer, items, args)[:count]
    tokens, mask, prompt_len = pack(rows, width)
    np.savez(out / f"{name}.npz", tokens=tokens, mask=mask, prompt_len=prompt_len)
    print(f"{name}: {len(rows)} rows in {time.perf_counter() - t0:.0f} s", flush=True)
  print(tokenizer.decode(tokens[0][mask[0]].tolist()))


# --- features ---------------------------------------------------------------------------------

def features_path(out: Path, name: str, feature_layers: tuple[int, ...]) -> Path:
  """Where the target's hidden states for a drafter live: the last layer's alone, or with the
  layers a block drafter reads (their ids in the name, so that kinds never mix them)."""
  return out / f"{name}.hidden{''.join(f'-{i}' for i in feature_layers)}.npy"


def stage_features(args):
  from spec_jax.drafters.base import target_with_features
  from spec_jax.losses import target_outputs
  from spec_jax.training.distill import make_spec
  out = Path(args.out)
  model, params, _ = load(args)
  drafter = make_spec(args.kind, model).drafter
  target = target_with_features(model, drafter)
  run = jax.jit(lambda p, t, m: target_outputs(target, p, t, m).hidden_BTD.astype(jnp.float16))
  for name in ("heldout", "train"):
    data = np.load(out / f"{name}.npz")
    t0, parts = time.perf_counter(), []
    for start in range(0, len(data["tokens"]), 8):
      tokens, mask = data["tokens"][start:start + 8], data["mask"][start:start + 8]
      n = len(tokens)
      if n < 8:  # one shape: one compile
        tokens, mask = np.pad(tokens, ((0, 8 - n), (0, 0))), np.pad(mask, ((0, 8 - n), (0, 0)))
      parts.append(np.asarray(run(params, tokens, mask))[:n])
    np.save(features_path(out, name, drafter.feature_layers), np.concatenate(parts))
    print(f"{name}: features in {time.perf_counter() - t0:.0f} s", flush=True)


# --- training ---------------------------------------------------------------------------------

def make_feature_loss_fn(kind, model, spec, **options):
  """loss_fn(own, batch, rng) on precomputed target hidden states: the teacher logits are the
  target's head on them (spec_jax.models.drafter_heads.SharedHead.logits)."""
  from spec_jax.drafters.files import draft_params_for
  from spec_jax.losses import TargetOutputs
  from spec_jax.models.drafter_heads import shared_head
  dim = model.config.dim

  def loss_fn(own, batch, rng):
    hidden_BTD = batch["hidden"].astype(jnp.float32)
    logits_BTV = shared_head(model, batch["target_params"]).logits(hidden_BTD[..., :dim])
    t = TargetOutputs(batch["tokens"], batch["mask"], jax.lax.stop_gradient(logits_BTV),
                      hidden_BTD)
    return spec.trained.loss(spec.model, draft_params_for(kind, own, model,
                                                         batch["target_params"]),
                             t, rng, **options)
  return loss_fn


def _gather_BND(x_BTD, idx_BN):
  return jnp.take_along_axis(x_BTD, idx_BN[..., None], axis=1)


def _kl_at(student_BND, teacher_logits_BNV, valid_BN, head):
  """Forward KL(teacher || student) where the student is the head on `student_BND`."""
  from spec_jax.losses import distillation_kl
  return distillation_kl(head.logits(student_BND), teacher_logits_BNV, valid_BN)


def make_sampled_loss_fn(kind, model, spec, num_positions: int, feature_noise: float = 0.0,
                         token_weight: float = 0.1):
  """The family's loss with its token term on `num_positions` random positions per row.

  Profiled on this CPU: the 49,152-token head dominates a step (teacher logits, the
  drafter's logits and their gradient, per position and per MTP module), not the drafter's
  one layer. EAGLE keeps its feature regression on every position (its main term) and
  its token KL on the sampled ones; MTP's token KL (its only term) is sampled per module.
  Unused full-sequence logits are dead code to XLA.
  """
  from spec_jax.losses import positions_of, smooth_l1, shift_left, TargetOutputs  # noqa: F401
  from spec_jax.models.drafter_heads import HeadParams, shared_head
  dim = model.config.dim

  def loss_fn(own, batch, rng):
    head = shared_head(model, batch["target_params"])
    tokens_BT, mask_BT = batch["tokens"], batch["mask"]
    hidden_BTD = batch["hidden"].astype(jnp.float32)
    b, t = tokens_BT.shape
    rng_pos, rng_noise = jax.random.split(rng)
    params = HeadParams(own, head)
    positions_BT = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))
    cache = spec.model.init_cache(b, t)
    metrics = {}
    if not hasattr(spec.model, "num_modules"):  # EAGLE's single layer (MTP has modules)
      feats_BTD = hidden_BTD
      if feature_noise:
        feats_BTD = feats_BTD + jax.random.uniform(rng_noise, feats_BTD.shape, feats_BTD.dtype,
                                                   -feature_noise, feature_noise)
      _, pred_BTD, _ = spec.model.apply(params, feats_BTD, shift_left(tokens_BT, 1),
                                        positions_BT, cache)
      feature = smooth_l1(pred_BTD, shift_left(hidden_BTD, 1), shift_left(mask_BT, 1, False))
      # pred at i is f_{i+1}; its token is x_{i+2}: the target's logits at i+1
      idx_BN = jax.random.randint(rng_pos, (b, num_positions), 0, t - 2)
      teacher_BNV = head.logits(_gather_BND(hidden_BTD[..., :dim], idx_BN + 1))
      valid_BN = jnp.take_along_axis(shift_left(mask_BT, 2, False), idx_BN, axis=1)
      tok = _kl_at(_gather_BND(pred_BTD, idx_BN), teacher_BNV, valid_BN, head)
      metrics = {"feature_loss": feature, "token_loss": tok}
      return feature + token_weight * tok, metrics
    # MTP: module k at i reads (h^{k-1}_i, x_{i+k}) and predicts x_{i+k+1}: target logits at i+k
    h_BTD, total, K = hidden_BTD[..., :dim], 0.0, spec.model.num_modules
    for k in range(1, K + 1):
      _, h_BTD, cache = spec.model.apply_module(params, k, h_BTD, shift_left(tokens_BT, k),
                                                positions_BT, cache)
      idx_BN = jax.random.randint(jax.random.fold_in(rng_pos, k), (b, num_positions), 0, t - k - 1)
      teacher_BNV = head.logits(_gather_BND(hidden_BTD[..., :dim], idx_BN + k))
      valid_BN = jnp.take_along_axis(shift_left(mask_BT, k + 1, False), idx_BN, axis=1)
      loss = _kl_at(head.final_norm(_gather_BND(h_BTD, idx_BN)), teacher_BNV, valid_BN, head)
      metrics[f"loss_{k}"] = loss
      total = total + loss / K
    return total, metrics
  return loss_fn


def stage_train(args):
  import inspect

  from spec_jax.drafters.files import export_drafter
  from spec_jax.training.distill import make_spec, mean_accepted
  from spec_jax.training.loop import TrainState, make_optimizer, make_train_step, train_loop
  out = Path(args.out)
  model, params, _ = load(args)
  spec = make_spec(args.kind, model, num_heads=args.num_heads, draft_hidden=args.draft_hidden)
  data = {name: dict(np.load(out / f"{name}.npz"),
                    hidden=np.load(features_path(out, name, spec.drafter.feature_layers)))
          for name in ("train", "heldout")}
  accepted = inspect.signature(spec.trained.loss).parameters
  options = {k: v for k, v in dict(token="kl", feature_noise=args.feature_noise,
                                   anchors=args.anchors).items() if k in accepted}
  if args.token_positions and "anchors" not in accepted:  # EAGLE, MTP (block drafters
    # sample their own positions: --anchors blocks per row)
    loss_fn = make_sampled_loss_fn(args.kind, model, spec, args.token_positions,
                                   **({"feature_noise": args.feature_noise}
                                      if "feature_noise" in accepted else {}))
  else:
    loss_fn = make_feature_loss_fn(args.kind, model, spec, **options)
  train = data["train"]

  def batch_fn(step):
    rows = np.random.default_rng([0, step]).integers(0, len(train["tokens"]), args.batch_size)
    return {"tokens": train["tokens"][rows], "mask": train["mask"][rows],
            "hidden": train["hidden"][rows], "target_params": params}

  def make(steps):
    opt = make_optimizer(args.lr, min(50, steps // 10), steps, weight_decay=0.0)
    return opt, make_train_step(loss_fn, opt)

  steps = args.steps
  if steps is None:  # time a few steps (after the compile) to fit the budget
    opt, step_fn = make(1000)
    state = TrainState.create(spec.init_params(jax.random.key(0)), opt, jax.random.key(1))
    state, m = step_fn(state, batch_fn(0))
    jax.block_until_ready(m)
    t0 = time.perf_counter()
    for i in range(3):
      state, m = step_fn(state, batch_fn(i))
    jax.block_until_ready(m)
    per_step = (time.perf_counter() - t0) / 3
    steps = max(int(args.minutes * 60 / per_step), 20)
    print(f"{per_step:.2f} s/step -> {steps} steps in {args.minutes} min", flush=True)
  opt, step_fn = make(steps)
  state = TrainState.create(spec.init_params(jax.random.key(0)), opt, jax.random.key(1))
  t0 = time.perf_counter()
  state, info = train_loop(state, batch_fn, step_fn, num_steps=steps, log_every=10,
                           progress=False, desc=f"train {args.kind}")
  train_s = time.perf_counter() - t0
  print(f"trained {steps} steps in {train_s / 60:.1f} min: {info['train']}", flush=True)
  own = state.params
  report = {"kind": args.kind, "steps": steps, "train_minutes": train_s / 60,
            "train_metrics": info["train"]}
  held = data["heldout"]
  prompts = [row[:n].tolist() for row, n in zip(held["tokens"], held["prompt_len"])]
  if args.export:
    path = export_drafter(args.export, args.kind, spec.model, own, dtype=args.dtype)
    report["exported"] = str(path)
    from spec_jax.drafters.files import read_drafter
    own = read_drafter(path)[2]  # measure what ships (int8 rounding included)
  gamma = min(args.gamma, spec.max_gamma or args.gamma)
  m = mean_accepted(model, params, spec, own, prompts, gamma=gamma, max_new_tokens=48)
  report[f"gamma{gamma}"] = {k: m[k] for k in ("mean_accepted", "acceptance_rate",
                                               "position_acceptance")}
  print(json.dumps(report, indent=2, default=float), flush=True)


def main(argv=None):
  args = parse_args(argv)
  {"corpus": stage_corpus, "features": stage_features, "train": stage_train}[args.stage](args)


if __name__ == "__main__":
  main()
