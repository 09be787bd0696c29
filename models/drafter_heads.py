"""Trained drafter heads on a frozen target, in Flax NNX: Medusa, EAGLE and MTP.

All three read the target's last hidden state (the post-final-norm `hidden` that
`LlamaModel.apply` returns) and reuse the target's token embedding, final norm and LM head,
frozen. So their parameters come in two parts (`HeadParams`): `own`, the trainable weights
as a plain nested dict (what optax and orbax see), and `shared`, the target's pieces
(`SharedHead`), passed in by reference and never trained.

Index conventions (position t holds token x_t; the target's hidden h_t predicts x_{t+1}):
  Medusa head k (1..K): from h_t predicts x_{t+1+k}.
  EAGLE: element t pairs (f_t, x_{t+1}) and predicts f_{t+1}, whose logits predict x_{t+2}.
  MTP module k (1..K): element i pairs (h^{k-1}_i, x_{i+k}) -> h^k_i, which predicts
    x_{i+k+1} (h^0 is the target's hidden).

Like `LlamaModel`, each family has a frozen, hashable handle (config + `init_params` +
`apply`) that merges the NNX graph with the params inside the caller's jit; spec_jax only
ever sees the handles.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, ClassVar

import jax
import jax.numpy as jnp
from flax import nnx, struct

from spec_jax.models.llama import LAYOUTS, Block, LlamaConfig, LlamaModel, Linear, RMSNorm
from spec_jax.core.errors import BadArgument, check_int
from spec_jax.core.kv_cache import KVCache, causal_mask
from spec_jax.core.quantize import dense


# --- the target's frozen pieces ---------------------------------------------------------------

@struct.dataclass
class SharedHead:
  """The target's embedding, final norm and LM head, shared (frozen) by every drafter head."""
  embed_VD: jax.Array
  final_norm_D: jax.Array
  head_kernel_DV: Any = None  # [D, V] array or QuantizedArray; None: tied to the embedding
  head_kernel_VD: Any = None  # [V, D]: the head of a target with LlamaConfig.kernels_out_in
  norm_eps: float = struct.field(pytree_node=False, default=1e-5)

  def embed(self, tokens_BT: jax.Array) -> jax.Array:
    return jnp.take(self.embed_VD, tokens_BT, axis=0)

  def final_norm(self, x_BTD: jax.Array) -> jax.Array:
    x32 = x_BTD.astype(jnp.float32)
    normed = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + self.norm_eps)
    return (normed * self.final_norm_D.astype(jnp.float32)).astype(x_BTD.dtype)

  def logits(self, hidden_BTD: jax.Array) -> jax.Array:
    """The target's head on an already-normalised hidden state -> float32 logits."""
    if self.head_kernel_DV is not None:
      return dense(hidden_BTD, self.head_kernel_DV).astype(jnp.float32)
    if self.head_kernel_VD is not None:
      return dense(hidden_BTD, self.head_kernel_VD, out_in=True).astype(jnp.float32)
    return jnp.einsum("...d,vd->...v", hidden_BTD, self.embed_VD,
                      preferred_element_type=jnp.float32)


def _value(x):
  return x[...] if isinstance(x, nnx.Variable) else x


def shared_head(target: LlamaModel, params) -> SharedHead:
  """Picks the shared pieces out of a Llama target's params (nnx.State or pure dict)."""
  cfg = target.config
  head = {}
  if not cfg.tie_embeddings:
    head = ({"head_kernel_VD": _value(params["lm_head"]["kernel_OI"])} if cfg.kernels_out_in
            else {"head_kernel_DV": _value(params["lm_head"]["kernel"])})
  return SharedHead(_value(params["embed"]), _value(params["final_norm"]["scale"]),
                    norm_eps=cfg.norm_eps, **head)


@struct.dataclass
class HeadParams:
  """What a drafter head's `apply` takes: its own weights and the target's shared pieces."""
  own: Any  # nested dict of arrays: the trainable part
  shared: SharedHead


def _default_slots(positions_BT: jax.Array, max_len: int) -> jax.Array:
  # negative positions (windows reaching before the start) must not wrap around: drop them
  return jnp.where(positions_BT >= 0, positions_BT, max_len)


def _pure(module: nnx.Module) -> dict:
  return nnx.to_pure_dict(nnx.split(module)[1])


def _abstract(ctor) -> dict:
  return nnx.to_pure_dict(nnx.split(nnx.eval_shape(ctor))[1])


@functools.lru_cache(maxsize=None)
def _check_float_dtype(dtype, name: str) -> None:
  try:
    floating = isinstance(dtype, str) and jnp.issubdtype(jnp.dtype(dtype), jnp.floating)
  except TypeError:
    floating = False
  if not floating:
    raise BadArgument(f"{name} must name a floating dtype (float32, bfloat16, ...), got {dtype!r}")


def _graphdef(module_cls, cfg):
  """The (static) graph of module_cls(cfg), built once per config: params are merged into it."""
  return nnx.split(nnx.eval_shape(lambda: module_cls(cfg, nnx.Rngs(0))))[0]


# --- Medusa -----------------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class MedusaConfig:
  vocab_size: int
  dim: int
  num_heads: int = 4
  dtype: str = "float32"

  def __post_init__(self):
    for name in ("vocab_size", "dim", "num_heads"):
      check_int(getattr(self, name), f"MedusaConfig.{name}", minimum=1)
    _check_float_dtype(self.dtype, "MedusaConfig.dtype")

  @classmethod
  def for_target(cls, target: LlamaConfig, num_heads: int = 4) -> "MedusaConfig":
    return cls(target.vocab_size, target.dim, num_heads, target.dtype)


class ResBlock(nnx.Module):
  """h + SiLU(W h + b); W and b start at zero, so a fresh head is the identity."""

  def __init__(self, dim: int, dtype, rngs: nnx.Rngs):
    self.linear = Linear(dim, dim, use_bias=True, dtype=dtype, rngs=rngs)
    self.linear.kernel = nnx.Param(jnp.zeros((dim, dim), dtype))

  def __call__(self, h_BTD):
    return h_BTD + jax.nn.silu(self.linear(h_BTD))


class Medusa(nnx.Module):
  def __init__(self, cfg: MedusaConfig, rngs: nnx.Rngs):
    dt = jnp.dtype(cfg.dtype)
    self.heads = nnx.List([ResBlock(cfg.dim, dt, rngs) for _ in range(cfg.num_heads)])

  def __call__(self, hidden_BTD) -> jax.Array:
    return jnp.stack([head(hidden_BTD) for head in self.heads], axis=2)  # [B, T, K, D]


@dataclasses.dataclass(frozen=True)
class MedusaModel:
  config: MedusaConfig

  @property
  def vocab_size(self) -> int:
    return self.config.vocab_size

  @property
  def num_heads(self) -> int:
    return self.config.num_heads

  def init_params(self, key: jax.Array) -> dict:
    return _pure(Medusa(self.config, nnx.Rngs(params=key)))

  def abstract_params(self) -> dict:
    return _abstract(lambda: Medusa(self.config, nnx.Rngs(0)))

  def apply(self, params: HeadParams, hidden_BTD: jax.Array) -> jax.Array:
    """Target hidden states [B,T,D] -> logits [B,T,K,V]; head k (0-based) predicts x_{t+2+k}."""
    heads = nnx.merge(_graphdef(Medusa, self.config), params.own)
    return params.shared.logits(heads(hidden_BTD))

  def first_head_logits(self, params: HeadParams, hidden_BTD: jax.Array) -> jax.Array:
    """[B,T,V]: head 0's logits alone (x_{t+2}), without the other heads' vocabulary
    projections (the costly part)."""
    heads = nnx.merge(_graphdef(Medusa, self.config), params.own)
    return params.shared.logits(heads.heads[0](hidden_BTD))


# --- EAGLE ------------------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class EagleConfig:
  layer: LlamaConfig  # the shape of the single decoder Block (its n_layers is ignored)

  @classmethod
  def for_target(cls, target: LlamaConfig, **overrides) -> "EagleConfig":
    """One Block shaped like the target's (override e.g. hidden_dim or n_heads)."""
    # the head's Block keeps the checkpoint layout, whatever layout the target decodes in:
    # drafter files are written and read in it
    return cls(dataclasses.replace(target, n_layers=1, **LAYOUTS["checkpoint"], **overrides))


class EagleLayer(nnx.Module):
  """concat[f_t, embed(x_{t+1})] -> Linear(2D -> D) -> one Llama Block -> predicted f_{t+1}."""

  def __init__(self, cfg: EagleConfig, rngs: nnx.Rngs):
    d, dt = cfg.layer.dim, cfg.layer.jnp_dtype
    self.fc = Linear(2 * d, d, use_bias=True, dtype=dt, rngs=rngs)
    self.block = Block(cfg.layer, rngs)

  def __call__(self, features_BTD, token_emb_BTD, positions_BT, cache: KVCache, slots_BT,
               mask_BTS):
    x_BTD = self.fc(jnp.concatenate([features_BTD, token_emb_BTD.astype(features_BTD.dtype)],
                                    axis=-1))
    out_BTD, k, v = self.block(x_BTD, positions_BT, cache.k_LBKES, cache.v_LBKES, 0, slots_BT,
                               mask_BTS)
    return out_BTD, cache.replace(k_LBKES=k, v_LBKES=v)


@dataclasses.dataclass(frozen=True)
class BlockDrafterModel:
  """Handle shared by drafters built from Llama Blocks shaped by `config.layer` (EAGLE, MTP):
  vocabulary and context from that layer, params of `module_cls(config)`, and a KV cache of
  `cache_layers` layers. Subclasses set module_cls (a class attribute, not a field)."""
  config: Any
  module_cls: ClassVar[type]

  @property
  def vocab_size(self) -> int:
    return self.config.layer.vocab_size

  @property
  def max_seq_len(self) -> int:
    return self.config.layer.max_seq_len

  @property
  def cache_layers(self) -> int:
    return 1

  def init_params(self, key: jax.Array) -> dict:
    return _pure(self.module_cls(self.config, nnx.Rngs(params=key)))

  def abstract_params(self) -> dict:
    return _abstract(lambda: self.module_cls(self.config, nnx.Rngs(0)))

  def module(self, own):
    return nnx.merge(_graphdef(self.module_cls, self.config), own)

  def init_cache(self, batch_size: int, max_len: int) -> KVCache:
    c = self.config.layer
    return KVCache.zeros(num_layers=self.cache_layers, batch_size=batch_size, max_len=max_len,
                         num_kv_heads=c.n_kv_heads, head_dim=c.resolved_head_dim,
                         dtype=c.jnp_dtype)


@dataclasses.dataclass(frozen=True)
class EagleModel(BlockDrafterModel):
  config: EagleConfig
  module_cls = EagleLayer

  def apply(self, params: HeadParams, features_BTD, next_tokens_BT, positions_BT, cache: KVCache,
            *, slots_BT=None, mask_BTS=None, last_logits_only: bool = False):
    """Element t = (feature f_t, token x_{t+1}) at positions[t] -> (logits [B,T,V] predicting
    x_{t+2}, predicted features f_{t+1} [B,T,D], cache with the T entries written).

    Positions < 0 (a window reaching before the sequence start) are computed but not stored.
    `last_logits_only` (static): logits of the last element alone, [B,1,V].
    """
    if slots_BT is None:
      slots_BT = _default_slots(positions_BT, cache.max_len)
    if mask_BTS is None:
      mask_BTS = causal_mask(positions_BT, cache.max_len)
    layer = self.module(params.own)
    feats_BTD, cache = layer(features_BTD, params.shared.embed(next_tokens_BT), positions_BT,
                             cache, slots_BT, mask_BTS)
    # target features are post-final-norm, so predicted ones go straight into the head
    return (params.shared.logits(feats_BTD[:, -1:] if last_logits_only else feats_BTD),
            feats_BTD, cache)


# --- MTP (DeepSeek-V3 multi-token prediction) -------------------------------------------------

@dataclasses.dataclass(frozen=True)
class MTPConfig:
  layer: LlamaConfig  # the shape of each module's Block (its n_layers is ignored)
  num_modules: int = 2

  def __post_init__(self):
    if not isinstance(self.layer, LlamaConfig):
      raise BadArgument(f"MTPConfig.layer must be a LlamaConfig, got {type(self.layer).__name__}")
    check_int(self.num_modules, "MTPConfig.num_modules", minimum=1)

  @classmethod
  def for_target(cls, target: LlamaConfig, num_modules: int = 2, **overrides) -> "MTPConfig":
    return cls(dataclasses.replace(target, n_layers=1, **LAYOUTS["checkpoint"], **overrides),
               num_modules)


class MTPModule(nnx.Module):
  """h^k_i = Block(Linear(2D -> D)[RMSNorm(h^{k-1}_i); RMSNorm(embed(x_{i+k}))])."""

  def __init__(self, cfg: LlamaConfig, rngs: nnx.Rngs):
    d, dt = cfg.dim, cfg.jnp_dtype
    self.hidden_norm = RMSNorm(d, eps=cfg.norm_eps, dtype=dt)
    self.embed_norm = RMSNorm(d, eps=cfg.norm_eps, dtype=dt)
    self.proj = Linear(2 * d, d, use_bias=False, dtype=dt, rngs=rngs)
    self.block = Block(cfg, rngs)

  def __call__(self, h_prev_BTD, token_emb_BTD, positions_BT, cache: KVCache, layer: int,
               slots_BT, mask_BTS):
    x_BTD = self.proj(jnp.concatenate([self.hidden_norm(h_prev_BTD),
                                       self.embed_norm(token_emb_BTD.astype(h_prev_BTD.dtype))],
                                      axis=-1))
    h_BTD, k, v = self.block(x_BTD, positions_BT, cache.k_LBKES, cache.v_LBKES, layer, slots_BT,
                             mask_BTS)
    return h_BTD, cache.replace(k_LBKES=k, v_LBKES=v)


class MTP(nnx.Module):
  def __init__(self, cfg: MTPConfig, rngs: nnx.Rngs):
    self.modules = nnx.List([MTPModule(cfg.layer, rngs) for _ in range(cfg.num_modules)])


@dataclasses.dataclass(frozen=True)
class MTPModel(BlockDrafterModel):
  config: MTPConfig
  module_cls = MTP

  @property
  def num_modules(self) -> int:
    return self.config.num_modules

  @property
  def cache_layers(self) -> int:
    """One cache layer per module: module k attends over its own sequence of h^k."""
    return self.config.num_modules

  def apply_module(self, params: HeadParams, k: int, h_prev_BTD, tokens_BT, positions_BT,
                   cache: KVCache, *, slots_BT=None, mask_BTS=None,
                   last_logits_only: bool = False):
    """Module k (1-based, static): element i = (h^{k-1}_i, x_{i+k}) at positions[i] ->
    (logits [B,T,V] predicting x_{i+k+1}, h^k [B,T,D], cache with layer k-1 written).
    `last_logits_only` (static): logits of the last element alone, [B,1,V]."""
    if not 1 <= k <= self.config.num_modules:
      raise ValueError(f"MTP module {k} out of range 1..{self.config.num_modules}")
    if slots_BT is None:
      slots_BT = _default_slots(positions_BT, cache.max_len)
    if mask_BTS is None:
      mask_BTS = causal_mask(positions_BT, cache.max_len)
    mtp = self.module(params.own)
    h_BTD, cache = mtp.modules[k - 1](h_prev_BTD, params.shared.embed(tokens_BT), positions_BT,
                                      cache, k - 1, slots_BT, mask_BTS)
    # h^k is a residual stream, like the target's before its final norm: the shared output
    # head is the target's final norm + LM head, as in DeepSeek-V3
    head_in_BTD = h_BTD[:, -1:] if last_logits_only else h_BTD
    return params.shared.logits(params.shared.final_norm(head_in_BTD)), h_BTD, cache

  def apply(self, params: HeadParams, hidden_BTD, tokens_BT, positions_BT, cache: KVCache,
            num_modules: int | None = None):
    """Teacher-forced pass of modules 1..num_modules over a sequence x_0..x_{T-1} with target
    hidden h^0 -> (logits [K,B,T,V], cache). Module k reads x_{i+k} (zeros past the end), so
    its logits at i predict x_{i+k+1}; entries with i+k >= T are garbage for the caller to mask.
    """
    K = self.config.num_modules if num_modules is None else num_modules
    h_BTD, logits = hidden_BTD, []
    batch = tokens_BT.shape[0]
    for k in range(1, K + 1):
      shifted_BT = jnp.concatenate([tokens_BT[:, k:], jnp.zeros((batch, k), tokens_BT.dtype)],
                                   axis=1)
      logits_BTV, h_BTD, cache = self.apply_module(params, k, h_BTD, shifted_BT, positions_BT,
                                                   cache)
      logits.append(logits_BTV)
    return jnp.stack(logits), cache
