"""Block drafters (DFlash, DSpark) and the target-layer features they read: the features
option changes nothing else, greedy output equals autoregressive output, sampled output
follows the target's distribution, the draft-side context cache equals a fresh computation,
training blocks are aligned, and bad files and mismatched targets are refused clearly.

Tiny random targets and untrained (random, nonzero) drafters throughout: losslessness must
hold for any drafter weights. Trained drafters are measured by scripts/drafter_table.py.
"""

from __future__ import annotations

import json
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from conftest import tiny_llama
from spec_jax.core.sampling import SamplingConfig, warped_probs
from spec_jax.drafters import make_drafter
from spec_jax.drafters.base import target_with_features
from spec_jax.drafters.dflash import (DFlashConfig, block_targets, default_feature_layers,
                                     random_anchors)
from spec_jax.drafters.dspark import DSparkDrafter
from spec_jax.generate import generate, pad_prompts
from spec_jax.losses import TargetOutputs
from spec_jax.metrics import summarize
from spec_jax.models.params_io import CheckpointError
from spec_jax.speculative import prepare, speculative_generate
from spec_jax.training import distill as td
from test_speculative import (DEPTH, PROMPT, SAMPLES, SIGNIFICANCE, VOCAB,
                              assert_cache_prefix_close, exact_joint, pvalue_vs_exact)

KINDS = ("dflash", "dspark")
DRAFTS = 2  # drafts per block (block of 3): the distribution test runs the block full
PROMPTS = [[3, 1, 4, 1, 5, 2, 6], [5], [2, 7], [1, 2, 3, 4, 5, 6, 7, 0, 1, 2, 3], [6, 6, 6, 1]]


@pytest.fixture(scope="module")
def tiny_target():
  return tiny_llama(vocab_size=VOCAB, dim=16, n_layers=2, n_heads=2, n_kv_heads=1, hidden_dim=32,
                    seed=11)


def _random_drafter(kind, target, seed=0, scale=0.5, drafts=DRAFTS, layers=1):
  """An untrained drafter with every weight random and nonzero (W2 starts at zero)."""
  spec = td.make_spec(kind, target, num_heads=drafts, draft_layers=layers)
  own = spec.init_params(jax.random.key(seed))
  leaves, treedef = jax.tree.flatten(own)
  keys = jax.random.split(jax.random.key(seed + 1), len(leaves))
  return spec, jax.tree.unflatten(treedef, [
      leaf + scale * jax.random.normal(k, leaf.shape, leaf.dtype) for leaf, k in zip(leaves, keys)])


# --- the target's layer features --------------------------------------------------------------

def test_only_drafters_that_read_layers_change_the_target(tiny_target):
  target, tp = tiny_target
  spec, _ = _random_drafter("dflash", target)
  assert spec.drafter.feature_layers == default_feature_layers(2) == (0, 1)
  tokens, lengths = pad_prompts([PROMPT])
  kw = dict(max_new_tokens=4, sampling=SamplingConfig(), eos_id=None, key=None, budgets_B=None,
            pad_id=0, cache_len=None, verifier=None)
  program, _ = prepare(target, spec.drafter, tokens, lengths, gamma=2, **kw)
  assert program.target == target.with_feature_layers((0, 1))
  eagle = td.make_spec("eagle", target).drafter
  assert target_with_features(target, eagle) is target
  assert prepare(target, eagle, tokens, lengths, gamma=2, **kw)[0].target is target
  # a sharded target keeps its mesh wrapper
  from spec_jax.sharding import ShardedModel
  mesh = jax.make_mesh((1, 1), ("data", "model"))
  sharded = target_with_features(ShardedModel(target, mesh), spec.drafter)
  assert isinstance(sharded, ShardedModel) and sharded.model.feature_layers == (0, 1)
  assert default_feature_layers(5) == (1, 2, 3) and default_feature_layers(32) == (1, 16, 30)


# --- lossless -----------------------------------------------------------------------------------

@pytest.mark.parametrize("kind", KINDS)
def test_catch_up_leaves_the_state_and_runs_no_block(tiny_target, kind):
  # a round that verifies none of a block drafter's drafts (gamma="auto"'s plain steps, a
  # combination's other rows) leaves its state alone: the context K/V grows in `commit`
  target, tp = tiny_target
  spec, own = _random_drafter(kind, target)
  state = object()  # never looked at
  ctx = None
  assert spec.drafter.catch_up(spec.draft_params(own, target, tp), state, ctx, DRAFTS,
                               SamplingConfig(), jax.random.key(0)) is state


@pytest.mark.parametrize("kind,gamma", [("dflash", DRAFTS), ("dspark", DRAFTS), ("dspark", 1)])
def test_greedy_identity(tiny_target, kind, gamma):
  target, tp = tiny_target
  spec, own = _random_drafter(kind, target)
  prompts = pad_prompts(PROMPTS)
  reference = generate(target, tp, *prompts, max_new_tokens=24, eos_id=0)
  out = speculative_generate(target, tp, spec.drafter, spec.draft_params(own, target, tp),
                             *prompts, gamma=gamma, max_new_tokens=24, eos_id=0)
  assert np.array_equal(out.tokens, reference.tokens)
  assert np.array_equal(out.num_tokens, reference.num_tokens)
  assert summarize(out.metrics)["mean_accepted"] > 0.05  # some drafts were accepted


def test_dflash_with_auto_is_greedy_identical(tiny_target):
  # gamma="auto" with a DFlash block (no confidence head: the rules read its top
  # probabilities); "auto" drafts at most the block's DRAFTS slots
  from spec_jax.engine import speculate
  target, tp = tiny_target
  spec, own = _random_drafter("dflash", target)
  assert spec.drafter.max_gamma == DRAFTS
  prompts = pad_prompts(PROMPTS)
  reference = generate(target, tp, *prompts, max_new_tokens=24, eos_id=0)
  out = speculate(target, tp, spec.drafter, spec.draft_params(own, target, tp), *prompts,
                  gamma="auto", max_new_tokens=24, eos_id=0)
  assert np.array_equal(out.tokens, reference.tokens)
  assert np.array_equal(out.num_tokens, reference.num_tokens)
  assert max(summarize(out.metrics)["adaptive"]["width_rounds"]) == DRAFTS + 1


@pytest.mark.parametrize("kind", KINDS)
def test_plain_stretches_write_the_context_the_next_round_reads(tiny_target, kind):
  # gamma="auto"'s plain stretches: a block drafter skips rounds, each plain step writing its
  # position's context K/V (record_plain_step). The rounds after must draft exactly what they
  # draft when every plain step runs the generic round and its commit: same accepted drafts
  import dataclasses
  from spec_jax.adaptive import AdaptiveConfig, AdaptiveRules
  from spec_jax.engine import speculate
  target, tp = tiny_target
  spec, own = _random_drafter(kind, target)

  @dataclasses.dataclass(frozen=True)
  class Stretching(type(spec.drafter)):
    def acceptance_estimates(self, state):
      return None  # a random DSpark head's confidences would admit no draft at all

  @dataclasses.dataclass(frozen=True)
  class EveryStep(Stretching):
    skips_rounds = False

  assert Stretching(spec.drafter.model).skips_rounds
  prompts = pad_prompts(PROMPTS)
  reference = generate(target, tp, *prompts, max_new_tokens=40, eos_id=0)
  # drafting pays only now and then: plain stretches between drafted rounds (probes, not
  # hindsight, which finds a random drafter's guesses hopeless and never drafts again; no
  # loss budget, which charges the stretching drafter's catch-ups and not the other's
  # catch-up in each plain step, so the two would stop drafting at different rounds)
  config = AdaptiveConfig(DRAFTS, target_costs=(1.0, 1.5, 1.9), draft_cost=0.3,
                          rules=AdaptiveRules(confidence=0.0, survival=0.0, probe_every=4,
                                              probe_growth=1, hindsight=False,
                                              loss_budget=math.inf))
  outs = [speculate(target, tp, d, spec.draft_params(own, target, tp), *prompts, gamma=config,
                    max_new_tokens=40, eos_id=0)
          for d in (Stretching(spec.drafter.model), EveryStep(spec.drafter.model))]
  for out in outs:
    assert np.array_equal(out.tokens, reference.tokens)
    assert np.array_equal(out.num_tokens, reference.num_tokens)
  stretch, step = (summarize(o.metrics) for o in outs)
  widths = stretch["adaptive"]["width_rounds"]
  assert widths.get(1, 0) > 0 and sum(widths.values()) > widths[1], widths
  assert (stretch["mean_accepted"], widths) == (step["mean_accepted"],
                                                 step["adaptive"]["width_rounds"])


def test_adaptive_rounds_read_dspark_confidences(tiny_target):
  # gamma="auto" truncates DSpark's blocks with its confidence head: greedy output unchanged,
  # and confidences of 0 (a head that expects every draft to fail) admit next to nothing
  from spec_jax.adaptive import AdaptiveConfig
  from spec_jax.engine import speculate
  target, tp = tiny_target
  spec, own = _random_drafter("dspark", target)
  prompts = pad_prompts(PROMPTS)
  reference = generate(target, tp, *prompts, max_new_tokens=24, eos_id=0)
  draft_params = spec.draft_params(own, target, tp)
  config = AdaptiveConfig(DRAFTS, target_costs=(1.0, 1.0, 1.0), draft_cost=0.0)
  out = speculate(target, tp, spec.drafter, draft_params, *prompts, gamma=config,
                  max_new_tokens=24, eos_id=0)
  assert np.array_equal(out.tokens, reference.tokens)
  assert summarize(out.metrics)["adaptive"]["mean_admitted"] > 0

  class Doubtful(type(spec.drafter)):
    def acceptance_estimates(self, state):
      return jnp.zeros_like(super().acceptance_estimates(state))

  doubtful = Doubtful(spec.drafter.model)
  out = speculate(target, tp, doubtful, draft_params, *prompts, gamma=config, max_new_tokens=24,
                  eos_id=0)
  assert np.array_equal(out.tokens, reference.tokens)
  a = summarize(out.metrics)["adaptive"]
  assert a["admitted_hist"][0] > 0.8 * sum(a["admitted_hist"])  # nearly every round: none


@pytest.mark.parametrize("kind", KINDS)
def test_hindsight_and_prompt_guesses_are_the_greedy_first_drafts(tiny_target, kind):
  """A block drafter's look back (gamma="auto"'s plain stretches learn from it instead of
  probing): for a round started at each of the stretch's last HINDSIGHT_WIDTH pending
  positions, whether its greedy first draft, one block over the context before it, would
  have been the token that followed; and at the prompt, the guesses themselves. Both are
  what propose drafts there. Draft j > 1 is slot j of that round's block, not slot 1 of a
  later one: the hindsight speaks for the first draft alone."""
  from spec_jax.drafters.base import HINDSIGHT_WIDTH, DraftContext, PromptInfo, SampledHindsight
  target, tp = tiny_target
  spec, own = _random_drafter(kind, target, seed=5)
  drafter, draft_params = spec.drafter, spec.draft_params(own, target, tp)
  assert drafter.has_hindsight and drafter.guesses_at_init
  assert not drafter.hindsight_speaks_for_later_drafts
  prompts = pad_prompts(PROMPTS)
  seq_BS = jnp.asarray(generate(target, tp, *prompts, max_new_tokens=24).sequences)
  rows = np.arange(seq_BS.shape[0])
  positions_BS = jnp.broadcast_to(jnp.arange(seq_BS.shape[1], dtype=jnp.int32), seq_BS.shape)
  _, hidden, _ = target.with_feature_layers(drafter.feature_layers).apply(
      tp, seq_BS, positions_BS, target.init_cache(*seq_BS.shape))
  full_B = jnp.full((seq_BS.shape[0],), seq_BS.shape[1], jnp.int32)
  # every position's context exact, as record_plain_step and commit leave it
  state = drafter.init(draft_params, PromptInfo(seq_BS, full_B, seq_BS.shape[1], hidden))
  ctx = lambda pos_B: DraftContext(seq_BS, jnp.asarray(pos_B), seq_BS[rows, pos_B])
  first = jax.jit(lambda pos_B: drafter.propose(draft_params, state, ctx(pos_B), 1,
                                                SamplingConfig(0.0), jax.random.key(0))[0][:, 0])
  at_B = np.asarray(prompts[1]) + 14
  rounds = 9  # more steps than the hindsight sees
  kept, agree_BA = jax.jit(drafter.catch_up_with_hindsight, static_argnums=(3, 4))(
      draft_params, state, ctx(at_B), rounds, DRAFTS)
  assert agree_BA.shape == (len(at_B), HINDSIGHT_WIDTH)
  assert jax.tree.all(jax.tree.map(lambda a, b: bool((a == b).all()), kept, state))
  for a in range(HINDSIGHT_WIDTH):
    pending_B = at_B - HINDSIGHT_WIDTH + a
    followed_B = np.asarray(seq_BS)[rows, pending_B + 1]
    np.testing.assert_array_equal(agree_BA[:, a], np.asarray(first(pending_B)) == followed_B)
  assert 0 < np.mean(agree_BA) < 1  # both outcomes occur: the comparison can fail
  # sampled (drafters.SampledHindsight): min(1, q(y) / p(y)), q the distribution propose
  # draws the first draft from there (DSpark's: with the Markov bias from the pending token)
  assert drafter.has_sampled_hindsight
  sampling = SamplingConfig(1.0)
  prob_BS = jax.random.uniform(jax.random.key(1), seq_BS.shape, minval=0.05, maxval=1.0)
  hindsight = SampledHindsight(prob_BS, sampling)
  _, score_BA = jax.jit(drafter.catch_up_with_hindsight, static_argnums=(3, 4))(
      draft_params, state, ctx(at_B).replace(sampled_hindsight=hindsight), rounds, DRAFTS)
  q_first = jax.jit(lambda pos_B: drafter.propose(draft_params, state, ctx(pos_B), 1, sampling,
                                                  jax.random.key(0))[1][:, 0])
  for a in range(HINDSIGHT_WIDTH):
    pending_B = at_B - HINDSIGHT_WIDTH + a
    followed_B = np.asarray(seq_BS)[rows, pending_B + 1]
    q_B = np.asarray(q_first(pending_B))[rows, followed_B]
    np.testing.assert_allclose(score_BA[:, a], np.minimum(
        1.0, q_B / np.asarray(prob_BS)[rows, pending_B + 1]), rtol=1e-4, atol=1e-7)
  assert 0 < float(np.mean(score_BA)) < 1
  # the look at the prompt: guesses at every prompt position after the first, from the
  # prefill's context
  tokens_BP, lengths_B = prompts
  _, prompt_hidden, _ = target.with_feature_layers(drafter.feature_layers).apply(
      tp, tokens_BP, positions_BS[:, :tokens_BP.shape[1]], target.init_cache(*tokens_BP.shape))
  positions_BA = np.minimum(np.arange(tokens_BP.shape[1])[None, :],
                            np.asarray(lengths_B)[:, None] - 1).astype(np.int32)
  _, guess_BA = jax.jit(drafter.init_with_guesses)(
      draft_params, PromptInfo(tokens_BP, lengths_B, tokens_BP.shape[1] + 8, prompt_hidden),
      jnp.asarray(positions_BA))
  for a in range(positions_BA.shape[1]):
    q_B = positions_BA[:, a]  # (none at q = 0: no round starts there)
    np.testing.assert_array_equal(guess_BA[:, a], np.where(q_B > 0, first(q_B), -1))
  assert (guess_BA[:, 0] == -1).all() and (guess_BA[:, 1:] >= 0).any()
  # and a sampled run's look: the distributions propose draws those first drafts from
  _, logits_BAV, has_BA = jax.jit(drafter.init_with_first_logits)(
      draft_params, PromptInfo(tokens_BP, lengths_B, tokens_BP.shape[1] + 8, prompt_hidden),
      jnp.asarray(positions_BA))
  np.testing.assert_array_equal(has_BA, positions_BA > 0)
  for a in range(1, positions_BA.shape[1]):
    q_B = positions_BA[:, a]
    np.testing.assert_allclose(warped_probs(logits_BAV[:, a], sampling)[q_B > 0],
                               np.asarray(q_first(q_B))[q_B > 0], rtol=1e-4, atol=1e-6)


_JOINTS: dict = {}  # exact_joint runs eagerly (slow): once per sampling setting


@pytest.mark.parametrize("sampling", [SamplingConfig(1.0), SamplingConfig(0.7, top_k=4),
                                      SamplingConfig(1.3, top_p=0.8)],
                         ids=["temperature", "top_k", "top_p"])
@pytest.mark.parametrize("kind", KINDS)
def test_sampled_distribution_matches_target(tiny_target, kind, sampling):
  """gamma = the block's drafts: every round drafts the whole block."""
  target, tp = tiny_target
  spec, own = _random_drafter(kind, target, seed=4)
  assert spec.max_gamma == DRAFTS
  out = speculative_generate(target, tp, spec.drafter, spec.draft_params(own, target, tp),
                             *pad_prompts([PROMPT] * SAMPLES), gamma=DRAFTS, max_new_tokens=DEPTH,
                             sampling=sampling, key=jax.random.key(1))
  assert (np.asarray(out.num_tokens) == DEPTH).all()
  if sampling not in _JOINTS:
    _JOINTS[sampling] = exact_joint(target, tp, PROMPT, DEPTH, sampling)
  assert pvalue_vs_exact(out.tokens, _JOINTS[sampling]) > SIGNIFICANCE
  m = summarize(out.metrics)
  assert m["mean_accepted"] > 0.1  # drafts were accepted, not only bonus tokens
  assert m["position_acceptance"][DRAFTS - 1] > 0  # the block's last draft too


# --- the draft-side cache -----------------------------------------------------------------------

@pytest.mark.parametrize("kind", KINDS)
def test_context_cache_equals_a_fresh_computation_after_sampled_rounds(tiny_target, kind):
  """After sampled rounds, the context K/V up to the target's length equals one pass of the
  drafter's context projection over the final tokens' true target features: rejected
  drafts left no trace, and the length is the target's."""
  target, tp = tiny_target
  spec, own = _random_drafter(kind, target, seed=7, drafts=3, layers=2)
  head_params = spec.draft_params(own, target, tp)
  tokens, lengths = pad_prompts(PROMPTS)
  out, cache, state = speculative_generate(
      target, tp, spec.drafter, head_params, tokens, lengths, gamma=2, max_new_tokens=20,
      sampling=SamplingConfig(1.0), key=jax.random.key(3), cache_len=48, return_state=True)
  m = summarize(out.metrics)
  assert 0.2 < m["mean_accepted"] and m["accept_hist"][0] > 0  # ragged acceptance
  np.testing.assert_array_equal(state.cache.length_B, cache.length_B)
  seq = jnp.asarray(out.sequences)
  positions = jnp.broadcast_to(jnp.arange(seq.shape[1], dtype=jnp.int32), seq.shape)
  _, hidden, _ = target.with_feature_layers(spec.drafter.feature_layers).apply(
      tp, seq, positions, target.init_cache(*seq.shape))
  fresh = spec.model.write_context(head_params, spec.model.features(hidden), positions,
                                   spec.model.init_cache(*seq.shape))
  for row, length in enumerate(np.asarray(cache.length_B)):
    assert_cache_prefix_close(state.cache, fresh, row, int(length), f"{kind} row {row}")
  if kind == "dspark":  # the last round's confidences: gamma columns in (0, 1), zeros after
    conf = np.asarray(DSparkDrafter.confidences(state))
    assert conf.shape == (len(PROMPTS), 3)
    assert ((conf[:, :2] > 0) & (conf[:, :2] < 1)).all() and (conf[:, 2] == 0).all()


# --- training blocks ----------------------------------------------------------------------------

def test_training_blocks_are_aligned():
  """Slot j of the block at anchor a is compared with x_{a+j} and with the target's logits at
  a+j-1; it sees x_{a+j-1} as its Markov input; weights decay as exp(-(j-1)/decay) and vanish
  past the sequence or the mask."""
  batch, length, vocab, size = 2, 12, 50, 4
  tokens = jax.random.randint(jax.random.key(0), (batch, length), 0, vocab)
  logits = 5.0 * jax.nn.one_hot(jnp.concatenate([tokens[:, 1:], tokens[:, :1]], 1), vocab)
  mask = jnp.arange(length)[None] < jnp.array([[length], [9]])
  t = TargetOutputs(tokens, mask, logits, jnp.zeros((batch, length, 4)))
  anchors, usable = random_anchors(jax.random.key(1), mask, 6, size)
  assert (anchors >= 1).all() and usable.all()
  for b in range(batch):
    assert len(set(np.asarray(anchors[b]).tolist())) == 6
    assert (np.asarray(anchors[b]) < int(mask[b].sum()) - 1).all()  # a real token after it
  bt = block_targets(t, anchors, usable, size, decay=4.0)
  for b in range(batch):
    for i, a in enumerate(np.asarray(anchors[b])):
      for j in range(1, size):
        w = float(bt.weight_BAJ[b, i, j - 1])
        if a + j < length and mask[b, a + j]:
          assert bt.labels_BAJ[b, i, j - 1] == tokens[b, a + j]
          assert bt.prev_BAJ[b, i, j - 1] == tokens[b, a + j - 1]
          assert jnp.argmax(bt.teacher_BAJV[b, i, j - 1]) == tokens[b, a + j]
          assert w == pytest.approx(np.exp(-(j - 1) / 4.0))
        else:
          assert w == 0.0


# --- files and targets --------------------------------------------------------------------------

@pytest.mark.parametrize("kind", KINDS)
def test_export_load_and_mismatched_targets(kind, tmp_path):
  target, tp = tiny_llama(vocab_size=VOCAB, dim=16, n_layers=4, n_heads=2, n_kv_heads=1,
                          hidden_dim=32, seed=2)
  spec, own = _random_drafter(kind, target)
  assert spec.drafter.feature_layers == (1, 2)
  folder = td.export_drafter(tmp_path / kind, spec, own)
  loaded_kind, model, params = td.load_drafter(folder, target, tp)
  assert loaded_kind == kind and model == spec.model
  jax.tree.map(np.testing.assert_array_equal, params.own, own)
  drafter, _ = make_drafter(kind, target, tp, checkpoint=folder)
  assert drafter == spec.drafter
  other = dict(vocab_size=VOCAB, dim=16, n_layers=4, n_heads=2, n_kv_heads=1, hidden_dim=32)
  for change, message in [(dict(vocab_size=12), "vocabulary 8 != target vocabulary 12"),
                          (dict(dim=32, n_heads=4), "width 16, the target's are 32"),
                          (dict(n_layers=2), r"reads target layers \(1, 2\), but the target "
                                             "has 2 layers")]:
    wrong, wrong_params = tiny_llama(**{**other, **change})
    with pytest.raises(ValueError, match=message):
      td.load_drafter(folder, wrong, wrong_params)
  shallow, shallow_params = tiny_llama(**{**other, "n_layers": 2})
  with pytest.raises(ValueError, match="has 2 layers"):  # a drafter built in memory too
    speculative_generate(shallow, shallow_params, spec.drafter,
                         spec.draft_params(own, target, tp), *pad_prompts([PROMPT]), gamma=1,
                         max_new_tokens=2)
  with pytest.raises(ValueError, match=r"drafts at most 2 tokens per round \(a block of 3: .*\), got gamma=3"):
    speculative_generate(target, tp, spec.drafter, spec.draft_params(own, target, tp),
                         *pad_prompts([PROMPT]), gamma=3, max_new_tokens=2)


def test_bad_block_drafter_files_fail_clearly(tmp_path):
  target, tp = tiny_llama(vocab_size=VOCAB, dim=16, n_layers=2, n_heads=2, n_kv_heads=1,
                          hidden_dim=32)
  folders = {}
  for kind in KINDS:
    spec, own = _random_drafter(kind, target)
    folders[kind] = td.export_drafter(tmp_path / kind, spec, own)
  meta = json.loads((folders["dflash"] / td.DRAFTER_JSON).read_text())
  broken = tmp_path / "broken"
  broken.mkdir()
  (broken / td.DRAFTER_WEIGHTS).write_bytes((folders["dflash"] / td.DRAFTER_WEIGHTS).read_bytes())
  for change, what in [({"block_size": 1}, "block_size must be an integer >= 2"),
                       ({"feature_layers": []}, "feature_layers must be distinct"),
                       ({"feature_layers": [0, -1]}, "feature_layers must be distinct"),
                       ({"block_size": None}, "block_size")]:
    bad = {**meta, "config": {**meta["config"], **change}}
    (broken / td.DRAFTER_JSON).write_text(json.dumps(bad))
    with pytest.raises(CheckpointError, match=f"malformed drafter description.*{what}"):
      td.load_drafter(broken, target, tp)
  missing = {**meta, "config": {k: v for k, v in meta["config"].items() if k != "block_size"}}
  (broken / td.DRAFTER_JSON).write_text(json.dumps(missing))
  with pytest.raises(CheckpointError, match="malformed drafter description"):
    td.load_drafter(broken, target, tp)
  # three feature layers' worth of fc weights for a two-layer description
  more = {**meta, "config": {**meta["config"], "feature_layers": [0, 1, 2]}}
  (broken / td.DRAFTER_JSON).write_text(json.dumps(more))
  with pytest.raises(CheckpointError, match="fc.kernel has shape .* the dflash config expects"):
    td.load_drafter(broken, target, tp)
  # DFlash weights under a DSpark description: the Markov and confidence heads are missing
  (broken / td.DRAFTER_JSON).write_text((folders["dspark"] / td.DRAFTER_JSON).read_text())
  with pytest.raises(CheckpointError, match="do not match the dspark config"):
    td.load_drafter(broken, target, tp)
  data = (folders["dspark"] / td.DRAFTER_WEIGHTS).read_bytes()
  (broken / td.DRAFTER_WEIGHTS).write_bytes(data[:len(data) // 2])
  with pytest.raises(CheckpointError, match="truncated or malformed"):
    td.load_drafter(broken, target, tp)
  with pytest.raises(ValueError, match="block_size must be an integer >= 2"):
    DFlashConfig.for_target(target.config, block_size=1)


def test_lookup_with_dspark_reads_the_head_on_the_rows_that_draft_from_it(tiny_target):
  # lookup + DSpark under gamma="auto": the rows that draft from DSpark are truncated by its
  # confidence head, the rows that copy from lookup are not (lookup has no head: a copy's
  # top probability, one). A head of zeros then admits lookup's copies alone, a head of ones
  # DSpark's drafts too; greedy output unchanged either way
  from spec_jax.adaptive import AdaptiveConfig
  from spec_jax.drafters.combined import FallbackDrafter
  from spec_jax.drafters.prompt_lookup import PromptLookupDrafter
  from spec_jax.engine import speculate
  target, tp = tiny_target
  spec, own = _random_drafter("dspark", target)
  prompts = pad_prompts(PROMPTS)
  reference = generate(target, tp, *prompts, max_new_tokens=24, eos_id=0)
  draft_params = (None, spec.draft_params(own, target, tp))
  config = AdaptiveConfig(DRAFTS, target_costs=(1.0, 1.0, 1.0), draft_cost=0.0)

  def head(value):
    class Head(type(spec.drafter)):
      def acceptance_estimates(self, state):
        return jnp.full_like(super().acceptance_estimates(state), value)
    combined = FallbackDrafter(PromptLookupDrafter(3, 2), Head(spec.drafter.model))
    assert combined.has_sources
    out = speculate(target, tp, combined, draft_params, *prompts, gamma=config,
                    max_new_tokens=24, eos_id=0)
    assert np.array_equal(out.tokens, reference.tokens)
    return int(out.metrics.adaptive.admitted_B.sum())

  doubtful, confident = head(0.0), head(1.0)
  assert 0 < doubtful < confident, (doubtful, confident)
