"""Training-free drafters: prompt lookup, layer skip, int8 target, and their combination.

Each is lossless (greedy: the autoregressive tokens; sampling: the target's distribution),
keeps its cache right after rollback, and does what it claims (lookup finds the right
continuation; int8 logits stay close to the float target's).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from conftest import perturbed
from spec_jax.drafters import (DraftModelDrafter, Drafter, FallbackDrafter, LayerSkipDrafter,
                               PromptLookupDrafter, ResyncDraftModelDrafter, make_drafter,
                               ngram_lookup, quantized_target_drafter)
from spec_jax.drafters.base import DraftContext, PromptInfo
from spec_jax.drafters.combined import LAG_WIDTHS, resync_widths
from spec_jax.drafters.draft_model import DraftModelState
from spec_jax.drafters.layer_skip import truncated_model
from spec_jax.generate import generate, pad_prompts
from spec_jax.metrics import summarize
from spec_jax.core.quantize import quantize_params
from spec_jax.core.sampling import SamplingConfig
from spec_jax.speculative import speculative_generate
from test_speculative import (DEPTH, NEW, PROMPT, SAMPLES, SIGNIFICANCE,  # noqa: F401
                              assert_cache_prefix_close, exact_joint, pvalue_vs_exact,
                              small_pair)  # small_pair: a fixture

# --- n-gram lookup on constructed sequences ---------------------------------------------------


def reference_lookup(seq, length, gamma, max_ngram, min_ngram):
  """Plain-Python lookup: the definition ngram_lookup must implement."""
  seq = list(seq[:length])
  for n in range(max_ngram, min_ngram - 1, -1):
    ends = [e for e in range(n - 1, length - 1) if seq[e - n + 1:e + 1] == seq[length - n:]]
    if ends:
      out = seq[:]
      for j in range(gamma):  # copy what followed; the copy may read its own output
        out.append(out[max(ends) + 1 + j])
      return out[length:], True
  return [seq[-1]] * gamma, False


# (tokens, length, gamma, max_ngram, min_ngram) -> (proposal, found)
CASES = {
    "most recent match": (([5, 6, 7, 5, 6, 8, 5, 6], 8, 6, 3, 1), ([8, 5, 6, 8, 5, 6], True)),
    "longest n before recency": (([1, 2, 3, 9, 4, 2, 3, 7, 1, 2, 3], 11, 4, 3, 1),
                                 ([9, 4, 2, 3], True)),
    "shorter n when longer fail": (([1, 2, 3, 9, 4, 2, 3, 7, 1, 2, 3], 11, 4, 2, 1),
                                   ([7, 1, 2, 3], True)),
    "overlapping, period 1": (([4, 4, 4, 4], 4, 5, 3, 1), ([4, 4, 4, 4, 4], True)),
    "overlapping, period 2": (([1, 2, 1, 2, 1], 5, 5, 3, 1), ([2, 1, 2, 1, 2], True)),
    "no match: last token": (([1, 2, 3, 4], 4, 3, 3, 1), ([4, 4, 4], False)),
    "only below min_ngram": (([7, 1, 2, 7], 4, 2, 3, 2), ([7, 7], False)),
    "the suffix is no match": (([1, 2, 3], 3, 2, 3, 1), ([3, 3], False)),
    "tokens past length unseen": (([3, 7, 1, 2, 3, 7, 9, 9], 2, 2, 2, 1), ([7, 7], False)),
    "one token only": (([6, 6, 6], 1, 2, 3, 1), ([6, 6], False)),
    "match ends just before the suffix, buffer full": (([8, 1, 2, 3, 3, 3, 3, 3, 3, 3, 3, 3], 12,
                                                        3, 2, 1), ([3, 3, 3], True)),
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_ngram_lookup_constructed(name):
  (tokens, length, gamma, max_n, min_n), expected = CASES[name]
  assert reference_lookup(tokens, length, gamma, max_n, min_n) == expected  # the definition
  proposal_BG, found_B = ngram_lookup(jnp.array([tokens]), jnp.array([length]), gamma, max_n,
                                      min_n)
  assert (np.asarray(proposal_BG)[0].tolist(), bool(found_B[0])) == expected


def test_ngram_lookup_matches_reference_on_random_batches():
  """Rows of different lengths in one fixed-shape batch, small vocabularies (many matches)."""
  rng = np.random.default_rng(0)
  lookup = jax.jit(ngram_lookup, static_argnums=(2, 3, 4))
  for vocab, width, gamma, max_n, min_n in [(3, 20, 5, 3, 1), (5, 30, 4, 4, 2), (2, 12, 7, 2, 2)]:
    seq = rng.integers(0, vocab, (64, width)).astype(np.int32)
    lengths = rng.integers(1, width + 1, 64).astype(np.int32)
    proposal_BG, found_B = lookup(seq, lengths, gamma, max_n, min_n)
    for row in range(64):
      expected = reference_lookup(seq[row], lengths[row], gamma, max_n, min_n)
      assert (np.asarray(proposal_BG[row]).tolist(), bool(found_B[row])) == expected, row


# --- greedy identity on stories260K, caches after rollback ----------------------------------


@pytest.fixture(scope="module")
def story_reference(stories, story_prompts):
  model, params = stories
  prompts = pad_prompts(story_prompts, width=12)
  return prompts, generate(model, params, *prompts, max_new_tokens=NEW, eos_id=1)


# On stories260K the first 4 of 5 layers agree with the target often enough for ragged
# acceptance; fewer layers accept little (see scripts/drafter_table.py).
LAYERS = 4


def _draft_caches(kind, model, params, draft_params, draft_state):
  """(model, params, cache) of every draft-model cache in the drafter's state."""
  if kind == "layer_skip":
    return [(truncated_model(model, LAYERS), params, draft_state.cache)]
  if kind == "quantized":
    return [(model, draft_params, draft_state.cache)]
  if kind == "lookup+layer_skip":
    return [(truncated_model(model, LAYERS), params, draft_state.secondary.cache)]
  return []


@pytest.mark.parametrize("kind", ["prompt_lookup", "layer_skip", "quantized", "lookup+layer_skip"])
@pytest.mark.parametrize("gamma", [2, 4])
def test_greedy_identity_and_draft_cache_stories260k(stories, story_reference, kind, gamma):
  model, params = stories
  prompts, reference = story_reference
  drafter, draft_params = make_drafter(kind, model, params, num_layers=LAYERS)
  out, _, draft_state = speculative_generate(model, params, drafter, draft_params, *prompts,
                                             gamma=gamma, max_new_tokens=NEW, eos_id=1,
                                             return_state=True)
  assert np.array_equal(out.tokens, reference.tokens)
  assert np.array_equal(out.num_tokens, reference.num_tokens)
  m = summarize(out.metrics)
  print(f"{kind} gamma={gamma}: acceptance {m['acceptance_rate']:.1%}, "
        f"mean accepted {m['mean_accepted']:.2f}")
  if kind == "quantized":
    # fixed before running: int8 logits stay within ~0.3 of the float ones (see the test
    # below), so the argmax differs only at near-ties
    assert m["acceptance_rate"] > 0.8
  # after any sequence of rounds, a draft cache up to its length equals a fresh prefill
  seq = np.asarray(out.sequences)
  lengths = np.asarray(prompts[1]) + np.asarray(out.num_tokens)
  positions = np.broadcast_to(np.arange(seq.shape[1], dtype=np.int32), seq.shape)
  for draft_model, p, cache in _draft_caches(kind, model, params, draft_params, draft_state):
    _, _, fresh = draft_model.apply(p, seq, positions, draft_model.init_cache(*seq.shape))
    kept = np.asarray(cache.length_B)
    assert (kept >= lengths - 1 - gamma).all() and (kept <= lengths).all()
    for row, length in enumerate(kept):
      assert_cache_prefix_close(cache, fresh, row, length, f"row {row}")


def test_prompt_lookup_accepts_more_on_a_repetitive_prompt(stories, reference_tokens):
  """A passage the model tends to repeat, given twice, against a short fresh prompt."""
  model, params = stories
  passage = reference_tokens[131:160]  # 'Lily was sad and didn't know what to do. She said, ...'
  prompts = pad_prompts([[1] + passage + passage, [1, 403, 407]])  # ..., 'Once upon'
  gamma = 4
  out = speculative_generate(model, params, PromptLookupDrafter(), None, *prompts, gamma=gamma,
                             max_new_tokens=NEW)
  m = jax.tree.map(np.asarray, out.metrics)
  rate_B = m.accepted_B / (m.rounds_B * gamma)
  print(f"lookup acceptance: repetitive {rate_B[0]:.1%}, not repetitive {rate_B[1]:.1%}")
  # fixed before running: 'clearly higher' as at least a fifth of all drafts accepted, and
  # three times the rate of the fresh prompt
  assert rate_B[0] >= 0.2 and rate_B[0] >= 3 * rate_B[1]


@dataclasses.dataclass(frozen=True)
class ProposeToCatchUp(ResyncDraftModelDrafter):
  """Catches up the default way: a full proposal, its drafts dropped."""

  def catch_up(self, params, state, ctx, gamma, sampling, key):
    return Drafter.catch_up(self, params, state, ctx, gamma, sampling, key)


@dataclasses.dataclass(frozen=True)
class NeverCatchesUp(ResyncDraftModelDrafter):
  """Wrong on purpose: claims the rounds it sits out, which never reach its cache."""

  def catch_up(self, params, state, ctx, gamma, sampling, key):
    return DraftModelState(state.cache.with_length(ctx.position_B + 1))


def test_a_draft_model_that_sat_out_rounds_drafts_as_one_that_did_not(stories, reference_tokens):
  """A combination's draft model defers its catch-up (rounds where every row copies leave its
  cache behind); its next propose feeds what it missed. Ragged lags in one batch (none, within
  each of LAG_WIDTHS' windows, and past the widest, which fill_below feeds first): the same
  drafts, draft probabilities and cache as a draft model that saw every token in its prefill,
  and the same model guesses in hindsight after a stretch."""
  model, params = stories
  drafter, draft_params = make_drafter("lookup+layer_skip", model, params, num_layers=LAYERS)
  resync, draft_params = drafter.secondary, draft_params[1]
  gamma, position = 4, 70
  lags = [0, 1, LAG_WIDTHS[1], LAG_WIDTHS[1] + 5, LAG_WIDTHS[2], LAG_WIDTHS[2] + 30]
  seq = np.asarray(reference_tokens[:position + 9], np.int32)
  seq_BS = jnp.asarray(np.pad(np.tile(seq, (len(lags), 1)), ((0, 0), (0, 32))))
  position_B = jnp.full((len(lags),), position, jnp.int32)
  # a cache valid below position - gamma - lag (lag slots beyond what a round can leave
  # missing, gamma + 1), its stale slots written from other tokens
  valid_B = position_B - gamma - jnp.asarray(lags, jnp.int32)
  other_BS = jnp.where(jnp.arange(seq_BS.shape[1])[None] < valid_B[:, None], seq_BS, 7)
  lagging = PromptInfo(other_BS, valid_B, seq_BS.shape[1])
  caught_up = PromptInfo(seq_BS, position_B, seq_BS.shape[1])
  ctx = DraftContext(seq_BS, position_B, seq_BS[:, position])
  sampled = SamplingConfig(temperature=1.0)
  key = jax.random.key(3)
  outs = {}
  for name, prompt in (("lagging", lagging), ("caught up", caught_up), ("claims", lagging)):
    state = resync.init(draft_params, prompt)
    if name == "claims":  # the control: a cache that says it holds what it missed
      state = DraftModelState(state.cache.with_length(position_B - gamma))
    greedy_BG = resync.propose(draft_params, state, ctx, gamma, SamplingConfig(), key)[0]
    tokens_BG, probs_BGV, after = resync.propose(draft_params, state, ctx, gamma, sampled, key)
    stretched = DraftContext(seq_BS, position_B + 8, seq_BS[:, position + 8])
    _, agree_BA = resync.catch_up_with_hindsight(draft_params, state, stretched, 8, gamma)
    outs[name] = greedy_BG, tokens_BG, probs_BGV, agree_BA, after.cache
  lag_out, ref_out = outs["lagging"], outs["caught up"]
  np.testing.assert_array_equal(lag_out[0], ref_out[0])
  np.testing.assert_array_equal(lag_out[1], ref_out[1])
  np.testing.assert_allclose(lag_out[2], ref_out[2], atol=1e-5)
  np.testing.assert_array_equal(lag_out[3], ref_out[3])
  np.testing.assert_array_equal(lag_out[4].length_B, position_B + 1)
  for row in range(len(lags)):
    assert_cache_prefix_close(lag_out[4], ref_out[4], row, position + 1, f"lag {lags[row]}")
  wrong = np.abs(np.asarray(outs["claims"][2] - ref_out[2])).max(axis=(1, 2))
  assert (wrong[2:] > 1e-3).all()  # where the lag reaches past the resync's own window


def test_a_resync_feeds_only_the_slots_its_cache_lacks(stories, reference_tokens):
  """After a round the model drafted in, its cache lacks the accepted drafts and the
  target's token (1 to gamma + 1 slots before the pending one, ragged across rows): the
  resync feeds them in the narrowest window that covers every row (resync_widths), with
  the same drafts, draft probabilities and cache as a model that saw every token. A control
  whose cache claims one slot it lacks (a window picked one slot too narrow) drafts
  differently wherever that picks a window that misses the slot."""
  model, params = stories
  drafter, draft_params = make_drafter("lookup+layer_skip", model, params, num_layers=LAYERS)
  resync, draft_params = drafter.secondary, draft_params[1]
  gamma, position = 4, 70
  widths = resync_widths(gamma)
  assert widths[:2] == (2, 5)  # narrow windows exist to be tested
  seq = np.asarray(reference_tokens[:position + 9], np.int32)
  sampled = SamplingConfig(temperature=1.0)
  key = jax.random.key(5)
  # compiled once for every case below (op by op, the cases took ~50 s)
  propose = jax.jit(resync.propose, static_argnums=(3, 4))
  init = jax.jit(resync.init)
  for lacking in ([1, 1], [2, 1], [3, 2], [gamma + 1, 3], [gamma + 2, 2]):  # missing, per row
    rows = len(lacking)
    seq_BS = jnp.asarray(np.pad(np.tile(seq, (rows, 1)), ((0, 0), (0, 32))))
    position_B = jnp.full((rows,), position, jnp.int32)
    caught_up = PromptInfo(seq_BS, position_B, seq_BS.shape[1])
    ctx = DraftContext(seq_BS, position_B, seq_BS[:, position])
    valid_B = position_B + 1 - jnp.asarray(lacking, jnp.int32)
    other_BS = jnp.where(jnp.arange(seq_BS.shape[1])[None] < valid_B[:, None], seq_BS, 7)
    prefilled = init(draft_params, PromptInfo(other_BS, valid_B, seq_BS.shape[1]))
    outs = {}
    for name, missing in (("lacking", lacking), ("claims one", [m - 1 for m in lacking])):
      claimed_B = position_B + 1 - jnp.asarray(missing, jnp.int32)
      state = DraftModelState(prefilled.cache.with_length(claimed_B))
      tokens_BG, probs_BGV, after = propose(draft_params, state, ctx, gamma, sampled, key)
      outs[name] = tokens_BG, probs_BGV, after.cache
    ref = propose(draft_params, init(draft_params, caught_up), ctx, gamma, sampled, key)
    got = outs["lacking"]
    np.testing.assert_array_equal(got[0], ref[0], err_msg=f"lacking {lacking}")
    np.testing.assert_allclose(got[1], ref[1], atol=1e-5, err_msg=f"lacking {lacking}")
    for row in range(rows):
      assert_cache_prefix_close(got[2], ref[2].cache, row, position + 1, f"lacking {lacking}")
    most = max(lacking)
    if min(w for w in widths if w >= most - 1) < most:  # the control's window misses a slot
      wrong = np.abs(np.asarray(outs["claims one"][1] - ref[1])).max(axis=(1, 2))
      assert wrong[lacking.index(most)] > 1e-3, f"lacking {lacking}: a missing slot unnoticed"


def test_rounds_where_every_row_copies_leave_the_draft_model_behind(stories, reference_tokens):
  """Lookup matches in most rounds on a passage given twice (batch 1): there the draft model
  does nothing, and feeds what it missed when it next drafts. Same tokens, same acceptance
  per round as a full proposal every round; at the end its cache lags (the last rounds
  copied) and holds what a fresh prefill would below its length; a drafter that claimed
  those rounds' tokens without feeding them would be caught by the cache check."""
  model, params = stories
  passage = reference_tokens[131:160]
  prompts = pad_prompts([[1] + passage + passage])
  reference = generate(model, params, *prompts, max_new_tokens=NEW)
  fast, draft_params = make_drafter("lookup+layer_skip", model, params, num_layers=LAYERS)
  gamma, draft_model = 4, fast.secondary.model
  caches, metrics = {}, {}
  for name, secondary in (("fast", fast.secondary), ("full", ProposeToCatchUp(draft_model)),
                          ("never", NeverCatchesUp(draft_model))):
    drafter = dataclasses.replace(fast, secondary=secondary)
    out, _, state = speculative_generate(model, params, drafter, draft_params, *prompts,
                                         gamma=gamma, max_new_tokens=NEW, return_state=True)
    assert np.array_equal(out.tokens, reference.tokens), name  # lossless whatever the draft
    caches[name], metrics[name] = state.secondary.cache, jax.tree.map(np.asarray, out.metrics)
  assert jax.tree.all(jax.tree.map(np.array_equal, metrics["fast"], metrics["full"]))
  assert summarize(out.metrics)["mean_accepted"] > 1  # lookup copies the passage
  seq = np.asarray(out.sequences)  # the same in every run
  seq_len = int(np.asarray(prompts[1])[0] + np.asarray(out.num_tokens)[0])
  positions = np.broadcast_to(np.arange(seq.shape[1], dtype=np.int32), seq.shape)
  _, _, fresh = draft_model.apply(params, seq, positions, draft_model.init_cache(*seq.shape))
  kept = int(np.asarray(caches["fast"].length_B)[0])
  assert kept < seq_len - 1 - gamma  # behind: the rounds that copied last were not fed
  assert_cache_prefix_close(caches["fast"], fresh, 0, kept, "catch-up cache")
  with pytest.raises(AssertionError):  # the catch-up rounds happened, and they matter
    assert_cache_prefix_close(caches["never"], fresh, 0, kept, "no catch-up")


# --- int8 target: logit error ---------------------------------------------------------------


def test_int8_logits_stay_close_to_the_float_target(stories, reference_tokens):
  model, params = stories
  tokens = jnp.array([reference_tokens])
  positions = jnp.arange(tokens.shape[1])[None]
  cache = model.init_cache(*tokens.shape)
  drafter, q_params = quantized_target_drafter(model, params)
  assert drafter == DraftModelDrafter(model)
  logits = np.asarray(model.apply(params, tokens, positions, cache)[0][0], np.float64)
  q_logits = np.asarray(model.apply(q_params, tokens, positions, cache)[0][0], np.float64)
  # Fixed from the rounding alone: int8 moves a weight by at most absmax/254 of its output
  # channel, ~0.7% of a matmul's output RMS for near-Gaussian weights; about 20 matmuls lie
  # in series over 5 layers and their errors mostly add in quadrature (~3%). So: logit error
  # at most 2% of the largest |logit|, and at every position a total-variation distance of
  # the softmax (1 - acceptance when sampling at temperature 1) of at most 0.05.
  assert np.abs(q_logits - logits).max() <= 0.02 * np.abs(logits).max()
  probs, q_probs = jax.nn.softmax(logits), jax.nn.softmax(q_logits)
  assert 0.5 * np.abs(np.asarray(probs) - np.asarray(q_probs)).sum(-1).max() <= 0.05
  leaves = jax.tree.leaves(q_params, is_leaf=lambda x: hasattr(x, "values_IO"))
  assert sum(hasattr(x, "values_IO") for x in leaves) == 7 * model.config.n_layers


# --- distribution identity when sampling (the small pair of test_speculative) -----------------


def _sampling_drafter(kind, target, tp):
  """Drafters for the 2-layer target of `small_pair` (layer skip keeps 1 of its 2 layers)."""
  if kind == "prompt_lookup":
    return PromptLookupDrafter(), None
  if kind == "lookup+layer_skip":  # min_ngram 1: both branches are common on 3-token prompts
    return make_drafter(kind, target, tp, num_layers=1, min_ngram=1)
  return make_drafter(kind, target, tp, num_layers=1)


_joints = {}


def _joint(small_pair, sampling):
  """exact_joint, computed once per setting (eagerly it costs seconds)."""
  if sampling not in _joints:
    _joints[sampling] = exact_joint(*small_pair[:2], PROMPT, DEPTH, sampling)
  return _joints[sampling]


def _sample(small_pair, drafter, draft_params, sampling):
  target, tp = small_pair[:2]
  out = speculative_generate(target, tp, drafter, draft_params, *pad_prompts([PROMPT] * SAMPLES),
                             gamma=2, max_new_tokens=DEPTH, sampling=sampling,
                             key=jax.random.key(1))
  assert (np.asarray(out.num_tokens) == DEPTH).all()
  return pvalue_vs_exact(out.tokens, _joint(small_pair, sampling))


# temperature 1 leaves q least changed by warping, so a wrong q shows most
@pytest.mark.parametrize("kind,sampling", [
    ("prompt_lookup", SamplingConfig(0.7, top_k=4)), ("layer_skip", SamplingConfig(1.0)),
    ("quantized", SamplingConfig(1.0)), ("lookup+layer_skip", SamplingConfig(1.0))])
def test_sampled_distribution_matches_target(small_pair, kind, sampling):
  drafter, draft_params = _sampling_drafter(kind, *small_pair[:2])
  assert _sample(small_pair, drafter, draft_params, sampling) > SIGNIFICANCE


def test_rounds_without_any_match_sample_the_target_directly(small_pair):
  """3-gram lookup on 3-token prompts finds nothing in the first rounds: every row is empty,
  so those rounds run one target step and sample from p (the one-step branch)."""
  assert _sample(small_pair, PromptLookupDrafter(3, 3), None, SamplingConfig(0.7, top_k=4)) \
      > SIGNIFICANCE


@dataclasses.dataclass(frozen=True)
class AlwaysEmpty(DraftModelDrafter):
  """A perfect draft that claims to have proposed nothing: only the one-step branch runs."""

  def empty_rows(self, state):
    return jnp.ones(state.cache.length_B.shape, bool)


def test_all_empty_rounds_take_one_step_and_keep_the_output(stories, story_reference):
  model, params = stories
  prompts, reference = story_reference
  perfect = speculative_generate(model, params, DraftModelDrafter(model), params, *prompts,
                                 gamma=3, max_new_tokens=NEW, eos_id=1)
  empty = speculative_generate(model, params, AlwaysEmpty(model), params, *prompts, gamma=3,
                               max_new_tokens=NEW, eos_id=1)
  for out in (perfect, empty):
    assert np.array_equal(out.tokens, reference.tokens)
    assert np.array_equal(out.num_tokens, reference.num_tokens)
  assert summarize(perfect.metrics)["mean_accepted"] > 2.5  # the drafts are the target's own
  assert summarize(empty.metrics)["mean_accepted"] == 0  # never verified: one step a round


@dataclasses.dataclass(frozen=True)
class OtherDraftersQ(FallbackDrafter):
  """Wrong on purpose: rows that took lookup's tokens get the draft model's q, not one-hot."""

  def propose(self, params, state, ctx, gamma, sampling, key):
    tokens_BG, _, new_state = super().propose(params, state, ctx, gamma, sampling, key)
    # the secondary's own call again, with the key FallbackDrafter gave it
    _, model_probs_BGV, _ = self.secondary.propose(params[1], state.secondary, ctx, gamma,
                                                   sampling, jax.random.split(key)[1])
    return tokens_BG, model_probs_BGV, new_state


def test_distribution_test_catches_q_of_the_other_drafter(small_pair):
  drafter, draft_params = _sampling_drafter("lookup+layer_skip", *small_pair[:2])
  wrong = OtherDraftersQ(drafter.primary, drafter.secondary)
  assert _sample(small_pair, wrong, draft_params, SamplingConfig(1.0)) < SIGNIFICANCE


# --- construction and checks ------------------------------------------------------------------


def test_construction_and_checks(stories):
  model, params = stories
  assert LayerSkipDrafter(model, 2) == LayerSkipDrafter(model, 2)  # hashable static argument
  assert LayerSkipDrafter(model, 2).model.num_layers == 2
  drafter, draft_params = make_drafter("layer_skip", model, params, num_layers=3)
  assert draft_params is params and drafter == LayerSkipDrafter(model, 3)
  assert make_drafter("layer_skip", model, params)[0] == LayerSkipDrafter(model, 4)  # 3/4 of 5
  for bad in (0, model.config.n_layers + 1):
    with pytest.raises(ValueError, match="num_layers"):
      LayerSkipDrafter(model, bad)
  with pytest.raises(ValueError, match="min_ngram"):
    PromptLookupDrafter(max_ngram=1, min_ngram=2)
  with pytest.raises(ValueError, match="unknown drafter kind"):
    make_drafter("lookahead", model, params)
  with pytest.raises(ValueError, match="needs draft_model"):
    make_drafter("draft_model", model, params)
  with pytest.raises(ValueError, match="'layer_skip' needs the target model"):  # (AttributeError)
    make_drafter("layer_skip", None, params)
  assert make_drafter("prompt_lookup", None, None)[1] is None  # lookup reads no model
  with pytest.raises(ValueError, match="draft_model must be a model handle .*got str"):
    make_drafter("draft_model", model, params, draft_model="draft.bin", draft_params=params)
  combined, combined_params = make_drafter("lookup+quantized", model, params)
  assert combined == FallbackDrafter(PromptLookupDrafter(3, 2), ResyncDraftModelDrafter(model))
  assert combined_params[0] is None
  # a plain draft model inside a combination would keep the other drafter's tokens' slots
  # filled with its own drafts: refused before anything compiles
  plain = FallbackDrafter(PromptLookupDrafter(), LayerSkipDrafter(model, 2))
  with pytest.raises(ValueError, match="ResyncDraftModelDrafter"):
    speculative_generate(model, params, plain, (None, params), *pad_prompts([[1, 2]]), gamma=2,
                         max_new_tokens=4)
  noisy = perturbed(params, 0.15, seed=1)
  drafter, draft_params = make_drafter("lookup+draft_model", model, params, draft_model=model,
                                       draft_params=noisy)
  assert drafter.secondary == ResyncDraftModelDrafter(model) and draft_params[1] is noisy
