"""DFlash: a block drafter that drafts a whole block in one parallel forward pass, conditioned
on the outputs of several target layers (z-lab, "DFlash: Block Diffusion for Flash
Speculative Decoding", arXiv 2602.06036; written from the paper's description).

The model (DFlashModel, NNX modules below), for a block of B slots (B - 1 drafts):
  - context feature of position i: c_i = RMSNorm(W_fc [o_{l_1,i} ; ... ; o_{l_n,i}]), with
    o_l the output of target layer l (its residual stream), n layers spaced evenly through
    the target (`default_feature_layers`); the target returns them on request
    (LlamaModel.with_feature_layers, asked for through Drafter.feature_layers);
  - a few decoder layers of the target's width (RMSNorm, grouped-query attention with RoPE,
    SwiGLU) with KV injection: queries come from the block only, keys and values from
    [c_0 .. c_{L-1} ; the block], and the block attends to all of itself (non-causal);
  - block input: [x_L (the pending token), MASK x (B - 1)] at positions L .. L+B-1. x_L is
    embedded with the target's frozen embedding; MASK is the drafter's own learned vector
    (`mask_embed`), not a vocabulary id: the vocabularies here have no spare id (all 512 of
    stories260K's are tokens) and a vector of its own leaves the shared embedding frozen;
  - output: the drafter's own final RMSNorm, then the target's frozen LM head (HeadParams).
    Block slot j (1 .. B-1) gives q_j, the distribution of x_{L+j}: one denoising step.

Why it is lossless: every q_j comes out of one pass over the context (the target features
of committed tokens, and the pending token) and the fixed MASK inputs; it is a fixed function
of the context and depends on no draft of the round. So the drafts are drawn independently,
d_j ~ warped q_j, and q is handed to the verifier: the contract's condition 2 holds trivially
(q_j may even ignore d_1 .. d_{j-1}). Greedy takes each argmax.

The draft-side cache (DFlashState.cache, one KVCache layer per draft layer) holds the K/V of
the context features c_i at slot i. They depend only on the target's features, so each
position is computed once: the prompt's at init, and at each commit the verify block's
positions L .. L+gamma, whose features the target has just computed; the length then moves
to the target's new length (entries beyond are stale and masked: rollback by length). The
block's own K/V are never stored. A round drafts min(gamma, B - 1) tokens from the full block
(the shape it was trained on); gamma > B - 1 is refused.

Training (`dflash_loss`): many random anchors per sequence, each with its own block; a block
sees the context strictly before its anchor and all of itself, never other blocks.
Cross-entropy (or KL to the target) on the tokens after the anchor, weighted by
exp(-(k-1)/decay) over block slot k (DeepSpec: block 7, decay 4).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx, struct

from spec_jax.core.kv_cache import KVCache, write_rows
from spec_jax.core.sampling import SamplingConfig
from spec_jax.drafters.base import HINDSIGHT_WIDTH, DraftContext, Drafter, PromptInfo, RoundOutcome
from spec_jax.drafters.common import draw, gather_positions, hindsight_scores, window_positions
from spec_jax.drafters.registry import DrafterFamily, DrafterSizes, Trained, register
from spec_jax.losses import (TOKEN_LOSSES, TargetOutputs, cross_entropy_with_integer_labels)
from spec_jax.models.drafter_heads import BlockDrafterModel, HeadParams
from spec_jax.models.llama import (LAYOUTS, MLP, LlamaConfig, Linear, RMSNorm, apply_rope,
                                   cache_scores)


def default_feature_layers(num_layers: int, count: int = 3) -> tuple[int, ...]:
  """`count` target layers spaced evenly from the second to the second-to-last (all of
  them for a target that shallow): low, middle and high features, as DFlash and EAGLE-3."""
  if num_layers <= count:
    return tuple(range(num_layers))
  return tuple(int(i) for i in np.unique(np.round(np.linspace(1, num_layers - 2, count))))


@dataclasses.dataclass(frozen=True)
class DFlashConfig:
  layer: LlamaConfig  # the draft layers' shape (target width); n_layers: how many
  feature_layers: tuple[int, ...]  # target layers whose outputs make the context feature
  block_size: int  # B: the pending token and B - 1 masks; B - 1 drafts a round at most

  def __post_init__(self):
    layers = self.feature_layers
    if (not isinstance(layers, tuple) or not layers or len(set(layers)) != len(layers)
        or any(isinstance(i, bool) or not isinstance(i, int) or i < 0 for i in layers)):
      raise ValueError(f"feature_layers must be distinct layer ids >= 0, got {layers!r}")
    if isinstance(self.block_size, bool) or not isinstance(self.block_size, int) \
        or self.block_size < 2:
      raise ValueError(f"block_size must be an integer >= 2, got {self.block_size!r}")

  @classmethod
  def for_target(cls, target: LlamaConfig, *, layers: int = 1, block_size: int = 5,
                 feature_layers: tuple[int, ...] | None = None, **overrides):
    if feature_layers is None:
      feature_layers = default_feature_layers(target.n_layers)
    # checkpoint layout whatever layout the target decodes in: drafter files are read in it
    layer = dataclasses.replace(target, n_layers=layers, **LAYOUTS["checkpoint"], **overrides)
    return cls(layer, tuple(feature_layers), block_size)

  @classmethod
  def from_dict(cls, config: dict) -> "DFlashConfig":
    return cls(LlamaConfig.from_dict(config["layer"]), tuple(config["feature_layers"]),
               config["block_size"])


# --- NNX modules --------------------------------------------------------------------------------

class InjectedAttention(nnx.Module):
  """Grouped-query attention whose queries come from the block and whose keys and values
  cover [context ; block]: the context's K/V arrive precomputed (a cache layer, or the whole
  sequence's in training), the block's are computed here and never stored."""

  def __init__(self, cfg: LlamaConfig, rngs: nnx.Rngs):
    d, e, dt = cfg.dim, cfg.resolved_head_dim, cfg.jnp_dtype
    self.n_heads, self.n_kv_heads, self.head_dim = cfg.n_heads, cfg.n_kv_heads, e
    self.rope_theta = cfg.rope_theta
    kw = dict(use_bias=cfg.qkv_bias, dtype=dt, rngs=rngs)
    self.wq = Linear(d, cfg.n_heads * e, **kw)
    self.wk = Linear(d, cfg.n_kv_heads * e, **kw)
    self.wv = Linear(d, cfg.n_kv_heads * e, **kw)
    self.wo = Linear(cfg.n_heads * e, d, use_bias=False, dtype=dt, rngs=rngs)

  def kv(self, x_BTD, positions_BT):
    """-> (k [B,T,K,E] with RoPE at positions, v [B,T,K,E])."""
    B, T, _ = x_BTD.shape
    k_BTKE = apply_rope(self.wk(x_BTD).reshape(B, T, self.n_kv_heads, self.head_dim),
                        positions_BT, self.rope_theta)
    return k_BTKE, self.wv(x_BTD).reshape(B, T, self.n_kv_heads, self.head_dim)

  def __call__(self, x_BTD, positions_BT, ctx_k_BKES, ctx_v_BKES, ctx_mask_BTS, block_mask_BTT,
               queries=None):
    """queries: None, or the block slots (static indices) whose outputs are wanted: keys and
    values still cover every slot, queries only those (the masks' rows: every slot's)."""
    k_BTKE, v_BTKE = self.kv(x_BTD, positions_BT)
    if queries is not None:
      x_BTD, positions_BT = x_BTD[:, queries], positions_BT[:, queries]
      ctx_mask_BTS = ctx_mask_BTS[:, queries]
      block_mask_BTT = None if block_mask_BTT is None else block_mask_BTT[:, queries]
    B, T, _ = x_BTD.shape
    K, Q, E = self.n_kv_heads, self.n_heads // self.n_kv_heads, self.head_dim
    q_BTKQE = apply_rope(self.wq(x_BTD).reshape(B, T, K * Q, E), positions_BT,
                         self.rope_theta).reshape(B, T, K, Q, E)
    neg = jnp.finfo(jnp.float32).min
    ctx_BKQTS = cache_scores(q_BTKQE, ctx_k_BKES)
    ctx_BKQTS = jnp.where(ctx_mask_BTS[:, None, None], ctx_BKQTS, neg)
    blk_BKQTU = jnp.einsum("btkqe,buke->bkqtu", q_BTKQE, k_BTKE,
                           preferred_element_type=jnp.float32) * (E ** -0.5)
    if block_mask_BTT is not None:
      blk_BKQTU = jnp.where(block_mask_BTT[:, None, None], blk_BKQTU, neg)
    # one softmax over both parts; every query sees at least its own block slot
    probs = jax.nn.softmax(jnp.concatenate([ctx_BKQTS, blk_BKQTU], axis=-1), axis=-1)
    probs = probs.astype(v_BTKE.dtype)
    num_ctx = ctx_BKQTS.shape[-1]
    out_BTKQE = (jnp.einsum("bkqts,bkes->btkqe", probs[..., :num_ctx], ctx_v_BKES)
                 + jnp.einsum("bkqtu,buke->btkqe", probs[..., num_ctx:], v_BTKE))
    return self.wo(out_BTKQE.reshape(B, T, K * Q * E))


class DFlashLayer(nnx.Module):
  def __init__(self, cfg: LlamaConfig, rngs: nnx.Rngs):
    dt = cfg.jnp_dtype
    self.attn_norm = RMSNorm(cfg.dim, eps=cfg.norm_eps, dtype=dt)
    self.attn = InjectedAttention(cfg, rngs)
    self.mlp_norm = RMSNorm(cfg.dim, eps=cfg.norm_eps, dtype=dt)
    self.mlp = MLP(cfg, rngs)

  def __call__(self, x_BTD, positions_BT, ctx_k_BKES, ctx_v_BKES, ctx_mask_BTS, block_mask_BTT,
               queries=None):
    attn_BTD = self.attn(self.attn_norm(x_BTD), positions_BT, ctx_k_BKES, ctx_v_BKES,
                         ctx_mask_BTS, block_mask_BTT, queries)
    x_BTD = (x_BTD if queries is None else x_BTD[:, queries]) + attn_BTD
    return x_BTD + self.mlp(self.mlp_norm(x_BTD))


class DFlashNet(nnx.Module):
  """fc + norm (context features), the draft layers, a final norm, and the MASK vector."""

  def __init__(self, cfg: DFlashConfig, rngs: nnx.Rngs):
    layer, dt = cfg.layer, cfg.layer.jnp_dtype
    d = layer.dim
    self.fc = Linear(len(cfg.feature_layers) * d, d, use_bias=False, dtype=dt, rngs=rngs)
    self.hidden_norm = RMSNorm(d, eps=layer.norm_eps, dtype=dt)
    self.layers = nnx.List([DFlashLayer(layer, rngs) for _ in range(layer.n_layers)])
    self.norm = RMSNorm(d, eps=layer.norm_eps, dtype=dt)
    self.mask_embed = nnx.Param((d ** -0.5 * jax.random.normal(rngs.params(), (d,))).astype(dt))

  def context(self, features_BTF):
    return self.hidden_norm(self.fc(features_BTF))

  def block(self, x_BTD, positions_BT, ctx_kv, ctx_mask_BTS, block_mask_BTT, outputs=None):
    """The draft layers over the block -> normalised hidden states [B, T, D].
    ctx_kv: per layer (k and v [B,K,E,S]) of the context. outputs: None, or the slots
    (static indices) whose hidden states are wanted -> [B, len(outputs), D]: the last layer
    then runs its queries and MLP on those alone."""
    last = len(self.layers) - 1
    for i, (layer, (k_BKES, v_BKES)) in enumerate(zip(self.layers, ctx_kv)):
      x_BTD = layer(x_BTD, positions_BT, k_BKES, v_BKES, ctx_mask_BTS, block_mask_BTT,
                    outputs if i == last else None)
    return self.norm(x_BTD)


@dataclasses.dataclass(frozen=True)
class DFlashModel(BlockDrafterModel):
  """Handle on a DFlash drafter (hashable); params: HeadParams(own, the target's SharedHead).
  Its KVCache has one layer per draft layer: the context K/V by position."""
  config: DFlashConfig
  module_cls = DFlashNet

  @property
  def cache_layers(self) -> int:
    return self.config.layer.n_layers

  @property
  def block_size(self) -> int:
    return self.config.block_size

  @property
  def num_drafts(self) -> int:
    return self.config.block_size - 1

  @property
  def dim(self) -> int:
    return self.config.layer.dim

  def features(self, target_hidden_BTX):
    """The context features out of a target hidden state [last ; layer l_1 ; ...]."""
    width = (1 + len(self.config.feature_layers)) * self.dim
    if target_hidden_BTX.shape[-1] != width:
      raise ValueError(f"DFlash reads target hidden states [last ; {len(self.config.feature_layers)}"
                       f" layers] of width {width}, got {target_hidden_BTX.shape[-1]}: the target "
                       "was not asked for the drafter's feature_layers (target_with_features)")
    return target_hidden_BTX[..., self.dim:]

  def write_context(self, params: HeadParams, features_BTF, positions_BT, cache: KVCache):
    """Writes the context K/V of T positions into every layer (length left to the caller)."""
    net = self.module(params.own)
    ctx_BTD = net.context(features_BTF)
    slots_BT = jnp.where(positions_BT >= 0, positions_BT, cache.max_len)  # padding: dropped
    k_LBKES, v_LBKES = cache.k_LBKES, cache.v_LBKES
    for i, layer in enumerate(net.layers):
      k_BTKE, v_BTKE = layer.attn.kv(ctx_BTD, positions_BT)
      k_LBKES = write_rows(k_LBKES, slots_BT, k_BTKE, i)
      v_LBKES = write_rows(v_LBKES, slots_BT, v_BTKE, i)
    return cache.replace(k_LBKES=k_LBKES, v_LBKES=v_LBKES)

  def block_input(self, net, params: HeadParams, pending_B):
    """[B, block_size, D]: the pending token's embedding, then MASK."""
    mask_D = net.mask_embed[...]
    first_B1D = params.shared.embed(pending_B[:, None]).astype(mask_D.dtype)
    masks = jnp.broadcast_to(mask_D, (pending_B.shape[0], self.num_drafts, self.dim))
    return jnp.concatenate([first_B1D, masks], axis=1)

  def draft_hidden(self, params: HeadParams, pending_B, position_B, cache: KVCache):
    """One pass over [pending, MASK ...] at positions L.. over the cached context (slots < L)
    -> normalised hidden states of the block [B, block_size, D]; slot j predicts x_{L+j}."""
    net = self.module(params.own)
    positions_BT = position_B[:, None] + jnp.arange(self.block_size, dtype=jnp.int32)[None, :]
    slots_S = jnp.arange(cache.max_len, dtype=jnp.int32)
    ctx_mask_B1S = (slots_S[None, :] < position_B[:, None])[:, None, :]
    ctx_kv = [(cache.k_LBKES[i], cache.v_LBKES[i]) for i in range(self.cache_layers)]
    return net.block(self.block_input(net, params, pending_B), positions_BT, ctx_kv,
                     ctx_mask_B1S, None)

  def first_slot_hidden(self, params: HeadParams, pending_BA, positions_BA, cache: KVCache):
    """A blocks per row in one pass, block a as `draft_hidden` would run it for a round whose
    pending token pending_BA[:, a] sat at positions_BA[:, a] (the cached context at slots
    below it, and its own block; never the other blocks) -> the normalised hidden state of
    each block's slot 1 [B, A, D], what that round's first draft is read from. Hindsight's
    look at where rounds would have started (catch_up_with_hindsight,
    init_with_first_logits)."""
    net = self.module(params.own)
    ctx_kv = [(cache.k_LBKES[i], cache.v_LBKES[i]) for i in range(self.cache_layers)]
    # (the last layer's queries and MLP at slot 1 only: 8 blocks of 4 with stories260K's
    # 1-layer DFlash took 0.15 ms in a loop on this CPU, against 0.44 ms for every slot)
    slot_1 = np.arange(pending_BA.shape[1]) * self.block_size + 1
    positions_BN, ctx_mask_BNS, block_mask_1NN = self.anchored_layout(positions_BA,
                                                                      cache.max_len)
    return net.block(self.anchored_input(net, params, pending_BA), positions_BN, ctx_kv,
                     ctx_mask_BNS, block_mask_1NN, slot_1)

  def anchored_input(self, net, params: HeadParams, pending_BA):
    """[B, A * block_size, D]: block_input of each of A blocks per row, one after another."""
    batch, num_blocks = pending_BA.shape
    return self.block_input(net, params, pending_BA.reshape(-1)).reshape(
        batch, num_blocks * self.block_size, self.dim)

  def anchored_layout(self, anchors_BA, num_slots: int):
    """A blocks per row laid out one after another (N = A * block_size), block a at
    positions anchors_BA[:, a] .. + block_size - 1 -> (positions [B, N], context mask
    [B, N, S]: the slots below its anchor, block mask [1, N, N]: itself, never the others),
    net.block's arguments around the context."""
    batch, num_blocks = anchors_BA.shape
    size = self.block_size
    positions_BN = (anchors_BA[:, :, None] + jnp.arange(size, dtype=jnp.int32)).reshape(
        batch, num_blocks * size)
    anchor_BN = jnp.repeat(anchors_BA, size, axis=1)
    ctx_mask_BNS = jnp.arange(num_slots, dtype=jnp.int32)[None, None, :] < anchor_BN[:, :, None]
    block_id_N = np.repeat(np.arange(num_blocks), size)
    block_mask_1NN = jnp.asarray(block_id_N[:, None] == block_id_N[None, :])[None]
    return positions_BN, ctx_mask_BNS, block_mask_1NN

  def train_hidden(self, params: HeadParams, features_BTF, tokens_BT, anchors_BA):
    """Teacher-forced blocks at A anchors per row of whole sequences -> [B, A, block, D].

    Block a holds [x_a, MASK ...] at positions a .. a+block-1; it sees the context at
    positions < a and its own block, never the other blocks.
    """
    net = self.module(params.own)
    batch, length = tokens_BT.shape
    num_anchors = anchors_BA.shape[1]
    positions_BT = jnp.broadcast_to(jnp.arange(length, dtype=jnp.int32), (batch, length))
    ctx_BTD = net.context(features_BTF)
    ctx_kv = []
    for layer in net.layers:
      k_BTKE, v_BTKE = layer.attn.kv(ctx_BTD, positions_BT)
      ctx_kv.append((k_BTKE.transpose(0, 2, 3, 1), v_BTKE.transpose(0, 2, 3, 1)))
    anchor_tokens_BA = jnp.take_along_axis(tokens_BT, anchors_BA, axis=1)
    positions_BN, ctx_mask_BNS, block_mask_1NN = self.anchored_layout(anchors_BA, length)
    h_BND = net.block(self.anchored_input(net, params, anchor_tokens_BA), positions_BN, ctx_kv,
                      ctx_mask_BNS, block_mask_1NN)
    return h_BND.reshape(batch, num_anchors, self.block_size, self.dim)


# --- the drafter ----------------------------------------------------------------------------------

@struct.dataclass
class DFlashState:
  cache: KVCache  # the context K/V per draft layer; exact below length_B (the target's length)


def block_init(model: DFlashModel, params, prompt: PromptInfo) -> DFlashState:
  if prompt.target_hidden_BPD is None:
    raise ValueError("DFlash needs the target's hidden states (PromptInfo.target_hidden_BPD)")
  batch, width = prompt.tokens_BP.shape
  positions_BP = jnp.broadcast_to(jnp.arange(width, dtype=jnp.int32), (batch, width))
  cache = model.write_context(params, model.features(prompt.target_hidden_BPD), positions_BP,
                              model.init_cache(batch, prompt.cache_len))
  return DFlashState(cache.with_length(prompt.lengths_B))  # past a prompt's end: stale


def block_commit(model: DFlashModel, params, cache: KVCache, outcome: RoundOutcome) -> KVCache:
  """The verify block's context K/V (positions L .. L+gamma), kept up to the target's new
  length: what the target kept is exact, the rest is stale past the length."""
  if outcome.target_hidden_BG1D is None:
    raise ValueError("DFlash needs the target's hidden states (RoundOutcome.target_hidden_BG1D)")
  if outcome.tree_path_BR1 is not None:
    raise ValueError("DFlash drafts chains; tree rounds are not supported")
  width = outcome.target_hidden_BG1D.shape[1]
  positions_BG1 = (outcome.context.position_B[:, None]
                   + jnp.arange(width, dtype=jnp.int32)[None, :])
  cache = model.write_context(params, model.features(outcome.target_hidden_BG1D), positions_BG1,
                              cache)
  return cache.with_length(outcome.new_target_length_B)


@dataclasses.dataclass(frozen=True)
class DFlashDrafter(Drafter):
  """Chain drafter: one parallel pass drafts min(gamma, block - 1) tokens, each drawn from
  its own warped q_j (a function of the context only). params: HeadParams."""
  model: object  # DFlashModel (hashable)

  @property
  def vocab_size(self) -> int:
    return self.model.vocab_size

  @property
  def feature_layers(self) -> tuple[int, ...]:
    return self.model.config.feature_layers

  @property
  def max_gamma(self) -> int:
    return self.model.num_drafts

  @property
  def max_gamma_reason(self) -> str:
    return f"a block of {self.model.block_size}: the pending token and its drafts"

  def check(self, target, gamma: int) -> None:
    super().check(target, gamma)  # vocabulary, feature layers inside the target
    name = type(self).__name__
    if target.config.dim != self.model.dim:
      raise ValueError(f"{name} reads target hidden states of width {self.model.dim}, the "
                       f"target's are {target.config.dim}: it was made for another target")

  def init(self, params, prompt: PromptInfo) -> DFlashState:
    return block_init(self.model, params, prompt)

  def first_draft_logits(self, params, h_BAD, pending_BA):
    """[B, A, V]: the logits a round's first draft is drawn from, given its block's slot-1
    hidden state and its pending token (DFlash's head reads the hidden state alone)."""
    del pending_BA
    return params.shared.logits(h_BAD)

  def first_logits_at(self, params, pending_BA, positions_BA, cache: KVCache):
    """[B, A, V]: the logits the first draft of a round whose pending token pending_BA[:, a]
    sat at positions_BA[:, a] is drawn from, over the context cached below it."""
    h_BAD = self.model.first_slot_hidden(params, pending_BA, positions_BA, cache)
    return self.first_draft_logits(params, h_BAD, pending_BA)

  def init_with_first_logits(self, params, prompt: PromptInfo, positions_BA):
    # the prefill writes every prompt position's context: a round at q reads slots < q. None
    # at q = 0: no round starts there, and training never anchors a block with no context
    state = self.init(params, prompt)
    pending_BA = jnp.take_along_axis(prompt.tokens_BP, positions_BA, axis=1)
    return (state, self.first_logits_at(params, pending_BA, positions_BA, state.cache),
            positions_BA > 0)

  @property
  def guesses_at_init(self) -> bool:
    return True

  def propose(self, params, state: DFlashState, ctx: DraftContext, gamma: int,
              sampling: SamplingConfig, key: jax.Array):
    h_BKD = self.model.draft_hidden(params, ctx.pending_B, ctx.position_B, state.cache)
    logits_BGV = params.shared.logits(h_BKD[:, 1:gamma + 1])
    tokens_BG, probs_BGV = draw(key, logits_BGV, sampling)  # independent per slot
    return tokens_BG, probs_BGV, state

  def commit(self, params, state: DFlashState, outcome: RoundOutcome) -> DFlashState:
    return DFlashState(block_commit(self.model, params, state.cache, outcome))

  def catch_up(self, params, state, ctx: DraftContext, gamma: int, sampling: SamplingConfig,
               key: jax.Array):
    # propose changes no state (DSpark's: only the confidences of its own drafts); the context
    # K/V grows in `commit`, from the target's hidden states, in every round. The default
    # (propose and drop the drafts) made each of gamma="auto"'s plain steps pay for a block.
    return state

  @property
  def skips_rounds(self) -> bool:
    return True  # record_plain_step writes each plain step's context K/V as it comes

  def catch_up_after(self, params, state, ctx: DraftContext, rounds: int, gamma: int):
    return state

  @property
  def has_hindsight(self) -> bool:
    return True

  @property
  def has_sampled_hindsight(self) -> bool:
    return True  # (its look back has the first draft's logits)

  @property
  def hindsight_speaks_for_later_drafts(self) -> bool:
    return False  # draft j is slot j of the round's own block, not slot 1 of a later block

  def catch_up_with_hindsight(self, params, state, ctx: DraftContext, rounds: int,
                              gamma: int):
    # the stretch's plain steps wrote every position's context below L (record_plain_step):
    # entry a is the round whose pending token sat at q = L - A + a, one block each, and its
    # first draft predicts x_{q+1}, known for every such q (x_L is the pending token)
    # (greedy: agreement; sampled: min(1, q(y) / p(y)), q the first draft's distribution,
    # first_draft_logits being what propose draws it from)
    seen = min(rounds + 1, HINDSIGHT_WIDTH)
    q_BA = jnp.maximum(window_positions(ctx.position_B, seen), 0)
    pending_BA = gather_positions(ctx.seq_BS, q_BA)
    logits_BAV = self.first_logits_at(params, pending_BA, q_BA, state.cache)
    return state, hindsight_scores(logits_BAV, q_BA + 1, ctx)

  def record_plain_step(self, params, state, hidden_BD, position_B, fed_B):
    # the step's one position of context, as commit writes a verified round's (a row that
    # did not feed writes nothing: its slot is padding, dropped)
    positions_B1 = jnp.where(fed_B, position_B, -1)[:, None]
    cache = self.model.write_context(params, self.model.features(hidden_BD[:, None]),
                                     positions_B1, state.cache)
    return state.replace(cache=cache.with_length(
        jnp.where(fed_B, position_B + 1, cache.length_B)))


# --- training -------------------------------------------------------------------------------------

def random_anchors(rng, mask_BT: jax.Array, num_anchors: int, block_size: int):
  """[B, A] distinct anchor positions per row, and [B, A] whether each is usable: a real
  token with context before it (a >= 1) and a real token after it. Without rng: a fixed
  draw (deterministic evaluation)."""
  batch, length = mask_BT.shape
  pos_T = jnp.arange(length)
  ok_BT = mask_BT & (pos_T >= 1)[None] & jnp.concatenate(
      [mask_BT[:, 1:], jnp.zeros((batch, 1), bool)], axis=1)
  score_BT = jax.random.uniform(jax.random.key(0) if rng is None else rng, (batch, length))
  score_BT = jnp.where(ok_BT, score_BT, -jnp.inf)
  _, anchors_BA = jax.lax.top_k(score_BT, num_anchors)
  anchors_BA = anchors_BA.astype(jnp.int32)
  return anchors_BA, jnp.take_along_axis(ok_BT, anchors_BA, axis=1)


@struct.dataclass
class BlockTargets:
  """What the drafts of every training block are compared with, slot j = 1 .. block-1."""
  labels_BAJ: jax.Array  # x_{a+j}
  prev_BAJ: jax.Array  # x_{a+j-1}: the token before slot j (the anchor for j = 1)
  teacher_BAJV: jax.Array  # target logits at a+j-1 (its distribution of x_{a+j})
  weight_BAJ: jax.Array  # exp(-(j-1)/decay) where the slot is usable, else 0


def block_targets(t: TargetOutputs, anchors_BA, usable_BA, block_size: int, decay: float):
  length = t.tokens_BT.shape[1]
  j_J = jnp.arange(1, block_size, dtype=jnp.int32)
  pos_BAJ = anchors_BA[:, :, None] + j_J
  idx_BAJ = jnp.minimum(pos_BAJ, length - 1)
  flat = lambda x_BT, idx: jnp.take_along_axis(x_BT, idx.reshape(idx.shape[0], -1), axis=1
                                               ).reshape(idx.shape)
  labels_BAJ = flat(t.tokens_BT, idx_BAJ)
  prev_BAJ = flat(t.tokens_BT, idx_BAJ - 1)
  real_BAJ = (pos_BAJ < length) & flat(t.mask_BT, idx_BAJ) & usable_BA[:, :, None]
  b, a, j = idx_BAJ.shape
  teacher_BAJV = jnp.take_along_axis(t.logits_BTV, (idx_BAJ - 1).reshape(b, a * j)[:, :, None],
                                     axis=1).reshape(b, a, j, -1)
  weight_J = jnp.exp(-(j_J - 1).astype(jnp.float32) / decay)
  return BlockTargets(labels_BAJ, prev_BAJ, teacher_BAJV,
                      jnp.where(real_BAJ, weight_J, 0.0))


def weighted_mean(values_BAJ, weight_BAJ):
  return jnp.sum(values_BAJ * weight_BAJ) / jnp.maximum(jnp.sum(weight_BAJ), 1e-6)


def token_term(student_BAJV, bt: BlockTargets, token: str):
  """Per-slot CE against the sequence's tokens, or KL(target || drafter)."""
  if token not in TOKEN_LOSSES:
    raise ValueError(f"token loss must be one of {TOKEN_LOSSES}, got {token!r}")
  if token == "ce":
    return cross_entropy_with_integer_labels(student_BAJV, bt.labels_BAJ)
  log_p = jax.nn.log_softmax(jax.lax.stop_gradient(bt.teacher_BAJV), axis=-1)
  log_q = jax.nn.log_softmax(student_BAJV.astype(jnp.float32), axis=-1)
  return jnp.sum(jnp.exp(log_p) * (log_p - log_q), axis=-1)


def agreement_metrics(student_BAJV, bt: BlockTargets) -> dict:
  """agree_1: the first draft is the target's argmax; greedy_accepted: expected greedy
  accepted length of a block (leading slots that all agree), over usable anchors."""
  agree_BAJ = (jnp.argmax(student_BAJV, -1) == jnp.argmax(bt.teacher_BAJV, -1))
  real_BAJ = bt.weight_BAJ > 0
  first_BA = real_BAJ[:, :, 0]
  run_BA = jnp.sum(jnp.cumprod(agree_BAJ & real_BAJ, axis=-1), axis=-1)
  denom = jnp.maximum(jnp.sum(first_BA), 1)
  return {"agree_1": jnp.sum(agree_BAJ[:, :, 0] & first_BA) / denom,
          "greedy_accepted": jnp.sum(jnp.where(first_BA, run_BA, 0)) / denom}


def training_blocks(model: DFlashModel, params, t: TargetOutputs, rng, anchors: int | None,
                    decay: float):
  """-> (block hidden states [B, A, block, D], BlockTargets) for random anchors."""
  length = t.tokens_BT.shape[1]
  num = anchors if anchors is not None else max(1, length // 4)
  anchors_BA, usable_BA = random_anchors(rng, t.mask_BT, min(num, length), model.block_size)
  h_BAKD = model.train_hidden(params, model.features(t.hidden_BTD), t.tokens_BT, anchors_BA)
  return h_BAKD, block_targets(t, anchors_BA, usable_BA, model.block_size, decay)


def dflash_loss(model, params, t: TargetOutputs, rng=None, *, token: str = "ce",
                anchors: int | None = None, decay: float = 4.0):
  """Position-weighted token loss of every block's drafts (module docstring). t.hidden_BTD
  holds [last ; feature layers] (distill asks the target for the drafter's layers)."""
  h_BAKD, bt = training_blocks(model, params, t, rng, anchors, decay)
  logits_BAJV = params.shared.logits(h_BAKD[:, :, 1:])
  loss = weighted_mean(token_term(logits_BAJV, bt, token), bt.weight_BAJ)
  return loss, {"token_loss": loss, **agreement_metrics(logits_BAJV, bt)}


def _new_model(target, sizes: DrafterSizes):
  return DFlashModel(DFlashConfig.for_target(target.config, layers=sizes.layers,
                                             block_size=sizes.num_heads + 1,
                                             **sizes.layer_overrides()))


register(DrafterFamily(
    name="dflash",
    summary="a block drafter: one parallel pass over [pending, MASK...] conditioned on several "
            "target layers (trained; --num-heads: drafts per block)",
    combinable=True,
    trained=Trained(
        new_model=_new_model,
        model_from_config=lambda config: DFlashModel(DFlashConfig.from_dict(config)),
        chain=DFlashDrafter,
        loss=dflash_loss, hidden_width=lambda model: model.dim)))
