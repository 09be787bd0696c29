"""The drafter protocol: a small bundle of pure functions, in the spirit of optax.

A drafter is a frozen (hashable) dataclass, so it can be a static argument of the jitted
generation; everything that changes lives in its `state` pytree, and its parameters (if
any) are passed in as a traced argument, never baked into the program:

    state = drafter.init(params, prompt)                               # after target prefill
    tokens_BG, probs_BGV | None, state = drafter.propose(params, state, ctx, gamma, sampling, key)
    state = drafter.commit(params, state, outcome)                     # after verification

`probs` are the warped probabilities the drafts were sampled from, or None for
deterministic drafters (the verifier then treats q as one-hot).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
from flax import struct

from spec_jax.core.sampling import SamplingConfig


@struct.dataclass
class PromptInfo:
  """What a drafter sees at initialisation (inside the jit, after the target's prefill)."""
  tokens_BP: jax.Array  # [B, P] padded prompts
  lengths_B: jax.Array  # [B] prompt lengths
  cache_len: int = struct.field(pytree_node=False)  # slots in every KV cache of this generation
  target_hidden_BPD: jax.Array | None = None  # target's last hidden states over the prompt


@struct.dataclass
class DraftContext:
  """The state of generation at the start of a round."""
  seq_BS: jax.Array  # [B, S] prompt + generated tokens; the pending token is the last one
  position_B: jax.Array  # [B] position of the pending token (== target cache length)
  pending_B: jax.Array  # [B] newest token: generated, not yet seen by the target


@struct.dataclass
class RoundOutcome:
  """What verification decided, given to `commit`."""
  context: DraftContext  # the context the round started from
  draft_tokens_BG: jax.Array
  num_accepted_B: jax.Array  # [B] drafts kept
  next_token_B: jax.Array  # [B] correction or bonus token: the next round's pending token
  new_target_length_B: jax.Array  # [B] target cache length after the round
  target_hidden_BG1D: jax.Array | None = None  # target's hidden states over [pending, drafts]
  # Tree rounds (spec_jax.tree_speculative): node indices of the accepted path, root first
  # [B, max_depth + 1]; draft_tokens_BG and target_hidden_BG1D are then the tokens and
  # hidden states along that path (entries past num_accepted are padding). None for chains.
  tree_path_BD1: jax.Array | None = None


@dataclasses.dataclass(frozen=True)
class Drafter:
  """Base class. Subclasses override init / propose / commit and set vocab_size."""

  @property
  def vocab_size(self) -> int | None:
    return None  # None: proposes ids from the target's own vocabulary (e.g. prompt lookup)

  def check(self, target, gamma: int) -> None:
    """Host-side validation against the target, before anything is compiled."""
    if self.vocab_size is not None and self.vocab_size != target.vocab_size:
      raise ValueError(f"drafter vocabulary ({self.vocab_size}) differs from the target's "
                       f"({target.vocab_size}); draft and target must share one tokenizer")

  def extra_slots(self, gamma: int) -> int:
    """Cache slots a round may write beyond the kept tokens (target: gamma drafts + 1)."""
    return gamma + 1

  def init(self, params, prompt: PromptInfo) -> Any:
    raise NotImplementedError

  def propose(self, params, state, ctx: DraftContext, gamma: int, sampling: SamplingConfig,
              key: jax.Array):
    raise NotImplementedError

  def commit(self, params, state, outcome: RoundOutcome) -> Any:
    return state

  def catch_up(self, params, state, ctx: DraftContext, gamma: int, sampling: SamplingConfig,
               key: jax.Array) -> Any:
    """The state `propose` would return, for a round in which no row uses this drafter's
    drafts (a combination verifies another drafter's on every row). By default: propose and
    drop the drafts; a drafter with a cheaper way to keep its state right overrides this."""
    return self.propose(params, state, ctx, gamma, sampling, key)[2]

  def empty_rows(self, state) -> jax.Array | None:
    """[B] bool, from the state `propose` returned: rows whose drafts are placeholders (the
    drafter found nothing to propose). None: every row always drafts.

    When every row is empty, the round runs one target step instead of a (gamma + 1)-token
    pass: not verifying placeholders is as exact as rejecting them.
    """
    return None


@dataclasses.dataclass(frozen=True)
class TreeDrafter(Drafter):
  """A drafter that proposes a token tree (spec_jax.tree.TokenTree) instead of a chain:

      tree, state = drafter.propose_tree(params, state, ctx, sampling, key)

  Node 0 of the tree is the pending token ctx.pending_B. `num_nodes` and `max_depth` are
  static; commit receives a RoundOutcome whose draft tokens and target hidden states are
  those along the accepted path (see RoundOutcome.tree_path_BD1).
  """

  @property
  def num_nodes(self) -> int:
    raise NotImplementedError

  @property
  def max_depth(self) -> int:
    raise NotImplementedError

  def extra_slots(self, gamma: int) -> int:
    return self.num_nodes  # the target writes the whole tree past the committed prefix

  def propose_tree(self, params, state, ctx: DraftContext, sampling: SamplingConfig,
                   key: jax.Array):
    raise NotImplementedError
