"""Autoregressive generation: prefill + one `lax.while_loop`, inside one `jax.jit`.

This is the baseline that speculative decoding must reproduce exactly, and the home of
the pieces both loops share: prompt checks, prefill, and writing tokens into the
fixed-shape buffer with per-row EOS and token budgets.

Buffers: `seq_BS` holds each row's prompt (left-aligned) followed by its generated tokens;
S is the cache length. `pending_B` is the newest generated token, already in `seq_BS` but
not yet fed to the model, so the model's cache always holds `prompt + generated - 1` slots.
"""

from __future__ import annotations

import functools
import numbers
from typing import Any, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from spec_jax.core.errors import BadArgument, check_int, is_int
from spec_jax.core.interface import CausalLM
from spec_jax.core.kv_cache import KVCache
from spec_jax.core.pytree_names import check_params_fit
from spec_jax.core.sampling import (SamplingConfig, TokenCounts, TokenHistory, nonfinite_rows,
                                    process_logits, sample, warp_logits)

NO_EOS = -1  # an EOS id that matches no token

# eos_id arguments: one id, several (Llama 3 instruct models declare two), or None
EosIds = int | Sequence[int] | None


@struct.dataclass
class GenerationOutput:
  tokens: jax.Array  # [B, max_new_tokens] generated tokens (EOS included), pad_id after
  num_tokens: jax.Array  # [B] how many of `tokens` each row generated
  metrics: Any = None  # speculative metrics (see spec_jax.metrics); None for autoregressive
  sequences: jax.Array | None = None  # [B, S] prompt + generated, for inspection
  # [B] bool: the row stopped early because the target's logits it was to sample from were
  # not finite (NaN or +inf: broken weights or activations); `tokens` holds what it generated
  # before that step. Never silently a token 0. See failure_message.
  failed: jax.Array | None = None


def failure_message(out: GenerationOutput) -> str | None:
  """One line naming the rows that failed and why, or None when none did (reads to host)."""
  if out.failed is None:
    return None
  rows = np.flatnonzero(np.asarray(out.failed)).tolist()
  if not rows:
    return None
  return (f"generation failed in row{'s' if len(rows) > 1 else ''} "
          f"{', '.join(map(str, rows))}: the model's logits were not finite (NaN or inf); "
          "check the weights")


def pad_prompts(prompts: Sequence[Sequence[int]], *, pad_id: int = 0,
                width: int | None = None) -> tuple[np.ndarray, np.ndarray]:
  """Left-aligned, right-padded [B, width] int32 tokens and [B] lengths.

  Padding to a fixed `width` keeps shapes, hence the compiled program, the same across
  prompts of different lengths.
  """
  if not prompts:
    raise BadArgument("no prompts given")
  lengths = np.array([len(p) for p in prompts], np.int32)
  width = int(lengths.max()) if width is None else width
  if lengths.max() > width:
    raise BadArgument(f"a prompt has {lengths.max()} tokens, more than the padded width {width}")
  tokens = np.full((len(prompts), width), pad_id, np.int32)
  for row, prompt in enumerate(prompts):
    ids = np.asarray(prompt)
    if ids.size and not np.issubdtype(ids.dtype, np.integer):  # 4.5 would be truncated
      raise BadArgument(f"prompt {row} must be token ids (integers), got {ids.dtype}")
    tokens[row, :len(prompt)] = ids
  return tokens, lengths


def check_generation_args(model: CausalLM, prompt_tokens_BP, prompt_lengths_B, *,
                          max_new_tokens: int, extra_slots: int = 0,
                          cache_len: int | None = None) -> tuple[np.ndarray, np.ndarray, int]:
  """Validates prompts and sizes on the host, before anything is computed.

  Returns (tokens, lengths, cache_len). `extra_slots` is room a speculative round writes
  past the last kept token (its gamma drafts).
  """
  tokens = np.asarray(prompt_tokens_BP)
  lengths = np.asarray(prompt_lengths_B)
  if tokens.ndim != 2:
    raise BadArgument(f"prompt tokens must be [batch, width], got shape {tokens.shape}")
  if not np.issubdtype(tokens.dtype, np.integer):  # bools and floats are not token ids
    raise BadArgument(f"prompt tokens must be integers, got {tokens.dtype}")
  if lengths.shape != (tokens.shape[0],):
    raise BadArgument(f"prompt lengths must have shape ({tokens.shape[0]},), got {lengths.shape}")
  if not np.issubdtype(lengths.dtype, np.integer):  # a length of 4.5 would drop a token
    raise BadArgument(f"prompt lengths must be integers, got {lengths.dtype}: "
                      f"{lengths.tolist()}")
  if (lengths < 1).any() or (lengths > tokens.shape[1]).any():
    raise BadArgument(f"prompt lengths must be in [1, {tokens.shape[1]}], got {lengths.tolist()}")
  valid = np.arange(tokens.shape[1])[None, :] < lengths[:, None]
  bad = valid & ((tokens < 0) | (tokens >= model.vocab_size))
  if bad.any():
    row, col = map(int, np.argwhere(bad)[0])
    raise BadArgument(f"prompt token id {int(tokens[row, col])} (row {row}, position {col}) "
                      f"is outside the model's vocabulary [0, {model.vocab_size})")
  if not is_int(max_new_tokens):  # 4.0 too: a float would be truncated silently
    raise BadArgument(f"max_new_tokens must be an integer, got {max_new_tokens!r} "
                      f"({type(max_new_tokens).__name__})")
  if max_new_tokens < 1:
    raise BadArgument(f"max_new_tokens must be >= 1, got {max_new_tokens}")
  max_new_tokens = int(max_new_tokens)
  if cache_len is not None:
    cache_len = check_int(cache_len, "cache_len", minimum=1)
  needed = tokens.shape[1] + int(max_new_tokens) + int(extra_slots)
  if cache_len is None:
    cache_len = needed
  if needed > cache_len:
    raise BadArgument(f"the cache of {cache_len} slots is too small: prompts of width "
                     f"{tokens.shape[1]} + {max_new_tokens} new tokens + {extra_slots} draft "
                     f"slots need {needed}")
  if cache_len > model.max_seq_len:
    raise BadArgument(f"prompt width {tokens.shape[1]} + {max_new_tokens} new tokens"
                     f"{f' + {extra_slots} draft slots' if extra_slots else ''} = {needed} "
                     f"positions is longer than the model's context of {model.max_seq_len}")
  return tokens.astype(np.int32), lengths.astype(np.int32), int(cache_len)


def budgets_array(max_new_tokens: int, budgets_B, batch_size: int) -> np.ndarray:
  """Per-row token budgets (default: all rows max_new_tokens), each in [1, max_new_tokens]."""
  if budgets_B is None:
    return np.full((batch_size,), max_new_tokens, np.int32)
  budgets = np.asarray(budgets_B)
  if budgets.shape != (batch_size,) or not np.issubdtype(budgets.dtype, np.integer) or \
      (budgets < 1).any() or (budgets > max_new_tokens).any():  # no floats: never truncated
    raise BadArgument(f"budgets_B (per-row budgets) must be [{batch_size}] integers in "
                      f"[1, {max_new_tokens}], got {budgets_B!r}")
  return budgets.astype(np.int32)


def eos_array(eos_id: EosIds, vocab_size: int | None = None) -> np.ndarray:
  """[E] int32 EOS ids from one id, a sequence of ids, or None ([NO_EOS]: nothing stops).

  Each id must be an integer inside the vocabulary (when vocab_size is given). The array's
  length is part of the compiled program's shapes; its values are not.
  """
  if eos_id is None:
    return np.array([NO_EOS], np.int32)
  ids = list(np.asarray(eos_id).reshape(-1)) if isinstance(eos_id, np.ndarray) else (
      [eos_id] if isinstance(eos_id, numbers.Number) else list(eos_id))
  if not ids:
    raise BadArgument("eos_id is an empty sequence; pass None for no EOS")
  top = vocab_size if vocab_size is not None else np.iinfo(np.int32).max
  for i in ids:
    if not is_int(i):
      raise BadArgument(f"eos_id must be an integer or a sequence of integers, got {eos_id!r}")
    if i < 0 or i >= top:
      raise BadArgument(f"eos_id {int(i)} is outside the model's vocabulary [0, {top})")
  return np.array([int(i) for i in ids], np.int32)


def pad_id_value(pad_id, vocab_size: int) -> int:
  """The id written after each row's tokens: an integer inside the vocabulary."""
  return check_int(pad_id, "pad_id", minimum=0, maximum=vocab_size - 1)


def key_and_eos(sampling: SamplingConfig, key, eos_id: EosIds,
                vocab_size: int | None = None) -> tuple[jax.Array, np.ndarray]:
  """The PRNG key (required when sampling; greedy needs none) and the EOS ids (eos_array)."""
  if not isinstance(sampling, SamplingConfig):
    raise BadArgument(f"sampling must be a SamplingConfig, got {type(sampling).__name__}")
  if key is None:
    if not sampling.is_greedy:
      raise BadArgument("sampling with temperature > 0 needs a PRNG key")
    key = _greedy_key()
  check_key(key)
  return key, eos_array(eos_id, vocab_size)


def check_key(key) -> None:
  """One PRNG key: jax.random.key(seed) (a typed scalar) or jax.random.PRNGKey(seed) (its
  raw uint32 data), not a batch of keys, a seed or anything else (which fail inside jit)."""
  dtype, shape = getattr(key, "dtype", None), getattr(key, "shape", None)
  if dtype is not None and jax.dtypes.issubdtype(dtype, jax.dtypes.prng_key):
    if shape != ():
      raise BadArgument(f"key must be one PRNG key, got an array of keys of shape {shape}")
    return
  if dtype != np.uint32 or shape != _raw_key_shape(jax.config.jax_default_prng_impl):
    raise BadArgument(f"key must be a PRNG key (jax.random.key(seed)), got "
                      f"{type(key).__name__}" + (f" {dtype}{list(shape)}" if shape else ""))


@functools.lru_cache(maxsize=None)
def _raw_key_shape(impl: str) -> tuple[int, ...]:
  """A raw key's shape under the default PRNG implementation `impl` ((2,): threefry)."""
  return tuple(jax.random.PRNGKey(0).shape)


@functools.lru_cache(maxsize=1)
def _greedy_key() -> jax.Array:
  # greedy decoding draws nothing; one key made once (a new one costs host time every call)
  return jax.random.key(0)


def token_history(sampling: SamplingConfig, num_generated_B, eos_E,
            counts: TokenCounts | None) -> TokenHistory | None:
  """What process_logits reads at each row's next token; None when nothing is processed."""
  if not sampling.processes_logits:
    return None
  return TokenHistory(num_generated_B, jnp.reshape(eos_E, (-1,)), counts)


def prefill(model: CausalLM, params, tokens_BP, lengths_B, cache_len: int):
  """Runs the prompts through the model -> (last-position logits [B,V], hidden [B,P,D], cache)."""
  logits_BPV, hidden_BPD, cache = prefill_all(model, params, tokens_BP, lengths_B, cache_len)
  return last_position(logits_BPV, lengths_B), hidden_BPD, cache


def prefill_all(model: CausalLM, params, tokens_BP, lengths_B, cache_len: int):
  """prefill with the logits at every prompt position -> (logits [B,P,V], hidden, cache)."""
  batch, width = tokens_BP.shape
  positions_BP = jnp.broadcast_to(jnp.arange(width, dtype=jnp.int32), (batch, width))
  cache = model.init_cache(batch, cache_len)
  logits_BPV, hidden_BPD, cache = model.apply(params, tokens_BP, positions_BP, cache)
  return logits_BPV, hidden_BPD, cache.with_length(lengths_B)


def at_positions(x_BP, positions_BA):
  """x[b, positions[b, a]] for [B, P] or [B, P, ...] arrays -> [B, A] or [B, A, ...]."""
  idx = positions_BA.reshape(positions_BA.shape + (1,) * (x_BP.ndim - 2))
  return jnp.take_along_axis(x_BP, idx, axis=1)


def last_position(x_BP, lengths_B):
  """Each row's entry at its last prompt position, lengths[b] - 1 -> [B] or [B, ...]."""
  return at_positions(x_BP, (lengths_B - 1)[:, None])[:, 0]


def write_tokens(seq_BS, start_B, new_BT, count_B):
  """seq[b, start[b] + j] = new[b, j] for j < count[b]; nothing else changes."""
  j_T = jnp.arange(new_BT.shape[1], dtype=jnp.int32)
  slots_BT = jnp.where(j_T[None, :] < count_B[:, None], start_B[:, None] + j_T[None, :],
                       seq_BS.shape[1])  # out of range -> dropped
  # vmap over rows: a batched scatter, local to each shard when the batch is sharded
  return jax.vmap(lambda s_S, i_T, v_T: s_S.at[i_T].set(v_T, mode="drop"))(seq_BS, slots_BT,
                                                                             new_BT)


def remaining_tokens(done_B, num_generated_B, budget_B) -> jax.Array:
  """[B] int32: the tokens each row may still emit (0 once done)."""
  return jnp.where(done_B, 0, jnp.maximum(budget_B - num_generated_B, 0))


def tokens_to_emit(new_BT, num_new_B, num_generated_B, budget_B, done_B, eos_E):
  """How many of the candidate tokens each row keeps, and whether it is then done.

  A row keeps its candidates up to and including the first EOS (any of eos_E's ids), never
  more than its remaining budget, and nothing once it is done.
  """
  j_T = jnp.arange(new_BT.shape[1], dtype=jnp.int32)
  eos_E = jnp.reshape(eos_E, (-1,))
  is_eos_BT = jnp.any(new_BT[..., None] == eos_E, axis=-1) & (j_T[None, :] < num_new_B[:, None])
  first_eos_B = jnp.where(is_eos_BT.any(axis=1), jnp.argmax(is_eos_BT, axis=1), new_BT.shape[1])
  count_B = jnp.minimum(jnp.minimum(num_new_B, first_eos_B + 1), budget_B - num_generated_B)
  count_B = jnp.where(done_B, 0, jnp.maximum(count_B, 0))
  hit_eos_B = is_eos_BT.any(axis=1) & (first_eos_B < count_B)
  now_done_B = done_B | hit_eos_B | (num_generated_B + count_B >= budget_B)
  return count_B, now_done_B


def finite_prefix(bad_BT) -> jax.Array:
  """[B] int32: the index of each row's first True (non-finite logits: nonfinite_rows), T when
  none. A row keeps only tokens chosen from finite logits and stops at the first others."""
  return jnp.where(bad_BT.any(axis=1), jnp.argmax(bad_BT, axis=1),
                   bad_BT.shape[1]).astype(jnp.int32)


def first_token(key, last_logits_BV, seq_BS, lengths_B, budget_B, eos_E, sampling,
                counts: TokenCounts | None = None):
  """Samples the first generated token after prefill and writes it into the buffer.

  -> (pending, seq, num_generated, done, counts with the token added, failed [B]: the
  logits were not finite, so the row emitted nothing and is done).
  """
  zeros_B = jnp.zeros_like(lengths_B)
  last_logits_BV = process_logits(last_logits_BV, sampling,
                                  token_history(sampling, zeros_B, eos_E, counts))
  pending_B = sample(key, last_logits_BV, sampling)
  failed_B = nonfinite_rows(last_logits_BV)  # such a row emits nothing and stops
  count_B, done_B = tokens_to_emit(pending_B[:, None], jnp.ones_like(lengths_B), zeros_B, budget_B,
                                   failed_B, eos_E)
  seq_BS = write_tokens(seq_BS, lengths_B, pending_B[:, None], count_B)
  counts = None if counts is None else counts.add(pending_B[:, None], count_B)
  return pending_B, seq_BS, count_B, done_B, counts, failed_B


def gather_generated(seq_BS, lengths_B, num_generated_B, max_new_tokens: int, pad_id):
  """The generated part of each row of the buffer: [B, max_new_tokens], pad_id after."""
  j_N = jnp.arange(max_new_tokens, dtype=jnp.int32)
  idx_BN = jnp.minimum(lengths_B[:, None] + j_N[None, :], seq_BS.shape[1] - 1)
  out_BN = jnp.take_along_axis(seq_BS, idx_BN, axis=1)
  return jnp.where(j_N[None, :] < num_generated_B[:, None], out_BN, pad_id)


def initial_buffer(tokens_BP, cache_len: int):
  batch, width = tokens_BP.shape
  return jnp.zeros((batch, cache_len), jnp.int32).at[:, :width].set(tokens_BP)


@struct.dataclass
class _ARState:
  seq_BS: jax.Array
  pending_B: jax.Array
  num_generated_B: jax.Array
  done_B: jax.Array
  cache: KVCache
  key: jax.Array
  step: jax.Array
  failed_B: jax.Array  # [B] bool: stopped at non-finite logits (GenerationOutput.failed)
  counts: TokenCounts | None = None  # only with penalties (SamplingConfig.has_penalties)


def decode_token(model, params, sampling, lengths_B, budget_B, eos_E, key, seq_BS, pending_B,
                 num_generated_B, done_B, cache, counts):
  """One autoregressive token for every row: generate's loop body, shared with gamma="auto"'s
  plain steps. The pending token goes through the model at its position (the cache length)
  and the next one is sampled and written. The cache comes back with its length untouched
  (the caller's bookkeeping). -> (seq_BS, pending_B, num_generated_B, done_B, bad_B, count_B,
  cache, counts, hidden_BD, prob_B); bad_B: rows that stop here at non-finite logits,
  emitting nothing; hidden_BD: the model's hidden state at the pending token, prob_B the
  warped probability of the token drawn (each dead code unless read)."""
  logits_B1V, hidden_B1D, cache = model.apply(params, pending_B[:, None],
                                              cache.length_B[:, None], cache)
  logits_BV = process_logits(logits_B1V[:, 0], sampling,
                             token_history(sampling, num_generated_B, eos_E, counts))
  next_B = sample(key, logits_BV, sampling)
  bad_B = ~done_B & nonfinite_rows(logits_BV)
  stop_B = done_B | bad_B
  count_B, new_done_B = tokens_to_emit(next_B[:, None], jnp.ones_like(next_B), num_generated_B,
                                       budget_B, stop_B, eos_E)
  seq_BS = write_tokens(seq_BS, lengths_B + num_generated_B, next_B[:, None], count_B)
  counts = None if counts is None else counts.add(next_B[:, None], count_B)
  prob_B = jnp.exp(jnp.take_along_axis(warp_logits(logits_BV, sampling), next_B[:, None],
                                       axis=1)[:, 0])
  return (seq_BS, jnp.where(stop_B, pending_B, next_B), num_generated_B + count_B, new_done_B,
          bad_B, count_B, cache, counts, hidden_B1D[:, 0], prob_B)


@functools.partial(jax.jit, static_argnames=("model", "max_new_tokens", "cache_len", "sampling"))
def generate_jit(model, params, tokens_BP, lengths_B, budget_B, eos_E, pad_id, key, *,
                  max_new_tokens: int, cache_len: int, sampling: SamplingConfig):
  seq_BS = initial_buffer(tokens_BP, cache_len)
  last_logits_BV, _, cache = prefill(model, params, tokens_BP, lengths_B, cache_len)
  key, first_key = jax.random.split(key)
  counts = TokenCounts.of_prompts(tokens_BP, lengths_B, model.vocab_size, sampling)
  pending_B, seq_BS, num_generated_B, done_B, counts, failed_B = first_token(
      first_key, last_logits_BV, seq_BS, lengths_B, budget_B, eos_E, sampling, counts)
  state = _ARState(seq_BS, pending_B, num_generated_B, done_B, cache, key, jnp.int32(0),
                   failed_B, counts)

  def cond(s: _ARState):
    return jnp.any(~s.done_B) & (s.step < max_new_tokens)

  def body(s: _ARState):
    key, step_key = jax.random.split(s.key)
    seq_BS, pending_B, num_generated_B, done_B, bad_B, _, cache, counts, _, _ = decode_token(
        model, params, sampling, lengths_B, budget_B, eos_E, step_key, s.seq_BS, s.pending_B,
        s.num_generated_B, s.done_B, s.cache, s.counts)
    # every row fed its pending token; done rows stay where they are
    cache = cache.with_length(cache.length_B + (~s.done_B).astype(jnp.int32))
    return _ARState(seq_BS, pending_B, num_generated_B, done_B, cache, key, s.step + 1,
                    s.failed_B | bad_B, counts)

  state = jax.lax.while_loop(cond, body, state)
  tokens_BN = gather_generated(state.seq_BS, lengths_B, state.num_generated_B, max_new_tokens,
                               pad_id)
  return GenerationOutput(tokens_BN, state.num_generated_B, None, state.seq_BS,
                          failed=state.failed_B), state.cache


def generate(model: CausalLM, params, prompt_tokens_BP, prompt_lengths_B, *, max_new_tokens: int,
             sampling: SamplingConfig = SamplingConfig(), eos_id: EosIds = None,
             key: jax.Array | None = None, budgets_B=None, pad_id: int = 0,
             cache_len: int | None = None, return_cache: bool = False):
  """Autoregressive generation for a padded batch of prompts, in one jitted call.

  Args:
    prompt_tokens_BP: [B, P] int prompts, left-aligned and right-padded (see pad_prompts).
    prompt_lengths_B: [B] the number of real tokens in each row.
    max_new_tokens: static size of the output buffer (and default per-row budget).
    budgets_B: optional [B] per-row budgets <= max_new_tokens.
    sampling: temperature / top-k / top-p, penalties, min_new_tokens (see SamplingConfig).
    eos_id: a row stops after generating this token, or any of these tokens (kept in the
      output); None: rows stop only at their budget.
    key: PRNG key, required when sampling. Each row draws with its own key derived from it
      (fold_in of the row index), so a row's output does not depend on the other rows.
  Returns GenerationOutput (and the final KVCache with `return_cache=True`); its `failed`
  marks rows stopped by non-finite logits (failure_message says which).
  """
  tokens, lengths, cache_len = check_generation_args(
      model, prompt_tokens_BP, prompt_lengths_B, max_new_tokens=max_new_tokens,
      cache_len=cache_len)
  check_params_fit(model, params, what="params")
  budgets = budgets_array(max_new_tokens, budgets_B, tokens.shape[0])
  key, eos = key_and_eos(sampling, key, eos_id, model.vocab_size)
  pad_id = pad_id_value(pad_id, model.vocab_size)
  out, cache = generate_jit(model, params, tokens, lengths, budgets, np.asarray(eos),
                             np.int32(pad_id), key, max_new_tokens=int(max_new_tokens),
                             cache_len=cache_len, sampling=sampling)
  return (out, cache) if return_cache else out
