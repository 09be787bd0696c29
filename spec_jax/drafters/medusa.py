"""Medusa: K heads on the target's last hidden state draft gamma <= K tokens in one pass.

At a round's start the pending token x_L is known but unseen by the target; the target's
hidden state at L-1 (the last committed position, whose own LM head gave x_L) is what the
heads read: head k predicts x_{L+k} = draft k. The state keeps that hidden state; `init`
takes it from the prompt's hidden states and `commit` from the verify pass, whose block
[pending, d_1..d_gamma] sits at positions L..L+gamma: the new pending token is at the
new target length L', so the hidden state to keep is the block's entry at L' - 1 - L.
A chain also keeps the hidden states of the RECENT positions before the pending token (a
shift register: init, record_plain_step and commit shift in what they see), so that a
catch-up after plain steps can say where head 1 would have been accepted (hindsight).

Drafts are independent of each other given the context (head k does not see d_1..d_{k-1}),
which is still a valid proposal: the verifier gets each head's warped distribution q_k.

`MedusaTreeDrafter` proposes a static Medusa tree instead: a node at depth d with rank r
holds head d's r-th best token, whatever its parent (spec_jax.tree.tokens_from_topk). The
tree is a deterministic function of the context, so tree verification with one-hot q is
lossless. Its commit sees the accepted path in chain form, so the bookkeeping is shared.
"""

from __future__ import annotations

import dataclasses
import heapq

import jax
import jax.numpy as jnp
from flax import struct

from spec_jax.drafters.base import (HINDSIGHT_WIDTH, DraftContext, Drafter, PromptInfo,
                                    RoundOutcome, TreeDrafter)
from spec_jax.core.sampling import SamplingConfig, greedy
from spec_jax.drafters.common import (draw, gather_positions, hidden_before_pending,
                                     hindsight_scores, last_hidden, tree_log_probs)
from spec_jax.drafters.registry import DrafterFamily, DrafterSizes, Trained, TreeOptions, register
from spec_jax.losses import TargetOutputs, token_loss
from spec_jax.models.drafter_heads import MedusaConfig, MedusaModel
from spec_jax.tree import StaticTree, TokenTree, static_tree, tokens_from_topk


# The recent target hidden states a chain keeps: a catch-up's last HINDSIGHT_WIDTH guesses
# read those before the pending token's predecessor
RECENT = HINDSIGHT_WIDTH + 1


@struct.dataclass
class MedusaState:
  hidden_BD: jax.Array  # target hidden state at the position before the pending token
  # chains: [B, RECENT, D] the target's hidden states at the RECENT positions before the
  # pending token, oldest first (the last is hidden_BD's), what hindsight reads; a shift
  # register, not a ring (a plain step writing a slot picked by its position cost
  # stories260K's step 27% on the CPU, shifting nothing measurable); None for trees
  recent_BRD: jax.Array | None = None


def _shifted_in(recent_BRD, new_BTD, count_B):
  """The register after new_BTD's first count_B[b] entries (in position order) followed
  row b's: its last RECENT positions."""
  both_BXD = jnp.concatenate([recent_BRD, new_BTD.astype(recent_BRD.dtype)], axis=1)
  idx_BR = count_B[:, None] + jnp.arange(RECENT, dtype=jnp.int32)[None, :]
  return jnp.take_along_axis(both_BXD, idx_BR[..., None], axis=1)


@dataclasses.dataclass(frozen=True)
class MedusaDrafter(Drafter):
  model: object  # spec_jax.models.drafter_heads.MedusaModel (hashable); params: HeadParams

  @property
  def vocab_size(self) -> int:
    return self.model.vocab_size

  @property
  def max_gamma(self) -> int:
    return self.model.num_heads

  @property
  def max_gamma_reason(self) -> str:
    return f"one draft per head, {self.model.num_heads} heads"

  def init(self, params, prompt: PromptInfo) -> MedusaState:
    last_BD = last_hidden(prompt)
    # positions L - RECENT .. L - 1 of the prompt (clamped at 0: never read by hindsight)
    pos_BR = jnp.maximum(prompt.lengths_B[:, None] - RECENT
                         + jnp.arange(RECENT, dtype=jnp.int32)[None, :], 0)
    recent_BRD = jnp.take_along_axis(prompt.target_hidden_BPD[..., :last_BD.shape[1]],
                                     pos_BR[..., None], axis=1)
    return MedusaState(last_BD, recent_BRD.astype(last_BD.dtype))

  def init_with_first_logits(self, params, prompt: PromptInfo, positions_BA):
    # As in catch_up_with_hindsight, a round whose pending token sat at q drafts head 1 of
    # the target's hidden state at q - 1. That head never sees x_q: it was trained on text
    # where x_q is what the target's head makes of the same state, as in a greedy run, and
    # a prompt's tokens often are not. So only positions whose x_q is the target's greedy
    # token there have a draft (and not q = 0, which nothing precedes). A sampled run's x_q
    # is a sample, often not the greedy token: there the look reads head 1 where the
    # context is likeliest, an estimate on the high side that its stretches then correct.
    state = self.init(params, prompt)
    hidden_BAD = gather_positions(prompt.target_hidden_BPD[..., :state.hidden_BD.shape[1]],
                                  positions_BA - 1)
    greedy_BA = greedy(params.shared.logits(hidden_BAD)) == gather_positions(
        prompt.tokens_BP, positions_BA)
    return (state, self.model.first_head_logits(params, hidden_BAD),
            (positions_BA >= 1) & greedy_BA)

  @property
  def guesses_at_init(self) -> bool:
    return True

  def propose(self, params, state: MedusaState, ctx: DraftContext, gamma: int,
              sampling: SamplingConfig, key: jax.Array):
    logits_BGV = self.model.apply(params, state.hidden_BD[:, None])[:, 0, :gamma]
    keys = jax.random.split(key, gamma)
    drawn, history = [], ctx.history
    for g in range(gamma):  # head g's draft, processed after the drafts before it
      drawn.append(draw(keys[g], logits_BGV[:, g], sampling, history))
      history = None if history is None else history.push(drawn[-1][0])
    tokens_BG = jnp.stack([t for t, _ in drawn], axis=1)
    probs_BGV = None if sampling.is_greedy else jnp.stack([p for _, p in drawn], axis=1)
    return tokens_BG, probs_BGV, state

  def commit(self, params, state: MedusaState, outcome: RoundOutcome) -> MedusaState:
    hidden_BD = hidden_before_pending(outcome, state.hidden_BD)
    recent_BRD = state.recent_BRD
    if recent_BRD is not None:  # the block's kept positions, L .. L' - 1
      kept_B = jnp.maximum(outcome.new_target_length_B - outcome.context.position_B, 0)
      recent_BRD = _shifted_in(recent_BRD, outcome.target_hidden_BG1D[..., :hidden_BD.shape[1]],
                               kept_B)
    return MedusaState(hidden_BD, recent_BRD)

  @property
  def skips_rounds(self) -> bool:
    return True  # the state is hidden states, which record_plain_step keeps current

  def catch_up_after(self, params, state: MedusaState, ctx: DraftContext, rounds: int,
                     gamma: int) -> MedusaState:
    return state

  def record_plain_step(self, params, state: MedusaState, hidden_BD, position_B,
                        fed_B) -> MedusaState:
    # a row that fed x_L emitted its successor, the new pending token: x_L's hidden state
    # is the one before it
    hidden_BD = hidden_BD.astype(state.hidden_BD.dtype)
    recent_BRD = state.recent_BRD
    if recent_BRD is not None:
      shifted_BRD = jnp.concatenate([recent_BRD[:, 1:], hidden_BD[:, None]], axis=1)
      recent_BRD = jnp.where(fed_B[:, None, None], shifted_BRD, recent_BRD)
    return MedusaState(jnp.where(fed_B[:, None], hidden_BD, state.hidden_BD), recent_BRD)

  @property
  def has_hindsight(self) -> bool:
    return True

  @property
  def hindsight_speaks_for_later_drafts(self) -> bool:
    return False  # head k > 1 is not head 1 one position on: the later estimates need rounds

  @property
  def has_sampled_hindsight(self) -> bool:
    return True  # (its catch-up has head 1's logits, what propose draws the first draft from)

  def catch_up_with_hindsight(self, params, state: MedusaState, ctx: DraftContext,
                              rounds: int, gamma: int):
    # entry a: the round whose pending token sat at q = L - A + a would have drafted head 1
    # of the hidden state at q - 1 for the token at q + 1 (the last: the pending one)
    width = min(rounds + 1, HINDSIGHT_WIDTH)
    q_BA = ctx.position_B[:, None] - width + jnp.arange(width, dtype=jnp.int32)[None, :]
    hidden_BAD = state.recent_BRD[:, RECENT - 1 - width:RECENT - 1]  # positions q - 1
    # (a sampled run: min(1, q(y) / p(y)); head 1 never sees the pending token x_q, so its
    # q is the one propose would draw from whatever x_q was drawn)
    return state, hindsight_scores(self.model.first_head_logits(params, hidden_BAD), q_BA + 1,
                                   ctx)


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
    logits_BRV = self.model.apply(params, state.hidden_BD[:, None])[:, 0, :spec.max_depth]
    logp_BRV = tree_log_probs(logits_BRV, sampling, ctx.history, jnp.arange(spec.max_depth))
    candidates_BRC = jax.lax.top_k(logp_BRV, spec.max_rank + 1)[1]
    return spec.tree(tokens_from_topk(spec, ctx.pending_B, candidates_BRC)), state

  commit = MedusaDrafter.commit
  skips_rounds = MedusaDrafter.skips_rounds
  catch_up_after = MedusaDrafter.catch_up_after
  record_plain_step = MedusaDrafter.record_plain_step


# --- the family ---------------------------------------------------------------------------------

def static_choices(tree: TreeOptions) -> tuple[tuple[int, ...], ...]:
  """A static (Medusa-style) tree of the same budget: the `nodes - 1` paths of ranks < top_k
  and length <= depth with the smallest rank sums (shorter first on ties), so every path's
  parent is in the tree before it.

  Best-first over a heap, never enumerating the top_k**depth paths: each path is generated
  once, by its previous sibling (last rank - 1) or, for rank 0, by its parent, and both
  sort before it; so time O(nodes log nodes) and memory O(nodes) (`--tree 12,10,16` once
  built 10**12 paths before anything was checked)."""
  for name, least in (("depth", 1), ("top_k", 1), ("nodes", 2)):
    value = getattr(tree, name)
    if isinstance(value, bool) or not isinstance(value, int) or value < least:
      raise ValueError(f"tree {name} must be an integer >= {least}, got {value!r}")
  paths, level = 0, 1  # paths of length <= depth, counted only until the budget is met
  for _ in range(tree.depth):
    level = min(level * tree.top_k, tree.nodes)
    paths += level
    if paths >= tree.nodes - 1:
      break
  if tree.nodes - 1 > paths:
    raise ValueError(f"a static tree of depth {tree.depth} and top-k {tree.top_k} has at most "
                     f"{paths + 1} nodes (root included), got nodes={tree.nodes}")
  key = lambda p: (sum(p), len(p), p)
  heap, out = [(key((0,)), (0,))], []
  while heap and len(out) < tree.nodes - 1:
    _, path = heapq.heappop(heap)
    out.append(path)
    if path[-1] + 1 < tree.top_k:  # next sibling
      sibling = path[:-1] + (path[-1] + 1,)
      heapq.heappush(heap, (key(sibling), sibling))
    if len(path) < tree.depth:  # first child
      heapq.heappush(heap, (key(path + (0,)), path + (0,)))
  return tuple(out)


def _tree_drafter(model, tree: TreeOptions) -> MedusaTreeDrafter:
  # checked before the tree is built: a depth no head can draft is an error, not a big tree
  if tree.depth > model.num_heads:
    raise ValueError(f"a Medusa tree of depth {tree.depth} needs as many heads; the model has "
                     f"{model.num_heads}")
  return MedusaTreeDrafter(model, static_choices(tree))


def medusa_loss(model, params, t: TargetOutputs, rng=None, *, token: str = "kl",
                decay: float = 0.8):
  """Sum over heads of decay**k * token loss of head k (later heads matter less, as in Medusa).
  Head k (0-based) reads the target hidden h_t and predicts x_{t+2+k}: target logits at t+1+k."""
  logits_BTAV = model.apply(params, t.hidden_BTD)  # A: the heads
  total, metrics = 0.0, {}
  for k in range(logits_BTAV.shape[2]):
    loss, agree = token_loss(logits_BTAV[:, :, k], t, 2 + k, token)
    total = total + decay ** k * loss
    metrics[f"loss_{k + 1}"], metrics[f"agree_{k + 1}"] = loss, agree
  return total, metrics


def _new_model(target, sizes: DrafterSizes):
  return MedusaModel(MedusaConfig.for_target(target.config, sizes.num_heads))


def _model_from_config(config: dict):
  return MedusaModel(MedusaConfig(**config))


register(DrafterFamily(
    name="medusa", summary="K residual heads on the target's last hidden state (trained)",
    tree=True,
    combinable=True,
    trained=Trained(new_model=_new_model, model_from_config=_model_from_config,
                    chain=MedusaDrafter,
                    tree=_tree_drafter,
                    loss=medusa_loss, hidden_width=lambda model: model.config.dim,
)))
