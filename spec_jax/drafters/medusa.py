"""Medusa: K heads on the target's last hidden state draft gamma <= K tokens in one pass.

At a round's start the pending token x_L is known but unseen by the target; the target's
hidden state at L-1 (the last committed position, whose own LM head gave x_L) is what the
heads read: head k predicts x_{L+k} = draft k. The state keeps that hidden state; `init`
takes it from the prompt's hidden states and `commit` from the verify pass, whose block
[pending, d_1..d_gamma] sits at positions L..L+gamma: the new pending token is at the
new target length L', so the hidden state to keep is the block's entry at L' - 1 - L.

Drafts are independent of each other given the context (head k does not see d_1..d_{k-1}),
which is still a valid proposal: the verifier gets each head's warped distribution q_k.

`MedusaTreeDrafter` proposes a static Medusa tree instead: a node at depth d with rank r
holds head d's r-th best token, whatever its parent (spec_jax.tree.tokens_from_topk). The
tree is a deterministic function of the context, so tree verification with one-hot q is
lossless. Its commit sees the accepted path in chain form, so the bookkeeping is shared.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from flax import struct

from spec_jax.drafters.base import DraftContext, Drafter, PromptInfo, RoundOutcome, TreeDrafter
from spec_jax.core.sampling import SamplingConfig, sample, warp_logits, warped_probs
from spec_jax.tree import StaticTree, TokenTree, static_tree, tokens_from_topk


@struct.dataclass
class MedusaState:
  hidden_BD: jax.Array  # target hidden state at the position before the pending token


def last_hidden(prompt: PromptInfo) -> jax.Array:
  """[B, D] target hidden state at each prompt's last position."""
  if prompt.target_hidden_BPD is None:
    raise ValueError("this drafter needs the target's hidden states (PromptInfo.target_hidden_BPD)")
  idx_B11 = (prompt.lengths_B - 1)[:, None, None]
  return jnp.take_along_axis(prompt.target_hidden_BPD, idx_B11, axis=1)[:, 0]


def hidden_before_pending(outcome: RoundOutcome, old_BD: jax.Array) -> jax.Array:
  """[B, D] the verify block's hidden state just before the new pending token (old if none)."""
  if outcome.target_hidden_BG1D is None:
    raise ValueError("this drafter needs the target's hidden states "
                     "(RoundOutcome.target_hidden_BG1D)")
  idx_B = outcome.new_target_length_B - 1 - outcome.context.position_B
  width = outcome.target_hidden_BG1D.shape[1]
  new_BD = jnp.take_along_axis(outcome.target_hidden_BG1D,
                               jnp.clip(idx_B, 0, width - 1)[:, None, None], axis=1)[:, 0]
  return jnp.where((idx_B >= 0)[:, None], new_BD, old_BD)  # rows that kept nothing stay


def draw(key: jax.Array, logits_BV: jax.Array, sampling: SamplingConfig):
  """-> (token [B], warped probs [B, V] it was drawn from, or None when greedy)."""
  token_B = sample(key, logits_BV, sampling)
  return token_B, (None if sampling.is_greedy else warped_probs(logits_BV, sampling))


@dataclasses.dataclass(frozen=True)
class MedusaDrafter(Drafter):
  model: object  # spec_jax.models.drafter_heads.MedusaModel (hashable); params: HeadParams

  @property
  def vocab_size(self) -> int:
    return self.model.vocab_size

  def check(self, target, gamma: int) -> None:
    super().check(target, gamma)
    if gamma > self.model.num_heads:
      raise ValueError(f"Medusa with {self.model.num_heads} heads drafts at most that many "
                       f"tokens per round, got gamma={gamma}")

  def init(self, params, prompt: PromptInfo) -> MedusaState:
    return MedusaState(last_hidden(prompt))

  def propose(self, params, state: MedusaState, ctx: DraftContext, gamma: int,
              sampling: SamplingConfig, key: jax.Array):
    logits_BGV = self.model.apply(params, state.hidden_BD[:, None])[:, 0, :gamma]
    keys = jax.random.split(key, gamma)
    drawn = [draw(keys[g], logits_BGV[:, g], sampling) for g in range(gamma)]
    tokens_BG = jnp.stack([t for t, _ in drawn], axis=1)
    probs_BGV = None if sampling.is_greedy else jnp.stack([p for _, p in drawn], axis=1)
    return tokens_BG, probs_BGV, state

  def commit(self, params, state: MedusaState, outcome: RoundOutcome) -> MedusaState:
    return MedusaState(hidden_before_pending(outcome, state.hidden_BD))


def tree_log_probs(logits_NV: jax.Array, sampling: SamplingConfig) -> jax.Array:
  """What tree drafters rank children by: the warped log-probs, or plain ones when greedy
  (greedy warping is one-hot, which would leave nothing to rank the other children by)."""
  if sampling.is_greedy:
    return jax.nn.log_softmax(logits_NV.astype(jnp.float32), axis=-1)
  return warp_logits(logits_NV, sampling)


@dataclasses.dataclass(frozen=True)
class MedusaTreeDrafter(TreeDrafter):
  """A static Medusa tree; `choices` are paths of top-k ranks, e.g. ((0,), (1,), (0, 0))."""
  model: object  # spec_jax.models.drafter_heads.MedusaModel (hashable); params: HeadParams
  choices: tuple = ((0,), (1,), (2,), (0, 0), (0, 1), (1, 0), (0, 0, 0))

  @property
  def vocab_size(self) -> int:
    return self.model.vocab_size

  @property
  def spec(self) -> StaticTree:
    return static_tree(self.choices)

  @property
  def num_nodes(self) -> int:
    return self.spec.num_nodes

  @property
  def max_depth(self) -> int:
    return self.spec.max_depth

  def check(self, target, gamma: int) -> None:
    super().check(target, gamma)
    if self.max_depth > self.model.num_heads:
      raise ValueError(f"a Medusa tree of depth {self.max_depth} needs as many heads; the "
                       f"model has {self.model.num_heads}")

  def init(self, params, prompt: PromptInfo) -> MedusaState:
    return MedusaState(last_hidden(prompt))

  def propose_tree(self, params, state: MedusaState, ctx: DraftContext,
                   sampling: SamplingConfig, key: jax.Array) -> tuple[TokenTree, MedusaState]:
    spec = self.spec
    logits_BDV = self.model.apply(params, state.hidden_BD[:, None])[:, 0, :spec.max_depth]
    candidates_BDK = jax.lax.top_k(tree_log_probs(logits_BDV, sampling), spec.max_rank + 1)[1]
    return spec.tree(tokens_from_topk(spec, ctx.pending_B, candidates_BDK)), state

  def commit(self, params, state: MedusaState, outcome: RoundOutcome) -> MedusaState:
    return MedusaState(hidden_before_pending(outcome, state.hidden_BD))
