"""The verifier: which drafted tokens the target keeps, and the token that follows them.

A pure function of (drafts, draft probabilities, target logits, sampling settings, key).
Greedy: accept while the draft equals the target's argmax. Sampling (Leviathan et al.
2023; Chen et al. 2023): accept draft d_i with probability min(1, p_i(d_i) / q_i(d_i));
at the first rejection draw from norm(max(p_i - q_i, 0)); after full acceptance draw the
bonus token from p_gamma. p and q are the warped distributions (the same temperature /
top-k / top-p for both), so the output is distributed exactly as sampling from p.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from spec_jax.core.sampling import (SamplingConfig, greedy, sample_from_probs, uniform_rows,
                                    warped_probs)


def check_verify_shapes(draft_tokens_BG, draft_probs_BGV, target_logits_BG1V):
  batch, gamma = draft_tokens_BG.shape
  if target_logits_BG1V.shape[:2] != (batch, gamma + 1):
    raise ValueError(f"target logits must be [batch, gamma + 1, vocab] = [{batch}, {gamma + 1}, V], "
                     f"got {target_logits_BG1V.shape}")
  if draft_probs_BGV is not None and draft_probs_BGV.shape != (batch, gamma,
                                                               target_logits_BG1V.shape[2]):
    raise ValueError(f"draft probs must be [batch, gamma, vocab] = "
                     f"[{batch}, {gamma}, {target_logits_BG1V.shape[2]}], got {draft_probs_BGV.shape}")


def _count_leading_true(accept_BG):
  return jnp.sum(jnp.cumprod(accept_BG.astype(jnp.int32), axis=1), axis=1).astype(jnp.int32)


def verify_greedy(draft_tokens_BG, target_logits_BG1V):
  """-> (num_accepted [B], next_token [B]): the longest prefix matching the argmax, then argmax."""
  target_BG1 = greedy(target_logits_BG1V)
  num_accepted_B = _count_leading_true(draft_tokens_BG == target_BG1[:, :-1])
  next_B = jnp.take_along_axis(target_BG1, num_accepted_B[:, None], axis=1)[:, 0]
  return num_accepted_B, next_B


def verify_probs(draft_tokens_BG, draft_probs_BGV, target_probs_BG1V, key):
  """Speculative sampling on probabilities. draft_probs None means q is one-hot at the draft.

  Returns (num_accepted [B], next_token [B]). Safe where p or q are zero: acceptance is
  `u * q(d) < p(d)` (no division), and an all-zero residual falls back to p.
  """
  batch, gamma = draft_tokens_BG.shape
  vocab = target_probs_BG1V.shape[-1]
  p_BG1V = target_probs_BG1V.astype(jnp.float32)
  if draft_probs_BGV is None:
    q_BGV = jax.nn.one_hot(draft_tokens_BG, vocab, dtype=jnp.float32)
  else:
    q_BGV = draft_probs_BGV.astype(jnp.float32)
  accept_key, residual_key = jax.random.split(key)
  p_draft_BG = jnp.take_along_axis(p_BG1V[:, :gamma], draft_tokens_BG[..., None], axis=-1)[..., 0]
  q_draft_BG = jnp.take_along_axis(q_BGV, draft_tokens_BG[..., None], axis=-1)[..., 0]
  u_BG = uniform_rows(accept_key, (batch, gamma))  # a key per row: independent of the batch
  num_accepted_B = _count_leading_true(u_BG * q_draft_BG < p_draft_BG)

  # q is zero past the last draft, so the residual there is p itself: the bonus token.
  q_pad_BG1V = jnp.concatenate([q_BGV, jnp.zeros((batch, 1, vocab), jnp.float32)], axis=1)
  idx_B11 = num_accepted_B[:, None, None]
  p_at_BV = jnp.take_along_axis(p_BG1V, idx_B11, axis=1)[:, 0]
  q_at_BV = jnp.take_along_axis(q_pad_BG1V, idx_B11, axis=1)[:, 0]
  residual_BV = jnp.maximum(p_at_BV - q_at_BV, 0.0)
  residual_BV = jnp.where(jnp.sum(residual_BV, -1, keepdims=True) > 0, residual_BV, p_at_BV)
  return num_accepted_B, sample_from_probs(residual_key, residual_BV)


def verify(draft_tokens_BG: jax.Array, draft_probs_BGV: jax.Array | None,
           target_logits_BG1V: jax.Array, sampling: SamplingConfig, key: jax.Array):
  """-> (num_accepted [B] in [0, gamma], next_token [B]).

  draft_probs_BGV are the warped probabilities the drafter sampled from (None for
  deterministic drafters); target logits are warped here with the same settings (the round
  has already processed them: penalties and min_new_tokens, from each position's context).
  """
  check_verify_shapes(draft_tokens_BG, draft_probs_BGV, target_logits_BG1V)
  if sampling.is_greedy:
    return verify_greedy(draft_tokens_BG, target_logits_BG1V)
  return verify_probs(draft_tokens_BG, draft_probs_BGV,
                      warped_probs(target_logits_BG1V, sampling), key)
