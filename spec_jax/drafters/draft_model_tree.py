"""A separate (small) draft model growing a token tree: EAGLE-2-style dynamic, or static choices.

Trees are deterministic functions of the context (top-k of the draft's log-probs, warped
with the sampling settings when sampling), so tree verification with one-hot q is lossless.

Draft cache bookkeeping (choice: recompute the accepted path). At the end of a round the
draft cache is valid up to and including the round's root (slots <= L); the tree nodes the
draft model ran are scattered over slots past it and are stale. The next round starts with
a catch-up block of max_depth + 1 tokens read from the output buffer at positions V.. (V =
the draft cache length): the accepted drafts of the last round, the new pending token, and
past it stale tokens whose entries stay masked. The new root's logits are the block's
output at the pending token. A round accepts at most max_depth drafts, so the block always
reaches the pending token. Costs one extra draft pass of max_depth + 1 tokens per round, in
exchange for never copying the draft's tree entries.

Draft block for tree attention (see spec_jax.tree.Expansion): slot 0 is the root at slot
L (written by the catch-up), block slot j > 0 at cache slot L + j.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from flax import struct

from spec_jax.drafters.base import DraftContext, PromptInfo, RoundOutcome, TreeDrafter
from spec_jax.generate import prefill
from spec_jax.core.kv_cache import KVCache, tree_mask
from spec_jax.core.sampling import SamplingConfig
from spec_jax.drafters.common import feed_tokens_before_pending, tree_log_probs
from spec_jax.tree import (Expansion, TokenTree, TreeShape, grow_dynamic_tree,
                           grow_static_tree)


@struct.dataclass
class DraftTreeState:
  cache: KVCache


@dataclasses.dataclass(frozen=True)
class DraftModelTreeDrafter(TreeShape, TreeDrafter):
  """Dynamic tree (depth, top_k, nodes) unless `choices` (Medusa-style paths) is given.

  Dynamic: each depth expands the top_k best frontier nodes by cumulative draft log-prob;
  `nodes` (root included) best candidates form the tree. Static: node of rank r is its
  parent's r-th best draft token; depth, top_k and nodes are then taken from the choices.
  `model`: a CausalLM (hashable); draft_params: its params.
  """

  @property
  def block_slots(self) -> int:
    """Draft cache slots a round uses from the root on (block, or catch-up past the root)."""
    return max(self.tree_block, self.max_depth + 1)

  def init(self, params, prompt: PromptInfo) -> DraftTreeState:
    # the target's own prefill, run on the draft model (its last logits are unused)
    _, _, cache = prefill(self.model, params, prompt.tokens_BP, prompt.lengths_B,
                          prompt.cache_len)
    return DraftTreeState(cache)

  def catch_up_block(self, params, state: DraftTreeState, ctx: DraftContext):
    """[last round's accepted drafts, pending, stale...] at positions start.. through the
    draft model -> (logits [B, max_depth+1, V], cache valid up to and including the root)."""
    start_B = state.cache.length_B
    positions_BR1 = start_B[:, None] + jnp.arange(self.max_depth + 1, dtype=jnp.int32)[None, :]
    last_slot = ctx.seq_BS.shape[1] - 1
    tokens_BR1 = jnp.take_along_axis(ctx.seq_BS, jnp.minimum(positions_BR1, last_slot), axis=1)
    logits_BR1V, _, cache = self.model.apply(params, tokens_BR1, positions_BR1, state.cache)
    return logits_BR1V, cache.with_length(ctx.position_B + 1)

  def catch_up(self, params, state: DraftTreeState, ctx: DraftContext, gamma: int,
               sampling: SamplingConfig, key: jax.Array) -> DraftTreeState:
    # a round that verifies no tree (gamma="auto"'s plain steps): the catch-up block alone
    # (its logits are dead code); the tree levels would be thrown away
    return DraftTreeState(self.catch_up_block(params, state, ctx)[1])

  @property
  def skips_rounds(self) -> bool:
    return True

  def catch_up_after(self, params, state: DraftTreeState, ctx: DraftContext, rounds: int,
                     gamma: int) -> DraftTreeState:
    # Before the stretch the cache held every slot below V >= L0 - max_depth (a round keeps
    # at most max_depth drafts; L0: the stretch's first pending position), and L has moved
    # by at most `rounds` since: feeding L - rounds - max_depth .. L - 1 in one pass leaves
    # every slot before the pending token right, and the next catch-up block starts at it.
    return DraftTreeState(feed_tokens_before_pending(self.model, params, state.cache, ctx,
                                                     rounds + self.max_depth))

  def propose_tree(self, params, state: DraftTreeState, ctx: DraftContext,
                   sampling: SamplingConfig, key: jax.Array) -> tuple[TokenTree, DraftTreeState]:
    root_B = ctx.position_B
    logits_BR1V, cache = self.catch_up_block(params, state, ctx)
    root_logits_BV = jnp.take_along_axis(
        logits_BR1V, (root_B - state.cache.length_B)[:, None, None], axis=1)[:, 0]

    def expand(cache: KVCache, level: Expansion):
      positions_BT = jnp.broadcast_to(root_B[:, None] + level.depth, level.tokens_BT.shape)
      slots_BT = root_B[:, None] + jnp.asarray(level.block_ids)[None, :]
      mask_BTS = tree_mask(root_B, level.ancestors_BTM, cache.max_len)
      logits_BTV, _, cache = self.model.apply(params, level.tokens_BT, positions_BT, cache,
                                              slots_BT=slots_BT, mask_BTS=mask_BTS)
      return tree_log_probs(logits_BTV, sampling, ctx.history, level.depth), cache

    root_logp_BV = tree_log_probs(root_logits_BV, sampling, ctx.history)
    if self.choices is None:
      tree, cache = grow_dynamic_tree(root_logp_BV, ctx.pending_B, expand, cache,
                                      depth=self.depth, top_k=self.top_k, num_nodes=self.nodes)
    else:
      tree, cache = grow_static_tree(self.spec, root_logp_BV, ctx.pending_B, expand, cache)
    return tree, DraftTreeState(cache)

  def commit(self, params, state: DraftTreeState, outcome: RoundOutcome) -> DraftTreeState:
    # valid: the prefix and the root; never more than the target keeps (a finished row)
    valid_B = jnp.minimum(outcome.context.position_B + 1, outcome.new_target_length_B)
    return DraftTreeState(state.cache.with_length(valid_B))
