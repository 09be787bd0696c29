"""Losses as pure jax.numpy functions: the distillation stack's and every drafter family's.

No optax here: drafter family files declare their training loss next to their drafter, and
inference (which imports those files) must not pull in the training dependencies.

Alignment of the drafter losses (position t holds x_t; target logits at t predict x_{t+1}):
a prediction counts where the token it predicts exists and is unmasked (`token_loss`).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import struct


def masked_mean(values_BT: jax.Array, mask_BT: jax.Array | None) -> jax.Array:
  if mask_BT is None:
    return jnp.mean(values_BT)
  mask_BT = mask_BT.astype(jnp.float32)
  return jnp.sum(values_BT * mask_BT) / jnp.maximum(jnp.sum(mask_BT), 1.0)


def cross_entropy_with_integer_labels(logits_NV: jax.Array, labels_N: jax.Array) -> jax.Array:
  """-log softmax(logits)[label] per row, in float32."""
  logp_NV = jax.nn.log_softmax(logits_NV.astype(jnp.float32), axis=-1)
  return -jnp.take_along_axis(logp_NV, labels_N[..., None].astype(jnp.int32), axis=-1)[..., 0]


def huber(pred: jax.Array, target: jax.Array, delta: float = 1.0) -> jax.Array:
  """Elementwise Huber loss (smooth L1 for delta 1), as optax.huber_loss."""
  err = jnp.abs(pred - target)
  quad = jnp.minimum(err, delta)
  return 0.5 * quad * quad + delta * (err - quad)


def next_token_cross_entropy(logits_BTV: jax.Array, tokens_BT: jax.Array,
                             mask_BT: jax.Array | None = None) -> jax.Array:
  """Mean cross-entropy (nats) of logits[:, t] predicting tokens[:, t + 1].

  `logits_BTV` are the model's outputs on `tokens_BT`; the last position has no target.
  `mask_BT` marks the positions whose prediction counts (aligned with the logits).
  """
  ce_BT = cross_entropy_with_integer_labels(logits_BTV[:, :-1], tokens_BT[:, 1:])
  return masked_mean(ce_BT, None if mask_BT is None else mask_BT[:, :-1])


def distillation_kl(student_logits_BTV: jax.Array, teacher_logits_BTV: jax.Array,
                    mask_BT: jax.Array | None = None, temperature: float = 1.0) -> jax.Array:
  """Forward KL(teacher || student) per position, masked mean, times temperature**2.

  Forward KL makes the student put mass wherever the teacher does, which is what raises
  speculative acceptance (sum_x min(p, q) = 1 - TV(p, q)); the T**2 factor keeps gradient
  scale independent of the temperature (Hinton et al.). The teacher gets no gradient.
  """
  t = jnp.float32(temperature)
  teacher_BTV = jax.lax.stop_gradient(teacher_logits_BTV).astype(jnp.float32) / t
  log_p_BTV = jax.nn.log_softmax(teacher_BTV, axis=-1)
  log_q_BTV = jax.nn.log_softmax(student_logits_BTV.astype(jnp.float32) / t, axis=-1)
  kl_BT = jnp.sum(jnp.exp(log_p_BTV) * (log_p_BTV - log_q_BTV), axis=-1)
  return masked_mean(kl_BT, mask_BT) * t * t


TOKEN_LOSSES = ("kl", "ce")


@struct.dataclass
class TargetOutputs:
  tokens_BT: jax.Array  # [B, T] int32
  mask_BT: jax.Array  # [B, T] bool: real tokens (False on padding)
  logits_BTV: jax.Array  # [B, T, V] float32: target logits, predicting x_{t+1}
  hidden_BTD: jax.Array  # [B, T, D] target's last (post-final-norm) hidden states


def target_outputs(target, target_params, tokens_BT, mask_BT=None) -> TargetOutputs:
  """One frozen target pass over whole sequences (positions 0..T-1), no gradient."""
  batch, length = tokens_BT.shape
  positions_BT = jnp.broadcast_to(jnp.arange(length, dtype=jnp.int32), (batch, length))
  logits_BTV, hidden_BTD, _ = target.apply(target_params, tokens_BT, positions_BT,
                                           target.init_cache(batch, length))
  if mask_BT is None:
    mask_BT = jnp.ones((batch, length), bool)
  return TargetOutputs(tokens_BT, mask_BT.astype(bool),
                       jax.lax.stop_gradient(logits_BTV.astype(jnp.float32)),
                       jax.lax.stop_gradient(hidden_BTD))


def shift_left(x_BT, s: int, fill=0):
  """out[:, t] = x[:, t + s], `fill` where t + s is past the end."""
  if s == 0:
    return x_BT
  pad = jnp.full((x_BT.shape[0], s) + x_BT.shape[2:], fill, x_BT.dtype)
  return jnp.concatenate([x_BT[:, s:], pad], axis=1)


def token_loss(student_BTV, t: TargetOutputs, shift: int, kind: str):
  """Drafter logits at t against the target's prediction of x_{t+shift}.

  -> (loss, top-1 agreement with the target's argmax: the greedy acceptance of one draft).
  """
  if kind not in TOKEN_LOSSES:
    raise ValueError(f"token loss must be one of {TOKEN_LOSSES}, got {kind!r}")
  teacher_BTV = shift_left(t.logits_BTV, shift - 1)
  valid_BT = shift_left(t.mask_BT, shift, False)
  if kind == "kl":
    loss = distillation_kl(student_BTV, teacher_BTV, valid_BT)
  else:
    labels_BT = shift_left(t.tokens_BT, shift)
    ce_BT = cross_entropy_with_integer_labels(student_BTV, labels_BT)
    loss = masked_mean(ce_BT, valid_BT)
  agree_BT = jnp.argmax(student_BTV, -1) == jnp.argmax(teacher_BTV, -1)
  return loss, masked_mean(agree_BT, valid_BT)


def positions_of(t: TargetOutputs) -> jax.Array:
  """[B, T] positions 0..T-1 of a whole-sequence pass."""
  batch, length = t.tokens_BT.shape
  return jnp.broadcast_to(jnp.arange(length, dtype=jnp.int32), (batch, length))


def smooth_l1(pred_BTD, target_BTD, mask_BT):
  """Smooth L1 (Huber, delta 1), mean over features, masked mean over positions."""
  per_BT = jnp.mean(huber(pred_BTD.astype(jnp.float32), target_BTD.astype(jnp.float32)), axis=-1)
  return masked_mean(per_BT, mask_BT)
