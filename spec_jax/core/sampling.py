"""Sampling as pure functions: one place turns logits into the warped distribution.

The speculative verifier warps target and draft logits with this same function, which is
what keeps speculative sampling distributed exactly as plain sampling from the target.

Before warping, `process_logits` applies what depends on the tokens so far: repetition,
presence and frequency penalties and min_new_tokens (EOS forbidden until a row has that
many tokens). A verify block's position i is processed from the context it predicts
after (prompt + generated + the drafts before it), so verification stays exact.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from spec_jax.core.errors import is_int, is_real


@dataclasses.dataclass(frozen=True)
class SamplingConfig:
  """How a next token is chosen from the logits. Static (hashable): a jit argument.

  temperature 0 means greedy (the argmax of the processed logits); top_k 0 means no top-k;
  top_p 1 means no nucleus cut. The rest act on the logits before warping, in this order
  (HF applies its processors before its warpers too):
    repetition_penalty: HF's: for tokens in the context (prompt + generated), logits > 0
        are divided by it, logits < 0 multiplied; 1 is off.
    presence_penalty, frequency_penalty: OpenAI's / vLLM's, over generated tokens only:
        logit -= frequency_penalty * count + presence_penalty * (count > 0); 0 is off.
    min_new_tokens: every EOS id gets logit -inf while a row has generated fewer tokens.
  With the defaults nothing is processed and the compiled program carries no counts.
  """
  temperature: float = 0.0
  top_k: int = 0
  top_p: float = 1.0
  repetition_penalty: float = 1.0
  presence_penalty: float = 0.0
  frequency_penalty: float = 0.0
  min_new_tokens: int = 0

  def __post_init__(self):
    for name in ("temperature", "top_p", "repetition_penalty", "presence_penalty",
                 "frequency_penalty"):  # numbers, not strings or bools (a str fails in jit)
      value = getattr(self, name)
      if not is_real(value):
        raise ValueError(f"{name} must be a number, got {value!r} ({type(value).__name__})")
      try:
        float(value)
      except OverflowError:  # an int no float holds: it would overflow inside the program
        raise ValueError(f"{name} must be a finite number a float can hold, got an integer "
                         f"of {len(str(abs(value)))} digits") from None
    for name in ("top_k", "min_new_tokens"):  # (4.0 would reach jit as a shape and fail there)
      value = getattr(self, name)
      if not is_int(value) or value < 0:
        raise ValueError(f"{name} must be a non-negative integer, got {value!r}")
    # an infinite temperature divides every logit to nan or 0: top_k and top_p then cut nothing
    if not 0.0 <= self.temperature < float("inf"):
      raise ValueError(f"temperature must be >= 0 and finite, got {self.temperature}")
    if not 0.0 < self.top_p <= 1.0:
      raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
    if not 0.0 < self.repetition_penalty < float("inf"):
      raise ValueError(f"repetition_penalty must be > 0 and finite, got "
                       f"{self.repetition_penalty}")
    for name in ("presence_penalty", "frequency_penalty"):
      value = getattr(self, name)
      if not abs(value) < float("inf"):  # negative values reward repeats, as in vLLM
        raise ValueError(f"{name} must be a finite number, got {value}")

  @property
  def is_greedy(self) -> bool:
    return self.temperature == 0.0

  @property
  def has_penalties(self) -> bool:
    """Whether the logits depend on which tokens came before (counts must be kept)."""
    return self.repetition_penalty != 1.0 or self.presence_penalty != 0.0 or \
        self.frequency_penalty != 0.0

  @property
  def processes_logits(self) -> bool:
    """Whether process_logits changes anything (else it is never called)."""
    return self.has_penalties or self.min_new_tokens > 0


# --- processing from the tokens so far ---------------------------------------------------------

def _scatter_rows(buf_BV, tokens_BK, weights_BK, op: str):
  """buf[b, tokens[b, k]] (op)= weights[b, k]: a vmapped scatter, local to each batch shard."""
  def row(b_V, t_K, w_K):
    return getattr(b_V.at[t_K], op)(w_K, mode="drop")
  return jax.vmap(row)(buf_BV, tokens_BK, weights_BK)


@struct.dataclass
class TokenCounts:
  """Per-row statistics of the tokens so far, over the vocabulary. A field is None when no
  setting reads it, so a generation without penalties carries no such buffer.

  Fields may have more leading axes ([B, N, V]: one context per verified node).
  """
  in_context_BV: jax.Array | None  # bool: occurs in prompt + generated (repetition_penalty)
  generated_BV: jax.Array | None  # int32: times generated (presence / frequency penalty)

  @classmethod
  def of_prompts(cls, tokens_BP, lengths_B, vocab_size: int,
                 cfg: SamplingConfig) -> TokenCounts | None:
    """The counts before anything is generated; None when `cfg` has no penalties."""
    if not cfg.has_penalties:
      return None
    batch, width = tokens_BP.shape
    in_context_BV = None
    if cfg.repetition_penalty != 1.0:
      valid_BP = jnp.arange(width)[None, :] < lengths_B[:, None]
      in_context_BV = _scatter_rows(jnp.zeros((batch, vocab_size), bool),
                                    jnp.where(valid_BP, tokens_BP, vocab_size), valid_BP, "set")
    generated_BV = None
    if cfg.presence_penalty != 0.0 or cfg.frequency_penalty != 0.0:
      generated_BV = jnp.zeros((batch, vocab_size), jnp.int32)
    return cls(in_context_BV, generated_BV)

  def add(self, tokens_BK, count_B) -> TokenCounts:
    """The counts after each row generates its first count_B[b] tokens of tokens_BK."""
    vocab = (self.in_context_BV if self.generated_BV is None else self.generated_BV).shape[-1]
    valid_BK = jnp.arange(tokens_BK.shape[1])[None, :] < count_B[:, None]
    idx_BK = jnp.where(valid_BK, tokens_BK, vocab)  # out of range: dropped
    return TokenCounts(
        None if self.in_context_BV is None else
        _scatter_rows(self.in_context_BV, idx_BK, valid_BK, "set"),
        None if self.generated_BV is None else
        _scatter_rows(self.generated_BV, idx_BK, valid_BK.astype(jnp.int32), "add"))

  def along_tree(self, tokens_BN, ancestors_BNN) -> TokenCounts:
    """[B, N, V] counts per node: node i's context adds the tokens of its ancestors and
    itself, but not the root's (node 0: the pending token, already counted)."""
    batch, num_nodes = tokens_BN.shape
    weights_BNN = ancestors_BNN & (jnp.arange(num_nodes) > 0)[None, None, :]

    def per_node(buf_BV, op: str, dtype):
      if buf_BV is None:
        return None

      def row(b_V, w_NN, t_N):  # node i: b[t[j]] (op)= w[i, j], for each j
        return jax.vmap(lambda w_N: getattr(b_V.at[t_N], op)(w_N))(w_NN)

      return jax.vmap(row)(buf_BV, weights_BNN.astype(dtype), tokens_BN)

    return TokenCounts(per_node(self.in_context_BV, "max", bool),
                       per_node(self.generated_BV, "add", jnp.int32))


@struct.dataclass
class TokenHistory:
  """What process_logits reads for one position per row ([B]), or per node of a block
  ([B, N]): the tokens generated before it, the EOS ids, and the counts (None without
  penalties)."""
  num_generated: jax.Array  # int32 [B] or [B, N]: tokens generated before this position's
  eos_E: jax.Array  # int32 [E] EOS ids (-1: none), forbidden before min_new_tokens
  counts: TokenCounts | None = None

  def push(self, token_B) -> TokenHistory:
    """The history one token later (a chain drafter after drawing token_B)."""
    counts = None if self.counts is None else self.counts.add(
        token_B[:, None], jnp.ones_like(token_B))
    return TokenHistory(self.num_generated + 1, self.eos_E, counts)

  def ahead(self, depth) -> TokenHistory:
    """For the nodes of a tree level ([B, T, V] logits) whose paths are not tracked: `depth`
    (an int, or [T]) tokens later, the counts still the round's. Tree drafters rank children
    with this; any ranking keeps verification exact (a tree's q is one-hot)."""
    counts = None if self.counts is None else jax.tree.map(lambda c: c[:, None], self.counts)
    return TokenHistory(self.num_generated[:, None] + jnp.asarray(depth, jnp.int32), self.eos_E,
                        counts)

  def along_tree(self, tokens_BN, ancestors_BNN, depth_BN) -> TokenHistory:
    """Per node of a tree whose root is the pending token: the history of the token that
    follows node i (its path from the root added; see TokenCounts.along_tree)."""
    counts = None if self.counts is None else self.counts.along_tree(tokens_BN, ancestors_BNN)
    return TokenHistory(self.num_generated[:, None] + depth_BN, self.eos_E, counts)

  def along_chain(self, tokens_BT) -> TokenHistory:
    """along_tree for a chain [pending, d_1..d_{T-1}]: position i follows d_1..d_i."""
    batch, width = tokens_BT.shape
    lower_TT = jnp.tril(jnp.ones((width, width), bool))
    depth_BT = jnp.broadcast_to(jnp.arange(width, dtype=jnp.int32), (batch, width))
    return self.along_tree(tokens_BT, jnp.broadcast_to(lower_TT, (batch, width, width)),
                           depth_BT)


def process_logits(logits_XV: jax.Array, cfg: SamplingConfig,
                   history: TokenHistory | None) -> jax.Array:
  """The logits after penalties and min_new_tokens (float32); unchanged when `cfg` has
  none. `history`'s leading axes are logits_XV's ([B] or [B, N])."""
  if history is None or not cfg.processes_logits:
    return logits_XV
  logits_XV = logits_XV.astype(jnp.float32)
  counts = history.counts
  if cfg.repetition_penalty != 1.0:
    penalised_XV = jnp.where(logits_XV > 0, logits_XV / cfg.repetition_penalty,
                             logits_XV * cfg.repetition_penalty)
    logits_XV = jnp.where(counts.in_context_BV, penalised_XV, logits_XV)
  if cfg.presence_penalty != 0.0 or cfg.frequency_penalty != 0.0:
    generated_XV = counts.generated_BV
    logits_XV = logits_XV - (cfg.frequency_penalty * generated_XV.astype(jnp.float32) +
                             cfg.presence_penalty * (generated_XV > 0).astype(jnp.float32))
  if cfg.min_new_tokens > 0:
    vocab = logits_XV.shape[-1]
    is_eos_V = jnp.any(jnp.arange(vocab)[:, None] == history.eos_E[None, :], axis=-1)
    early_X1 = (history.num_generated < cfg.min_new_tokens)[..., None]
    logits_XV = jnp.where(is_eos_V & early_X1, -jnp.inf, logits_XV)
  return logits_XV


def greedy(logits_NV: jax.Array) -> jax.Array:
  """jnp.argmax over the last axis, exactly (the first maximum; the first NaN if any), as
  two plain reductions: XLA:CPU runs argmax's variadic (value, index) reduce 3-4x slower,
  which was over a third of a decoding step at 16 rows x 512 tokens (scripts/benchmark.py)."""
  vocab = logits_NV.shape[-1]
  top_N1 = jnp.max(logits_NV, axis=-1, keepdims=True)
  hit_NV = (logits_NV == top_N1) | jnp.isnan(logits_NV)
  return jnp.min(jnp.where(hit_NV, jnp.arange(vocab, dtype=jnp.int32), vocab), axis=-1)


def nonfinite_rows(logits_XV: jax.Array) -> jax.Array:
  """[X] bool: the logits hold a NaN or +inf (broken weights or activations); -inf is a
  legitimate mask. Sampling from such a row would silently give garbage (often token 0)."""
  return jnp.any(jnp.isnan(logits_XV) | (logits_XV == jnp.inf), axis=-1)


# The smallest temperature divided by: a normal float32, so the division never meets a
# flushed denormal; any T below it already gives a one-hot distribution in float32.
_MIN_TEMPERATURE = float(np.finfo(np.float32).tiny)


def warp_logits(logits_NV: jax.Array, cfg: SamplingConfig) -> jax.Array:
  """Log-probabilities of the warped distribution (float32; -inf where cut away).

  Temperature, then top-k, then top-p, as in HF transformers. Ties at a cut-off are kept,
  so the result depends only on the logits, never on sort order. At temperature 0 the
  distribution is one-hot at the argmax.

  The temperature divides (logits - max): the largest entry is exactly 0 however the
  division rounds, so at a tiny T (1e-9, 1e-30) every other entry goes to -inf and the
  distribution becomes one-hot at the argmax (sampling equals greedy), instead of the
  normaliser underflowing to 0 (which made every row draw token 0).
  """
  logits_NV = logits_NV.astype(jnp.float32)
  neg_inf = jnp.float32(-jnp.inf)
  if cfg.is_greedy:
    one_hot = jax.nn.one_hot(greedy(logits_NV), logits_NV.shape[-1], dtype=jnp.bool_)
    return jnp.where(one_hot, 0.0, neg_inf)
  max_N1 = jnp.max(logits_NV, axis=-1, keepdims=True)
  max_N1 = jnp.where(jnp.isfinite(max_N1), max_N1, 0.0)  # all -inf: stays -inf, not NaN
  logits_NV = (logits_NV - max_N1) / jnp.float32(max(cfg.temperature, _MIN_TEMPERATURE))
  vocab = logits_NV.shape[-1]
  if 0 < cfg.top_k < vocab:
    kth_N1 = jax.lax.top_k(logits_NV, cfg.top_k)[0][..., -1:]
    logits_NV = jnp.where(logits_NV >= kth_N1, logits_NV, neg_inf)
  logp_NV = jax.nn.log_softmax(logits_NV, axis=-1)
  if cfg.top_p < 1.0:
    sorted_NV = jnp.sort(logp_NV, axis=-1)[..., ::-1]
    mass_before_NV = jnp.cumsum(jnp.exp(sorted_NV), axis=-1) - jnp.exp(sorted_NV)
    # the smallest kept log-prob: the last token whose preceding mass is below top_p
    kept_NV = mass_before_NV < cfg.top_p
    threshold_N1 = jnp.min(jnp.where(kept_NV, sorted_NV, jnp.inf), axis=-1, keepdims=True)
    logp_NV = jax.nn.log_softmax(jnp.where(logp_NV >= threshold_N1, logp_NV, neg_inf), axis=-1)
  return logp_NV


def warped_probs(logits_NV: jax.Array, cfg: SamplingConfig) -> jax.Array:
  return jnp.exp(warp_logits(logits_NV, cfg))


def acceptance_probability(p_NV: jax.Array, q_NV: jax.Array) -> jax.Array:
  """[N]: sum_x min(p, q), the probability that a draft drawn from q is accepted against a
  target distribution p by speculative sampling's rejection rule; 0 where either is not
  finite (a miss)."""
  accept_N = jnp.sum(jnp.minimum(p_NV, q_NV.astype(p_NV.dtype)), axis=-1)
  return jnp.where(jnp.isnan(accept_N), 0.0, jnp.clip(accept_N, 0.0, 1.0))


def token_acceptance(p_NV: jax.Array, tokens_N: jax.Array) -> jax.Array:
  """[N]: acceptance_probability for a deterministic draft (q one-hot at tokens_N): p of
  the token, read without building the one-hot; 0 where p is not finite, or where the
  token is negative (no draft: a miss)."""
  p_N = jnp.take_along_axis(p_NV, jnp.maximum(tokens_N, 0)[..., None], axis=-1)[..., 0]
  broken_N = jnp.any(jnp.isnan(p_NV), axis=-1)  # (as the sum over the row would be)
  return jnp.where((tokens_N >= 0) & ~broken_N, jnp.clip(p_N, 0.0, 1.0), 0.0)


# --- random draws, one key per row ---------------------------------------------------------------
#
# Every draw of the loops, verifiers and drafters goes through these: row b uses
# fold_in(key, b), and draws a shape without the batch axis. A [B, ...]-shaped draw would
# give row 0 different numbers when B changes; this way a row's output depends only on its
# prompt, settings and key, never on the batch size or the other rows.

def split_unless_greedy(key: jax.Array, num: int, cfg: SamplingConfig, *,
                        draws_when_greedy: bool = False) -> tuple[jax.Array, ...]:
  """`num` keys from `key`: jax.random.split's, or `key` itself `num` times where nothing
  draws (greedy, unless the caller draws even then). On CPU a split is a rolled threefry
  loop of a dozen small operations, 10-15% of a small model's step; inside a loop whose key
  outlives it, XLA cannot drop it as dead code."""
  if cfg.is_greedy and not draws_when_greedy:
    return (key,) * num
  return tuple(jax.random.split(key, num))


def row_keys(key: jax.Array, num_rows: int) -> jax.Array:
  """[num_rows] keys: row b's is fold_in(key, b)."""
  return jax.vmap(lambda b: jax.random.fold_in(key, b))(jnp.arange(num_rows, dtype=jnp.uint32))


def uniform_rows(key: jax.Array, shape: tuple[int, ...]) -> jax.Array:
  """float32 uniforms in [0, 1) of `shape` = (rows, ...), row b drawn with row_keys' key."""
  keys = row_keys(key, shape[0])
  return jax.vmap(lambda k: jax.random.uniform(k, shape[1:], jnp.float32))(keys)


def categorical_rows(key: jax.Array, logits_XV: jax.Array) -> jax.Array:
  """One draw per distribution (last axis) of logits_XV; rows (the first axis) with their
  own keys. A 1-D [V] is one draw with `key` itself."""
  if logits_XV.ndim == 1:
    return jax.random.categorical(key, logits_XV).astype(jnp.int32)
  keys = row_keys(key, logits_XV.shape[0])
  return jax.vmap(lambda k, l: jax.random.categorical(k, l, axis=-1))(
      keys, logits_XV).astype(jnp.int32)


def sample(key: jax.Array, logits_XV: jax.Array, cfg: SamplingConfig) -> jax.Array:
  """Draws one token per row from the warped distribution (argmax when greedy); each row
  (first axis) with its own key (categorical_rows)."""
  if cfg.is_greedy:
    return greedy(logits_XV)
  return categorical_rows(key, warp_logits(logits_XV, cfg))


def sample_from_probs(key: jax.Array, probs_XV: jax.Array) -> jax.Array:
  """Draws from (possibly unnormalised) non-negative weights; zero weight is never drawn.
  Each row (first axis) with its own key (categorical_rows)."""
  logits = jnp.where(probs_XV > 0, jnp.log(jnp.maximum(probs_XV, 1e-38)), -jnp.inf)
  return categorical_rows(key, logits)
