"""Sampled runs of gamma="auto" learn in hindsight (drafters.SampledHindsight): each plain
step records the target's probability p(y) of the token y it drew, and a catch-up scores its
draft model's q at the same positions as min(1, q(y) / p(y)), an unbiased estimate of the
acceptance probability sum_x min(p, q). Checked: the score itself, its mean against the exact
acceptance (with two wrong estimators as controls), what a run learns against the exact
acceptance of its own positions, and the distribution with hindsight steering the rounds.
Before the first round a sampled run looks at the prompt, whose tokens are not samples of
the target but whose distributions are known: there it learns the exact sum_x min(p, q)."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from conftest import perturbed
from spec_jax.adaptive import AdaptiveConfig, AdaptiveRules
from spec_jax.core.sampling import SamplingConfig, warped_probs
from spec_jax.drafters.base import HINDSIGHT_WIDTH, DraftContext, SampledHindsight
from spec_jax.drafters.common import hindsight_scores
from spec_jax.drafters.draft_model import DraftModelDrafter
from spec_jax.engine import prepare_program, speculate
from spec_jax.generate import pad_prompts
from spec_jax.metrics import summarize
from spec_jax.testing import tiny_llama
from test_speculative import (DEPTH, PROMPT, SAMPLES, SIGNIFICANCE, exact_joint,  # noqa: F401
                              pvalue_vs_exact, small_pair)

# the estimator's mean must sit within this many standard errors of the exact acceptance
# (fixed before running: a correct estimator fails about once in 10^6 draws of the test)
Z = 5.0


def _context(seq_BS, prob_BS=None, sampling=None):
  batch = seq_BS.shape[0]
  hindsight = None if prob_BS is None else SampledHindsight(jnp.asarray(prob_BS), sampling)
  return DraftContext(jnp.asarray(seq_BS), jnp.full((batch,), seq_BS.shape[1] - 1, jnp.int32),
                      jnp.asarray(seq_BS[:, -1]), sampled_hindsight=hindsight)


def test_the_score_is_min_of_one_and_q_over_p_at_the_token_that_followed():
  rng = np.random.default_rng(0)
  batch, length, width, vocab = 3, 10, 4, 7
  seq_BS = rng.integers(0, vocab, (batch, length)).astype(np.int32)
  prob_BS = rng.uniform(0.05, 1.0, (batch, length)).astype(np.float32)
  logits_BAV = jnp.asarray(rng.normal(size=(batch, width, vocab)) * 2, jnp.float32)
  followed_BA = np.array([[5, 6, 7, 8], [6, 7, 8, 9], [1, 2, 3, 4]], np.int32)
  sampling = SamplingConfig(0.7, top_k=5)
  got = np.asarray(hindsight_scores(logits_BAV, jnp.asarray(followed_BA),
                                    _context(seq_BS, prob_BS, sampling)))
  q_BAV = np.asarray(warped_probs(logits_BAV, sampling))
  for b in range(batch):
    for a in range(width):
      y, t = seq_BS[b, followed_BA[b, a]], followed_BA[b, a]
      assert math.isclose(got[b, a], min(1.0, q_BAV[b, a, y] / prob_BS[b, t]), rel_tol=1e-5)
  assert (got >= 0).all() and (got <= 1).all() and (got < 1).any()
  # greedy (no SampledHindsight): whether the draft's argmax is the token that followed
  greedy = np.asarray(hindsight_scores(logits_BAV, jnp.asarray(followed_BA), _context(seq_BS)))
  expected = np.argmax(np.asarray(logits_BAV), -1) == np.take_along_axis(seq_BS, followed_BA, 1)
  np.testing.assert_array_equal(greedy, expected)


def test_the_score_estimates_the_acceptance_probability():
  """y ~ p: the mean of min(1, q(y) / p(y)) is sum_x min(p, q), the probability that a draft
  drawn from q is accepted. Two wrong estimators read off the same draws fail: the ratio the
  other way up (a draft's acceptance ratio, read at the target's token) and the greedy
  agreement a greedy run uses."""
  rng = np.random.default_rng(1)
  draws, vocab = 40_000, 6
  for case in range(4):
    p = rng.dirichlet(np.full(vocab, 0.7))
    q = rng.dirichlet(np.full(vocab, 0.7))
    exact = np.minimum(p, q).sum()
    y = rng.choice(vocab, size=draws, p=p)
    seq_BS = np.concatenate([np.zeros((draws, 1), np.int32), y[:, None].astype(np.int32)], 1)
    logits_BAV = jnp.broadcast_to(jnp.log(jnp.asarray(q, jnp.float32)), (draws, 1, vocab))
    prob_BS = np.stack([np.ones(draws), p[y]], 1).astype(np.float32)
    score = np.asarray(hindsight_scores(logits_BAV, jnp.ones((draws, 1), jnp.int32),
                                        _context(seq_BS, prob_BS, SamplingConfig(1.0))))[:, 0]
    stderr = score.std() / math.sqrt(draws)
    assert abs(score.mean() - exact) < Z * stderr, (case, score.mean(), exact)
    for wrong in (np.minimum(1.0, p[y] / q[y]), (y == np.argmax(q)).astype(float)):
      assert abs(wrong.mean() - exact) > Z * max(wrong.std() / math.sqrt(draws), stderr), case


def test_a_sampled_stretch_learns_the_acceptance_of_its_positions():
  """A noisy draft model under gamma="auto", sampled, where drafting would pay only at a
  first-draft acceptance above 0.9 (it never drafts): a check after every plain step scores
  that step's token, so the record's rate (first drafts accepted / seen, all in hindsight) is
  the mean of the scores over the run's positions. It must match the exact acceptance
  sum_x min(p, q) at those positions, computed from both models' distributions over the
  generated sequences."""
  target, tp = tiny_llama(vocab_size=32, dim=16, n_layers=2, n_heads=2, n_kv_heads=1,
                          hidden_dim=32, seed=5)
  dp = perturbed(tp, 0.6, seed=6)
  sampling = SamplingConfig(1.0)
  batch, new = 48, 24
  rng = np.random.default_rng(2)
  prompts = pad_prompts([list(rng.integers(1, 32, 5)) for _ in range(batch)])
  cfg = AdaptiveConfig(4, widths=(1, 2, 3, 5), target_costs=(1.0, 1.92, 2.9, 4.8),
                       draft_cost=0.0,
                       rules=AdaptiveRules(prior=0.0, probe_every=1, probe_growth=1, give_up=0.0,
                                           min_gain=0.0, probe_share=0.0,
                                           loss_budget=math.inf, prompt_look=False))
  program, _ = prepare_program(target, DraftModelDrafter(target), *prompts, gamma=cfg,
                               max_new_tokens=new, sampling=sampling, key=jax.random.key(3))
  assert program.records_followed_probs  # (sampled, and the drafter scores its catch-ups)
  out = speculate(target, tp, DraftModelDrafter(target), dp, *prompts, gamma=cfg,
                  max_new_tokens=new, sampling=sampling, key=jax.random.key(3))
  m = summarize(out.metrics)
  assert m["rounds"] == m["adaptive"]["undrafted_rounds"], m  # plain steps only
  stats = out.metrics.adaptive
  seen = int(np.sum(stats.first_seen_B))
  # each row's plain-step tokens, each once, from token 2 (the first is the prefill's) until
  # the last few, past the last check (a probe's window: AdaptiveRound.plan's last_probe)
  steps = seen // batch
  assert seen == batch * steps and new // 2 < steps < new - 1, seen
  learned = float(np.sum(stats.first_accepted_B)) / seen

  tokens_BP, lengths_B = prompts
  exact = []
  for b in range(batch):
    seq = np.concatenate([np.asarray(tokens_BP[b, :lengths_B[b]]), np.asarray(out.tokens[b])])
    pos = np.arange(len(seq))[None]
    p_SV, q_SV = (np.asarray(warped_probs(model_logits, sampling)) for model_logits in (
        target.apply(params, seq[None], pos, target.init_cache(1, len(seq)))[0][0]
        for params in (tp, dp)))
    # the distributions that drew generated tokens 2 .. steps + 1
    rows = slice(int(lengths_B[b]), int(lengths_B[b]) + steps)
    exact.extend(np.minimum(p_SV[rows], q_SV[rows]).sum(-1))
  exact = np.asarray(exact)
  # the scores' spread bounds the standard error; the positions are the same ones
  assert abs(learned - exact.mean()) < Z * 0.5 / math.sqrt(seen), (learned, exact.mean())
  assert 0.2 < exact.mean() < 0.9  # (a draft neither useless nor the target)


@pytest.fixture(scope="module")
def joint_t1(small_pair):
  target, tp = small_pair[:2]
  return exact_joint(target, tp, PROMPT, DEPTH, SamplingConfig(1.0))


def test_sampled_distribution_with_hindsight_steering_the_rounds(small_pair, joint_t1):
  """The distribution test with sampled hindsight deciding when rounds draft: one row with a
  longer budget sets the batch's finish, a check after its first plain step lifts the
  estimates from a low prior, and the rounds that follow draft for every row. Decided from
  past tokens only, so the first tokens still follow the target."""
  target, tp = small_pair[:2]
  sampling = SamplingConfig(1.0)
  cfg = AdaptiveConfig(4, widths=(1, 2, 3, 5), target_costs=(1.0, 1.2, 1.4, 1.8), draft_cost=0.1,
                       # (no look at the prompt, and verified rounds teach their outcomes:
                       # the first round's rejection on the long row is what makes it check)
                       rules=AdaptiveRules(prior=0.3, learning_rate=0.5, probe_every=1,
                                           initial_gamma=4, prompt_look=False,
                                           exact_acceptance=False))
  out = speculate(target, tp, DraftModelDrafter(target), perturbed(tp, 0.7, seed=3),
                  *pad_prompts([PROMPT] * SAMPLES), gamma=cfg, max_new_tokens=DEPTH + 9,
                  budgets_B=[DEPTH + 9] + [DEPTH + 3] * (SAMPLES - 1), sampling=sampling,
                  key=jax.random.key(1))
  m = summarize(out.metrics)
  stats = out.metrics.adaptive
  # one plain stretch, checked in hindsight (one position a row: first drafts seen beyond
  # the verified ones, a row-round each), then drafted rounds that accepted drafts
  assert m["adaptive"]["undrafted_rounds"] == 1, m["adaptive"]
  assert int(np.sum(out.metrics.accepted_B)) > SAMPLES // 2, m
  verified_first = int(np.sum(stats.admitted_hist_G1[1:]))
  assert int(np.sum(stats.first_seen_B)) - verified_first == SAMPLES, m["adaptive"]
  assert pvalue_vs_exact(out.tokens, joint_t1) > SIGNIFICANCE


@pytest.mark.parametrize("kind", ["medusa", "eagle", "dflash", "dspark"])
def test_sampled_distribution_with_each_familys_hindsight(small_pair, joint_t1, kind):
  """The distribution test for the other families that score sampled stretches (random
  heads on the test target): a check after the first plain step scores every row in
  hindsight before the rounds that follow are planned, and the first tokens still follow
  the target."""
  from test_block_drafters import _random_drafter
  from test_trained_drafters import _random_head
  target, tp = small_pair[:2]
  spec, own = (_random_head(kind, target) if kind in ("medusa", "eagle")
               else _random_drafter(kind, target, seed=4))
  drafter = spec.drafter
  assert drafter.has_sampled_hindsight
  cfg = AdaptiveConfig(2, widths=(1, 2, 3), target_costs=(1.0, 1.2, 1.4), draft_cost=0.1,
                       # (a prior no round pays at: the first round is a plain stretch)
                       rules=AdaptiveRules(prior=0.1, learning_rate=0.5, probe_every=1,
                                           initial_gamma=2, prompt_look=False))
  out = speculate(target, tp, drafter, spec.draft_params(own, target, tp),
                  *pad_prompts([PROMPT] * SAMPLES), gamma=cfg, max_new_tokens=DEPTH + 9,
                  budgets_B=[DEPTH + 9] + [DEPTH + 3] * (SAMPLES - 1),
                  sampling=SamplingConfig(1.0), key=jax.random.key(1))
  stats = out.metrics.adaptive
  verified_first = int(np.sum(stats.admitted_hist_G1[1:]))
  assert int(np.sum(stats.first_seen_B)) - verified_first >= SAMPLES, summarize(out.metrics)
  assert pvalue_vs_exact(out.tokens, joint_t1) > SIGNIFICANCE


@pytest.mark.parametrize("sampling", [SamplingConfig(0.8), SamplingConfig(0.8, top_k=5),
                                      SamplingConfig(0.9, top_p=0.8)],
                         ids=["temperature", "top_k", "top_p"])
def test_a_sampled_look_at_the_prompt_learns_the_exact_acceptance(stories, story_prompts,
                                                                  sampling):
  """Before its first round, a sampled watching program learns, after each of the prompt's
  last min(8, length) positions, the exact probability sum_x min(p, q) that the draft
  model's first draft there would be accepted (both models teacher-forced on the prompt,
  both distributions warped as the run's rounds warp them), as from a catch-up in
  hindsight: not the greedy agreement a greedy run learns."""
  from test_adaptive import _prompt_look
  model, params = stories
  draft_params = perturbed(params, 0.25, seed=1)
  prompts = pad_prompts(story_prompts, width=12)
  cfg = AdaptiveConfig(4, widths=(1, 2, 3, 5), target_costs=(1.0, 1.2, 1.4, 1.8), draft_cost=0.1,
                       rules=AdaptiveRules(give_up=0.0))
  program, args = prepare_program(model, DraftModelDrafter(model), *prompts, gamma=cfg,
                                  max_new_tokens=16, sampling=sampling, key=jax.random.key(0))
  stats = _prompt_look(program, params, draft_params, args)
  tokens_BP, lengths_B = map(np.asarray, prompts)
  positions = np.broadcast_to(np.arange(tokens_BP.shape[1], dtype=np.int32), tokens_BP.shape)
  probs = {}
  for name, p in (("target", params), ("draft", draft_params)):
    logits = model.apply(p, tokens_BP, positions, model.init_cache(*tokens_BP.shape))[0]
    if sampling.top_k or sampling.top_p < 1.0:  # the rounds' own warp (checked against HF)
      probs[name] = np.asarray(warped_probs(logits, sampling), np.float64)
    else:  # temperature alone, computed here
      logits = np.asarray(logits, np.float64) / sampling.temperature
      e = np.exp(logits - logits.max(-1, keepdims=True))
      probs[name] = e / e.sum(-1, keepdims=True)
  exact_all = []
  lr, prior = cfg.rules.learning_rate, cfg.rules.prior
  for row, length in enumerate(lengths_B):
    window = np.arange(max(0, length - HINDSIGHT_WIDTH), length)
    exact = np.minimum(probs["target"][row, window], probs["draft"][row, window]).sum(-1)
    assert int(stats.first_seen_B[row]) == len(window)
    np.testing.assert_allclose(float(stats.first_accepted_B[row]), exact.sum(), rtol=1e-4)
    expected = prior + (1 - (1 - lr) ** len(window)) * (exact.mean() - prior)
    np.testing.assert_allclose(stats.estimate_BG[row, 0], expected, rtol=1e-4)
    exact_all.extend(exact)
  # neither certain nor hopeless, and fractional where greedy agreement would be 0 or 1
  exact_all = np.asarray(exact_all)
  assert 0.2 < exact_all.mean() < 0.95 and np.sum((0.1 < exact_all) & (exact_all < 0.9)) >= 3


def test_sampled_distribution_with_the_prompt_look_steering_the_rounds(small_pair, joint_t1):
  """The distribution test where the look at the prompt steers the rounds: from a prior below
  break-even, the exact acceptance at the prompt's positions makes the rounds draft from the
  first (one row with a longer budget sets the batch's finish, as above); with the look off,
  the same program's rows verify almost no drafts. Decided from the prompt and both models
  alone, so the first tokens still follow the target."""
  target, tp = small_pair[:2]
  runs = {}
  for look in (True, False):
    cfg = AdaptiveConfig(2, widths=(1, 2, 3), target_costs=(1.0, 1.2, 1.4), draft_cost=0.1,
                         rules=AdaptiveRules(prior=0.1, learning_rate=0.5, probe_every=4,
                                             initial_gamma=2, min_gain=0.0, prompt_look=look))
    runs[look] = speculate(target, tp, DraftModelDrafter(target), perturbed(tp, 0.7, seed=3),
                           *pad_prompts([PROMPT] * SAMPLES), gamma=cfg, max_new_tokens=DEPTH + 9,
                           budgets_B=[DEPTH + 9] + [DEPTH + 3] * (SAMPLES - 1),
                           sampling=SamplingConfig(1.0), key=jax.random.key(1))
  verified = {look: int(np.sum(out.metrics.adaptive.admitted_hist_G1[1:]))
              for look, out in runs.items()}
  assert verified[True] >= SAMPLES > 10 * verified[False], verified
  assert int(np.sum(runs[True].metrics.accepted_B)) > SAMPLES // 2
  assert pvalue_vs_exact(runs[True].tokens, joint_t1) > SIGNIFICANCE


def test_exact_acceptance_is_sum_of_min_p_q_at_each_draft():
  """What a sampled verified round teaches at each position: sum_x min(p, q), p the target's
  warped distribution there and q the draft's; p(draft) for a deterministic drafter (q
  one-hot); 0 where the logits are not finite."""
  from spec_jax.adaptive.rounds import exact_acceptance
  rng = np.random.default_rng(4)
  batch, drafts, vocab = 3, 2, 6
  logits_BGV = jnp.asarray(rng.normal(size=(batch, drafts, vocab)) * 2, jnp.float32)
  q_BGV = jnp.asarray(rng.dirichlet(np.ones(vocab), (batch, drafts)), jnp.float32)
  drafts_BG = jnp.asarray(rng.integers(0, vocab, (batch, drafts)), jnp.int32)
  sampling = SamplingConfig(0.7, top_k=4)
  p_BGV = np.asarray(warped_probs(logits_BGV, sampling))
  got = np.asarray(exact_acceptance(drafts_BG, q_BGV, warped_probs(logits_BGV, sampling)))
  np.testing.assert_allclose(got, np.minimum(p_BGV, np.asarray(q_BGV)).sum(-1), rtol=1e-5)
  copied = np.asarray(exact_acceptance(drafts_BG, None, warped_probs(logits_BGV, sampling)))
  np.testing.assert_allclose(copied, np.take_along_axis(p_BGV, np.asarray(drafts_BG)[..., None],
                                                        -1)[..., 0], rtol=1e-5)
  broken = np.asarray(exact_acceptance(drafts_BG, q_BGV, warped_probs(
      logits_BGV.at[1].set(jnp.nan), sampling)))
  assert (broken[1] == 0).all() and (broken[0] == got[0]).all()
  broken_copy = np.asarray(exact_acceptance(drafts_BG, None, warped_probs(
      logits_BGV.at[1].set(jnp.nan), sampling)))
  assert (broken_copy[1] == 0).all() and (broken_copy[0] == copied[0]).all()


@pytest.mark.parametrize("exact", [True, False])
def test_a_sampled_round_learns_the_exact_acceptance_of_its_draft(small_pair, exact):
  """One drafted round per row (a budget of 3 tokens: the prefill's, a draft and the one
  the verdict adds): with AdaptiveRules.exact_acceptance each row's first-draft record and
  estimate learn the exact probability sum_x min(p, q) that its draft would be accepted
  after its prompt and first token, computed here from both models; without it, the 0/1
  outcome its verifier drew."""
  target, tp = small_pair[:2]
  dp = perturbed(tp, 0.7, seed=3)
  rows, prior, lr = 64, 0.9, 0.5
  cfg = AdaptiveConfig(1, widths=(1, 2), target_costs=(1.0, 1.1), draft_cost=0.0,
                       rules=AdaptiveRules(prior=prior, learning_rate=lr, prompt_look=False,
                                           exact_acceptance=exact))
  sampling = SamplingConfig(1.0)
  out = speculate(target, tp, DraftModelDrafter(target), dp, *pad_prompts([PROMPT] * rows),
                  gamma=cfg, max_new_tokens=3, sampling=sampling, key=jax.random.key(5))
  stats = out.metrics.adaptive
  assert (np.asarray(stats.first_seen_B) == 1).all()  # one verified first draft a row
  first_B = np.asarray(out.tokens)[:, 0]
  exact_B = []
  for token in first_B:
    seq = np.asarray(PROMPT + [int(token)])[None]
    pos = np.arange(seq.shape[1])[None]
    p, q = (np.asarray(warped_probs(target.apply(params, seq, pos,
                                                 target.init_cache(1, seq.shape[1]))[0][0, -1],
                                    sampling)) for params in (tp, dp))
    exact_B.append(np.minimum(p, q).sum())
  exact_B = np.asarray(exact_B)
  learned_B = np.asarray(stats.first_accepted_B)
  if exact:
    np.testing.assert_allclose(learned_B, exact_B, rtol=1e-4)
    np.testing.assert_allclose(stats.estimate_BG[:, 0], prior + lr * (exact_B - prior),
                               rtol=1e-4)
  else:  # the coins: 0 or 1, both drawn
    assert set(np.unique(learned_B)) == {0.0, 1.0}
  assert 0.2 < exact_B.mean() < 0.95 and len(np.unique(first_B)) > 1
