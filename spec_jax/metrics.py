"""Speculative decoding metrics, accumulated on device inside the loop, summarised on the host."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct


@struct.dataclass
class SpecMetrics:
  rounds: jax.Array  # [] loop iterations (draft + verify rounds)
  target_calls: jax.Array  # [] target forward passes, prefill included
  rounds_B: jax.Array  # [B] rounds in which the row was still generating
  accepted_B: jax.Array  # [B] drafted tokens accepted, summed over the row's rounds
  tokens_B: jax.Array  # [B] tokens generated (the first, from prefill, included)
  accept_hist_G1: jax.Array  # [gamma+1] count of row-rounds that accepted k drafts
  position_accepted_G: jax.Array  # [gamma] row-rounds whose draft i was accepted
  position_reached_G: jax.Array  # [gamma] row-rounds whose drafts before i were all accepted

  @classmethod
  def zeros(cls, batch_size: int, gamma: int) -> "SpecMetrics":
    z = lambda *shape: jnp.zeros(shape, jnp.int32)
    return cls(z(), jnp.int32(1), z(batch_size), z(batch_size), z(batch_size), z(gamma + 1),
               z(gamma), z(gamma))

  def update(self, active_B, num_accepted_B, emitted_B) -> "SpecMetrics":
    gamma = self.position_reached_G.shape[0]
    active_i = active_B.astype(jnp.int32)
    i_G = jnp.arange(gamma, dtype=jnp.int32)
    reached_BG = (i_G[None, :] <= num_accepted_B[:, None]) * active_i[:, None]
    accepted_BG = (i_G[None, :] < num_accepted_B[:, None]) * active_i[:, None]
    hist_BG1 = jax.nn.one_hot(num_accepted_B, gamma + 1, dtype=jnp.int32) * active_i[:, None]
    return SpecMetrics(
        rounds=self.rounds + 1, target_calls=self.target_calls + 1,
        rounds_B=self.rounds_B + active_i, accepted_B=self.accepted_B + num_accepted_B * active_i,
        tokens_B=self.tokens_B + emitted_B, accept_hist_G1=self.accept_hist_G1 + hist_BG1.sum(0),
        position_accepted_G=self.position_accepted_G + accepted_BG.sum(0),
        position_reached_G=self.position_reached_G + reached_BG.sum(0))


def summarize(m: SpecMetrics) -> dict:
  """Host-side summary. 'mean_accepted' counts accepted drafts per row-round; 'with_bonus'
  adds the one target token every round yields (tokens per target pass, prefill aside)."""
  m = jax.tree.map(np.asarray, m)
  row_rounds = int(m.rounds_B.sum())
  accepted = int(m.accepted_B.sum())
  gamma = m.position_reached_G.shape[0]
  mean_accepted = accepted / row_rounds if row_rounds else 0.0
  drafted = row_rounds * gamma
  return {
      "rounds": int(m.rounds),
      "target_calls": int(m.target_calls),
      "tokens_per_row": m.tokens_B.tolist(),
      "row_rounds": row_rounds,
      "mean_accepted": mean_accepted,
      "mean_accepted_with_bonus": mean_accepted + 1.0 if row_rounds else 0.0,
      "acceptance_rate": accepted / drafted if drafted else 0.0,
      "accept_hist": m.accept_hist_G1.tolist(),
      "position_acceptance": [float(a) / r if r else float("nan")
                              for a, r in zip(m.position_accepted_G, m.position_reached_G)],
  }
