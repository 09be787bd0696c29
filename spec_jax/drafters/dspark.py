"""DSpark: the DFlash block backbone plus a light sequential head, so that a block's drafts
become semi-autoregressive, and a confidence per draft (deepseek-ai/DeepSpec, "DSpark:
Confidence-Scheduled Speculative Decoding with Semi-Autoregressive Generation"; written from
its description).

On top of DFlash (spec_jax.drafters.dflash: one parallel pass over [pending, MASK ...] with
the target's layer features injected as context K/V, cached per draft layer):
  - Markov head: logits_j = base_j + W2 W1[x_{j-1}], with base_j the backbone's logits at
    block slot j, W1 a [V, r] table and W2 [r, V]: a low-rank bias from the token before
    slot j (x_0 the pending token, then the drafts themselves). Drafts are drawn left to
    right from the anchor: d_j ~ warped softmax(logits_j), then d_j feeds slot j + 1.
  - confidence head: c_j = sigmoid(w . [h_j ; W1[x_{j-1}]] + b), h_j the backbone's
    normalised hidden state at slot j. It estimates the chance that d_j is accepted
    (trained against 1 - TV(p_draft, p_target)) and is what the confidence-scheduled
    (adaptive) verification of a later step reads.
W2 starts at zero, so a fresh DSpark drafts what its backbone alone would.

Why it is lossless: q_j = warped softmax(base_j + W2 W1[d_{j-1}]) is a function of the
context (base_j: one pass over the context and the fixed block input) and of the earlier
draft d_{j-1}, never of d_j or later drafts; propose returns exactly the q_j each draft was
drawn from. The confidence c_j is likewise known before d_j is drawn (it reads h_j and
x_{j-1} only), so a verification length chosen from c_1 .. c_j keeps the output exact.

Where the confidences are: `DSparkState.confidence_BJ` ([B, block - 1], float32) after each
`propose`: column j-1 holds c_j of that round's draft j for j <= gamma, zeros beyond;
`DSparkDrafter.confidences(state)` returns it.

Training (`dspark_loss`, the DFlash anchors and position weights w_j = exp(-(j-1)/decay)):
0.1 CE + 0.9 sum_j w_j |p_d - p_t|_1 + BCE(c_j, 1 - TV(p_d, p_t)), teacher-forced (x_{j-1} is
the sequence's token), each term a w-weighted mean over usable block slots.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from flax import nnx, struct

from spec_jax.core.kv_cache import KVCache
from spec_jax.core.sampling import SamplingConfig
from spec_jax.drafters.base import DraftContext, PromptInfo, RoundOutcome
from spec_jax.drafters.common import draw
from spec_jax.drafters.dflash import (DFlashConfig, DFlashDrafter, DFlashModel, DFlashNet,
                                     agreement_metrics, block_commit, block_init, token_term,
                                     training_blocks, weighted_mean)
from spec_jax.drafters.registry import DrafterFamily, DrafterSizes, Trained, register
from spec_jax.losses import TargetOutputs
from spec_jax.models.drafter_heads import HeadParams
from spec_jax.models.llama import LlamaConfig, Linear


@dataclasses.dataclass(frozen=True)
class DSparkConfig(DFlashConfig):
  markov_rank: int = 32  # r: the Markov head's bias is W2 W1[x], rank r

  def __post_init__(self):
    super().__post_init__()
    if isinstance(self.markov_rank, bool) or not isinstance(self.markov_rank, int) \
        or self.markov_rank < 1:
      raise ValueError(f"markov_rank must be an integer >= 1, got {self.markov_rank!r}")

  @classmethod
  def for_target(cls, target: LlamaConfig, *, markov_rank: int = 32, **kw):
    base = DFlashConfig.for_target(target, **kw)
    return cls(base.layer, base.feature_layers, base.block_size, markov_rank)

  @classmethod
  def from_dict(cls, config: dict) -> "DSparkConfig":
    return cls(LlamaConfig.from_dict(config["layer"]), tuple(config["feature_layers"]),
               config["block_size"], config["markov_rank"])


class DSparkNet(DFlashNet):
  """The DFlash modules, plus the Markov head (W1, W2) and the confidence head."""

  def __init__(self, cfg: DSparkConfig, rngs: nnx.Rngs):
    super().__init__(cfg, rngs)
    layer, r = cfg.layer, cfg.markov_rank
    dt = layer.jnp_dtype
    self.markov_in = nnx.Param(
        (r ** -0.5 * jax.random.normal(rngs.params(), (layer.vocab_size, r))).astype(dt))
    self.markov_out = nnx.Param(jnp.zeros((r, layer.vocab_size), dt))  # starts as DFlash
    self.confidence = Linear(layer.dim + r, 1, use_bias=True, dtype=dt, rngs=rngs)

  def markov(self, prev_tokens):
    """-> (W1[x] [..., r], the logit bias W2 W1[x] [..., V] float32)."""
    e_XR = jnp.take(self.markov_in[...], prev_tokens, axis=0)
    return e_XR, jnp.einsum("...r,rv->...v", e_XR, self.markov_out[...],
                            preferred_element_type=jnp.float32)

  def confidence_logit(self, h_XD, e_XR):
    """w . [h ; W1[x]] + b, float32 [...] (sigmoid: the confidence)."""
    return self.confidence(jnp.concatenate([h_XD, e_XR.astype(h_XD.dtype)], -1))[..., 0] \
        .astype(jnp.float32)


@dataclasses.dataclass(frozen=True)
class DSparkModel(DFlashModel):
  config: DSparkConfig
  module_cls = DSparkNet


@struct.dataclass
class DSparkState:
  cache: KVCache  # the context K/V per draft layer, as DFlashState's
  # [B, block - 1] float32: c_j of the last proposal's draft j in column j-1 (zeros past gamma)
  confidence_BJ: jax.Array


@dataclasses.dataclass(frozen=True)
class DSparkDrafter(DFlashDrafter):
  """Chain drafter: the block's base logits in one pass, then drafts drawn left to right
  through the Markov head; per-draft confidences in the state. params: HeadParams."""
  model: object  # DSparkModel (hashable)

  def init(self, params, prompt: PromptInfo) -> DSparkState:
    state = block_init(self.model, params, prompt)
    return DSparkState(state.cache, jnp.zeros((prompt.tokens_BP.shape[0], self.model.num_drafts),
                                              jnp.float32))

  @staticmethod
  def confidences(state: DSparkState) -> jax.Array:
    """[B, block - 1]: c_j of the drafts the last `propose` returned (column j-1)."""
    return state.confidence_BJ

  def acceptance_estimates(self, state: DSparkState) -> jax.Array:
    # c_j reads h_j and the previous draft x_{j-1}, never x_j: known before x_j is drawn, as
    # the adaptive rounds' lossless condition asks (columns past gamma are zeros, unread)
    return state.confidence_BJ

  def first_draft_logits(self, params: HeadParams, h_BAD, pending_BA):
    # slot 1's base logits, and the Markov bias from the token before it: the pending one
    base_BAV = params.shared.logits(h_BAD)
    return base_BAV + self.model.module(params.own).markov(pending_BA)[1]

  def propose(self, params: HeadParams, state: DSparkState, ctx: DraftContext, gamma: int,
              sampling: SamplingConfig, key: jax.Array):
    h_BKD = self.model.draft_hidden(params, ctx.pending_B, ctx.position_B, state.cache)
    h_GBD = h_BKD[:, 1:gamma + 1].transpose(1, 0, 2)
    base_GBV = params.shared.logits(h_GBD)
    net = self.model.module(params.own)

    def step(prev_B, inputs):  # slot j: bias from x_{j-1}, then draw d_j
      step_key, base_BV, h_BD = inputs
      e_BR, bias_BV = net.markov(prev_B)
      token_B, probs_BV = draw(step_key, base_BV + bias_BV, sampling)
      conf_B = jax.nn.sigmoid(net.confidence_logit(h_BD, e_BR))
      return token_B, (token_B, probs_BV, conf_B)

    _, (tokens_GB, probs_GBV, conf_GB) = jax.lax.scan(
        step, ctx.pending_B, (jax.random.split(key, gamma), base_GBV, h_GBD))
    probs_BGV = None if probs_GBV is None else probs_GBV.transpose(1, 0, 2)
    confidence_BJ = jnp.zeros_like(state.confidence_BJ).at[:, :gamma].set(conf_GB.T)
    return tokens_GB.T, probs_BGV, DSparkState(state.cache, confidence_BJ)

  def commit(self, params, state: DSparkState, outcome: RoundOutcome) -> DSparkState:
    return state.replace(cache=block_commit(self.model, params, state.cache, outcome))


# --- training -------------------------------------------------------------------------------------

def dspark_loss(model, params, t: TargetOutputs, rng=None, *, token: str = "ce",
                anchors: int | None = None, decay: float = 4.0, ce_weight: float = 0.1,
                l1_weight: float = 0.9, confidence_weight: float = 1.0):
  """0.1 CE + 0.9 |p_d - p_t|_1 + BCE(c, 1 - TV), each w_j-weighted over block slots."""
  h_BAKD, bt = training_blocks(model, params, t, rng, anchors, decay)
  net = model.module(params.own)
  h_BAJD = h_BAKD[:, :, 1:]
  e_BAJR, bias_BAJV = net.markov(bt.prev_BAJ)  # teacher-forced: the sequence's x_{j-1}
  logits_BAJV = params.shared.logits(h_BAJD) + bias_BAJV
  ce = weighted_mean(token_term(logits_BAJV, bt, token), bt.weight_BAJ)
  p_d = jax.nn.softmax(logits_BAJV, axis=-1)
  p_t = jax.nn.softmax(jax.lax.stop_gradient(bt.teacher_BAJV), axis=-1)
  l1_BAJ = jnp.sum(jnp.abs(p_d - p_t), axis=-1)
  label_BAJ = jax.lax.stop_gradient(1.0 - 0.5 * l1_BAJ)  # 1 - TV: the chance d_j is accepted
  z_BAJ = net.confidence_logit(h_BAJD, e_BAJR)
  bce_BAJ = -(label_BAJ * jax.nn.log_sigmoid(z_BAJ) + (1 - label_BAJ) * jax.nn.log_sigmoid(-z_BAJ))
  l1 = weighted_mean(l1_BAJ, bt.weight_BAJ)
  bce = weighted_mean(bce_BAJ, bt.weight_BAJ)
  loss = ce_weight * ce + l1_weight * l1 + confidence_weight * bce
  conf_err = weighted_mean(jnp.abs(jax.nn.sigmoid(z_BAJ) - label_BAJ), bt.weight_BAJ)
  return loss, {"token_loss": ce, "l1": l1, "confidence_bce": bce, "confidence_error": conf_err,
                **agreement_metrics(logits_BAJV, bt)}


def _new_model(target, sizes: DrafterSizes):
  return DSparkModel(DSparkConfig.for_target(target.config, layers=sizes.layers,
                                             block_size=sizes.num_heads + 1,
                                             **sizes.layer_overrides()))


register(DrafterFamily(
    name="dspark",
    summary="DFlash's block backbone + a Markov head (semi-autoregressive drafts) and per-draft "
            "confidences (trained; --num-heads: drafts per block)",
    combinable=True,
    trained=Trained(
        new_model=_new_model,
        model_from_config=lambda config: DSparkModel(DSparkConfig.from_dict(config)),
        chain=DSparkDrafter,
        loss=dspark_loss, hidden_width=lambda model: model.dim)))
