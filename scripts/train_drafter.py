"""Distil a drafter from a frozen target, then measure its acceptance on held-out prompts.

  python scripts/train_drafter.py --kind medusa --model ../shared/models/stories260K/stories260K.bin \
      --checkpoint-dir /tmp/medusa --steps 2000
  python scripts/train_drafter.py --kind eagle --model ... --corpus stories.txt --steps 3000

Kinds: draft_model (a small separate Llama), medusa (K heads), eagle (one feature-level
layer), mtp (K DeepSeek-V3 modules). Corpus: a text file (tokenised with the target's
tokenizer) or, by default, the target's own sampled generations. Training is the shared
loop of spec_jax.training (AdamW, warm-up + cosine, clipping, orbax checkpoints: rerun the
same command to resume; the best params by held-out loss or acceptance are kept in
<checkpoint-dir>/best). At the end it prints mean accepted lengths on held-out prompts,
untrained vs trained, via speculative_generate.

The functions here are importable (the tests use them); main() is the thin CLI around them.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import os
import sys
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
  sys.path.insert(0, str(REPO))

from models.drafter_heads import (EagleConfig, EagleModel, HeadParams, MedusaConfig,  # noqa: E402
                                  MedusaModel, MTPConfig, MTPModel, shared_head)
from models.llama import LlamaModel  # noqa: E402
from spec_jax.drafter_losses import KINDS, make_loss_fn  # noqa: E402
from spec_jax.drafters.draft_model import DraftModelDrafter  # noqa: E402
from spec_jax.drafters.eagle import EagleDrafter  # noqa: E402
from spec_jax.drafters.medusa import MedusaDrafter  # noqa: E402
from spec_jax.drafters.mtp import MTPDrafter  # noqa: E402
from spec_jax.generate import generate, pad_prompts  # noqa: E402
from spec_jax.metrics import summarize  # noqa: E402
from spec_jax.sampling import SamplingConfig  # noqa: E402
from spec_jax.speculative import speculative_generate  # noqa: E402
from spec_jax.training import (TrainState, make_optimizer, make_train_step,  # noqa: E402
                               restore_best, train_loop)


# --- drafters ---------------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class DrafterSpec:
  """A drafter kind bound to a target: its model handle, its Drafter, how params combine."""
  kind: str
  model: Any  # MedusaModel / EagleModel / MTPModel / LlamaModel (the draft model)
  drafter: Any
  max_gamma: int | None  # None: any gamma

  def init_params(self, key: jax.Array):
    """Trainable params, as a plain nested dict (what optax and orbax handle best)."""
    params = self.model.init_params(key)
    return nnx.to_pure_dict(params) if isinstance(params, nnx.State) else params

  def draft_params(self, own, target, target_params):
    """What speculative_generate takes as draft_params."""
    if self.kind == "draft_model":
      return own
    return HeadParams(own, shared_head(target, target_params))

  def describe(self) -> dict:
    cfg = self.model.config
    return {"kind": self.kind, "config": json.loads(json.dumps(dataclasses.asdict(cfg)))}


def make_spec(kind: str, target: LlamaModel, *, num_heads: int = 4, draft_dim: int | None = None,
              draft_layers: int = 1, draft_hidden: int | None = None) -> DrafterSpec:
  """Builds the drafter of `kind` shaped for `target` (num_heads: Medusa heads / MTP modules)."""
  cfg = target.config
  if kind == "medusa":
    model = MedusaModel(MedusaConfig.for_target(cfg, num_heads))
    return DrafterSpec(kind, model, MedusaDrafter(model), num_heads)
  if kind == "eagle":
    overrides = {} if draft_hidden is None else {"hidden_dim": draft_hidden}
    model = EagleModel(EagleConfig.for_target(cfg, **overrides))
    return DrafterSpec(kind, model, EagleDrafter(model), None)
  if kind == "mtp":
    overrides = {} if draft_hidden is None else {"hidden_dim": draft_hidden}
    model = MTPModel(MTPConfig.for_target(cfg, num_heads, **overrides))
    return DrafterSpec(kind, model, MTPDrafter(model), num_heads)
  if kind == "draft_model":
    dim = draft_dim or max(cfg.dim // 2, 8)
    head_dim = cfg.resolved_head_dim
    heads = max(1, dim // head_dim)
    small = dataclasses.replace(cfg, dim=dim, n_layers=draft_layers, n_heads=heads,
                                n_kv_heads=heads // 2 if heads % 2 == 0 else heads,
                                head_dim=head_dim, hidden_dim=draft_hidden or 2 * dim)
    model = LlamaModel(small)
    return DrafterSpec(kind, model, DraftModelDrafter(model), None)
  raise ValueError(f"unknown drafter kind {kind!r}; one of {', '.join(KINDS)}")


# --- corpus -----------------------------------------------------------------------------------

@dataclasses.dataclass
class Corpus:
  """Training sequences (rows, or one long stream cut into random windows) and held-out rows."""
  train_rows: np.ndarray | None  # [N, T] int32, or None when streaming
  stream: np.ndarray | None  # [N] token stream for random windows
  heldout: np.ndarray  # [H, T] int32
  seq_len: int
  seed: int = 0

  def batch(self, step: int, batch_size: int) -> np.ndarray:
    """[batch_size, seq_len] int32: a pure function of (seed, step), so resuming is exact."""
    if self.train_rows is not None:
      rng = np.random.default_rng([self.seed, step])
      return self.train_rows[rng.integers(0, len(self.train_rows), size=batch_size)]
    from spec_jax.data import random_windows
    return random_windows(self.stream, batch_size, self.seq_len, self.seed, step)


def self_generated(target, params, *, num_sequences: int, seq_len: int, bos_id: int = 1,
                   temperature: float = 1.0, top_p: float = 1.0, seed: int = 0,
                   chunk: int = 256) -> np.ndarray:
  """[num_sequences, seq_len] int32: BOS then the target's own samples (no early stop)."""
  rows = []
  for start in range(0, num_sequences, chunk):
    n = min(chunk, num_sequences - start)
    out = generate(target, params, *pad_prompts([[bos_id]] * n), max_new_tokens=seq_len - 1,
                   sampling=SamplingConfig(temperature, top_p=top_p),
                   key=jax.random.fold_in(jax.random.key(seed), start))
    rows.append(np.concatenate([np.full((n, 1), bos_id, np.int32), np.asarray(out.tokens)], 1))
  return np.concatenate(rows).astype(np.int32)


def generated_corpus(target, params, *, num_sequences: int, seq_len: int, heldout: int,
                     seed: int = 0, **kw) -> Corpus:
  rows = self_generated(target, params, num_sequences=num_sequences + heldout, seq_len=seq_len,
                        seed=seed, **kw)
  return Corpus(rows[:num_sequences], None, rows[num_sequences:], seq_len, seed)


def text_corpus(path: str, tokenizer, *, seq_len: int, heldout_fraction: float = 0.05,
                max_heldout: int = 64, seed: int = 0) -> Corpus:
  """A text file as one token stream; its last `heldout_fraction` is held out."""
  text = Path(path).read_text(encoding="utf-8", errors="replace")
  docs = [d for d in text.split("\n\n") if d.strip()]
  ids = [tokenizer.encode(d, add_bos=tokenizer.bos_id is not None) for d in docs]
  stream = np.concatenate([np.asarray(x, np.int32) for x in ids])
  cut = int(len(stream) * (1 - heldout_fraction))
  heldout = stream[cut:][:(len(stream) - cut) // seq_len * seq_len].reshape(-1, seq_len)
  if len(heldout) == 0 or cut < seq_len + 1:
    raise SystemExit(f"{path}: too little text for windows of {seq_len} tokens")
  return Corpus(None, stream[:cut], heldout[:max_heldout], seq_len, seed)


# --- evaluation -------------------------------------------------------------------------------

def mean_accepted(target, target_params, spec: DrafterSpec, own, prompts_BP, *, gamma: int,
                  max_new_tokens: int, sampling: SamplingConfig = SamplingConfig(),
                  seed: int = 0) -> dict:
  """speculative_generate on the prompts -> summarize() (mean_accepted[_with_bonus], ...)."""
  prompts = pad_prompts([list(map(int, p)) for p in prompts_BP])
  out = speculative_generate(target, target_params, spec.drafter,
                             spec.draft_params(own, target, target_params), *prompts,
                             gamma=gamma, max_new_tokens=max_new_tokens, sampling=sampling,
                             key=jax.random.key(seed))
  return summarize(out.metrics)


def heldout_loss_fn(loss_fn, heldout: np.ndarray, target_params):
  """-> fn(own params) -> mean loss over the held-out rows (one jitted pass)."""
  batch = {"tokens": jnp.asarray(heldout), "target_params": target_params}
  run = jax.jit(lambda own, batch: loss_fn(own, batch, jax.random.key(0))[0])
  return lambda own: float(run(own, batch))


# --- training ---------------------------------------------------------------------------------

@dataclasses.dataclass
class Trainer:
  """Everything one distillation run needs; `run` may be called again to resume."""
  spec: DrafterSpec
  target: Any
  target_params: Any
  corpus: Corpus
  steps: int
  batch_size: int = 16
  learning_rate: float = 3e-3
  warmup_steps: int = 20
  weight_decay: float = 0.0
  clip: float = 1.0
  loss_options: dict = dataclasses.field(default_factory=dict)
  seed: int = 0

  def __post_init__(self):
    self.optimizer = make_optimizer(self.learning_rate, self.warmup_steps, self.steps,
                                    weight_decay=self.weight_decay, clip=self.clip)
    self.loss_fn = make_loss_fn(self.spec.kind, self.target, self.spec.model, **self.loss_options)
    self.train_step = make_train_step(self.loss_fn, self.optimizer)  # built once: one compile
    # held-out loss without EAGLE's training-time feature noise
    eval_options = {k: (0.0 if k == "feature_noise" else v) for k, v in self.loss_options.items()}
    eval_loss_fn = make_loss_fn(self.spec.kind, self.target, self.spec.model, **eval_options)
    self.heldout_loss = heldout_loss_fn(eval_loss_fn, self.corpus.heldout, self.target_params)

  def initial_params(self):
    return self.spec.init_params(jax.random.key(self.seed))

  def initial_state(self) -> TrainState:
    # a fresh copy: the train step donates its state
    return TrainState.create(jax.tree.map(jnp.copy, self.initial_params()), self.optimizer,
                             jax.random.key(self.seed + 1))

  def batch(self, step: int):
    return {"tokens": self.corpus.batch(step, self.batch_size),
            "target_params": self.target_params}

  def run(self, *, checkpoint_dir: str | None = None, save_every: int = 100,
          eval_every: int = 0, best_by: str | None = None, gamma: int = 4,
          eval_prompts: int = 8, prompt_len: int = 8, eval_new_tokens: int = 48,
          progress: bool = True, batch_fn=None):
    """Trains to `steps` -> (params, info), resuming from checkpoint_dir/latest if present.

    best_by: None, "loss" (held-out loss) or "acceptance" (held-out mean accepted length);
    needs checkpoint_dir; the best params are then in checkpoint_dir/best.
    """
    prompts = self.corpus.heldout[:eval_prompts, :prompt_len]

    def eval_fn(own):
      result = {"heldout_loss": self.heldout_loss(own)}
      if best_by == "acceptance":
        m = mean_accepted(self.target, self.target_params, self.spec, own, prompts, gamma=gamma,
                          max_new_tokens=eval_new_tokens)
        result["neg_mean_accepted"] = -m["mean_accepted"]
      return result

    best_metric = {None: None, "loss": "heldout_loss", "acceptance": "neg_mean_accepted"}[best_by]
    state, info = train_loop(
        self.initial_state(), batch_fn or self.batch, self.train_step,
        num_steps=self.steps, checkpoint_dir=checkpoint_dir,
        save_every=save_every, eval_fn=eval_fn if (eval_every or best_by) else None,
        eval_every=eval_every, best_metric=best_metric,
        tokens_per_step=self.batch_size * self.corpus.seq_len, progress=progress,
        desc=f"train {self.spec.kind}")
    return state.params, info


def write_description(checkpoint_dir: str, spec: DrafterSpec, args: dict) -> None:
  os.makedirs(checkpoint_dir, exist_ok=True)
  with open(os.path.join(checkpoint_dir, "drafter.json"), "w") as f:
    json.dump(dict(spec.describe(), args=args), f, indent=2, sort_keys=True, default=str)


# --- command line -----------------------------------------------------------------------------

def parse_args(argv=None) -> argparse.Namespace:
  p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  p.add_argument("--kind", required=True, choices=KINDS)
  p.add_argument("--model", required=True,
                 help="target checkpoint (llama2.c .bin, HF or native folder)")
  p.add_argument("--tokenizer", default=None, help="for --corpus FILE (default: beside the model)")
  p.add_argument("--corpus", default="self",
                 help="a text file, or 'self' for the target's own sampled generations")
  p.add_argument("--num-sequences", type=int, default=1024, help="generated training sequences")
  p.add_argument("--heldout", type=int, default=32, help="generated held-out sequences")
  p.add_argument("--gen-temperature", type=float, default=1.0)
  p.add_argument("--seq-len", type=int, default=64)
  p.add_argument("--num-heads", type=int, default=4, help="Medusa heads / MTP modules")
  p.add_argument("--draft-dim", type=int, default=None, help="draft_model width")
  p.add_argument("--draft-layers", type=int, default=1, help="draft_model layers")
  p.add_argument("--draft-hidden", type=int, default=None, help="MLP width of the drafter's block")
  p.add_argument("--loss", default="kl", choices=("kl", "ce"), help="token loss")
  p.add_argument("--feature-weight", type=float, default=1.0, help="EAGLE smooth-L1 weight")
  p.add_argument("--token-weight", type=float, default=0.1, help="EAGLE token-loss weight")
  p.add_argument("--feature-noise", type=float, default=0.0, help="EAGLE input feature noise")
  p.add_argument("--steps", type=int, default=1000)
  p.add_argument("--batch-size", type=int, default=16)
  p.add_argument("--lr", type=float, default=3e-3)
  p.add_argument("--warmup", type=int, default=50)
  p.add_argument("--weight-decay", type=float, default=0.0)
  p.add_argument("--clip", type=float, default=1.0)
  p.add_argument("--checkpoint-dir", default=None)
  p.add_argument("--save-every", type=int, default=200)
  p.add_argument("--eval-every", type=int, default=0)
  p.add_argument("--best-by", default=None, choices=("loss", "acceptance"))
  p.add_argument("--gamma", type=int, default=4, help="draft length for the acceptance evaluation")
  p.add_argument("--eval-prompts", type=int, default=16)
  p.add_argument("--eval-new-tokens", type=int, default=64)
  p.add_argument("--seed", type=int, default=0)
  p.add_argument("--no-progress", action="store_true")
  return p.parse_args(argv)


def main(argv=None) -> dict:
  args = parse_args(argv)
  from models.loading import find_tokenizer_path, load_model
  target, target_params = load_model(args.model)
  spec = make_spec(args.kind, target, num_heads=args.num_heads, draft_dim=args.draft_dim,
                   draft_layers=args.draft_layers, draft_hidden=args.draft_hidden)
  if spec.max_gamma is not None and args.gamma > spec.max_gamma:
    raise SystemExit(f"--gamma {args.gamma} > {spec.max_gamma} ({args.kind} drafts at most "
                     "that many per round)")
  if args.corpus == "self":
    corpus = generated_corpus(target, target_params, num_sequences=args.num_sequences,
                              seq_len=args.seq_len, heldout=args.heldout, seed=args.seed,
                              temperature=args.gen_temperature)
  else:
    from models.tokenizer import load_tokenizer
    tok_path = args.tokenizer or find_tokenizer_path(args.model)
    if tok_path is None:
      raise SystemExit(f"no tokenizer found beside {args.model}; pass --tokenizer")
    corpus = text_corpus(args.corpus, load_tokenizer(tok_path), seq_len=args.seq_len,
                         max_heldout=max(args.eval_prompts, 8), seed=args.seed)
  options = {"token": args.loss}
  if args.kind == "eagle":
    options.update(feature_weight=args.feature_weight, token_weight=args.token_weight,
                   feature_noise=args.feature_noise)
  trainer = Trainer(spec, target, target_params, corpus, args.steps, args.batch_size, args.lr,
                    args.warmup, args.weight_decay, args.clip, options, args.seed)
  if args.checkpoint_dir:
    write_description(args.checkpoint_dir, spec, vars(args))
  with contextlib.redirect_stdout(sys.stderr):  # progress and eval lines; stdout is the report
    params, info = trainer.run(checkpoint_dir=args.checkpoint_dir, save_every=args.save_every,
                               eval_every=args.eval_every, best_by=args.best_by,
                               gamma=args.gamma, eval_prompts=args.eval_prompts,
                               eval_new_tokens=args.eval_new_tokens,
                               progress=not args.no_progress)
  report = {"kind": args.kind, "steps": args.steps, "start_step": info["start_step"],
            "train": info["train"],
            "tokens_per_s": info.get("tokens_per_s"), "evals": info["evals"]}
  prompts = corpus.heldout[:args.eval_prompts, :8]
  candidates = {"untrained": trainer.initial_params(), "trained": params}
  if args.best_by and args.checkpoint_dir:
    best = restore_best(args.checkpoint_dir, params)
    if best is not None:
      candidates["best"] = best[0]
      report["best_step"] = int(best[1])
  for name, own in candidates.items():
    m = mean_accepted(target, target_params, spec, own, prompts, gamma=args.gamma,
                      max_new_tokens=args.eval_new_tokens)
    report[name] = {k: m[k] for k in ("mean_accepted", "mean_accepted_with_bonus",
                                      "acceptance_rate", "position_acceptance")}
  # positions never reached have no rate (NaN): null in strict JSON
  report = json.loads(json.dumps(report).replace("NaN", "null"))
  print(json.dumps(report, indent=2))
  return report


if __name__ == "__main__":
  main()
