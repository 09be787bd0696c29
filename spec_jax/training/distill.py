"""Distilling drafters from a frozen target: drafter specs, corpora, the trainer, and export.

Any trained family in the registry (spec_jax.drafters.registry: draft_model, medusa, eagle,
mtp, ...) trains here: its `Trained` declaration gives the new model and the loss. Training
is the shared loop of spec_jax.training (AdamW, warm-up + cosine, clipping, orbax
checkpoints: resumable; the best params by held-out loss or acceptance can be kept).
`scripts/train_drafter.py` is the command line around this. The exported file format lives
with the drafters (spec_jax.drafters.files), so inference loads a drafter without optax.
"""

from __future__ import annotations

import dataclasses
import json
import os
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from spec_jax.core.sampling import SamplingConfig
from spec_jax.drafters import registry
from spec_jax.drafters.base import target_with_features
from spec_jax.drafters.files import (DRAFTER_JSON, DRAFTER_WEIGHTS, FORMAT, describe,  # noqa: F401
                                     draft_params_for, export_drafter as _export, load_drafter,
                                     read_drafter)
from spec_jax.drafters.registry import DrafterSizes
from spec_jax.generate import generate, pad_prompts
from spec_jax.losses import target_outputs
from spec_jax.metrics import summarize
from spec_jax.speculative import speculative_generate
from spec_jax.training.loop import TrainState, make_optimizer, make_train_step, train_loop

# --- drafters ---------------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class DrafterSpec:
  """A trained family's new model, bound to a target: its handle and its chain drafter."""
  kind: str
  model: Any

  @property
  def trained(self) -> registry.Trained:
    return registry.trained_family(self.kind).trained

  @property
  def drafter(self):
    return self.trained.chain(self.model)

  @property
  def max_gamma(self) -> int | None:
    return self.drafter.max_gamma

  def init_params(self, key: jax.Array):
    """Trainable params, as a plain nested dict (what optax and orbax handle best)."""
    params = self.model.init_params(key)
    return nnx.to_pure_dict(params) if isinstance(params, nnx.State) else params

  def draft_params(self, own, target, target_params):
    """What speculative_generate takes as draft_params."""
    return draft_params_for(self.kind, own, target, target_params)

  def describe(self) -> dict:
    return describe(self.kind, self.model)


def make_spec(kind: str, target, *, num_heads: int = 4, draft_dim: int | None = None,
              draft_layers: int = 1, draft_hidden: int | None = None) -> DrafterSpec:
  """A new drafter of a trained `kind` shaped for `target` (num_heads: Medusa heads / MTP
  modules; draft_*: the draft model's width, layers, MLP width; each family reads its own)."""
  sizes = DrafterSizes(num_heads, draft_dim, draft_layers, draft_hidden)
  return DrafterSpec(kind, registry.trained_family(kind).trained.new_model(target, sizes))


def make_loss_fn(kind: str, target, model, **options):
  """-> loss_fn(params, batch, rng) for spec_jax.training.make_train_step.

  `params` are the drafter's trainable params; `batch` is {"tokens": [B, T] int32,
  "target_params": the frozen target's params, optional "mask": [B, T]}. The target runs
  inside the step (its params a traced argument, never a baked-in constant); families that
  share the target's embedding and head get them through HeadParams.
  """
  trained = registry.trained_family(kind).trained
  # families reading several target layers get them in TargetOutputs.hidden_BTD (after the
  # last hidden state), as the generation loops give them to the drafter
  target = target_with_features(target, trained.chain(model))

  def loss_fn(params, batch, rng):
    t = target_outputs(target, batch["target_params"], batch["tokens"], batch.get("mask"))
    return trained.loss(model, draft_params_for(kind, params, target, batch["target_params"]),
                        t, rng, **options)

  return loss_fn


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
    from spec_jax.training.data import random_windows
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


def stdlib_corpus(tokenizer, *, seq_len: int, max_heldout: int = 64, seed: int = 0,
                  root: str | os.PathLike | None = None) -> Corpus:
  """The Python standard library's source as the built-in pair was trained on it
  (spec_jax.training.data: same files, same held-out split by path, each file after the
  tokenizer's BOS, which the built-in tokenizer uses as its file separator)."""
  from spec_jax.training import data
  if tokenizer.bos_id is None:
    raise ValueError("the stdlib corpus separates files with the tokenizer's BOS; this "
                     "tokenizer has none")
  root = data.stdlib_root() if root is None else Path(root)
  train_files, heldout_files = data.split_files(data.stdlib_files(root), root)
  encode = lambda texts: [tokenizer.encode(t, add_bos=False) for t in texts]
  streams = [data.token_stream(encode, data.read_texts(files), tokenizer.bos_id,
                               tokenizer.vocab_size) for files in (train_files, heldout_files)]
  heldout = data.sequential_windows(streams[1], seq_len, max_heldout)
  if len(heldout) == 0 or len(streams[0]) < seq_len + 1:
    raise ValueError(f"{root}: too little source for training and held-out windows of "
                     f"{seq_len} tokens")
  return Corpus(None, streams[0], heldout, seq_len, seed)


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


# --- export -----------------------------------------------------------------------------------

def export_drafter(folder: str | os.PathLike, spec: DrafterSpec, own,
                   dtype: str = "float32") -> Path:
  """Writes the trained drafter in the drafter file format (spec_jax.drafters.files), its
  weights stored in `dtype` (float32, float16 or int8)."""
  return _export(folder, spec.kind, spec.model, own, dtype=dtype)
