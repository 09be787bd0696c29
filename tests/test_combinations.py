"""Prompt lookup combined with every drafter that reads the target's hidden states (Medusa,
EAGLE, MTP, DFlash, DSpark): lossless, and the rows that take lookup's drafts leave the other
drafter's state as if it had drafted every round."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from conftest import tiny_llama
from spec_jax import make_drafter
from spec_jax.adaptive import AdaptiveConfig
from spec_jax.core.sampling import SamplingConfig
from spec_jax.drafters import registry
from spec_jax.drafters.base import DraftContext, PromptInfo, target_with_features
from spec_jax.drafters.combined import FallbackDrafter
from spec_jax.engine import speculate
from spec_jax.generate import generate, pad_prompts, prefill_all
from spec_jax.metrics import summarize
from spec_jax.training import distill
from test_trained_drafters import _random_head
from test_speculative import (DEPTH, PROMPT, SAMPLES, SIGNIFICANCE, VOCAB, exact_joint,
                              pvalue_vs_exact)

HIDDEN_STATE_KINDS = ("medusa", "eagle", "mtp", "dflash", "dspark")
GAMMA = 3
NEW = 40
# the rows stop short of NEW: drafts proposed at their final context have room in the run's
# caches (a drafter writes its drafts' slots; the program sizes them for rounds within budget)
BUDGETS = [NEW - 2 * GAMMA, NEW - GAMMA]
# flat costs and free drafting: the rounds draft whatever the rules admit (a start-up table on
# this CPU rules a random drafter's rounds out, and the run would be plain steps alone)
FREE_DRAFTING = AdaptiveConfig(GAMMA, target_costs=(1.0, 1.0, 1.0, 1.0), draft_cost=0.0)


def test_every_trained_family_combines_with_lookup():
  assert {f"lookup+{k}" for k in HIDDEN_STATE_KINDS} <= set(registry.kinds())


def _export(kind, model, tmp_path, scale=0.0):
  """An exported drafter of `kind` for `model`: its initial weights, plus noise of `scale`
  (Medusa starts as the target's own head; noise makes its drafts its own)."""
  spec, own = _random_head(kind, model, seed=1, scale=scale, num_heads=GAMMA)
  return distill.export_drafter(tmp_path / kind, spec, own)


def _final_context(out, cache):
  """The context the next round would draft from: the final tokens, the pending token at the
  target's cache length."""
  seq_BS = jnp.asarray(out.sequences)
  position_B = jnp.asarray(cache.length_B)
  return DraftContext(seq_BS, position_B, jnp.take_along_axis(seq_BS, position_B[:, None], 1)[:, 0])


@pytest.fixture(scope="module")
def repetitive(stories, reference_tokens):
  """A passage the model repeats, in two rows with different budgets (lookup copies it: rounds
  where no row drafts from the other drafter, which then only catches up)."""
  model, params = stories
  prompts = pad_prompts([[1] + reference_tokens[131:160] * 2] * 2)
  return prompts, generate(model, params, *prompts, max_new_tokens=NEW, budgets_B=BUDGETS)


def _fresh_proposal(model, params, drafter, dparams, ctx, key):
  """What `drafter` proposes at ctx when it starts there: its init over a prefill of every
  token before the pending one (the target's true hidden states), then one propose."""
  seq_BS = ctx.seq_BS
  cache_len = seq_BS.shape[1] + 2 * GAMMA + 2
  _, hidden_BSD, _ = prefill_all(target_with_features(model, drafter), params, seq_BS,
                                 ctx.position_B, cache_len)
  state = drafter.init(dparams, PromptInfo(seq_BS, ctx.position_B, cache_len, hidden_BSD))
  return drafter.propose(dparams, state, ctx, GAMMA, SamplingConfig(temperature=1.0), key)


@pytest.mark.parametrize("kind", HIDDEN_STATE_KINDS)
def test_lookup_rounds_leave_the_other_drafter_as_a_fresh_start_would(stories, repetitive, kind,
                                                                       tmp_path):
  """lookup+<kind> and <kind> alone, greedy, gamma fixed: both equal autoregressive decoding,
  lookup drafted (fewer rounds), and from each run's
  final context its <kind> drafts the same tokens with the same probabilities as a <kind>
  started there from the true hidden states. A drafter whose state kept its own drafts on rows
  that took lookup's, or missed the positions lookup's accepted drafts covered, would not."""
  model, params = stories
  prompts, reference = repetitive
  folder = _export(kind, model, tmp_path, scale=0.5 if kind == "medusa" else 0.0)
  rounds = []
  for name in (kind, f"lookup+{kind}"):
    drafter, dparams = make_drafter(name, model, params, checkpoint=folder)
    out, cache, state = speculate(model, params, drafter, dparams, *prompts, gamma=GAMMA,
                                  max_new_tokens=NEW, budgets_B=BUDGETS, return_state=True)
    np.testing.assert_array_equal(np.asarray(out.tokens), np.asarray(reference.tokens), name)
    rounds.append(int(np.asarray(out.metrics.rounds)))
    if isinstance(drafter, FallbackDrafter):
      drafter, dparams, state = drafter.secondary, dparams[1], state.secondary
    ctx = _final_context(out, cache)
    key = jax.random.key(0)
    tokens_BG, probs_BGV, _ = drafter.propose(dparams, state, ctx, GAMMA,
                                              SamplingConfig(temperature=1.0), key)
    fresh_BG, fresh_BGV, _ = _fresh_proposal(model, params, drafter, dparams, ctx, key)
    np.testing.assert_allclose(np.asarray(probs_BGV), np.asarray(fresh_BGV), atol=2e-5,
                               err_msg=name)
    np.testing.assert_array_equal(np.asarray(tokens_BG), np.asarray(fresh_BG), name)
  assert rounds[1] < rounds[0], rounds  # lookup's copies were verified


@pytest.mark.parametrize("kind", ["eagle", "dflash"])
def test_lookup_with_auto_stays_greedy_identical(stories, repetitive, kind, tmp_path):
  """gamma="auto" over a combination whose other drafter reads hidden states (each source
  keeps its record; plain stretches record the target's hidden states for it): exact, and
  lookup's copies of the repeated passage were verified and accepted."""
  model, params = stories
  prompts, reference = repetitive
  drafter, dparams = make_drafter(f"lookup+{kind}", model, params,
                                  checkpoint=_export(kind, model, tmp_path))
  out = speculate(model, params, drafter, dparams, *prompts, gamma=FREE_DRAFTING,
                  max_new_tokens=NEW, budgets_B=BUDGETS)
  np.testing.assert_array_equal(np.asarray(out.tokens), np.asarray(reference.tokens))
  assert summarize(out.metrics)["mean_accepted"] > 0  # drafts were verified and accepted


@pytest.mark.parametrize("kind,sampling", [("dspark", SamplingConfig(1.0)),
                                           ("mtp", SamplingConfig(0.8, top_k=5))])
def test_sampled_distribution_of_lookup_with_a_hidden_state_drafter(kind, sampling, tmp_path):
  """Rows mix lookup's one-hot q with the other drafter's q in one round: the output follows
  the target's distribution (exact joint over DEPTH tokens)."""
  target, tp = tiny_llama(vocab_size=VOCAB, dim=16, n_layers=2, n_heads=2, n_kv_heads=1,
                          hidden_dim=32, seed=11)
  drafter, dparams = make_drafter(f"lookup+{kind}", target, tp,
                                  checkpoint=_export(kind, target, tmp_path, scale=0.5),
                                  min_ngram=1)
  out = speculate(target, tp, drafter, dparams, *pad_prompts([PROMPT] * SAMPLES), gamma=2,
                  max_new_tokens=DEPTH, sampling=sampling, key=jax.random.key(1))
  assert (np.asarray(out.num_tokens) == DEPTH).all()
  assert pvalue_vs_exact(out.tokens, exact_joint(target, tp, PROMPT, DEPTH, sampling)) \
      > SIGNIFICANCE
  assert summarize(out.metrics)["mean_accepted"] > 0.1
