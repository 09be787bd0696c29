"""MTP (DeepSeek-V3 multi-token prediction modules) as a drafter: module k drafts d_k.

Module k's element i pairs h^{k-1}_i (h^0: the target's hidden state) with x_{i+k}, sits at
position i of the module's own cache layer (each module attends over its own sequence of
h^k), and predicts x_{i+k+1}. With the pending token x_L, module k at i = L-1 reads
x_{L-1+k}, which is d_{k-1} for k > 1, and predicts x_{L+k} = d_k: gamma <= K drafts,
one module each, in order.

Cache bookkeeping (fixed shapes, rollback by overwriting). Module k's entry i is exact
once x_{i+k} is known and h^{k-1}_i is exact, i.e. for i <= L-k when x_L is the newest known
token. Its entries L-k+1 .. L-1 need drafts and are provisional. So each round, in module
order, every module runs the same window of 2*gamma positions L-2*gamma .. L-1, with
h^{k-1} from the previous module's window (true target features for k = 1, kept by
position as in EAGLE) and tokens x_{i+k} from the known sequence up to x_L and from this
round's drafts beyond. Why 2*gamma: after the previous round (started at L_prev >=
L-gamma-1) module k's first non-exact entry is L_prev-k+1 >= L-2*gamma, so the window
rewrites every entry that the last verify made known or that last round's drafts wrote,
and re-derives the rest (a no-op up to round-off). Padding positions below 0 are
computed but never stored. The state needs no gamma at init: the prompt runs through all
K modules (entries past each prompt's end are garbage that the first window rewrites).
Cost per round: gamma module passes over 2*gamma tokens each.

`MTPTreeDrafter` grows a token tree (EAGLE-2-style dynamic, or static from choices) from
the same modules, depth by depth: module d+1 expands the nodes at depth d. Write E(n, k) for
module k's element on tree node n (depth e, token x_{L+e} = n's token): it sits at position
L+e-k, pairs E(parent(n), k-1) (E(., 0): the target feature) with n's token and predicts
n's children; for the root (e = 0, the pending token) and known tokens it is the ordinary
exact entry. In a chain this is exactly what MTPDrafter computes (module k's entries
L-k+1 .. L-1 hold the drafts' diagonal), so a tree that is a chain drafts the same tokens.
One pass of module k per round (D = max depth): a window of known entries at positions
L-2D .. L-k (h^{k-1} from module k-1's window; the last one is E(root, k)), plus, for
k >= 2, E(n, k) for every node n of the drafter's block (spec_jax.tree.Expansion) at depths
1 .. k-1, whose tokens and parents the earlier levels fixed. A block node attends over its
module's exact entries (slots <= L-k) and its ancestors' E(., k): block slot j > 0 is
written at cache slot L-1+j (past every position the module has exact), with a tree mask
that hides the stale slots L-k+1 .. L-1 (and ancestors at positions below 0, padding as in
the window). The depth-d nodes' outputs give their children.
State: as the chain with gamma = D (a round accepts at most D drafts): after a round
module k is exact below L-k+1 and the next round's windows start at L'-2D <= L-D+1, so
they rewrite everything the verify made known and the tree entries are never read again.
The tree is a deterministic function of the context (top-k of the warped log-probs), so
its probs are None and one-hot verification is lossless, as for the other tree drafters.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from spec_jax.drafters.base import DraftContext, Drafter, PromptInfo, RoundOutcome, TreeDrafter
from spec_jax.drafters.common import (draw, gather_positions, prompt_features,
                                     store_step_features, store_verified_features,
                                     tree_log_probs, window_positions)
from spec_jax.drafters.registry import DrafterFamily, DrafterSizes, Trained, register
from spec_jax.losses import TargetOutputs, positions_of, token_loss
from spec_jax.models.drafter_heads import MTPConfig, MTPModel
from spec_jax.models.llama import LlamaConfig
from spec_jax.core.kv_cache import KVCache, causal_mask, tree_mask
from spec_jax.core.sampling import SamplingConfig
from spec_jax.tree import (Expansion, TokenTree, TreeShape, grow_dynamic_tree,
                           grow_static_tree)


@struct.dataclass
class MTPState:
  cache: KVCache  # layer k-1 is module k's; entries below length_B are exact in every module used
  features_BSD: jax.Array  # target hidden states by position, valid below the target's length


def mtp_init(model, params, prompt: PromptInfo) -> MTPState:
  """The prompt through all modules; module k is then exact for i < length - k."""
  features_BSD = prompt_features(prompt)
  tokens_BP = prompt.tokens_BP
  batch, width = tokens_BP.shape
  positions_BP = jnp.broadcast_to(jnp.arange(width, dtype=jnp.int32), (batch, width))
  cache = model.init_cache(batch, prompt.cache_len)
  _, cache = model.apply(params, features_BSD[:, :width], tokens_BP, positions_BP, cache)
  return MTPState(cache.with_length(jnp.maximum(prompt.lengths_B - model.num_modules, 0)),
                  features_BSD)


def mtp_windows(model, params, state: MTPState, ctx: DraftContext, gamma: int, draw_module,
                width: int | None = None):
  """Modules 1..gamma over the window L-width .. L-1 (width: 2*gamma by default), in order;
  module k's input tokens past x_L are the drafts draw_module(k, logits_BV) made (zeros when
  draw_module is None) -> (drafts_BG, state). Entries below L-gamma+1 come out exact in
  every module."""
  pos_B = ctx.position_B
  pos_BW = window_positions(pos_B, 2 * gamma if width is None else width)
  h_BWD = gather_positions(state.features_BSD, pos_BW)
  cache = state.cache
  drafts_BG = jnp.zeros((pos_B.shape[0], gamma), jnp.int32)
  for k in range(1, gamma + 1):
    token_pos_BW = pos_BW + k  # module k reads x_{i+k}: known up to x_L, then drafts
    from_draft_BW = gather_positions(drafts_BG, token_pos_BW - pos_B[:, None] - 1)
    tokens_BW = jnp.where(token_pos_BW <= pos_B[:, None],
                          gather_positions(ctx.seq_BS, token_pos_BW), from_draft_BW)
    logits_B1V, h_BWD, cache = model.apply_module(params, k, h_BWD, tokens_BW, pos_BW, cache,
                                                  last_logits_only=True)
    if draw_module is not None:
      drafts_BG = drafts_BG.at[:, k - 1].set(draw_module(k, logits_B1V[:, 0]))
  # module k is exact for i <= L-k: below L-gamma+1 in all of the modules used
  cache = cache.with_length(jnp.maximum(pos_B - gamma + 1, 0))
  return drafts_BG, MTPState(cache, state.features_BSD)


@dataclasses.dataclass(frozen=True)
class MTPDrafter(Drafter):
  model: object  # spec_jax.models.drafter_heads.MTPModel (hashable); params: HeadParams

  @property
  def vocab_size(self) -> int:
    return self.model.vocab_size

  @property
  def max_gamma(self) -> int:
    return self.model.num_modules

  @property
  def max_gamma_reason(self) -> str:
    return f"one draft per module, {self.model.num_modules} modules"

  def init(self, params, prompt: PromptInfo) -> MTPState:
    return mtp_init(self.model, params, prompt)

  def propose(self, params, state: MTPState, ctx: DraftContext, gamma: int,
              sampling: SamplingConfig, key: jax.Array):
    keys = jax.random.split(key, gamma)
    probs, history = [], ctx.history

    def draw_module(k, logits_BV):
      nonlocal history
      d_B, q_BV = draw(keys[k - 1], logits_BV, sampling, history)
      history = None if history is None else history.push(d_B)
      probs.append(q_BV)
      return d_B

    drafts_BG, state = mtp_windows(self.model, params, state, ctx, gamma, draw_module)
    probs_BGV = None if sampling.is_greedy else jnp.stack(probs, axis=1)
    return drafts_BG, probs_BGV, state

  def catch_up(self, params, state: MTPState, ctx: DraftContext, gamma: int,
               sampling: SamplingConfig, key: jax.Array) -> MTPState:
    # a round that verifies none of its drafts (gamma="auto"'s plain steps, a combination's
    # other drafter): the windows without drafting. Entries below L-gamma+1 come out exact
    # as in propose (they read known tokens only); the draft-fed ones past them are
    # provisional either way, rewritten by the next window. No draws: the modules' heads
    # (113 MB each on SmolLM2) are dead code.
    return mtp_windows(self.model, params, state, ctx, gamma, None)[1]

  @property
  def skips_rounds(self) -> bool:
    return True

  def catch_up_after(self, params, state: MTPState, ctx: DraftContext, rounds: int,
                     gamma: int) -> MTPState:
    # the last round of gamma drafts left every module exact below L_prev-gamma+1; L has
    # since moved by at most gamma + 1 + rounds: a window of 2*gamma + rounds rewrites all
    # the entries made known since (features kept by record_plain_step), as propose's does
    return mtp_windows(self.model, params, state, ctx, gamma, None, 2 * gamma + rounds)[1]

  def record_plain_step(self, params, state: MTPState, hidden_BD, position_B,
                        fed_B) -> MTPState:
    return state.replace(features_BSD=store_step_features(state.features_BSD, hidden_BD,
                                                          position_B, fed_B))

  def commit(self, params, state: MTPState, outcome: RoundOutcome) -> MTPState:
    return state.replace(features_BSD=store_verified_features(state.features_BSD, outcome))


@dataclasses.dataclass(frozen=True)
class MTPTreeDrafter(TreeShape, TreeDrafter):
  """EAGLE-2-style dynamic tree (depth, top_k, nodes) unless `choices` (static paths) is given;
  depth d's children come from module d+1, so the depth is at most the number of modules.

  Children are ranked by the draft's log-probs (warped when sampling): the tree is a
  deterministic function of the context, so tree verification with one-hot q is lossless.
  `model`: a spec_jax.models.drafter_heads.MTPModel; params: HeadParams.
  """

  def check(self, target, gamma: int) -> None:
    super().check(target, gamma)  # TreeShape: the tree's shape
    if self.max_depth > self.model.num_modules:
      raise ValueError(f"an MTP tree of depth {self.max_depth} needs as many modules; the "
                       f"model has {self.model.num_modules}")

  def init(self, params, prompt: PromptInfo) -> MTPState:
    return mtp_init(self.model, params, prompt)

  def propose_tree(self, params, state: MTPState, ctx: DraftContext, sampling: SamplingConfig,
                   key: jax.Array) -> tuple[TokenTree, MTPState]:
    max_depth = self.max_depth
    pos_B = ctx.position_B
    width = 2 * max_depth
    pos_BW = window_positions(pos_B, width)  # L-2D .. L-1; module k runs L-2D .. L-k
    max_len = state.cache.max_len
    # module 1: true features and tokens x_{i+1}; its last element (f_{L-1}, pending) is the root
    root_logits_B1V, win_h_BWD, cache = self.model.apply_module(
        params, 1, gather_positions(state.features_BSD, pos_BW),
        gather_positions(ctx.seq_BS, pos_BW + 1), pos_BW, state.cache, last_logits_only=True)
    batch, num_block = pos_B.shape[0], self.block_slots
    # block bookkeeping: tokens, parent block slots and ancestor rows of the nodes run so far,
    # and the previous module's output E(., k-1) per block slot (slot 0: the root)
    block = (jnp.zeros((batch, num_block), jnp.int32), jnp.zeros((batch, num_block), jnp.int32),
             jnp.zeros((batch, num_block, num_block), bool))
    feats_BMD = jnp.zeros((batch, num_block, win_h_BWD.shape[-1]),
                          win_h_BWD.dtype).at[:, 0].set(win_h_BWD[:, -1])
    depth_of: dict[int, int] = {}  # block slot -> depth of the node there (static)
    slots_S = jnp.arange(max_len, dtype=jnp.int32)

    def expand(carry, level: Expansion):
      cache, win_h_BWD, feats_BMD, (tokens_BM, parents_BM, anc_BMM) = carry
      k = level.depth + 1  # module k expands depth k-1
      ids = level.block_ids
      tokens_BM = tokens_BM.at[:, ids].set(level.tokens_BT)
      parents_BM = parents_BM.at[:, ids].set(level.parent_block_BT)
      anc_BMM = anc_BMM.at[:, ids].set(level.ancestors_BTM)
      depth_of.update((int(i), level.depth) for i in ids)
      run = np.array(sorted(depth_of), np.int32)  # every node so far: depths 1 .. k-1
      run_depths = np.array([depth_of[int(i)] for i in run], np.int32)
      # the window of known entries: positions L-2D .. L-k, tokens x_{i+k} (at most x_L)
      win = width - k + 1
      wpos_BW = pos_BW[:, :win]
      w_slots_BW = jnp.where(wpos_BW >= 0, wpos_BW, max_len)  # padding is never stored
      # tree nodes: E(n, k) at position L+e-k, at cache slot L-1+j; they see the exact
      # entries (slots <= L-k) and their ancestors' entries, not the stale L-k+1 .. L-1, nor
      # ancestors at positions below 0 (padding, as in the window)
      npos_BT = pos_B[:, None] + jnp.asarray(run_depths)[None, :] - k
      nslots_BT = pos_B[:, None] - 1 + jnp.asarray(run)[None, :]
      block_depth_M = np.zeros(num_block, np.int32)
      block_depth_M[run] = run_depths
      real_BM = (pos_B[:, None] + jnp.asarray(block_depth_M)[None, :] - k) >= 0
      stale_BS = (slots_S[None, :] > (pos_B - k)[:, None]) & (slots_S[None, :] < pos_B[:, None])
      nmask_BTS = (tree_mask(pos_B - 1, anc_BMM[:, run] & real_BM[:, None, :], max_len)
                   & ~stale_BS[:, None, :])
      nh_BTD = jnp.take_along_axis(feats_BMD, parents_BM[:, run][:, :, None], axis=1)
      # one pass over the window, then the nodes run (local letter U = win + the nodes run)
      logits_BUV, h_BUD, cache = self.model.apply_module(
          params, k, jnp.concatenate([win_h_BWD[:, :win], nh_BTD], axis=1),
          jnp.concatenate([gather_positions(ctx.seq_BS, wpos_BW + k), tokens_BM[:, run]], 1),
          jnp.concatenate([wpos_BW, npos_BT], axis=1), cache,
          slots_BT=jnp.concatenate([w_slots_BW, nslots_BT], axis=1),
          mask_BTS=jnp.concatenate([causal_mask(wpos_BW, max_len), nmask_BTS], axis=1))
      feats_BMD = feats_BMD.at[:, 0].set(h_BUD[:, win - 1]).at[:, run].set(h_BUD[:, win:])
      level_logits_BTV = logits_BUV[:, win + np.searchsorted(run, ids)]
      return (tree_log_probs(level_logits_BTV, sampling, ctx.history, level.depth),
              (cache, h_BUD[:, :win], feats_BMD, (tokens_BM, parents_BM, anc_BMM)))

    root_logp_BV = tree_log_probs(root_logits_B1V[:, 0], sampling, ctx.history)
    carry = (cache, win_h_BWD, feats_BMD, block)
    if self.choices is None:
      tree, carry = grow_dynamic_tree(root_logp_BV, ctx.pending_B, expand, carry,
                                      depth=self.depth, top_k=self.top_k, num_nodes=self.nodes)
    else:
      tree, carry = grow_static_tree(self.spec, root_logp_BV, ctx.pending_B, expand, carry)
    # module k is exact for i <= L-k: below L-D+1 in all of the modules used
    cache = carry[0].with_length(jnp.maximum(pos_B - max_depth + 1, 0))
    return tree, MTPState(cache, state.features_BSD)

  # a tree round of depth D leaves every module exact below L-D+1, as the chain's round of D
  # drafts does: the chain's upkeep at gamma = max_depth (tree levels and heads unneeded)
  def catch_up(self, params, state: MTPState, ctx: DraftContext, gamma: int,
               sampling: SamplingConfig, key: jax.Array) -> MTPState:
    return MTPDrafter.catch_up(self, params, state, ctx, self.max_depth, sampling, key)

  def catch_up_after(self, params, state: MTPState, ctx: DraftContext, rounds: int,
                     gamma: int) -> MTPState:
    return MTPDrafter.catch_up_after(self, params, state, ctx, rounds, self.max_depth)

  skips_rounds = MTPDrafter.skips_rounds
  record_plain_step = MTPDrafter.record_plain_step
  commit = MTPDrafter.commit


# --- the family ---------------------------------------------------------------------------------

def mtp_loss(model, params, t: TargetOutputs, rng=None, *, token: str = "kl"):
  """Mean over modules of module k's token loss (DeepSeek-V3 weighs them equally). Module k
  (1-based): element i = (h^{k-1}_i, x_{i+k}) predicts x_{i+k+1}: target logits at i+k."""
  batch, length = t.tokens_BT.shape
  logits_ABTV, _ = model.apply(params, t.hidden_BTD, t.tokens_BT, positions_of(t),
                               model.init_cache(batch, length))  # A: the modules
  num = logits_ABTV.shape[0]
  total, metrics = 0.0, {}
  for k in range(1, num + 1):
    loss, agree = token_loss(logits_ABTV[k - 1], t, k + 1, token)
    total = total + loss / num
    metrics[f"loss_{k}"], metrics[f"agree_{k}"] = loss, agree
  return total, metrics


def _new_model(target, sizes: DrafterSizes):
  return MTPModel(MTPConfig.for_target(target.config, sizes.num_heads,
                                       **sizes.layer_overrides()))


register(DrafterFamily(
    name="mtp", summary="DeepSeek-V3-style sequential multi-token-prediction modules (trained)",
    tree=True,
    combinable=True,
    trained=Trained(
        new_model=_new_model,
        model_from_config=lambda config: MTPModel(MTPConfig(
            LlamaConfig.from_dict(config["layer"]), config["num_modules"])),
        chain=MTPDrafter,
        tree=lambda model, tree: MTPTreeDrafter(model, tree.depth, tree.top_k, tree.nodes),
        loss=mtp_loss, hidden_width=lambda model: model.config.layer.dim)))
