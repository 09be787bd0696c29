"""Sampling as pure functions: one place turns logits into the warped distribution.

The speculative verifier warps target and draft logits with this same function, which is
what keeps speculative sampling distributed exactly as plain sampling from the target.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp


@dataclasses.dataclass(frozen=True)
class SamplingConfig:
  """temperature 0 means greedy; top_k 0 means no top-k; top_p 1 means no nucleus cut."""
  temperature: float = 0.0
  top_k: int = 0
  top_p: float = 1.0

  def __post_init__(self):
    if not self.temperature >= 0.0:
      raise ValueError(f"temperature must be >= 0, got {self.temperature}")
    if int(self.top_k) != self.top_k or self.top_k < 0:
      raise ValueError(f"top_k must be a non-negative integer, got {self.top_k}")
    if not 0.0 < self.top_p <= 1.0:
      raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")

  @property
  def is_greedy(self) -> bool:
    return self.temperature == 0.0


def greedy(logits_NV: jax.Array) -> jax.Array:
  return jnp.argmax(logits_NV, axis=-1).astype(jnp.int32)


def warp_logits(logits_NV: jax.Array, cfg: SamplingConfig) -> jax.Array:
  """Log-probabilities of the warped distribution (float32; -inf where cut away).

  Temperature, then top-k, then top-p, as in HF transformers. Ties at a cut-off are kept,
  so the result depends only on the logits, never on sort order. At temperature 0 the
  distribution is one-hot at the argmax.
  """
  logits_NV = logits_NV.astype(jnp.float32)
  neg_inf = jnp.float32(-jnp.inf)
  if cfg.is_greedy:
    one_hot = jax.nn.one_hot(greedy(logits_NV), logits_NV.shape[-1], dtype=jnp.bool_)
    return jnp.where(one_hot, 0.0, neg_inf)
  logits_NV = logits_NV / cfg.temperature
  vocab = logits_NV.shape[-1]
  if 0 < cfg.top_k < vocab:
    kth_N1 = jax.lax.top_k(logits_NV, cfg.top_k)[0][..., -1:]
    logits_NV = jnp.where(logits_NV >= kth_N1, logits_NV, neg_inf)
  logp_NV = jax.nn.log_softmax(logits_NV, axis=-1)
  if cfg.top_p < 1.0:
    sorted_NV = jnp.sort(logp_NV, axis=-1)[..., ::-1]
    mass_before_NV = jnp.cumsum(jnp.exp(sorted_NV), axis=-1) - jnp.exp(sorted_NV)
    # the smallest kept log-prob: the last token whose preceding mass is below top_p
    kept_NV = mass_before_NV < cfg.top_p
    threshold_N1 = jnp.min(jnp.where(kept_NV, sorted_NV, jnp.inf), axis=-1, keepdims=True)
    logp_NV = jax.nn.log_softmax(jnp.where(logp_NV >= threshold_N1, logp_NV, neg_inf), axis=-1)
  return logp_NV


def warped_probs(logits_NV: jax.Array, cfg: SamplingConfig) -> jax.Array:
  return jnp.exp(warp_logits(logits_NV, cfg))


def sample(key: jax.Array, logits_NV: jax.Array, cfg: SamplingConfig) -> jax.Array:
  """Draws one token per row from the warped distribution (argmax when greedy)."""
  if cfg.is_greedy:
    return greedy(logits_NV)
  return jax.random.categorical(key, warp_logits(logits_NV, cfg), axis=-1).astype(jnp.int32)


def sample_from_probs(key: jax.Array, probs_NV: jax.Array) -> jax.Array:
  """Draws from (possibly unnormalised) non-negative weights; zero weight is never drawn."""
  logits = jnp.where(probs_NV > 0, jnp.log(jnp.maximum(probs_NV, 1e-38)), -jnp.inf)
  return jax.random.categorical(key, logits, axis=-1).astype(jnp.int32)
