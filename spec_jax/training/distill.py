"""Distilling drafters from a frozen target: drafter specs, corpora, the trainer, and the
drafter file format (export after training, load for generation).

Kinds: draft_model (a small separate Llama), medusa (K heads), eagle (one feature-level
layer), mtp (K DeepSeek-V3 modules). Training is the shared loop of spec_jax.training
(AdamW, warm-up + cosine, clipping, orbax checkpoints: resumable; the best params by held-out
loss or acceptance can be kept). `scripts/train_drafter.py` is the command line around this.

A trained drafter is exported as two files in one folder:
  drafter.json          {"format": FORMAT, "kind": ..., "config": the model's config}
  drafter.safetensors   its own params (float32, '.'-joined names); Medusa/EAGLE/MTP share
                        the target's embedding and head, which are not stored
`load_drafter(folder, target, target_params)` rebuilds the Drafter and its draft params,
checking the file against the config and the target (vocabulary, width) before use.
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

from spec_jax.models.drafter_heads import (EagleConfig, EagleModel, HeadParams, MedusaConfig,
                                  MedusaModel, MTPConfig, MTPModel, shared_head)
from spec_jax.models.llama import LlamaConfig, LlamaModel
from spec_jax.models.params_io import CheckpointError
from spec_jax.drafter_losses import KINDS, make_loss_fn
from spec_jax.drafters.draft_model import DraftModelDrafter
from spec_jax.drafters.eagle import EagleDrafter
from spec_jax.drafters.medusa import MedusaDrafter
from spec_jax.drafters.mtp import MTPDrafter
from spec_jax.generate import generate, pad_prompts
from spec_jax.metrics import summarize
from spec_jax.core.sampling import SamplingConfig
from spec_jax.speculative import speculative_generate
from spec_jax.training import TrainState, make_optimizer, make_train_step, train_loop

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


# --- the drafter file format ------------------------------------------------------------------

FORMAT = "spec_jax-drafter"
DRAFTER_JSON = "drafter.json"
DRAFTER_WEIGHTS = "drafter.safetensors"


def _model_from_config(kind: str, config: dict):
  if kind == "medusa":
    return MedusaModel(MedusaConfig(**config))
  if kind == "eagle":
    return EagleModel(EagleConfig(LlamaConfig.from_dict(config["layer"])))
  if kind == "mtp":
    return MTPModel(MTPConfig(LlamaConfig.from_dict(config["layer"]), config["num_modules"]))
  if kind == "draft_model":
    return LlamaModel(LlamaConfig.from_dict(config))
  raise CheckpointError(f"unknown drafter kind {kind!r}; one of {', '.join(KINDS)}")


def _drafter_for(kind: str, model):
  return {"medusa": MedusaDrafter, "eagle": EagleDrafter, "mtp": MTPDrafter,
          "draft_model": DraftModelDrafter}[kind](model)


def _abstract_own(model):
  params = model.abstract_params()
  return nnx.to_pure_dict(params) if isinstance(params, nnx.State) else params


def _name(path) -> str:
  return ".".join(str(getattr(k, "key", getattr(k, "idx", k))) for k in path)


def export_drafter(folder: str | os.PathLike, spec: DrafterSpec, own) -> Path:
  """Writes drafter.json and drafter.safetensors (the drafter's own params) into `folder`."""
  import safetensors.numpy
  folder = Path(folder)
  folder.mkdir(parents=True, exist_ok=True)
  tensors = {_name(path): np.ascontiguousarray(np.asarray(leaf, np.float32))
             for path, leaf in jax.tree_util.tree_leaves_with_path(own)}
  tmp = folder / (DRAFTER_WEIGHTS + ".tmp")
  safetensors.numpy.save_file(tensors, str(tmp), metadata={"format": FORMAT})
  tmp.replace(folder / DRAFTER_WEIGHTS)
  (folder / DRAFTER_JSON).write_text(json.dumps(
      {"format": FORMAT, **spec.describe()}, indent=2, sort_keys=True) + "\n")
  return folder


def read_drafter(folder: str | os.PathLike) -> tuple[str, Any, Any]:
  """-> (kind, model handle, own params), validated against the stored config."""
  import safetensors
  folder = Path(folder)
  missing = [f for f in (DRAFTER_JSON, DRAFTER_WEIGHTS) if not (folder / f).is_file()]
  if missing:
    raise CheckpointError(f"{folder}: not an exported drafter (missing {', '.join(missing)}; "
                          "scripts/train_drafter.py --export-dir writes them)")
  try:
    meta = json.loads((folder / DRAFTER_JSON).read_text())
    kind, config = meta["kind"], meta["config"]
    model = _model_from_config(kind, config)
  except (json.JSONDecodeError, KeyError, TypeError, ValueError) as e:
    raise CheckpointError(f"{folder / DRAFTER_JSON}: malformed drafter description ({e})") from e
  path = folder / DRAFTER_WEIGHTS
  try:
    with safetensors.safe_open(str(path), framework="numpy") as f:
      flat = {name: f.get_tensor(name) for name in f.keys()}
  except (safetensors.SafetensorError, OSError) as e:
    raise CheckpointError(f"{path}: truncated or malformed safetensors file ({e})") from e
  abstract = _abstract_own(model)
  leaves, treedef = jax.tree_util.tree_flatten_with_path(abstract)
  expected = {_name(p): leaf for p, leaf in leaves}
  if set(expected) != set(flat):
    raise CheckpointError(f"{path}: parameters do not match the {kind} config: missing "
                          f"{sorted(set(expected) - set(flat))[:6]}, unexpected "
                          f"{sorted(set(flat) - set(expected))[:6]}")
  for name, leaf in expected.items():
    if tuple(flat[name].shape) != tuple(leaf.shape):
      raise CheckpointError(f"{path}: {name} has shape {tuple(flat[name].shape)}, the config "
                            f"expects {tuple(leaf.shape)}")
    if not np.all(np.isfinite(flat[name])):
      raise CheckpointError(f"{path}: {name} has non-finite values")
  own = jax.tree_util.tree_unflatten(
      treedef, [jnp.asarray(flat[_name(p)], leaf.dtype) for p, leaf in leaves])
  return kind, model, own


def check_drafter_fits(kind: str, model, target) -> None:
  """The target a drafter was trained for must match in vocabulary (and, for heads that read
  the target's hidden states, in width)."""
  if model.vocab_size != target.vocab_size:
    raise ValueError(f"{kind} drafter vocabulary {model.vocab_size} != target vocabulary "
                     f"{target.vocab_size}: it was trained for another target")
  width = {"medusa": lambda: model.config.dim, "eagle": lambda: model.config.layer.dim,
           "mtp": lambda: model.config.layer.dim}.get(kind)
  if width is not None and width() != target.config.dim:
    raise ValueError(f"{kind} drafter reads hidden states of width {width()}, the target's are "
                     f"{target.config.dim}: it was trained for another target")


def load_drafter(folder: str | os.PathLike, target, target_params):
  """An exported drafter for `target` -> (kind, model handle, draft params for generation)."""
  kind, model, own = read_drafter(folder)
  check_drafter_fits(kind, model, target)
  if kind == "draft_model":
    return kind, model, own
  return kind, model, HeadParams(own, shared_head(target, target_params))
