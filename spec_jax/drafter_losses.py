"""Distillation losses for trained drafters, one pure function per kind.

Every loss reads a frozen target's outputs on a token sequence (`TargetOutputs`: its
logits and last hidden states, no gradient) and compares the drafter's predictions with
them at the positions they refer to. Token losses are either "kl", forward
KL(target || drafter) per position, which is what raises acceptance (sum_x min(p, q) =
1 - TV(p, q)), or "ce", cross-entropy to the sequence's actual next tokens (the target's
own samples when the corpus is its generations: the same objective in expectation).

Alignment (position t holds x_t; target logits at t predict x_{t+1}):
  draft model: its logits at t vs the target's at t.
  Medusa head k (0-based): from the target hidden h_t predicts x_{t+2+k}: target logits at t+1+k.
  EAGLE: element t = (f_t, x_{t+1}) predicts f_{t+1} (smooth L1 to the target's feature) and,
    through the head, x_{t+2}: target logits at t+1.
  MTP module k (1-based): element i = (h^{k-1}_i, x_{i+k}) predicts x_{i+k+1}: target logits at i+k.
A prediction counts where the token it predicts exists and is unmasked.
"""

from __future__ import annotations

from typing import Callable

import jax
import jax.numpy as jnp
from spec_jax.losses import (TargetOutputs, positions_of, shift_left, smooth_l1,
                             target_outputs, token_loss)

def draft_model_loss(model, params, t: TargetOutputs, *, token: str = "kl"):
  """A separate draft model (a CausalLM) on the same tokens: logits at t vs the target's."""
  batch, length = t.tokens_BT.shape
  logits_BTV, _, _ = model.apply(params, t.tokens_BT, positions_of(t),
                                 model.init_cache(batch, length))
  loss, agree = token_loss(logits_BTV, t, 1, token)
  return loss, {"token_loss": loss, "agree_1": agree}


def medusa_loss(model, params, t: TargetOutputs, *, token: str = "kl", decay: float = 0.8):
  """Sum over heads of decay**k * token loss of head k (later heads matter less, as in Medusa)."""
  logits_BTKV = model.apply(params, t.hidden_BTD)
  total, metrics = 0.0, {}
  for k in range(logits_BTKV.shape[2]):
    loss, agree = token_loss(logits_BTKV[:, :, k], t, 2 + k, token)
    total = total + decay ** k * loss
    metrics[f"loss_{k + 1}"], metrics[f"agree_{k + 1}"] = loss, agree
  return total, metrics


def eagle_loss(model, params, t: TargetOutputs, rng=None, *, token: str = "kl",
               feature_weight: float = 1.0, token_weight: float = 0.1,
               feature_noise: float = 0.0):
  """EAGLE: feature regression (smooth L1 to f_{t+1}) + token loss on the predicted feature.

  `feature_noise` adds U(-a, a) to the input features (as EAGLE does), so the drafter learns
  to cope with its own imprecise features when it drafts several steps ahead.
  """
  batch, length = t.tokens_BT.shape
  features_BTD = t.hidden_BTD
  if feature_noise and rng is not None:
    features_BTD = features_BTD + jax.random.uniform(
        rng, features_BTD.shape, features_BTD.dtype, -feature_noise, feature_noise)
  logits_BTV, pred_BTD, _ = model.apply(params, features_BTD, shift_left(t.tokens_BT, 1),
                                        positions_of(t), model.init_cache(batch, length))
  feature = smooth_l1(pred_BTD, shift_left(t.hidden_BTD, 1), shift_left(t.mask_BT, 1, False))
  tok, agree = token_loss(logits_BTV, t, 2, token)
  loss = feature_weight * feature + token_weight * tok
  return loss, {"feature_loss": feature, "token_loss": tok, "agree_1": agree}


def mtp_loss(model, params, t: TargetOutputs, *, token: str = "kl"):
  """Mean over modules of module k's token loss (DeepSeek-V3 weighs them equally)."""
  batch, length = t.tokens_BT.shape
  logits_KBTV, _ = model.apply(params, t.hidden_BTD, t.tokens_BT, positions_of(t),
                               model.init_cache(batch, length))
  num = logits_KBTV.shape[0]
  total, metrics = 0.0, {}
  for k in range(1, num + 1):
    loss, agree = token_loss(logits_KBTV[k - 1], t, k + 1, token)
    total = total + loss / num
    metrics[f"loss_{k}"], metrics[f"agree_{k}"] = loss, agree
  return total, metrics


KINDS = ("draft_model", "medusa", "eagle", "mtp")


def make_loss_fn(kind: str, target, model, **options) -> Callable:
  """-> loss_fn(params, batch, rng) for spec_jax.training.make_train_step.

  `params` are the drafter's trainable params; `batch` is {"tokens": [B, T] int32,
  "target_params": the frozen target's params, optional "mask": [B, T]}. The target runs
  inside the step (its params a traced argument, never a baked-in constant); the heads
  get its embedding and LM head through HeadParams.
  """
  if kind not in KINDS:
    raise ValueError(f"unknown drafter kind {kind!r}; one of {', '.join(KINDS)}")
  from spec_jax.models.drafter_heads import HeadParams, shared_head  # heads live with the models

  def loss_fn(params, batch, rng):
    t = target_outputs(target, batch["target_params"], batch["tokens"], batch.get("mask"))
    if kind == "draft_model":
      return draft_model_loss(model, params, t, **options)
    head_params = HeadParams(params, shared_head(target, batch["target_params"]))
    if kind == "medusa":
      return medusa_loss(model, head_params, t, **options)
    if kind == "eagle":
      return eagle_loss(model, head_params, t, rng, **options)
    return mtp_loss(model, head_params, t, **options)

  return loss_fn
