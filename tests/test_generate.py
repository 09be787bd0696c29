"""Autoregressive generation: the llama2.c reference, cache == no cache, batching, compiles, errors."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from conftest import REFERENCE_DIR, REFERENCE_STEM, require_shared, tiny_llama
from spec_jax.generate import generate_jit, generate, pad_prompts
from spec_jax.core.sampling import SamplingConfig

LOGITS_ATOL = 1e-4  # the reference C implementation's float32 logits


def test_stories260k_greedy_reproduces_reference_tokens(stories, reference_tokens):
  model, params = stories
  prompt = reference_tokens[:5]  # BOS + "Once upon a time"
  out = generate(model, params, *pad_prompts([prompt]), max_new_tokens=len(reference_tokens) - 5)
  assert np.asarray(out.tokens[0]).tolist() == reference_tokens[5:]


def test_stories260k_logits_match_reference(stories, reference_tokens):
  model, params = stories
  path = require_shared(REFERENCE_DIR / f"{REFERENCE_STEM}.logits.f32")
  ref = np.fromfile(path, dtype="<f4").reshape(200, model.vocab_size)
  tokens = jnp.asarray([reference_tokens[:200]], jnp.int32)
  positions = jnp.arange(200, dtype=jnp.int32)[None]
  logits, _, _ = jax.jit(model.apply)(params, tokens, positions, model.init_cache(1, 200))
  np.testing.assert_allclose(np.asarray(logits[0]), ref, atol=LOGITS_ATOL, rtol=0)


def test_cached_decoding_equals_uncached_forward():
  model, params = tiny_llama(vocab_size=64, qkv_bias=True, tie_embeddings=False)
  tokens = np.random.default_rng(0).integers(0, 64, size=(2, 12)).astype(np.int32)
  positions = np.broadcast_to(np.arange(12, dtype=np.int32), (2, 12))
  full, _, _ = model.apply(params, tokens, positions, model.init_cache(2, 16))
  cache = model.init_cache(2, 16)
  apply = jax.jit(model.apply)
  steps = []
  for t in range(12):  # one token at a time through the cache
    logits, _, cache = apply(params, tokens[:, t:t + 1], positions[:, t:t + 1], cache)
    steps.append(logits[:, 0])
  np.testing.assert_allclose(np.stack(steps, 1), np.asarray(full), atol=1e-5, rtol=1e-5)


def test_generated_tokens_are_the_uncached_argmax():
  model, params = tiny_llama(vocab_size=64, seed=3)
  prompt = [5, 9, 2, 33]
  out = generate(model, params, *pad_prompts([prompt]), max_new_tokens=10)
  seq = np.array([prompt + np.asarray(out.tokens[0]).tolist()], np.int32)
  logits, _, _ = model.apply(params, seq, np.arange(seq.shape[1])[None], model.init_cache(1, 16))
  assert np.argmax(np.asarray(logits[0, 3:-1]), -1).tolist() == seq[0, 4:].tolist()


def test_batch_rows_equal_prompts_alone(stories, story_prompts):
  model, params = stories
  batch = generate(model, params, *pad_prompts(story_prompts), max_new_tokens=24)
  for row, prompt in enumerate(story_prompts):
    alone = generate(model, params, *pad_prompts([prompt]), max_new_tokens=24)
    assert np.asarray(batch.tokens[row]).tolist() == np.asarray(alone.tokens[0]).tolist()


def test_new_prompt_of_same_padded_shape_does_not_recompile():
  model, params = tiny_llama(vocab_size=48, seed=1)
  generate(model, params, *pad_prompts([[1, 2, 3], [4, 5]], width=8), max_new_tokens=6)
  compiled = generate_jit._cache_size()
  out = generate(model, params, *pad_prompts([[7, 8], [9, 10, 11, 12, 13]], width=8),
                 max_new_tokens=6, eos_id=3)
  assert generate_jit._cache_size() == compiled
  assert out.tokens.shape == (2, 6)


def test_eos_and_per_row_budgets():
  model, params = tiny_llama(vocab_size=48, seed=2)
  prompts = pad_prompts([[1, 2, 3], [4, 5, 6, 7]])
  free = generate(model, params, *prompts, max_new_tokens=12)
  eos = int(free.tokens[0, 4])  # a token row 0 produces; it must stop there
  first_eos = np.asarray(free.tokens[0]).tolist().index(eos)
  out = generate(model, params, *prompts, max_new_tokens=12, eos_id=eos, budgets_B=[12, 5])
  assert int(out.num_tokens[0]) == first_eos + 1
  assert np.asarray(out.tokens[0, :first_eos + 1]).tolist() == np.asarray(free.tokens[0, :first_eos + 1]).tolist()
  assert np.all(np.asarray(out.tokens[0, first_eos + 1:]) == 0)  # pad after the end
  row1 = np.asarray(free.tokens[1]).tolist()
  expected1 = min(5, row1.index(eos) + 1 if eos in row1[:5] else 5)
  assert int(out.num_tokens[1]) == expected1


def test_sampling_is_reproducible_and_key_dependent():
  model, params = tiny_llama(vocab_size=48, seed=4)
  prompts = pad_prompts([[1, 2, 3]] * 4)
  cfg = SamplingConfig(temperature=1.0)
  a = generate(model, params, *prompts, max_new_tokens=8, sampling=cfg, key=jax.random.key(1))
  b = generate(model, params, *prompts, max_new_tokens=8, sampling=cfg, key=jax.random.key(1))
  c = generate(model, params, *prompts, max_new_tokens=8, sampling=cfg, key=jax.random.key(2))
  assert np.array_equal(a.tokens, b.tokens)
  assert not np.array_equal(a.tokens, c.tokens)


def test_bad_input_raises_before_compute():
  model, params = tiny_llama(vocab_size=48, max_seq_len=32)
  with pytest.raises(ValueError, match="longer than the model's context of 32"):
    generate(model, params, *pad_prompts([[1] * 30]), max_new_tokens=8)
  with pytest.raises(ValueError, match="cache of 12 slots is too small"):
    generate(model, params, *pad_prompts([[1] * 8]), max_new_tokens=8, cache_len=12)
  with pytest.raises(ValueError, match="token id 48 .* outside the model's vocabulary"):
    generate(model, params, *pad_prompts([[1, 48]]), max_new_tokens=4)
  with pytest.raises(ValueError, match="token id -1"):
    generate(model, params, *pad_prompts([[1, -1]]), max_new_tokens=4)
  with pytest.raises(ValueError, match="max_new_tokens must be >= 1"):
    generate(model, params, *pad_prompts([[1, 2]]), max_new_tokens=0)
  with pytest.raises(ValueError, match="prompt lengths must be in"):
    generate(model, params, np.zeros((1, 4), np.int32), np.array([5]), max_new_tokens=4)
  with pytest.raises(ValueError, match=r"must be \[batch, width\]"):
    generate(model, params, np.zeros((4,), np.int32), np.array([4]), max_new_tokens=4)
  with pytest.raises(ValueError, match="needs a PRNG key"):
    generate(model, params, *pad_prompts([[1, 2]]), max_new_tokens=4,
             sampling=SamplingConfig(temperature=1.0))
  with pytest.raises(ValueError, match="budgets"):
    generate(model, params, *pad_prompts([[1, 2]]), max_new_tokens=4, budgets_B=[9])
