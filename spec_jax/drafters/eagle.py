"""EAGLE: a one-layer decoder that drafts autoregressively in the target's feature space.

EAGLE's sequence element t pairs the target feature f_t (its post-final-norm hidden state
at position t) with the next token x_{t+1}, sits at position t of EAGLE's own KV cache,
and predicts f_{t+1}, whose target-head logits predict x_{t+2}.

Committed positions must use TRUE target features, never EAGLE's own guesses. The state
keeps every target feature by position (`features_BSD`, filled from the prompt and from
each verify pass: the size of one cache layer). At a round's start (pending token x_L):
  1. a fixed window of gamma+1 elements at positions L-gamma-1 .. L-1 is (re)run with true
     features f_i and true tokens x_{i+1} (the last one pairs f_{L-1} with the pending
     token). The previous round started at L_prev >= L - gamma - 1 with every entry below
     L_prev exact, so the window covers exactly what the last verify made known (accepted
     drafts, the correction or bonus token, their features) and overwrites the entries the
     last round wrote from its own predictions. Rewriting entries that were already exact
     is a no-op (up to float round-off). The window's last output predicts f_L and d_1.
  2. a lax.scan of gamma-1 steps feeds (predicted f_{L-1+j}, d_j) at position L-1+j and
     draws d_{j+1}. These entries are provisional and get overwritten next round.
Windows reaching before position 0 compute their padding entries but never store them.
So every round has the same shapes whatever was accepted, and the state needs no gamma at
init. Sampling drafts are drawn from the warped distribution and returned with it.

`EagleTreeDrafter` grows an EAGLE-2-style dynamic tree (or a static one from choices) from
the same window: its root is the window's last element (f_{L-1}, pending) at slot L-1, and a
node at depth d, holding x_{L+d}, is the element (parent's predicted feature, x_{L+d}) at
position L-1+d, written at slot L-1 + its block slot with tree attention over its
ancestors. Those entries are stale after the round; the next window (max_depth+1 wide,
since a round accepts at most max_depth drafts) rewrites everything from slot L on.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from flax import struct

from spec_jax.drafters.base import (HINDSIGHT_WIDTH, DraftContext, Drafter, PromptInfo,
                                   RoundOutcome, TreeDrafter)
from spec_jax.drafters.common import (autoregressive_drafts, gather_positions,
                                     hindsight_scores, prompt_features, store_step_features,
                                     store_verified_features, tree_log_probs, window_positions)
from spec_jax.drafters.registry import DrafterFamily, DrafterSizes, Trained, register
from spec_jax.losses import (TargetOutputs, positions_of, shift_left, smooth_l1, token_loss)
from spec_jax.models.drafter_heads import EagleConfig, EagleModel
from spec_jax.models.llama import LlamaConfig
from spec_jax.core.kv_cache import KVCache, tree_mask
from spec_jax.core.sampling import SamplingConfig
from spec_jax.tree import (Expansion, TokenTree, TreeShape, grow_dynamic_tree,
                           grow_static_tree)


@struct.dataclass
class EagleState:
  cache: KVCache  # EAGLE's own; entries below length_B come from true target features
  features_BSD: jax.Array  # target features by position, valid below the target's length


def eagle_prefill(model, params, prompt: PromptInfo):
  """The prompt's elements through EAGLE -> (state, predicted features [B, P, D])."""
  features_BSD = prompt_features(prompt)
  tokens_BP = prompt.tokens_BP
  batch, width = tokens_BP.shape
  next_BP = jnp.concatenate([tokens_BP[:, 1:], jnp.zeros((batch, 1), tokens_BP.dtype)], 1)
  positions_BP = jnp.broadcast_to(jnp.arange(width, dtype=jnp.int32), (batch, width))
  cache = model.init_cache(batch, prompt.cache_len)
  _, feats_BPD, cache = model.apply(params, features_BSD[:, :width], next_BP, positions_BP,
                                    cache)
  # pairs (f_i, x_{i+1}) are exact for i < len-1; the pair at len-1 needs the first token
  return EagleState(cache.with_length(prompt.lengths_B - 1), features_BSD), feats_BPD


def eagle_init(model, params, prompt: PromptInfo) -> EagleState:
  return eagle_prefill(model, params, prompt)[0]


def eagle_init_with_first_logits(model, params, prompt: PromptInfo, positions_BA):
  """eagle_init, and the logits of the first draft of a round whose pending token sat at
  each prompt position q = positions_BA[b, a] -> (state, logits_BAV, has_BA: q >= 1). Such
  a round drafts from the element (f_{q-1}, x_q) at q - 1, which the prefill ran with true
  features: the head on its predicted feature is that draft's distribution exactly (as in
  catch_up_with_hindsight)."""
  state, feats_BPD = eagle_prefill(model, params, prompt)
  return (state, params.shared.logits(gather_positions(feats_BPD, positions_BA - 1)),
          positions_BA >= 1)


def window_elements(state: EagleState, ctx: DraftContext, width: int):
  """The true-feature window's elements at positions L-width .. L-1 -> (features [B,W,D],
  next tokens [B,W], positions [B,W])."""
  pos_BW = window_positions(ctx.position_B, width)
  return (gather_positions(state.features_BSD, pos_BW), gather_positions(ctx.seq_BS, pos_BW + 1),
          pos_BW)


def eagle_window(model, params, state: EagleState, ctx: DraftContext, width: int):
  """Runs the true-feature window L-width .. L-1 -> (logits [B,V] of d_1, predicted f_L [B,D],
  cache). The caller sets the cache length (entries below L are then exact)."""
  logits_B1V, feats_BWD, cache = model.apply(
      params, *window_elements(state, ctx, width), state.cache, last_logits_only=True)
  return logits_B1V[:, 0], feats_BWD[:, -1], cache


def eagle_catch_up(model, params, state: EagleState, ctx: DraftContext, width: int):
  """A round that verifies none of its drafts (gamma="auto"'s plain steps): the true-feature
  window alone keeps every entry below L exact, which is all the next window relies on; the
  drafting steps or tree levels and the head (113 MB a step on SmolLM2) would be thrown
  away."""
  _, _, cache = eagle_window(model, params, state, ctx, width)
  return EagleState(cache.with_length(ctx.position_B), state.features_BSD)


def eagle_catch_up_with_hindsight(model, params, state: EagleState, ctx: DraftContext,
                                  rounds: int, gamma: int):
  """eagle_catch_up over a stretch of `rounds` plain steps after a round of `gamma` drafts,
  and whether EAGLE's greedy first draft would have been the token that followed, for a
  round started at each of the last A = min(rounds + 1, HINDSIGHT_WIDTH) pending positions
  L - A .. L - 1 -> (state, agree_BA; a sampled run's scores: common.hindsight_scores). A
  round with pending token x_p drafts from the element (f_{p-1}, x_p) at position p - 1,
  which the catch-up's window runs with true features: the head on that element's
  predicted feature is that round's first draft exactly, and it predicts x_{p+1}, known
  for every such p (x_L is the pending token)."""
  width = gamma + 1 + rounds
  seen = min(rounds + 1, HINDSIGHT_WIDTH)
  split = width - 1 - seen  # elements p - 1 = L - 1 - seen .. L - 2, then L - 1's (dead)
  features_BWD, next_BW, pos_BW = window_elements(state, ctx, width)
  # keys and values alone up to the split (the layer's outputs there are dead code)
  cache = model.apply(params, features_BWD[:, :split], next_BW[:, :split], pos_BW[:, :split],
                      state.cache, last_logits_only=True)[2]
  _, feats_BUD, cache = model.apply(params, features_BWD[:, split:], next_BW[:, split:],
                                    pos_BW[:, split:], cache, last_logits_only=True)
  state = EagleState(cache.with_length(ctx.position_B), state.features_BSD)
  # (greedy: agreement; sampled: min(1, q(y) / p(y)), q its first draft's distribution)
  return state, hindsight_scores(params.shared.logits(feats_BUD[:, :seen]),
                                 pos_BW[:, split:-1] + 2, ctx)


@dataclasses.dataclass(frozen=True)
class EagleDrafter(Drafter):
  model: object  # spec_jax.models.drafter_heads.EagleModel (hashable); params: HeadParams

  @property
  def vocab_size(self) -> int:
    return self.model.vocab_size

  def init(self, params, prompt: PromptInfo) -> EagleState:
    return eagle_init(self.model, params, prompt)

  def init_with_first_logits(self, params, prompt: PromptInfo, positions_BA):
    return eagle_init_with_first_logits(self.model, params, prompt, positions_BA)

  @property
  def guesses_at_init(self) -> bool:
    return True

  def propose(self, params, state: EagleState, ctx: DraftContext, gamma: int,
              sampling: SamplingConfig, key: jax.Array):
    pos_B = ctx.position_B
    root_logits_BV, root_feat_BD, cache = eagle_window(self.model, params, state, ctx, gamma + 1)

    def step(carry, token_B, offset):  # (predicted f_{L-1+offset}, d_offset) at L-1+offset
      cache, feat_BD = carry
      logits_B1V, feat_B1D, cache = self.model.apply(params, feat_BD[:, None], token_B[:, None],
                                                     (pos_B - 1 + offset)[:, None], cache)
      return (cache, feat_B1D[:, 0]), logits_B1V[:, 0]

    tokens_BG, probs_BGV, (cache, _) = autoregressive_drafts(
        step, (cache, root_feat_BD), root_logits_BV, gamma, sampling, key, ctx.history,
        ctx.max_drafts)
    return tokens_BG, probs_BGV, EagleState(cache.with_length(pos_B), state.features_BSD)

  def catch_up(self, params, state: EagleState, ctx: DraftContext, gamma: int,
               sampling: SamplingConfig, key: jax.Array) -> EagleState:
    return eagle_catch_up(self.model, params, state, ctx, gamma + 1)

  @property
  def skips_rounds(self) -> bool:
    return True

  def catch_up_after(self, params, state: EagleState, ctx: DraftContext, rounds: int,
                     gamma: int) -> EagleState:
    # entries below L_prev were exact after the last round of gamma drafts (propose's window
    # started there); L has since moved by at most gamma + 1 (that round) + rounds (the
    # stretch, whose features record_plain_step kept): one window reaches back to L_prev
    return eagle_catch_up(self.model, params, state, ctx, gamma + 1 + rounds)

  @property
  def has_hindsight(self) -> bool:
    return True

  @property
  def has_sampled_hindsight(self) -> bool:
    return True  # (its catch-up has the first draft's logits)

  def catch_up_with_hindsight(self, params, state: EagleState, ctx: DraftContext,
                              rounds: int, gamma: int):
    return eagle_catch_up_with_hindsight(self.model, params, state, ctx, rounds, gamma)

  @property
  def hindsight_speaks_for_later_drafts(self) -> bool:
    return False  # later drafts read EAGLE's predicted features, the window's are the target's

  def record_plain_step(self, params, state: EagleState, hidden_BD, position_B,
                        fed_B) -> EagleState:
    return state.replace(features_BSD=store_step_features(state.features_BSD, hidden_BD,
                                                          position_B, fed_B))

  def commit(self, params, state: EagleState, outcome: RoundOutcome) -> EagleState:
    return state.replace(features_BSD=store_verified_features(state.features_BSD, outcome))


@dataclasses.dataclass(frozen=True)
class EagleTreeDrafter(TreeShape, TreeDrafter):
  """EAGLE-2-style dynamic tree (depth, top_k, nodes) unless `choices` (static paths) is given.

  Children are ranked by the draft's log-probs (warped when sampling): the tree is a
  deterministic function of the context, so tree verification with one-hot q is lossless.
  `model`: a spec_jax.models.drafter_heads.EagleModel; params: HeadParams.
  """

  def init(self, params, prompt: PromptInfo) -> EagleState:
    return eagle_init(self.model, params, prompt)

  def propose_tree(self, params, state: EagleState, ctx: DraftContext,
                   sampling: SamplingConfig, key: jax.Array) -> tuple[TokenTree, EagleState]:
    root_logits_BV, root_feat_BD, cache = eagle_window(self.model, params, state, ctx,
                                                       self.max_depth + 1)
    root_B = ctx.position_B - 1  # the root element (f_{L-1}, pending) sits at slot L-1
    feats_BMD = jnp.zeros(root_feat_BD.shape[:1] + (self.block_slots,) + root_feat_BD.shape[1:],
                          root_feat_BD.dtype).at[:, 0].set(root_feat_BD)

    def expand(carry, level: Expansion):
      cache, feats_BMD = carry
      positions_BT = jnp.broadcast_to(root_B[:, None] + level.depth, level.tokens_BT.shape)
      slots_BT = root_B[:, None] + jnp.asarray(level.block_ids)[None, :]
      mask_BTS = tree_mask(root_B, level.ancestors_BTM, cache.max_len)
      parent_feats_BTD = jnp.take_along_axis(feats_BMD, level.parent_block_BT[:, :, None], 1)
      logits_BTV, feats_BTD, cache = self.model.apply(
          params, parent_feats_BTD, level.tokens_BT, positions_BT, cache, slots_BT=slots_BT,
          mask_BTS=mask_BTS)
      feats_BMD = feats_BMD.at[:, level.block_ids].set(feats_BTD)
      return tree_log_probs(logits_BTV, sampling, ctx.history, level.depth), (cache, feats_BMD)

    root_logp_BV = tree_log_probs(root_logits_BV, sampling, ctx.history)
    if self.choices is None:
      tree, (cache, _) = grow_dynamic_tree(root_logp_BV, ctx.pending_B, expand,
                                           (cache, feats_BMD), depth=self.depth,
                                           top_k=self.top_k, num_nodes=self.nodes)
    else:
      tree, (cache, _) = grow_static_tree(self.spec, root_logp_BV, ctx.pending_B, expand,
                                          (cache, feats_BMD))
    return tree, EagleState(cache.with_length(ctx.position_B), state.features_BSD)

  # a tree round keeps at most max_depth drafts: the chain's upkeep at gamma = max_depth
  def catch_up(self, params, state: EagleState, ctx: DraftContext, gamma: int,
               sampling: SamplingConfig, key: jax.Array) -> EagleState:
    return EagleDrafter.catch_up(self, params, state, ctx, self.max_depth, sampling, key)

  def catch_up_after(self, params, state: EagleState, ctx: DraftContext, rounds: int,
                     gamma: int) -> EagleState:
    return EagleDrafter.catch_up_after(self, params, state, ctx, rounds, self.max_depth)

  skips_rounds = EagleDrafter.skips_rounds
  record_plain_step = EagleDrafter.record_plain_step
  commit = EagleDrafter.commit


# --- the family ---------------------------------------------------------------------------------

def eagle_loss(model, params, t: TargetOutputs, rng=None, *, token: str = "kl",
               feature_weight: float = 1.0, token_weight: float = 0.1,
               feature_noise: float = 0.0):
  """EAGLE: feature regression (smooth L1 to f_{t+1}) + token loss on the predicted feature.

  Element t = (f_t, x_{t+1}) predicts f_{t+1} and, through the head, x_{t+2}: target logits
  at t+1. `feature_noise` adds U(-a, a) to the input features (as EAGLE does), so the drafter
  learns to cope with its own imprecise features when it drafts several steps ahead.
  """
  batch, length = t.tokens_BT.shape
  features_BTD = t.hidden_BTD
  if feature_noise and rng is not None:
    features_BTD = features_BTD + jax.random.uniform(
        rng, features_BTD.shape, features_BTD.dtype, -feature_noise, feature_noise)
  logits_BTV, pred_BTD, _ = model.apply(params, features_BTD, shift_left(t.tokens_BT, 1),
                                        positions_of(t), model.init_cache(batch, length))
  feature = smooth_l1(pred_BTD, shift_left(t.hidden_BTD, 1), shift_left(t.mask_BT, 1, False))
  tok, agree = token_loss(logits_BTV, t, 2, token)
  loss = feature_weight * feature + token_weight * tok
  return loss, {"feature_loss": feature, "token_loss": tok, "agree_1": agree}


def _new_model(target, sizes: DrafterSizes):
  return EagleModel(EagleConfig.for_target(target.config, **sizes.layer_overrides()))


register(DrafterFamily(
    name="eagle", summary="a one-layer decoder drafting in the target's feature space (trained)",
    tree=True,
    combinable=True,
    trained=Trained(
        new_model=_new_model,
        model_from_config=lambda config: EagleModel(EagleConfig(
            LlamaConfig.from_dict(config["layer"]))),
        chain=EagleDrafter,
        tree=lambda model, tree: EagleTreeDrafter(model, tree.depth, tree.top_k, tree.nodes),
        loss=eagle_loss, hidden_width=lambda model: model.config.layer.dim)))
