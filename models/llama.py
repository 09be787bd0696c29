"""A Llama-family decoder in Flax NNX, and its functional adapter.

Covers Llama/Mistral/Qwen2-style models: grouped-query attention, RoPE (HF half-split
layout; llama2.c's adjacent-pair checkpoints are permuted at load), RMSNorm in float32,
SwiGLU MLP, optional QKV bias, tied or untied output head.

spec_jax never sees these classes: it gets `LlamaModel`, a frozen (hashable) handle whose
`apply(params, tokens, positions, cache)` merges the NNX graph with `params` inside the
caller's jit, so parameters are always traced arguments, never baked-in constants.
"""

from __future__ import annotations

import dataclasses
import functools
import json
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from spec_jax.core.errors import BadArgument, check_bool, check_int, check_real
from spec_jax.core.kv_cache import KVCache, causal_mask, write_rows
from spec_jax.core.quantize import dense


# Params layouts: {name: LlamaConfig layout fields}. "checkpoint" is what every reader and
# writer uses; spec_jax.models.params_io.to_layout converts to the others after loading.
LAYOUTS = {"checkpoint": dict(fused_projections=False, kernels_out_in=False),
           "fused": dict(fused_projections=True, kernels_out_in=False),
           "fused_out_in": dict(fused_projections=True, kernels_out_in=True)}


@dataclasses.dataclass(frozen=True)
class LlamaConfig:
  vocab_size: int
  dim: int
  n_layers: int
  n_heads: int
  n_kv_heads: int
  hidden_dim: int
  head_dim: int | None = None  # default dim // n_heads
  max_seq_len: int = 2048
  rope_theta: float = 10000.0
  norm_eps: float = 1e-5
  qkv_bias: bool = False
  tie_embeddings: bool = True
  # Layout fields (LAYOUTS; checkpoints keep the separate [in, out] layout). fused_projections: one QKV and one gate/up matmul per layer (4
  # matmuls, not 7). kernels_out_in: every kernel stored [out, in] (`kernel_OI`), which
  # XLA:CPU streams faster in one-token steps but multiplies slower in multi-token passes.
  fused_projections: bool = False
  kernels_out_in: bool = False
  dtype: str = "float32"  # parameter and activation dtype; norms and softmax run in float32

  def __post_init__(self):
    # types first: a "5" or 4.5 here would fail later with a TypeError, or silently truncate
    for name in ("vocab_size", "dim", "n_layers", "n_heads", "n_kv_heads", "hidden_dim",
                 "max_seq_len"):
      check_int(getattr(self, name), f"LlamaConfig.{name}", minimum=1)
    if self.head_dim is not None:
      check_int(self.head_dim, "LlamaConfig.head_dim", minimum=1)
    for name in ("rope_theta", "norm_eps"):
      check_real(getattr(self, name), f"LlamaConfig.{name}", positive=True)
    for name in ("qkv_bias", "tie_embeddings", "fused_projections", "kernels_out_in"):
      check_bool(getattr(self, name), f"LlamaConfig.{name}")
    if self.n_heads % self.n_kv_heads:
      raise BadArgument(f"n_heads={self.n_heads} is not a multiple of n_kv_heads={self.n_kv_heads}")
    if self.head_dim is None and self.dim % self.n_heads:
      raise BadArgument(f"dim={self.dim} is not divisible by n_heads={self.n_heads}")
    if self.resolved_head_dim % 2:
      raise BadArgument(f"head_dim must be even for RoPE, got {self.resolved_head_dim}")
    try:
      floating = isinstance(self.dtype, str) and jnp.issubdtype(jnp.dtype(self.dtype), jnp.floating)
    except TypeError:
      floating = False
    if not floating:
      raise BadArgument(f"LlamaConfig.dtype must name a floating dtype (float32, bfloat16, ...), "
                        f"got {self.dtype!r}")

  @property
  def resolved_head_dim(self) -> int:
    return self.head_dim if self.head_dim is not None else self.dim // self.n_heads

  @property
  def layout(self) -> dict[str, bool]:
    """This config's layout fields (the values of one of LAYOUTS)."""
    return {name: getattr(self, name) for name in LAYOUTS["checkpoint"]}

  @property
  def jnp_dtype(self):
    return jnp.dtype(self.dtype)

  def num_params(self) -> int:
    d, h, kv, hd = self.dim, self.n_heads, self.n_kv_heads, self.resolved_head_dim
    attn = d * h * hd * 2 + d * kv * hd * 2 + (self.qkv_bias * (h + 2 * kv) * hd)
    mlp = 3 * d * self.hidden_dim
    head = 0 if self.tie_embeddings else self.vocab_size * d
    return self.vocab_size * d + self.n_layers * (attn + mlp + 2 * d) + d + head

  def to_json(self) -> str:
    return json.dumps(dataclasses.asdict(self), indent=2, sort_keys=True)

  @classmethod
  def from_dict(cls, d: dict[str, Any]) -> "LlamaConfig":
    known = {f.name for f in dataclasses.fields(cls)}
    unknown = set(d) - known
    if unknown:
      raise BadArgument(f"unknown LlamaConfig fields: {sorted(unknown)}")
    return cls(**d)


def _normal(key, shape, dtype, std):
  return (std * jax.random.normal(key, shape, jnp.float32)).astype(dtype)


class Linear(nnx.Module):
  """y = x @ W (+ bias), W stored as `kernel` [in, out] or, with out_in, `kernel_OI`
  [out, in]. Either may be an int8 QuantizedArray(OI)."""

  def __init__(self, in_features: int, out_features: int, *, use_bias: bool, dtype,
               rngs: nnx.Rngs, out_in: bool = False):
    w_IO = _normal(rngs.params(), (in_features, out_features), dtype, in_features ** -0.5)
    if out_in:
      self.kernel_OI = nnx.Param(w_IO.T)
    else:
      self.kernel = nnx.Param(w_IO)
    self.bias = nnx.Param(jnp.zeros((out_features,), dtype)) if use_bias else None

  def __call__(self, x):
    # get_value: the kernel may be a QuantizedArray pytree
    if hasattr(self, "kernel_OI"):
      y = dense(x, self.kernel_OI.get_value(), out_in=True)
    else:
      y = dense(x, self.kernel.get_value())
    return y + self.bias[...] if self.bias is not None else y


class RMSNorm(nnx.Module):
  def __init__(self, dim: int, *, eps: float, dtype):
    self.scale = nnx.Param(jnp.ones((dim,), dtype))
    self.eps = eps

  def __call__(self, x):
    x32 = x.astype(jnp.float32)
    normed = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + self.eps)
    return (normed * self.scale[...].astype(jnp.float32)).astype(x.dtype)


def apply_rope(x_BTHE: jax.Array, positions_BT: jax.Array, theta: float) -> jax.Array:
  """Rotary embedding, half-split layout: dims (i, i + E/2) rotate together by pos * freq_i.

  x is [B, T, heads, E]: the query heads (H) or the KV heads (K); F = E / 2 frequencies.
  """
  half = x_BTHE.shape[-1] // 2
  freq_F = 1.0 / (theta ** (jnp.arange(half, dtype=jnp.float32) * 2.0 / x_BTHE.shape[-1]))
  angle_BTF = positions_BT.astype(jnp.float32)[..., None] * freq_F
  cos, sin = jnp.cos(angle_BTF)[:, :, None, :], jnp.sin(angle_BTF)[:, :, None, :]
  x1, x2 = x_BTHE[..., :half].astype(jnp.float32), x_BTHE[..., half:].astype(jnp.float32)
  out = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
  return out.astype(x_BTHE.dtype)


class Attention(nnx.Module):
  def __init__(self, cfg: LlamaConfig, rngs: nnx.Rngs):
    d, hd, dt = cfg.dim, cfg.resolved_head_dim, cfg.jnp_dtype
    self.n_heads, self.n_kv_heads, self.head_dim = cfg.n_heads, cfg.n_kv_heads, hd
    self.rope_theta = cfg.rope_theta
    q_out, kv_out = cfg.n_heads * hd, cfg.n_kv_heads * hd
    kw = dict(dtype=dt, rngs=rngs, out_in=cfg.kernels_out_in)
    if cfg.fused_projections:  # outputs [q | k | v]
      self.wqkv = Linear(d, q_out + 2 * kv_out, use_bias=cfg.qkv_bias, **kw)
    else:
      self.wq = Linear(d, q_out, use_bias=cfg.qkv_bias, **kw)
      self.wk = Linear(d, kv_out, use_bias=cfg.qkv_bias, **kw)
      self.wv = Linear(d, kv_out, use_bias=cfg.qkv_bias, **kw)
    self.wo = Linear(q_out, d, use_bias=False, **kw)

  def project_qkv(self, x_BTD):
    """-> (q [B,T,H*E], k [B,T,K*E], v [B,T,K*E]), from one fused matmul or three."""
    if not hasattr(self, "wqkv"):
      return self.wq(x_BTD), self.wk(x_BTD), self.wv(x_BTD)
    q_out, kv_out = self.n_heads * self.head_dim, self.n_kv_heads * self.head_dim
    qkv = self.wqkv(x_BTD)
    return qkv[..., :q_out], qkv[..., q_out:q_out + kv_out], qkv[..., q_out + kv_out:]

  def __call__(self, x_BTD, positions_BT, k_LBKES, v_LBKES, layer: int, slots_BT, mask_BTS):
    """Writes this layer's new K/V into the stacked caches (in place under jit) and attends."""
    B, T, _ = x_BTD.shape
    K, Q, E = self.n_kv_heads, self.n_heads // self.n_kv_heads, self.head_dim
    q, k, v = self.project_qkv(x_BTD)
    q_BTHE = apply_rope(q.reshape(B, T, K * Q, E), positions_BT, self.rope_theta)
    k_BTKE = apply_rope(k.reshape(B, T, K, E), positions_BT, self.rope_theta)
    v_BTKE = v.reshape(B, T, K, E)
    k_LBKES = write_rows(k_LBKES, slots_BT, k_BTKE, layer)
    v_LBKES = write_rows(v_LBKES, slots_BT, v_BTKE, layer)
    # query head h reads KV head h // Q (grouped-query attention)
    out_BTKQE = attention(q_BTHE.reshape(B, T, K, Q, E), k_LBKES[layer], v_LBKES[layer],
                          mask_BTS)
    return self.wo(out_BTKQE.reshape(B, T, K * Q * E)), k_LBKES, v_LBKES


# Up to this many queries per row (decode steps, verification blocks, small trees), scores
# are a multiply-and-reduce over head_dim; wider blocks (prefill) use a dot, which is what
# matrix units want for long prompts.
ELEMENTWISE_SCORES_MAX_QUERIES = 16


def cache_scores(q_BTKQE: jax.Array, k_BKES: jax.Array) -> jax.Array:
  """Scaled attention scores [B, K, Q, T, S] (float32) of queries over a cached K [B,K,E,S].

  Why not always a dot: per (row, KV head) the product is [Q*T, E] x [E, S] with head_dim E
  often 8-64, and XLA:CPU runs a batched dot as B x K separate tiny matrix products. As
  E broadcast multiply-adds along the contiguous slots it fuses into one loop that reads
  the cache once. One layer's attention on a 2-core CPU: 1.3-2.9x faster at batch 1-256,
  head_dim 8 and 64, 1-5 queries; even with 64-100 queries 1.0-1.8x (README, "The batch
  baseline"). Past 16 queries the dot stays, for matrix units (GPU/TPU prefill).
  """
  B, T, _, _, E = q_BTKQE.shape
  # One row: XLA:CPU turns the cache write into an in-place dynamic-update-slice and, with
  # an elementwise consumer of the written layer, duplicates the write into it, which makes
  # it copy the whole stacked cache once per layer (+10% a step on the built-in target).
  # A dot reads the layer as its own slice, and B x K is small there anyway.
  if B == 1 or T > ELEMENTWISE_SCORES_MAX_QUERIES:
    scores = jnp.einsum("btkqe,bkes->bkqts", q_BTKQE, k_BKES, preferred_element_type=jnp.float32)
  else:
    q_BKQTE1 = q_BTKQE.transpose(0, 2, 3, 1, 4)[..., None].astype(jnp.float32)
    scores = jnp.sum(q_BKQTE1 * k_BKES[:, :, None, None].astype(jnp.float32), axis=-2)
  return scores * (E ** -0.5)


def attention(q_BTKQE: jax.Array, k_BKES: jax.Array, v_BKES: jax.Array,
              mask_BTS: jax.Array) -> jax.Array:
  """Grouped-query attention of T queries per row over one layer's cache -> [B,T,K,Q,E].

  Softmax with the normalisation after the value product: exp(s - max) times V, divided by
  the sum of exp, so the [B,K,Q,T,S] probabilities are never written out divided.
  """
  scores_BKQTS = cache_scores(q_BTKQE, k_BKES)
  scores_BKQTS = jnp.where(mask_BTS[:, None, None], scores_BKQTS, jnp.finfo(jnp.float32).min)
  weights_BKQTS = jnp.exp(scores_BKQTS - jnp.max(scores_BKQTS, axis=-1, keepdims=True))
  out_BKQTE = jnp.einsum("bkqts,bkes->bkqte", weights_BKQTS.astype(v_BKES.dtype), v_BKES,
                         preferred_element_type=jnp.float32)
  out_BKQTE = out_BKQTE / jnp.sum(weights_BKQTS, axis=-1, keepdims=True)
  return out_BKQTE.transpose(0, 3, 1, 2, 4).astype(q_BTKQE.dtype)


class MLP(nnx.Module):
  def __init__(self, cfg: LlamaConfig, rngs: nnx.Rngs):
    d, f = cfg.dim, cfg.hidden_dim
    kw = dict(use_bias=False, dtype=cfg.jnp_dtype, rngs=rngs, out_in=cfg.kernels_out_in)
    if cfg.fused_projections:  # outputs [gate | up]
      self.w_gate_up = Linear(d, 2 * f, **kw)
    else:
      self.w_gate = Linear(d, f, **kw)
      self.w_up = Linear(d, f, **kw)
    self.w_down = Linear(f, d, **kw)

  def __call__(self, x):
    if hasattr(self, "w_gate_up"):
      gate, up = jnp.split(self.w_gate_up(x), 2, axis=-1)
    else:
      gate, up = self.w_gate(x), self.w_up(x)
    return self.w_down(jax.nn.silu(gate) * up)


class Block(nnx.Module):
  def __init__(self, cfg: LlamaConfig, rngs: nnx.Rngs):
    dt = cfg.jnp_dtype
    self.attn_norm = RMSNorm(cfg.dim, eps=cfg.norm_eps, dtype=dt)
    self.attn = Attention(cfg, rngs)
    self.mlp_norm = RMSNorm(cfg.dim, eps=cfg.norm_eps, dtype=dt)
    self.mlp = MLP(cfg, rngs)

  def __call__(self, x_BTD, positions_BT, k_cache, v_cache, layer, slots_BT, mask_BTS):
    attn_out, k_cache, v_cache = self.attn(self.attn_norm(x_BTD), positions_BT, k_cache,
                                           v_cache, layer, slots_BT, mask_BTS)
    x_BTD = x_BTD + attn_out
    return x_BTD + self.mlp(self.mlp_norm(x_BTD)), k_cache, v_cache


class Llama(nnx.Module):
  def __init__(self, cfg: LlamaConfig, rngs: nnx.Rngs):
    self.config = cfg
    # std dim**-0.5 keeps a tied head's logits near unit scale at init
    self.embed = nnx.Param(_normal(rngs.params(), (cfg.vocab_size, cfg.dim), cfg.jnp_dtype,
                                   cfg.dim ** -0.5))
    self.layers = nnx.List([Block(cfg, rngs) for _ in range(cfg.n_layers)])
    self.final_norm = RMSNorm(cfg.dim, eps=cfg.norm_eps, dtype=cfg.jnp_dtype)
    self.lm_head = (None if cfg.tie_embeddings else
                    Linear(cfg.dim, cfg.vocab_size, use_bias=False, dtype=cfg.jnp_dtype,
                           rngs=rngs, out_in=cfg.kernels_out_in))

  def embed_tokens(self, tokens_BT):
    return jnp.take(self.embed[...], tokens_BT, axis=0)

  def logits(self, hidden_BTD):
    if self.lm_head is None:
      return jnp.einsum("btd,vd->btv", hidden_BTD, self.embed[...],
                        preferred_element_type=jnp.float32)
    return self.lm_head(hidden_BTD).astype(jnp.float32)

  def __call__(self, tokens_BT, positions_BT, cache: KVCache, slots_BT, mask_BTS,
               num_layers: int | None = None, feature_layers: tuple[int, ...] = (),
               last_logits_only: bool = False):
    x_BTD = self.embed_tokens(tokens_BT)
    k_LBKES, v_LBKES = cache.k_LBKES, cache.v_LBKES
    used = len(self.layers) if num_layers is None else num_layers
    outputs = {}  # layer id -> its output (the residual stream), for feature_layers only
    for i, layer in enumerate(self.layers[:used]):
      x_BTD, k_LBKES, v_LBKES = layer(x_BTD, positions_BT, k_LBKES, v_LBKES, i, slots_BT,
                                      mask_BTS)
      if i in feature_layers:
        outputs[i] = x_BTD
    hidden_BTD = self.final_norm(x_BTD)
    # XLA computes a whole [T, V] product even when only a slice of it is used
    logits_BTV = self.logits(hidden_BTD[:, -1:] if last_logits_only else hidden_BTD)
    if feature_layers:  # [last ; layer l_1 ; ... ; layer l_n] along the feature axis
      hidden_BTD = jnp.concatenate([hidden_BTD] + [outputs[i] for i in feature_layers], axis=-1)
    return logits_BTV, hidden_BTD, cache.replace(k_LBKES=k_LBKES, v_LBKES=v_LBKES)


def check_feature_layers(layers, num_layers: int) -> None:
  """Feature layer ids: distinct integers in 0..num_layers-1 (the layers a pass runs)."""
  if not isinstance(layers, tuple):
    raise TypeError(f"feature layers must be a tuple of layer ids, got {layers!r}")
  for i in layers:
    if isinstance(i, bool) or not isinstance(i, int) or not 0 <= i < num_layers:
      raise ValueError(f"feature layer {i!r} is not a layer of this model: ids are "
                       f"0..{num_layers - 1} ({num_layers} layers)")
  if len(set(layers)) != len(layers):
    raise ValueError(f"feature layers must be distinct, got {layers}")


@functools.lru_cache(maxsize=None)
def _graphdef(cfg: LlamaConfig):
  graphdef, _ = nnx.split(nnx.eval_shape(lambda: Llama(cfg, nnx.Rngs(0))))
  return graphdef


@dataclasses.dataclass(frozen=True)
class LlamaModel:
  """Functional handle on a Llama config: hashable, so it can be a static jit argument.

  `num_layers` < config.n_layers runs only the first layers (then final norm and head):
  the layer-skip self-speculation draft shares the target's params and cache layout.

  `feature_layers` (static, default none) asks `apply` for the outputs of those decoder
  layers (0-based; each the residual stream after the layer) alongside the last hidden
  state: `hidden` is then [last ; layer l_1 ; ... ; layer l_n] along its last axis, width
  (1 + n) * dim, and `hidden[..., :dim]` is what it is without them. Drafters conditioned
  on several target layers (DFlash, DSpark, EAGLE-3) ask for them through
  `with_feature_layers`; without the request the computation and its program are unchanged.
  """
  config: LlamaConfig
  num_layers: int | None = None
  feature_layers: tuple[int, ...] = ()

  def __post_init__(self):
    check_feature_layers(self.feature_layers,
                         self.config.n_layers if self.num_layers is None else self.num_layers)

  def with_feature_layers(self, layers) -> "LlamaModel":
    """This handle, with `apply` also returning the outputs of `layers` (see above)."""
    return dataclasses.replace(self, feature_layers=tuple(int(i) for i in layers))

  @property
  def vocab_size(self) -> int:
    return self.config.vocab_size

  @property
  def max_seq_len(self) -> int:
    return self.config.max_seq_len

  def init_params(self, key: jax.Array) -> nnx.State:
    return nnx.split(Llama(self.config, nnx.Rngs(params=key)))[1]

  def abstract_params(self) -> nnx.State:
    return nnx.split(nnx.eval_shape(lambda: Llama(self.config, nnx.Rngs(0))))[1]

  def init_cache(self, batch_size: int, max_len: int) -> KVCache:
    cfg = self.config
    layers = cfg.n_layers if self.num_layers is None else self.num_layers
    return KVCache.zeros(num_layers=layers, batch_size=batch_size, max_len=max_len,
                         num_kv_heads=cfg.n_kv_heads, head_dim=cfg.resolved_head_dim,
                         dtype=cfg.jnp_dtype)

  def module(self, params) -> Llama:
    return nnx.merge(_graphdef(self.config), params)

  def apply(self, params, tokens_BT: jax.Array, positions_BT: jax.Array, cache: KVCache, *,
            slots_BT: jax.Array | None = None, mask_BTS: jax.Array | None = None,
            feature_layers: tuple[int, ...] | None = None, last_logits_only: bool = False):
    """-> (logits[B,T,V] float32, hidden[B,T,D], cache with the T new entries written).

    By default token t of row b is written to slot positions[b, t] and attends causally.
    Token trees pass their own slots and mask. `cache.length_B` is left to the caller.
    `feature_layers` (static) overrides the handle's: hidden is then [B,T,(1+n)*D], the
    last hidden state followed by those layers' outputs. `last_logits_only` (static): logits
    of the block's last token alone, [B,1,V] (a drafter's window wants no more).
    """
    if slots_BT is None:
      slots_BT = positions_BT
    if mask_BTS is None:
      mask_BTS = causal_mask(positions_BT, cache.max_len)
    layers = self.feature_layers
    if feature_layers is not None:
      layers = tuple(int(i) for i in feature_layers)
      check_feature_layers(layers, self.config.n_layers if self.num_layers is None
                           else self.num_layers)
    model = self.module(params)
    return model(tokens_BT, positions_BT, cache, slots_BT, mask_BTS, self.num_layers, layers,
                 last_logits_only)
