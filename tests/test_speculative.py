"""Speculative generation: lossless (greedy identity, distribution identity), caches, compiles."""

from __future__ import annotations

import dataclasses
import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from scipy import stats

from conftest import STORIES_DIR, perturbed, require_shared, tiny_llama
from spec_jax.drafters.draft_model import DraftModelDrafter
from spec_jax.drafters.draft_model_tree import DraftModelTreeDrafter
from spec_jax.drafters.layer_skip import LayerSkipDrafter
from spec_jax.drafters.prompt_lookup import PromptLookupDrafter
from spec_jax.engine import lower, speculate
from spec_jax.generate import generate, pad_prompts
from spec_jax.metrics import summarize
from spec_jax.core.sampling import SamplingConfig, sample_from_probs, warped_probs
from spec_jax.speculative import speculative_jit, prepare, speculative_generate
from spec_jax.streaming import speculative_chunks
from spec_jax.verify import verify

SIGNIFICANCE = 1e-3  # fixed before running: a correct sampler fails 1 run in 1000
# K/V entries computed in blocks of other shapes than a fresh prefill's round differently:
# float32 round-off, relative to entries of magnitude up to ~10.
CACHE_TOL = dict(rtol=1e-5, atol=1e-5)
NEW = 40


def assert_cache_prefix_close(cache, fresh, row: int, length: int, msg: str, layers=None):
  """cache's first `length` slots of `row` (in its first `layers` layers) equal fresh's,
  within CACHE_TOL, for K and V (both [L,B,K,H,S])."""
  ls = slice(layers)
  np.testing.assert_allclose(cache.k_LBKES[ls, row, ..., :length],
                             fresh.k_LBKES[ls, row, ..., :length], err_msg=msg, **CACHE_TOL)
  np.testing.assert_allclose(cache.v_LBKES[ls, row, ..., :length],
                             fresh.v_LBKES[ls, row, ..., :length], err_msg=msg, **CACHE_TOL)


@pytest.fixture(scope="module")
def story_reference(stories, story_prompts):
  model, params = stories
  prompts = pad_prompts(story_prompts, width=12)
  return prompts, generate(model, params, *prompts, max_new_tokens=NEW, eos_id=1)


def _draft(kind, stories):
  model, params = stories
  if kind == "self":  # every round accepts all gamma drafts
    return model, params
  if kind == "noisy":  # the target with noise: ragged acceptance within the batch
    return model, perturbed(params, 0.15, seed=1)
  return tiny_llama(vocab_size=model.vocab_size, dim=16, n_layers=1, n_heads=2, n_kv_heads=1,
                    hidden_dim=32, max_seq_len=512, seed=5)  # random: accepts almost nothing


@pytest.mark.parametrize("kind", ["self", "noisy", "random"])
@pytest.mark.parametrize("gamma", [1, 3, 8])  # 8: past most rows' acceptance, near the budget
def test_greedy_identity_stories260k(stories, story_reference, kind, gamma):
  model, params = stories
  prompts, reference = story_reference
  draft_model, draft_params = _draft(kind, stories)
  out = speculative_generate(model, params, DraftModelDrafter(draft_model), draft_params,
                             *prompts, gamma=gamma, max_new_tokens=NEW, eos_id=1)
  assert np.array_equal(out.tokens, reference.tokens)
  assert np.array_equal(out.num_tokens, reference.num_tokens)
  m = summarize(out.metrics)
  assert m["tokens_per_row"] == np.asarray(reference.num_tokens).tolist()
  if kind == "self":
    assert m["accept_hist"][:-1] == [0] * gamma  # all rounds accept everything
  elif kind == "random":
    assert m["acceptance_rate"] < 0.1
  else:
    assert 0.05 < m["acceptance_rate"] < 0.98


def test_per_row_budgets_and_eos_inside_accepted_block(stories, story_prompts):
  model, params = stories
  prompts = pad_prompts(story_prompts, width=12)
  budgets = [3, 17, 40, 1, 29]
  free = generate(model, params, *prompts, max_new_tokens=40)
  eos = int(free.tokens[2, 5])  # row 2 meets this EOS mid-way
  ar = generate(model, params, *prompts, max_new_tokens=40, budgets_B=budgets, eos_id=eos)
  sp = speculative_generate(model, params, DraftModelDrafter(model), params, *prompts, gamma=6,
                            max_new_tokens=40, budgets_B=budgets, eos_id=eos)
  assert np.array_equal(sp.tokens, ar.tokens) and np.array_equal(sp.num_tokens, ar.num_tokens)
  n = np.asarray(sp.num_tokens)
  assert (n <= budgets).all()
  ended_by_eos = [int(sp.tokens[r, n[r] - 1]) == eos for r in range(len(budgets))]
  assert any(ended_by_eos) and not all(ended_by_eos)  # both ways of stopping occur


def test_blocks_past_the_cache_end_are_dropped_and_change_nothing(stories, story_prompts):
  """A chain's cache has exactly prompt width + max_new_tokens slots: a perfect draft at
  gamma 8 drafts 9 tokens a round, so the last round of the longest row verifies a block
  that runs past the cache's end. Those positions are past its budget: their writes are
  dropped and nothing kept reads them."""
  model, params = stories
  prompts = pad_prompts(story_prompts)  # width = the longest prompt: that row ends at the end
  new = 21  # the prefill's token, then rounds of 9, 9 and 2: the last block overhangs by 7
  ar = generate(model, params, *prompts, max_new_tokens=new)
  out, cache, _ = speculative_generate(model, params, DraftModelDrafter(model), params,
                                       *prompts, gamma=8, max_new_tokens=new, return_state=True)
  assert cache.max_len == prompts[0].shape[1] + new
  assert np.array_equal(out.tokens, ar.tokens) and np.array_equal(out.num_tokens, ar.num_tokens)
  assert summarize(out.metrics)["rounds"] == 3  # every draft accepted


def test_cache_invariant_after_generation(stories, story_prompts):
  """Target and draft caches up to each row's length equal a fresh prefill of those tokens."""
  model, params = stories
  draft_params = perturbed(params, 0.15, seed=1)
  prompts = pad_prompts(story_prompts, width=12)
  out, cache, draft_state = speculative_generate(
      model, params, DraftModelDrafter(model), draft_params, *prompts, gamma=4,
      max_new_tokens=30, budgets_B=[30, 7, 30, 13, 30], return_state=True)
  seq = np.asarray(out.sequences)
  lengths = np.asarray(prompts[1]) + np.asarray(out.num_tokens)
  positions = np.broadcast_to(np.arange(seq.shape[1], dtype=np.int32), seq.shape)
  for name, p, c in [("target", params, cache), ("draft", draft_params, draft_state.cache)]:
    _, _, fresh = model.apply(p, seq, positions, model.init_cache(*seq.shape))
    for row, length in enumerate(np.asarray(c.length_B)):
      assert length >= lengths[row] - 1, (name, row)  # everything but the pending token
      assert length <= lengths[row]
      assert_cache_prefix_close(c, fresh, row, length, f"{name} cache, row {row}")


def test_one_compilation_and_no_host_callbacks():
  model, params = tiny_llama(vocab_size=40, seed=2)
  drafter = DraftModelDrafter(model)
  args = dict(gamma=3, max_new_tokens=8)
  speculative_generate(model, params, drafter, params, *pad_prompts([[1, 2, 3], [4]], width=6),
                       **args)
  compiled = speculative_jit._cache_size()
  speculative_generate(model, params, drafter, params,
                       *pad_prompts([[9, 8], [7, 6, 5, 4, 3]], width=6), eos_id=2, **args)
  assert speculative_jit._cache_size() == compiled
  program, arrays = prepare(model, drafter, *pad_prompts([[1, 2, 3]], width=6), gamma=3,
                            max_new_tokens=8, sampling=SamplingConfig(1.0), eos_id=None,
                            key=jax.random.key(0), budgets_B=None, pad_id=0, cache_len=None,
                            verifier=verify)
  hlo = speculative_jit.lower(program, params, params, *arrays).as_text()
  assert "while" in hlo
  assert "callback" not in hlo.lower() and "outfeed" not in hlo.lower()


def test_a_drafter_on_the_target_params_is_handed_them_once():
  # a layer skip drafts with the target's own params: the program takes one copy of their
  # tensors (params given as another object, equal or not, are a second set), same output
  model, params = tiny_llama(vocab_size=40, seed=2)
  drafter = LayerSkipDrafter(model, 1)
  prompts = pad_prompts([[1, 2, 3], [4]], width=6)
  settings = dict(gamma=2, max_new_tokens=6)
  twin = jax.tree.map(lambda x: x, params)  # the same arrays in another tree
  shared = lower(model, params, drafter, params, *prompts, **settings)
  separate = lower(model, params, drafter, twin, *prompts, **settings)
  num_args = lambda lowered: len(jax.tree.leaves(lowered.args_info))
  assert num_args(separate) - num_args(shared) == len(jax.tree.leaves(params)) > 10
  out = speculate(model, params, drafter, params, *prompts, **settings)
  assert np.array_equal(out.tokens, speculate(model, params, drafter, twin, *prompts,
                                               **settings).tokens)
  assert np.array_equal(out.tokens, generate(model, params, *prompts, max_new_tokens=6).tokens)


def test_streaming_in_chunks_gives_the_same_result(stories, story_prompts):
  model, params = stories
  prompts = pad_prompts(story_prompts, width=12)
  kw = dict(gamma=3, max_new_tokens=30, sampling=SamplingConfig(0.9, top_k=20),
            key=jax.random.key(5))
  whole = speculative_generate(model, params, DraftModelDrafter(model), perturbed(params, 0.15),
                               *prompts, **kw)
  chunks = list(speculative_chunks(model, params, DraftModelDrafter(model),
                                   perturbed(params, 0.15), *prompts, rounds_per_chunk=3, **kw))
  assert len(chunks) > 2
  assert np.array_equal(chunks[-1].tokens, whole.tokens)
  assert np.array_equal(chunks[-1].num_tokens, whole.num_tokens)
  grown = [np.asarray(c.num_tokens) for c in chunks]
  assert all((a <= b).all() for a, b in zip(grown, grown[1:]))


def test_bad_input(stories):
  model, params = stories
  prompts = pad_prompts([[1, 2, 3]])
  other_vocab, other_params = tiny_llama(vocab_size=100)
  with pytest.raises(ValueError, match=r"vocabulary \(100\) differs from the target's \(512\)"):
    speculative_generate(model, params, DraftModelDrafter(other_vocab), other_params, *prompts,
                         gamma=3, max_new_tokens=5)
  for gamma in (0, -2, 1.5):
    with pytest.raises(ValueError, match="gamma"):
      speculative_generate(model, params, DraftModelDrafter(model), params, *prompts,
                           gamma=gamma, max_new_tokens=5)
  from spec_jax.adaptive import AdaptiveConfig
  for gamma in (512, AdaptiveConfig(10 ** 6)):  # (compiled as given, a block of 10**6 + 1)
    with pytest.raises(ValueError, match="gamma .draft length.* [0-9]+ is not below the "
                                         "model's context of 512"):
      speculate(model, params, PromptLookupDrafter(), None, *prompts, gamma=gamma,
                max_new_tokens=5)
  with pytest.raises(ValueError, match="longer than the model's context of 512"):
    speculative_generate(model, params, DraftModelDrafter(model), params, *prompts, gamma=7,
                         max_new_tokens=510)
  # a chain's block writes past the budget are dropped, so it needs no slots past it; a
  # tree's nodes sit at slots ahead of their positions, so it does
  tree = DraftModelTreeDrafter(model, depth=3, top_k=2, nodes=7)
  with pytest.raises(ValueError, match="7 draft slots"):
    speculate(model, params, tree, params, *prompts, max_new_tokens=505)
  with pytest.raises(ValueError, match="cache of 12 slots is too small"):
    speculative_generate(model, params, DraftModelDrafter(model), params, *prompts, gamma=7,
                         max_new_tokens=10, cache_len=12)
  # a draft model of a shorter context than the run (it ran past it, silently)
  short = dataclasses.replace(model, config=dataclasses.replace(model.config, max_seq_len=16))
  from spec_jax.drafters.factory import make_drafter
  for drafter, draft_params in [(DraftModelDrafter(short), params),
                                (DraftModelTreeDrafter(short, depth=3, top_k=2, nodes=7), params),
                                make_drafter("lookup+draft_model", model, params,
                                             draft_model=short, draft_params=params)]:
    with pytest.raises(ValueError, match=r"= 19 positions is longer than the context of "
                                         r".*DraftModel.*'s model \(16\)"):
      speculate(model, params, drafter, draft_params, *prompts, max_new_tokens=16, gamma="auto")
  # 3 + 13 = 16 positions: inside it, whatever cache the caller gives
  for cache_len in (None, 64):
    speculate(model, params, DraftModelDrafter(short), params, *prompts, max_new_tokens=13,
              gamma=2, cache_len=cache_len)


def test_incompatible_tokenizers_are_refused():
  from spec_jax.models.tokenizer import Llama2cTokenizer, check_same_tokenizer
  tok = Llama2cTokenizer.from_file(str(require_shared(STORIES_DIR / "tok512.bin")))
  check_same_tokenizer(tok, tok)
  pieces = [tok.piece_bytes(i) for i in range(tok.vocab_size)]
  pieces[300], pieces[301] = pieces[301], pieces[300]
  other = Llama2cTokenizer(pieces, tok.scores)
  with pytest.raises(ValueError, match="300"):
    check_same_tokenizer(tok, other)


# --- distribution identity when sampling ------------------------------------------------------

VOCAB, PROMPT, DEPTH, SAMPLES = 8, [3, 1, 4], 3, 6000


def exact_joint(model, params, prompt, depth, sampling):
  """The exact target probability of every sequence of `depth` next tokens: [V] * depth."""
  vocab = model.vocab_size
  joint = np.ones([1] * 0)
  prefixes = np.zeros((1, 0), np.int32)
  for _ in range(depth):
    seqs = np.concatenate([np.tile(prompt, (len(prefixes), 1)), prefixes], axis=1).astype(np.int32)
    pos = np.broadcast_to(np.arange(seqs.shape[1]), seqs.shape)
    logits, _, _ = model.apply(params, seqs, pos, model.init_cache(*seqs.shape))
    probs = np.asarray(warped_probs(logits[:, -1], sampling), np.float64)  # [prefixes, V]
    joint = (joint.reshape(-1, 1) * probs).reshape(-1)
    prefixes = np.array(list(itertools.product(range(vocab), repeat=prefixes.shape[1] + 1)),
                        np.int32)
  return joint / joint.sum()


def pvalue_vs_exact(tokens, joint):
  """Chi-square of sampled first-`depth`-token sequences against their exact probabilities.

  Bins expected to hold fewer than 5 samples are pooled so the test statistic is valid.
  """
  vocab_pow = np.array([VOCAB ** (DEPTH - 1 - i) for i in range(DEPTH)])
  counts = np.bincount(np.asarray(tokens)[:, :DEPTH] @ vocab_pow, minlength=joint.size)
  expected = joint * counts.sum()
  big = expected >= 5
  obs = np.append(counts[big], counts[~big].sum())
  exp = np.append(expected[big], expected[~big].sum())
  if exp[-1] == 0:
    obs, exp = obs[:-1], exp[:-1]
  return stats.chisquare(obs, exp * obs.sum() / exp.sum()).pvalue


@pytest.fixture(scope="module")
def small_pair():
  target, target_params = tiny_llama(vocab_size=VOCAB, dim=16, n_layers=2, n_heads=2,
                                     n_kv_heads=1, hidden_dim=32, seed=11)
  draft, draft_params = tiny_llama(vocab_size=VOCAB, dim=16, n_layers=1, n_heads=2,
                                   n_kv_heads=1, hidden_dim=32, seed=12)
  return target, target_params, draft, draft_params


def _sample_speculative(small_pair, sampling, draft="random", verifier=None, seed=0):
  target, tp, draft_model, dp = small_pair
  if draft == "noisy":
    draft_model, dp = target, perturbed(tp, 0.7, seed=3)
  kw = {} if verifier is None else {"verifier": verifier}
  out = speculative_generate(target, tp, DraftModelDrafter(draft_model), dp,
                             *pad_prompts([PROMPT] * SAMPLES), gamma=2, max_new_tokens=DEPTH,
                             sampling=sampling, key=jax.random.key(seed), **kw)
  assert (np.asarray(out.num_tokens) == DEPTH).all()
  return out


@pytest.mark.parametrize("sampling,draft", [
    (SamplingConfig(1.0), "random"), (SamplingConfig(1.0), "noisy"),
    (SamplingConfig(0.7, top_k=4), "random"), (SamplingConfig(1.3, top_p=0.8), "noisy")])
def test_sampled_distribution_matches_target(small_pair, sampling, draft):
  target, tp = small_pair[:2]
  joint = exact_joint(target, tp, PROMPT, DEPTH, sampling)
  out = _sample_speculative(small_pair, sampling, draft, seed=1)
  assert pvalue_vs_exact(out.tokens, joint) > SIGNIFICANCE
  # the plain sampler passes the same test (a control on the test itself)
  ar = generate(target, tp, *pad_prompts([PROMPT] * SAMPLES), max_new_tokens=DEPTH,
                sampling=sampling, key=jax.random.key(2))
  assert pvalue_vs_exact(ar.tokens, joint) > SIGNIFICANCE


def accept_everything(draft_tokens_BG, draft_probs_BGV, target_logits_BG1V, sampling, key):
  """A wrong verifier: keeps every draft and samples the bonus token from the target."""
  batch, gamma = draft_tokens_BG.shape
  bonus = sample_from_probs(key, warped_probs(target_logits_BG1V[:, -1], sampling))
  return jnp.full((batch,), gamma, jnp.int32), bonus


def test_distribution_test_catches_a_wrong_verifier(small_pair):
  sampling = SamplingConfig(1.0)
  target, tp = small_pair[:2]
  joint = exact_joint(target, tp, PROMPT, DEPTH, sampling)
  out = _sample_speculative(small_pair, sampling, verifier=accept_everything, seed=1)
  assert pvalue_vs_exact(out.tokens, joint) < SIGNIFICANCE
