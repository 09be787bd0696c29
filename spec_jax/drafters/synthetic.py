"""FOR ENGINE BENCHMARKS ONLY. LOSSY: output is NOT the target's. A set acceptance rate.

The cost of a speculative round depends on how many drafts the target keeps, not on which.
To time the engine at a chosen acceptance rate alpha, without a draft model that happens
to agree with the target that often, pair the two pieces here:

  - `SyntheticDrafter` is a real (small) draft model drafting gamma tokens per round, so the
    draft cost is real; it is DraftModelDrafter under a name no one can mistake;
  - `CoinVerifier(alpha)` ignores what was drafted: it keeps each draft position with
    probability alpha (the number kept is a geometric count truncated at gamma) and returns
    the target's argmax after the kept prefix as the next token.

Every round still does all the real work (gamma draft steps, one target pass over gamma + 1
tokens, the commit and its cache rollback), and keeps on average
E = (1 - alpha^(gamma+1)) / (1 - alpha) tokens per target pass (Leviathan et al. 2023).
The tokens it keeps are the drafter's, not the target's: never generate text with this.

    drafter, verifier = synthetic_pair(draft_model, alpha=0.8)
    speculative_generate(target, params, drafter, draft_params, ..., verifier=verifier)
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from spec_jax.drafters.draft_model import DraftModelDrafter
from spec_jax.core.sampling import SamplingConfig, greedy


@dataclasses.dataclass(frozen=True)
class SyntheticDrafter(DraftModelDrafter):
  """FOR ENGINE BENCHMARKS ONLY: a draft model meant to run with a CoinVerifier (lossy)."""


@dataclasses.dataclass(frozen=True)
class CoinVerifier:
  """FOR ENGINE BENCHMARKS ONLY, LOSSY: accepts each draft position with probability alpha.

  A static (hashable) verifier for speculative_generate(verifier=...). Accepted drafts are
  kept whatever the target thinks of them; the next token is the target's greedy choice.
  """
  alpha: float
  draws_when_greedy = True  # its coins need a fresh key every round (speculative.round_inputs)
  # a greedy draft's fate is its coin, not whether it is the target's token: gamma="auto"
  # must not learn from the drafter's guesses in hindsight (AdaptiveRound.watches)
  agreement_is_acceptance = False

  def __post_init__(self):
    if not 0.0 <= self.alpha <= 1.0:
      raise ValueError(f"alpha must be in [0, 1], got {self.alpha}")

  def __call__(self, draft_tokens_BG: jax.Array, draft_probs_BGV: jax.Array | None,
               target_logits_BG1V: jax.Array, sampling: SamplingConfig, key: jax.Array):
    batch, gamma = draft_tokens_BG.shape
    heads_BG = jax.random.uniform(key, (batch, gamma), jnp.float32) < self.alpha
    num_accepted_B = jnp.sum(jnp.cumprod(heads_BG.astype(jnp.int32), axis=1), axis=1)
    num_accepted_B = num_accepted_B.astype(jnp.int32)
    target_BG1 = greedy(target_logits_BG1V)
    next_B = jnp.take_along_axis(target_BG1, num_accepted_B[:, None], axis=1)[:, 0]
    return num_accepted_B, next_B


def synthetic_pair(draft_model, alpha: float) -> tuple[SyntheticDrafter, CoinVerifier]:
  """-> (drafter, verifier) for an engine benchmark at acceptance rate alpha. LOSSY."""
  return SyntheticDrafter(draft_model), CoinVerifier(float(alpha))


def expected_tokens_per_round(alpha: float, gamma: int) -> float:
  """E[accepted drafts + 1] per round when each position is kept with probability alpha."""
  if alpha >= 1.0:
    return float(gamma + 1)
  return (1.0 - alpha ** (gamma + 1)) / (1.0 - alpha)


def predicted_speedup(alpha: float, gamma: int, t_target: float, t_draft: float,
                      t_verify: float) -> float:
  """Leviathan et al.: E * t_target / (gamma * t_draft + t_verify), per-step costs in seconds.

  t_target: one autoregressive target step; t_draft: one draft step; t_verify: one target
  pass over gamma + 1 tokens. Ignores prefill and the loop's own overhead.
  """
  return expected_tokens_per_round(alpha, gamma) * t_target / (gamma * t_draft + t_verify)
