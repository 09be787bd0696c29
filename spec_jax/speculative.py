"""Speculative generation: prefill, then a `lax.while_loop` over rounds, inside one `jax.jit`.

Each round, with fixed shapes whatever each row accepts:
  1. draft:  the drafter proposes gamma tokens per row;
  2. verify: one target pass over [pending, d_1..d_gamma] at positions L..L+gamma (a
     one-token step instead when the drafter proposed nothing in any row: empty_rows);
  3. accept: the verifier returns num_accepted [B] and the next token [B];
  4. commit: write the kept tokens into the buffer at each row's offset (stopping at EOS
     and at the row's budget), move the target cache length to L + accepted + 1 (the rest
     is stale and masked), let the drafter roll back, update metrics.
Rows that are done keep their shape and write nothing.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from spec_jax.drafters.base import (DraftContext, Drafter, PromptInfo, RoundOutcome,
                                    target_with_features)
from spec_jax.core.control import cond_in_place, zeros_like_outputs
from spec_jax.core.interface import CausalLM
from spec_jax.generate import (EosIds, GenerationOutput, budgets_array, check_generation_args,
                               first_token, gather_generated, finite_prefix, initial_buffer,
                               key_and_eos, last_position, pad_id_value, prefill_all,
                               remaining_tokens, token_history, tokens_to_emit, write_tokens)
from spec_jax.core.errors import BadArgument, is_int
from spec_jax.core.kv_cache import KVCache
from spec_jax.core.pytree_names import check_params_fit, params_signature
from spec_jax.metrics import SpecMetrics
from spec_jax.core.sampling import (SamplingConfig, TokenCounts, nonfinite_rows, process_logits,
                                    sample, split_unless_greedy)
from spec_jax.verify import verify


@struct.dataclass
class SpecState:
  """The while_loop's carry between rounds; every array has the batch first."""
  # [B, S] int32: each row's prompt (left-aligned), then its generated tokens; the rest 0
  seq_BS: jax.Array
  # [B] int32: the newest generated token, in seq_BS but not yet fed to the target (the
  # next round's block starts with it)
  pending_B: jax.Array
  # [B] int32: tokens generated so far, pending included (seq_BS holds them after the prompt)
  num_generated_B: jax.Array
  # [B] bool: the row met an EOS or its budget; it keeps its shape and writes nothing more
  done_B: jax.Array
  # the target's KV cache; its length_B is the pending token's position (prompt +
  # generated - 1 entries are valid)
  cache: KVCache
  # the drafter's own pytree (see Drafter.init / propose / commit)
  draft_state: object
  # the PRNG key, split every round
  key: jax.Array
  # acceptance statistics per row and round (see spec_jax.metrics)
  metrics: SpecMetrics
  # [B] bool: the row stopped at target logits that were not finite (GenerationOutput.failed)
  failed_B: jax.Array
  # token counts the penalties read (SamplingConfig.has_penalties); None without penalties
  counts: TokenCounts | None = None
  # [B, S] float32: the target's warped probability of each token a plain step drew, at its
  # position in seq_BS (drafter.SampledHindsight); only where a sampled gamma="auto" run
  # learns in hindsight, else None
  followed_prob_BS: jax.Array | None = None


def candidates(draft_tokens_BG, num_accepted_B, next_B):
  """[B, gamma+1]: the accepted drafts, then the next token, then zeros."""
  batch, gamma = draft_tokens_BG.shape
  j_G1 = jnp.arange(gamma + 1, dtype=jnp.int32)[None, :]
  drafts_BG1 = jnp.concatenate([draft_tokens_BG, jnp.zeros((batch, 1), jnp.int32)], axis=1)
  n_B1 = num_accepted_B[:, None]
  return jnp.where(j_G1 < n_B1, drafts_BG1, jnp.where(j_G1 == n_B1, next_B[:, None], 0))


def round_inputs(s: SpecState, sampling: SamplingConfig, eos_id, verifier=None):
  """What every round (chain, tree, adaptive) starts from: -> (its DraftContext, the next
  round's key, the draft key, the verify key). A greedy round passes its key on unsplit
  (core.sampling.split_unless_greedy), unless the verifier draws even then
  (`draws_when_greedy`: the benchmarks' CoinVerifier)."""
  key, draft_key, verify_key = split_unless_greedy(
      s.key, 3, sampling, draws_when_greedy=getattr(verifier, "draws_when_greedy", False))
  history = token_history(sampling, s.num_generated_B, eos_id, s.counts)
  return DraftContext(s.seq_BS, s.cache.length_B, s.pending_B, history), key, draft_key, verify_key


def speculative_round(target: CausalLM, drafter: Drafter, gamma: int, sampling: SamplingConfig,
                      verifier, params, draft_params, lengths_B, budget_B, eos_id,
                      s: SpecState) -> SpecState:
  ctx, key, draft_key, verify_key = round_inputs(s, sampling, eos_id, verifier)
  length_B, history = ctx.position_B, ctx.history
  draft_tokens_BG, draft_probs_BGV, draft_state = drafter.propose(
      draft_params, s.draft_state, ctx, gamma, sampling, draft_key)

  block_BG1 = jnp.concatenate([s.pending_B[:, None], draft_tokens_BG], axis=1)
  positions_BG1 = length_B[:, None] + jnp.arange(gamma + 1, dtype=jnp.int32)[None, :]

  def verify_drafts(cache):
    logits_BG1V, hidden_BG1D, cache = target.apply(params, block_BG1, positions_BG1, cache)
    # position i is the distribution of d_{i+1}: processed after prompt + generated + d_1..d_i
    logits_BG1V = process_logits(logits_BG1V, sampling,
                                 None if history is None else history.along_chain(block_BG1))
    num_accepted_B, next_B = verifier(draft_tokens_BG, draft_probs_BGV, logits_BG1V, sampling,
                                      verify_key)
    return (num_accepted_B, next_B, hidden_BG1D, cache,
            finite_prefix(nonfinite_rows(logits_BG1V)))

  def one_step(cache):  # nothing drafted anywhere: an autoregressive step, no rejection
    logits_B1V, hidden_B1D, cache = target.apply(params, block_BG1[:, :1],
                                                 positions_BG1[:, :1], cache)
    logits_BV = process_logits(logits_B1V[:, 0], sampling, history)
    next_B = sample(verify_key, logits_BV, sampling)
    hidden_BG1D = jnp.pad(hidden_B1D, ((0, 0), (0, gamma), (0, 0)))  # past row 0: never read
    return (jnp.zeros_like(next_B), next_B, hidden_BG1D, cache,
            finite_prefix(nonfinite_rows(logits_BV)[:, None]))

  empty_B = drafter.empty_rows(draft_state)
  if empty_B is None:
    num_accepted_B, next_B, hidden_BG1D, cache, num_finite_B = verify_drafts(s.cache)
  else:
    # in place (spec_jax.core.control): a lax.cond here copied the target cache twice a round
    placeholders = zeros_like_outputs(verify_drafts, s.cache)
    outputs = placeholders[:3] + (s.cache,) + placeholders[4:]
    num_accepted_B, next_B, hidden_BG1D, cache, num_finite_B = cond_in_place(
        jnp.all(empty_B), lambda o: one_step(o[3]), lambda o: verify_drafts(o[3]), outputs)
  return commit_round(drafter=drafter, draft_params=draft_params, lengths_B=lengths_B,
                      budget_B=budget_B, eos_id=eos_id, state=s, key=key, ctx=ctx, cache=cache,
                      draft_state=draft_state, draft_tokens_BG=draft_tokens_BG,
                      num_accepted_B=num_accepted_B, next_B=next_B, hidden_BG1D=hidden_BG1D,
                      num_finite_B=num_finite_B)


def commit_round(*, drafter: Drafter, draft_params, lengths_B, budget_B, eos_id, state: SpecState,
                 key, ctx: DraftContext, cache: KVCache, draft_state, draft_tokens_BG,
                 num_accepted_B, next_B, hidden_BG1D, num_finite_B=None, verified_B=None,
                 **outcome_fields) -> SpecState:
  """Step 4 of a round, shared by chain and tree rounds (which pass their accepted path).

  `state` is the state the round started from, `key` the key the next round starts with, `ctx`
  the round's DraftContext, `draft_state` what propose returned; eos_id is the [E] EOS ids.
  `cache` holds [pending, accepted drafts] at slots L..L+num_accepted; draft_tokens_BG are
  the drafts in order (entries past num_accepted are never kept). `outcome_fields` go to
  RoundOutcome (a tree round's tree_path_BR1). `num_finite_B` [B] (None: all): how many of
  the positions along the row's drafts (pending first) have finite target logits.
  `verified_B` [B] (None: every draft): the drafts each row verified, for the metrics.
  """
  length_B = ctx.position_B
  new_BG1 = candidates(draft_tokens_BG, num_accepted_B, next_B)
  num_new_B, bad_B = num_accepted_B + 1, jnp.zeros_like(state.done_B)
  if num_finite_B is not None:
    # candidate k was chosen from position k's logits: a row keeps those chosen from finite
    # logits, then stops, failed (GenerationOutput.failed), never emitting a NaN's token
    bad_B = (num_finite_B <= num_accepted_B) & ~state.done_B
    num_new_B = jnp.minimum(num_new_B, num_finite_B)
  count_B, done_B = tokens_to_emit(new_BG1, num_new_B, state.num_generated_B, budget_B,
                                   state.done_B, eos_id)
  done_B = done_B | bad_B
  seq_BS = write_tokens(state.seq_BS, lengths_B + state.num_generated_B, new_BG1, count_B)
  # The target now holds pending + drafts up to the last kept one (a row cut short by its
  # budget or an EOS keeps only what it emitted); the next token is the new pending one.
  kept_in_cache_B = jnp.where(count_B > 0, jnp.minimum(count_B, num_accepted_B) + 1, 0)
  new_length_B = length_B + kept_in_cache_B
  cache = cache.with_length(new_length_B)
  outcome = RoundOutcome(ctx, draft_tokens_BG, num_accepted_B, next_B, new_length_B, hidden_BG1D,
                         **outcome_fields)
  draft_state = drafter.commit(draft_params, draft_state, outcome)
  last_kept_B = jnp.take_along_axis(new_BG1, jnp.maximum(count_B - 1, 0)[:, None], axis=1)[:, 0]
  pending_B = jnp.where(count_B > 0, last_kept_B, state.pending_B)
  metrics = state.metrics.update(~state.done_B, num_accepted_B, count_B, verified_B)
  counts = None if state.counts is None else state.counts.add(new_BG1, count_B)
  return SpecState(seq_BS, pending_B, state.num_generated_B + count_B, done_B, cache, draft_state,
                   key, metrics, state.failed_B | bad_B, counts, state.followed_prob_BS)


@dataclasses.dataclass(frozen=True)
class SpeculativeProgram:
  """Everything static about one speculative generation; hashable, so a jit static argument.

  `init` (prefill) and `run` (rounds up to a limit) are separate so that streaming can run
  the loop in chunks of rounds; `speculative_jit` runs init, run and finish in one jit.
  """
  target: CausalLM
  drafter: Drafter
  gamma: int
  max_new_tokens: int
  cache_len: int
  sampling: SamplingConfig
  verifier: object = verify
  # one round, with speculative_round's signature (the tree round: gamma = max tree depth)
  round_fn: object = speculative_round

  def __hash__(self):
    """The fields' hash, computed once: jit hashes its static program on every call, a dozen
    nested dataclass hashes each time (~50 us right after a run on this 2-core CPU)."""
    cached = self.__dict__.get("_hash")
    if cached is None:
      cached = hash(tuple(getattr(self, f.name) for f in dataclasses.fields(self)))
      object.__setattr__(self, "_hash", cached)
    return cached

  def __getstate__(self):  # a pickled program recomputes its hash (str hashes are per process)
    return {k: v for k, v in self.__dict__.items() if k != "_hash"}

  def init(self, params, draft_params, tokens_BP, lengths_B, budget_B, eos_id, key,
           costs=None) -> SpecState:
    """Prefill and the first token. costs: gamma="auto"'s cost table as an argument
    (adaptive.CostTable of arrays; None: the program's own, static); other programs take
    none."""
    seq_BS = initial_buffer(tokens_BP, self.cache_len)
    logits_BPV, hidden_BPD, cache = prefill_all(self.target, params, tokens_BP, lengths_B,
                                                self.cache_len)
    last_logits_BV = last_position(logits_BPV, lengths_B)
    key, first_key = jax.random.split(key)
    counts = TokenCounts.of_prompts(tokens_BP, lengths_B, self.target.vocab_size, self.sampling)
    pending_B, seq_BS, num_generated_B, done_B, counts, failed_B = first_token(
        first_key, last_logits_BV, seq_BS, lengths_B, budget_B, eos_id, self.sampling, counts)
    metrics = SpecMetrics.zeros(tokens_BP.shape[0], self.gamma).replace(tokens_B=num_generated_B)
    draft_state, metrics = self.init_drafter(
        draft_params, PromptInfo(tokens_BP, lengths_B, self.cache_len, hidden_BPD), metrics,
        remaining_tokens_B=remaining_tokens(done_B, num_generated_B, budget_B),
        target_logits_BPV=logits_BPV, **({} if costs is None else {"costs": costs}))
    return SpecState(seq_BS, pending_B, num_generated_B, done_B, cache, draft_state, key, metrics,
                     failed_B, counts, self.followed_probs(seq_BS))

  def followed_probs(self, seq_BS):
    """SpecState.followed_prob_BS's initial value: None (only sampled adaptive programs that
    learn in hindsight record the target's probabilities)."""
    del seq_BS
    return None

  def init_drafter(self, draft_params, prompt: PromptInfo, metrics: SpecMetrics, *,
                   remaining_tokens_B, target_logits_BPV):
    """-> (the drafter's state after the prefill, the initial metrics). Adaptive programs
    skip the drafter's prefill where no round will draft, and may learn from the prompt
    (target_logits_BPV: the target's logits at every prompt position)."""
    del remaining_tokens_B, target_logits_BPV
    return self.drafter.init(draft_params, prompt), metrics

  def run(self, params, draft_params, lengths_B, budget_B, eos_id, state: SpecState,
          round_limit) -> SpecState:
    """Runs rounds until every row is done or `round_limit` rounds have run in all."""
    round_fn = functools.partial(self.loop_round(lengths_B.shape[0]), self.target,
                                 self.drafter, self.gamma, self.sampling, self.verifier, params,
                                 draft_params, lengths_B, budget_B, eos_id)
    # every round emits at least one token per active row: max_new_tokens rounds suffice
    limit = jnp.minimum(round_limit, self.max_new_tokens)
    return jax.lax.while_loop(lambda s: jnp.any(~s.done_B) & (s.metrics.rounds < limit),
                              round_fn, state)

  def loop_round(self, batch: int):
    """The round function the loop runs at this batch size (static): round_fn."""
    del batch
    return self.round_fn

  def finish(self, state: SpecState, lengths_B, pad_id) -> GenerationOutput:
    tokens_BN = gather_generated(state.seq_BS, lengths_B, state.num_generated_B,
                                 self.max_new_tokens, pad_id)
    return GenerationOutput(tokens_BN, state.num_generated_B, state.metrics, state.seq_BS,
                            failed=state.failed_B)


class _TargetParams:
  """The draft params "the target's own" (TARGET_PARAMS): an empty pytree."""
  __slots__ = ()

  def __repr__(self):
    return "TARGET_PARAMS"


# speculative_jit's draft_params for a drafter that runs on the target's own params (a layer
# skip): the call then passes, flattens and hands XLA the target's tensors once, not twice
# (each params tree is ~50 Python callbacks and ~50 buffers a call: ~0.1-0.2 ms of a ~10 ms
# stories260K generation)
TARGET_PARAMS = _TargetParams()
jax.tree_util.register_pytree_node(_TargetParams, lambda _: ((), None),
                                   lambda _aux, _children: TARGET_PARAMS)


def passed_draft_params(params, draft_params):
  """What a call passes as draft_params: TARGET_PARAMS where they are the target's own."""
  return TARGET_PARAMS if draft_params is params else draft_params


@functools.partial(jax.jit, static_argnames=("program", "keep_state"))
def speculative_jit(program: SpeculativeProgram, params, draft_params, tokens_BP, lengths_B,
                     budget_B, eos_id, pad_id, key, costs=None, *, keep_state: bool = True):
  """-> (GenerationOutput, final target cache, final drafter state); keep_state=False: the
  two states are None (not outputs at all: each output array costs host time to hand back,
  and a drafter's state holds many). draft_params may be TARGET_PARAMS: the target's own.
  costs: gamma="auto"'s cost table as an argument (SpeculativeProgram.init)."""
  if isinstance(draft_params, _TargetParams):
    draft_params = params
  state = program.init(params, draft_params, tokens_BP, lengths_B, budget_B, eos_id, key,
                       costs)
  state = program.run(params, draft_params, lengths_B, budget_B, eos_id, state,
                      program.max_new_tokens)
  out = program.finish(state, lengths_B, pad_id)
  return (out, state.cache, state.draft_state) if keep_state else (out, None, None)


def prepare(target: CausalLM, drafter: Drafter, prompt_tokens_BP, prompt_lengths_B, *,
            gamma: int, max_new_tokens: int, sampling: SamplingConfig, eos_id, key, budgets_B,
            pad_id: int, cache_len: int | None, verifier) -> tuple[SpeculativeProgram, tuple]:
  """Validates everything on the host -> (program, its array arguments after the params)."""
  if not is_int(gamma) or gamma < 1:  # 4.0 and True are not draft lengths
    raise BadArgument(f"gamma (draft length) must be an integer >= 1, got {gamma!r}")
  gamma = int(gamma)
  if gamma >= target.max_seq_len:  # (its verification block alone would not fit)
    raise BadArgument(f"gamma (draft length; AdaptiveConfig.gamma_max with 'auto') {gamma} "
                      f"is not below the model's context of {target.max_seq_len} positions")
  drafter.check(target, gamma)
  args, cache_len = call_args(target, drafter, gamma, prompt_tokens_BP, prompt_lengths_B,
                              max_new_tokens=max_new_tokens, sampling=sampling, eos_id=eos_id,
                              key=key, budgets_B=budgets_B, pad_id=pad_id, cache_len=cache_len)
  # a drafter that reads several target layers gets them with every target hidden state
  program = SpeculativeProgram(target_with_features(target, drafter), drafter, gamma,
                               int(max_new_tokens), cache_len, sampling, verifier)
  return program, args


def call_args(target: CausalLM, drafter: Drafter, gamma: int, prompt_tokens_BP,
              prompt_lengths_B, *, max_new_tokens: int, sampling: SamplingConfig, eos_id, key,
              budgets_B, pad_id: int, cache_len: int | None) -> tuple[tuple, int]:
  """One call's array arguments after the params, validated on the host -> (args,
  cache_len): what `prepare` checks for every call, the program aside."""
  tokens, lengths, cache_len = check_generation_args(
      target, prompt_tokens_BP, prompt_lengths_B, max_new_tokens=max_new_tokens,
      extra_slots=drafter.extra_slots(gamma), cache_len=cache_len)
  # (positions, not cache_len: a caller's larger cache holds slots the run never reaches)
  drafter.check_context(tokens.shape[1] + int(max_new_tokens))
  budgets = budgets_array(max_new_tokens, budgets_B, tokens.shape[0])
  key, eos = key_and_eos(sampling, key, eos_id, target.vocab_size)
  pad_id = pad_id_value(pad_id, target.vocab_size)
  # numpy, not jnp: an eager device op costs ~50 us of host time per call
  return (tokens, lengths, budgets, np.asarray(eos), np.int32(pad_id), key), cache_len


def check_all_params(target, params, drafter, draft_params) -> tuple[tuple, tuple]:
  """Host-side: the target's and the drafter's params fit their models (BadArgument naming
  the tensor otherwise), so params of another model never reach the tracer.
  -> their params_signature's (a drafter on the target's own params: flattened once)."""
  signature = check_params_fit(target, params, what="target params")
  draft_signature = signature if draft_params is params else params_signature(draft_params)
  drafter.check_params(draft_params, signature=draft_signature)
  return signature, draft_signature


def speculative_generate(target: CausalLM, params, drafter: Drafter, draft_params,
                         prompt_tokens_BP, prompt_lengths_B, *, gamma: int, max_new_tokens: int,
                         sampling: SamplingConfig = SamplingConfig(), eos_id: EosIds = None,
                         key: jax.Array | None = None, budgets_B=None, pad_id: int = 0,
                         cache_len: int | None = None, return_state: bool = False,
                         verifier=verify):
  """Speculative generation; same arguments and output as `generate`, plus the drafter.

  The output's `metrics` is a SpecMetrics (see spec_jax.metrics.summarize). With
  `return_state=True` also returns the final target cache and drafter state. `verifier`
  (static; default `spec_jax.verify.verify`) may be swapped for research on acceptance rules.
  gamma="auto" (or an AdaptiveConfig): adaptive speculation, as engine.speculate.
  """
  if not isinstance(gamma, int):  # "auto" / AdaptiveConfig: the engine measures the costs
    from spec_jax.engine import speculate
    return speculate(target, params, drafter, draft_params, prompt_tokens_BP, prompt_lengths_B,
                     gamma=gamma, max_new_tokens=max_new_tokens, sampling=sampling, eos_id=eos_id,
                     key=key, budgets_B=budgets_B, pad_id=pad_id, cache_len=cache_len,
                     return_state=return_state, verifier=verifier)
  check_all_params(target, params, drafter, draft_params)
  program, args = prepare(target, drafter, prompt_tokens_BP, prompt_lengths_B, gamma=gamma,
                          max_new_tokens=max_new_tokens, sampling=sampling, eos_id=eos_id,
                          key=key, budgets_B=budgets_B, pad_id=pad_id, cache_len=cache_len,
                          verifier=verifier)
  out, cache, draft_state = speculative_jit(program, params,
                                            passed_draft_params(params, draft_params), *args,
                                            keep_state=return_state)
  return (out, cache, draft_state) if return_state else out
