"""Streaming: run the speculative loop in chunks of rounds and yield text as it grows.

The chunks are the same rounds with the same keys as one uninterrupted call, so the final
tokens are identical to `speculative_generate`'s; only the host sees partial results.
"""

from __future__ import annotations

import functools
from typing import Iterator

import jax
import numpy as np

from spec_jax import adaptive
from spec_jax.core.errors import check_int
from spec_jax.core.sampling import SamplingConfig
from spec_jax.engine import measured_program
from spec_jax.speculative import SpeculativeProgram


@functools.partial(jax.jit, static_argnames=("program",))
def _init(program: SpeculativeProgram, params, draft_params, tokens, lengths, budgets, eos, key,
          costs):
  return program.init(params, draft_params, tokens, lengths, budgets, eos, key, costs)


@functools.partial(jax.jit, static_argnames=("program",), donate_argnames=("state",))
def _run(program: SpeculativeProgram, params, draft_params, lengths, budgets, eos, state,
         round_limit):
  return program.run(params, draft_params, lengths, budgets, eos, state, round_limit)


@functools.partial(jax.jit, static_argnames=("program",))
def _finish(program: SpeculativeProgram, state, lengths, pad_id):
  return program.finish(state, lengths, pad_id)


def speculative_chunks(target, params, drafter, draft_params, prompt_tokens_BP, prompt_lengths_B,
                       *, gamma: int | str | None = None, max_new_tokens: int,
                       rounds_per_chunk: int = 4, sampling=None, eos_id=None, key=None,
                       budgets_B=None, pad_id: int = 0, cache_len=None, verifier=None) -> Iterator:
  """Yields a GenerationOutput after every `rounds_per_chunk` rounds; the last is final.

  Chains and trees alike, with `spec_jax.speculate`'s arguments: the params are checked and
  gamma="auto" measures its cost table as `speculate` does (engine.measured_program). Under
  gamma="auto" a plain step counts as a round, and no plain stretch runs past a chunk
  (AdaptiveConfig.max_stretch): a run that stops drafting streams as plain decoding does,
  where one stretch to the end used to arrive as a single chunk. Greedy output equals
  `speculate`'s; with gamma="auto" a sampled one follows the same distribution, but its
  draws differ (the cap changes where stretches end, and so the keys).
  """
  check_int(rounds_per_chunk, "rounds_per_chunk", minimum=1)
  program, args = measured_program(target, params, drafter, draft_params, prompt_tokens_BP,
                                   prompt_lengths_B, gamma=gamma, max_new_tokens=max_new_tokens,
                                   sampling=sampling or SamplingConfig(), eos_id=eos_id, key=key,
                                   budgets_B=budgets_B, pad_id=pad_id, cache_len=cache_len,
                                   verifier=verifier)
  # the table timed in speculate's executable (this one caps its stretches): the best known
  costs = adaptive.run_costs(program, args[0].shape)
  program = adaptive.with_max_stretch(program, rounds_per_chunk)
  tokens, lengths, budgets, eos, pad, key = args
  state = _init(program, params, draft_params, tokens, lengths, budgets, eos, key, costs)
  rounds = 0  # run so far, as the state counts them (a stretch of plain steps counts several)
  while True:
    state = _run(program, params, draft_params, lengths, budgets, eos, state,
                 rounds + rounds_per_chunk)
    rounds = int(state.metrics.rounds)
    out = _finish(program, state, lengths, pad)
    yield out
    if bool(np.asarray(state.done_B).all()) or rounds >= max_new_tokens:
      return


def stream_text(chunks: Iterator, tokenizer, prompts: list[list[int]]) -> Iterator[str]:
  """Turns successive outputs of row 0 into the newly decoded text of each chunk."""
  shown = tokenizer.decode(list(prompts[0]))
  yield shown
  for out in chunks:
    n = int(out.num_tokens[0])
    text = tokenizer.decode(list(prompts[0]) + np.asarray(out.tokens[0, :n]).tolist())
    # a multi-byte character split across chunks decodes to U+FFFD until complete
    stable = text.rstrip("\ufffd")
    if stable.startswith(shown) and len(stable) > len(shown):
      yield stable[len(shown):]
      shown = stable
