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
  # keys jit would fail on, deep inside the program: a seed, text, a batch of keys
  for key, says in [(0, "got int"), ("abc", "got str"), (np.array([1, 2]), "int64"),
                    (jax.random.split(jax.random.key(0), 2), "array of keys of shape")]:
    with pytest.raises(ValueError, match=f"key must be .*{says}"):
      generate(model, params, *pad_prompts([[1, 2]]), max_new_tokens=4,
               sampling=SamplingConfig(temperature=1.0), key=key)
  with pytest.raises(ValueError, match="sampling must be a SamplingConfig, got dict"):
    generate(model, params, *pad_prompts([[1, 2]]), max_new_tokens=4,
             sampling={"temperature": 1.0}, key=jax.random.key(0))
  with pytest.raises(ValueError, match="budgets"):
    generate(model, params, *pad_prompts([[1, 2]]), max_new_tokens=4, budgets_B=[9])


# --- issue 16: NaN rows reported, integer arguments, per-row reproducibility ---------------------

import dataclasses  # noqa: E402

import jax.numpy as jnp  # noqa: E402

from conftest import perturbed  # noqa: E402
from spec_jax.core.errors import BadArgument  # noqa: E402
from spec_jax.drafters.draft_model import DraftModelDrafter  # noqa: E402
from spec_jax.drafters.draft_model_tree import DraftModelTreeDrafter  # noqa: E402
from spec_jax.engine import speculate  # noqa: E402
from spec_jax.generate import failure_message  # noqa: E402


@dataclasses.dataclass(frozen=True)
class NaNLogits:
  """A target whose logits are NaN in one row from one position on (its first k generated
  tokens come from finite logits, the rest would not): params poisoned for a single row."""
  model: object
  row: int
  position: int

  def __getattr__(self, name):
    if name == "model":
      raise AttributeError(name)
    return getattr(self.model, name)

  def apply(self, params, tokens_BT, positions_BT, cache, **kw):
    logits_BTV, hidden_BTD, cache = self.model.apply(params, tokens_BT, positions_BT, cache, **kw)
    bad_BT = (jnp.arange(tokens_BT.shape[0])[:, None] == self.row) & (positions_BT >= self.position)
    return jnp.where(bad_BT[..., None], jnp.nan, logits_BTV), hidden_BTD, cache


ISSUE16_PROMPTS = [[1, 2, 3], [4, 5, 6, 7], [8, 9]]


def _runs(target, params, draft, draft_params, prompts, **kw):
  """The same generation autoregressive, by a chain and by a tree."""
  return {"autoregressive": generate(target, params, *prompts, **kw),
          "chain": speculate(target, params, DraftModelDrafter(draft), draft_params, *prompts,
                             gamma=3, **kw),
          "tree": speculate(target, params, DraftModelTreeDrafter(draft, 3, 2, 7), draft_params,
                            *prompts, **kw)}


@pytest.mark.parametrize("sampling,k", [(SamplingConfig(), 5), (SamplingConfig(1.0), 2)])
def test_a_row_with_nan_logits_stops_and_is_reported(sampling, k):  # k = 0: the next test
  model, params = tiny_llama(vocab_size=64, seed=5)
  draft_params = perturbed(params, 0.5, seed=1)
  prompts = pad_prompts(ISSUE16_PROMPTS)
  kw = dict(max_new_tokens=12, sampling=sampling, key=jax.random.key(3))
  clean = _runs(model, params, model, draft_params, prompts, **kw)
  poisoned = NaNLogits(model, row=1, position=len(ISSUE16_PROMPTS[1]) - 1 + k)
  for name, out in _runs(poisoned, params, model, draft_params, prompts, **kw).items():
    ref = clean[name]
    assert np.asarray(out.failed).tolist() == [False, True, False], name
    assert np.asarray(ref.failed).tolist() == [False] * 3, name
    # row 1 keeps the k tokens drawn from finite logits, then pads; never a token 0 stream
    assert np.asarray(out.num_tokens).tolist() == [12, k, 12], name
    assert np.array_equal(out.tokens[1, :k], ref.tokens[1, :k]), name
    assert (np.asarray(out.tokens[1, k:]) == 0).all(), name
    assert np.array_equal(out.tokens[0::2], ref.tokens[0::2]), name  # the other rows unchanged
    assert failure_message(out) == ("generation failed in row 1: the model's logits were not "
                                    "finite (NaN or inf); check the weights")
    assert failure_message(ref) is None


def test_a_nan_weight_fails_every_row_instead_of_emitting_token_0():
  model, params = tiny_llama(vocab_size=64, seed=5)

  def one_nan(path, leaf):
    is_gate = "['layers'][0]['mlp']['w_gate']" in jax.tree_util.keystr(path)
    return leaf.at[0, 0].set(jnp.nan) if is_gate else leaf

  bad = jax.tree_util.tree_map_with_path(one_nan, params)
  for name, out in _runs(model, bad, model, params, pad_prompts(ISSUE16_PROMPTS),
                         max_new_tokens=6).items():
    assert np.asarray(out.failed).all() and not np.asarray(out.num_tokens).any(), name
    assert "rows 0, 1, 2" in failure_message(out)


def test_generate_cli_exits_1_naming_the_failed_rows(monkeypatch, capsys):
  import importlib.util
  from spec_jax import cli
  from spec_jax.testing import REPO
  spec = importlib.util.spec_from_file_location("generate_script", REPO / "scripts" / "generate.py")
  script = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(script)

  class Tokens:  # a tokenizer of the ids themselves
    bos_id, eos_id = None, None
    encode = staticmethod(lambda text, add_bos=False: [int(t) for t in text.split()])
    decode = staticmethod(lambda ids: " ".join(map(str, ids)))

  model, params = tiny_llama(vocab_size=64, seed=5)
  poisoned = NaNLogits(model, row=1, position=3)
  monkeypatch.setattr(script, "load_target_and_tokenizer",
                      lambda args: (poisoned, params, Tokens(), None))
  for draft in ("none", "prompt_lookup"):
    status = cli.run(script.main, ["1 2 3", "4 5 6 7", "--draft", draft, "--max-new-tokens", "4"])
    err = capsys.readouterr().err
    assert status == 1 and err.count("\n") == 1, err
    assert err.startswith("error: generation failed in row 1: "), err


def test_integer_arguments_are_integers():
  model, params = tiny_llama(vocab_size=48)
  prompts = pad_prompts([[1, 2, 3, 4, 5]])
  drafter = DraftModelDrafter(model)
  cases = [
      (dict(prompt_lengths_B=np.array([4.5])), "prompt lengths must be integers"),
      (dict(prompt_lengths_B=np.array([True])), "prompt lengths must be integers"),
      (dict(prompt_tokens_BP=np.array([[1.0, 2.0]]), prompt_lengths_B=[2]), "prompt tokens"),
      (dict(max_new_tokens=4.0), "max_new_tokens must be an integer"),
      (dict(max_new_tokens=True), "max_new_tokens must be an integer"),
      (dict(budgets_B=[2.5]), "budgets_B"),
      (dict(budgets_B=[True]), "budgets_B"),
      (dict(eos_id=2.0), "eos_id"), (dict(eos_id=True), "eos_id"),
      (dict(eos_id=[1, 2.0]), "eos_id"),
      (dict(eos_id=48), "eos_id 48 is outside"), (dict(eos_id=10 ** 12), "eos_id 1000000000000"),
      (dict(eos_id=-1), "eos_id -1"),
      (dict(pad_id=1.5), "pad_id"), (dict(pad_id=False), "pad_id"), (dict(pad_id=48), "pad_id"),
      (dict(pad_id=10 ** 12), "pad_id"), (dict(cache_len=20.5), "cache_len"),
  ]
  for changes, message in cases:
    kw = dict(prompt_tokens_BP=prompts[0], prompt_lengths_B=prompts[1], max_new_tokens=4)
    kw.update(changes)
    tokens, lengths = kw.pop("prompt_tokens_BP"), kw.pop("prompt_lengths_B")
    with pytest.raises(BadArgument, match=message):
      generate(model, params, tokens, lengths, **kw)
    with pytest.raises(BadArgument, match=message):
      speculate(model, params, drafter, params, tokens, lengths, gamma=2, **kw)
  with pytest.raises(BadArgument, match="prompt 1 must be token ids"):
    pad_prompts([[1, 2], [3.5, 4]])
  for gamma in (2.0, True, 0):
    with pytest.raises(BadArgument, match="gamma"):
      speculate(model, params, drafter, params, *prompts, gamma=gamma, max_new_tokens=4)
  assert issubclass(BadArgument, ValueError)


def test_a_sampled_row_does_not_depend_on_the_batch():
  """Row 0 alone equals row 0 of a batch of 8 other prompts: every draw uses the row's key."""
  model, params = tiny_llama(vocab_size=64, seed=6)
  draft_params = perturbed(params, 0.5, seed=2)
  rng = np.random.default_rng(0)
  prompts = [[1, 2, 3, 4]] + [rng.integers(1, 64, rng.integers(2, 7)).tolist() for _ in range(7)]
  kw = dict(max_new_tokens=16, sampling=SamplingConfig(1.0, top_k=20), key=jax.random.key(7))
  alone = _runs(model, params, model, draft_params, pad_prompts(prompts[:1], width=6), **kw)
  batch = _runs(model, params, model, draft_params, pad_prompts(prompts, width=6), **kw)
  for name in alone:
    assert np.array_equal(alone[name].tokens[0], batch[name].tokens[0]), name
    assert int(alone[name].num_tokens[0]) == int(batch[name].num_tokens[0]) == 16
  assert len({np.asarray(batch[n].tokens[0]).tobytes() for n in batch}) > 1  # really sampled


@pytest.mark.parametrize("batch", [1, 3])
def test_the_decode_loop_copies_no_whole_kv_cache(batch):
  # The stacked cache is updated in place; a whole-cache copy inside the loop costs a
  # cache's worth of bytes per layer per step (it happened at batch 1 when the scores read
  # the written layer elementwise). Copies of the zero-initialised cache before the loop
  # (copies of a broadcast) are allowed.
  from spec_jax.bench.cases import ar_case
  from spec_jax.testing import compiled_text, whole_cache_copies
  model, params = tiny_llama(vocab_size=64, dim=128, n_heads=4, n_kv_heads=2, hidden_dim=64)
  tokens, lengths = pad_prompts([[1, 2, 3]] * batch, width=8)
  cache_len = 40
  text = compiled_text(ar_case(model, params, max_new_tokens=16, cache_len=cache_len).lower(
      tokens, lengths))
  assert whole_cache_copies(text, model.init_cache(batch, cache_len)) == []
