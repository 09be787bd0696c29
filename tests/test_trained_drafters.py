"""Trained drafters (Medusa, EAGLE, MTP): lossless before and after training, training helps,
drafter caches stay exact, checkpoints restore and interrupted training resumes exactly.

The corpus is stories260K's own sampled generations; training uses spec_jax.training.distill (the
library behind scripts/train_drafter.py; the shared spec_jax.training loop underneath).
"""

from __future__ import annotations

import json
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from conftest import REPO, STORIES_DIR, require_shared, tiny_llama
from spec_jax.models.drafter_heads import HeadParams, shared_head
from spec_jax.training import distill as td
from spec_jax.losses import shift_left, target_outputs
from spec_jax.drafters.base import HINDSIGHT_WIDTH, DraftContext, PromptInfo, SampledHindsight
from spec_jax.drafters.eagle import EagleTreeDrafter
from spec_jax.drafters.medusa import MedusaTreeDrafter
from spec_jax.drafters.mtp import MTPTreeDrafter
from spec_jax.generate import generate, pad_prompts
from spec_jax.metrics import summarize
from spec_jax.core.sampling import SamplingConfig, warped_probs
from spec_jax.speculative import speculative_generate
from spec_jax.training import restore_best, restore_latest
from spec_jax.tree_speculative import tree_speculative_generate
from spec_jax.tree_verify import verify_tree
from test_speculative import (CACHE_TOL, DEPTH, PROMPT, SAMPLES, SIGNIFICANCE, VOCAB,
                              assert_cache_prefix_close, exact_joint, pvalue_vs_exact)



KINDS = ("medusa", "eagle", "mtp")
HEADS = 3  # Medusa heads / MTP modules
GAMMA = 3
NEW = 40
# Training budget, chosen once for the 2-core CI box: 64 sampled sequences of 64 tokens,
# 200 AdamW steps of 8 sequences.
CORPUS = dict(num_sequences=64, seq_len=64, heldout=8, seed=0, temperature=0.6)
TRAIN = dict(steps=200, batch_size=8, learning_rate=1e-2, warmup_steps=20)
MARGIN = 0.5  # trained must accept at least this many more drafts per round than untrained


@pytest.fixture(scope="module")
def story_reference(stories, story_prompts):
  model, params = stories
  prompts = pad_prompts(story_prompts, width=12)
  return prompts, generate(model, params, *prompts, max_new_tokens=NEW, eos_id=1)


@pytest.fixture(scope="module")
def corpus(stories):
  model, params = stories
  return td.generated_corpus(model, params, **CORPUS)


@pytest.fixture(scope="module")
def trained(stories, corpus):
  """kind -> (spec, untrained params, trained params), each kind trained once, on demand."""
  model, params = stories
  done = {}

  def get(kind):
    if kind not in done:
      spec = td.make_spec(kind, model, num_heads=HEADS)
      trainer = td.Trainer(spec, model, params, corpus, **TRAIN)
      own, info = trainer.run(progress=False)
      done[kind] = (spec, trainer.initial_params(), own)
    return done[kind]

  return get


def _generate(stories, spec, own, prompts, **kw):
  model, params = stories
  return speculative_generate(model, params, spec.drafter, spec.draft_params(own, model, params),
                              *prompts, gamma=GAMMA, max_new_tokens=NEW, eos_id=1, **kw)


# --- greedy identity and acceptance on stories260K -------------------------------------------

@pytest.mark.slow
@pytest.mark.parametrize("kind", KINDS)
def test_greedy_identity_and_training_raises_acceptance(stories, story_reference, trained, kind):
  prompts, reference = story_reference
  spec, untrained, own = trained(kind)
  results = {}
  for name, p in (("untrained", untrained), ("trained", own)):
    out = _generate(stories, spec, p, prompts)
    assert np.array_equal(out.tokens, reference.tokens), name
    assert np.array_equal(out.num_tokens, reference.num_tokens), name
    m = summarize(out.metrics)
    results[name] = (m["mean_accepted"], m["mean_accepted_with_bonus"])
  print(f"\n{kind}: mean accepted (without, with bonus), gamma={GAMMA}: {results}")
  assert results["trained"][0] >= results["untrained"][0] + MARGIN, results


def _fresh_features(stories, seq):
  model, params = stories
  positions = np.broadcast_to(np.arange(seq.shape[1], dtype=np.int32), seq.shape)
  _, hidden, _ = model.apply(params, seq, positions, model.init_cache(*seq.shape))
  return hidden, positions


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["eagle", "mtp", "mtp_tree"])
def test_drafter_cache_matches_a_fresh_pass_over_true_features(stories, story_reference, trained,
                                                               kind):
  """After generation the drafter's cache up to its length equals one teacher-forced pass
  over the final tokens and the target's true features (drafts left no trace)."""
  model, params = stories
  prompts, _ = story_reference
  tree = kind == "mtp_tree"
  kind = kind.removesuffix("_tree")
  spec, _, own = trained(kind)
  if tree:  # depth GAMMA: the same bounds as the chain
    out, cache, state = tree_speculative_generate(
        model, params, TREES[kind](spec.model), spec.draft_params(own, model, params), *prompts,
        max_new_tokens=NEW, eos_id=1, return_state=True)
  else:
    out, cache, state = _generate(stories, spec, own, prompts, return_state=True)
  seq = np.asarray(out.sequences)
  final_B = np.asarray(prompts[1]) + np.asarray(out.num_tokens)  # tokens known, pending included
  hidden, positions = _fresh_features(stories, seq)
  head_params = spec.draft_params(own, model, params)
  fresh_cache = spec.model.init_cache(*seq.shape)
  if kind == "eagle":
    _, _, fresh = spec.model.apply(head_params, hidden, shift_left(jnp.asarray(seq), 1),
                                   positions, fresh_cache)
  else:
    _, fresh = spec.model.apply(head_params, hidden, seq, positions, fresh_cache)
  lengths = np.asarray(state.cache.length_B)
  for row, length in enumerate(lengths):
    target_len = int(np.asarray(cache.length_B)[row])
    np.testing.assert_allclose(state.features_BSD[row, :target_len], hidden[row, :target_len],
                               err_msg=f"features, row {row}", **CACHE_TOL)
    assert final_B[row] - 2 * GAMMA - 1 <= length <= final_B[row]
    layers = 1 if kind == "eagle" else GAMMA
    assert_cache_prefix_close(state.cache, fresh, row, length, f"{kind} cache, row {row}",
                              layers=layers)


TREES = {"medusa": lambda model: MedusaTreeDrafter(model, choices=(
             (0,), (1,), (2,), (0, 0), (0, 1), (1, 0), (0, 0, 0), (0, 1, 0))),
         "eagle": lambda model: EagleTreeDrafter(model, depth=3, top_k=3, nodes=10),
         "mtp": lambda model: MTPTreeDrafter(model, depth=3, top_k=3, nodes=10)}
# for the two-head drafters of the distribution test: >= 2 children at the first level
SMALL_TREES = {"medusa": lambda model: MedusaTreeDrafter(model, choices=((0,), (1,), (0, 0),
                                                                         (1, 0))),
               "eagle": lambda model: EagleTreeDrafter(model, depth=2, top_k=2, nodes=5),
               "mtp": lambda model: MTPTreeDrafter(model, depth=2, top_k=2, nodes=5)}


@pytest.mark.slow
@pytest.mark.parametrize("kind", list(TREES))
def test_tree_greedy_identity_with_trained_drafter(stories, story_reference, trained, kind):
  model, params = stories
  prompts, reference = story_reference
  spec, _, own = trained(kind)
  drafter = TREES[kind](spec.model)
  out = tree_speculative_generate(model, params, drafter, spec.draft_params(own, model, params),
                                  *prompts, max_new_tokens=NEW, eos_id=1)
  assert np.array_equal(out.tokens, reference.tokens)
  assert np.array_equal(out.num_tokens, reference.num_tokens)
  m = summarize(out.metrics)
  print(f"\n{kind} tree ({drafter.num_nodes} nodes, depth {drafter.max_depth}): mean accepted "
        f"{m['mean_accepted']:.3f} (+bonus {m['mean_accepted_with_bonus']:.3f})")
  assert m["mean_accepted"] >= MARGIN  # the trained heads work through the tree too


@pytest.mark.slow
def test_mtp_chain_tree_drafts_what_the_chain_drafter_drafts(stories, story_reference, trained):
  """A chain-shaped static tree is the chain drafter at gamma = depth: the same drafts, so
  the same rounds (the tree's entries E(node, k) are the chain's provisional diagonal)."""
  model, params = stories
  prompts, reference = story_reference
  spec, _, own = trained("mtp")
  drafter = MTPTreeDrafter(spec.model, choices=tuple((0,) * d for d in range(1, GAMMA + 1)))
  tree = tree_speculative_generate(model, params, drafter, spec.draft_params(own, model, params),
                                   *prompts, max_new_tokens=NEW, eos_id=1)
  chain = _generate(stories, spec, own, prompts)
  assert np.array_equal(tree.tokens, reference.tokens)
  assert summarize(tree.metrics)["accept_hist"] == summarize(chain.metrics)["accept_hist"]


# --- exact distribution when sampling, untrained (random, nonzero) drafters -----------------

@pytest.fixture(scope="module")
def tiny_target():
  return tiny_llama(vocab_size=VOCAB, dim=16, n_layers=2, n_heads=2, n_kv_heads=1, hidden_dim=32,
                    seed=11)


def _random_head(kind, target, seed=0, scale=0.5, num_heads=2):
  """An untrained drafter with every weight random and nonzero (Medusa starts as identity)."""
  spec = td.make_spec(kind, target, num_heads=num_heads)
  own = spec.init_params(jax.random.key(seed))
  leaves, treedef = jax.tree.flatten(own)
  keys = jax.random.split(jax.random.key(seed + 1), len(leaves))
  return spec, jax.tree.unflatten(treedef, [
      leaf + scale * jax.random.normal(k, leaf.shape, leaf.dtype) for leaf, k in zip(leaves, keys)])


_JOINTS: dict = {}  # exact_joint runs eagerly (slow): once per sampling setting


def _check_distribution(target, tp, out, sampling):
  assert (np.asarray(out.num_tokens) == DEPTH).all()
  if sampling not in _JOINTS:
    _JOINTS[sampling] = exact_joint(target, tp, PROMPT, DEPTH, sampling)
  assert pvalue_vs_exact(out.tokens, _JOINTS[sampling]) > SIGNIFICANCE
  assert summarize(out.metrics)["mean_accepted"] > 0.1  # drafts were accepted, not only bonus


@pytest.mark.parametrize("kind,sampling", [
    ("medusa", SamplingConfig(1.0)), ("eagle", SamplingConfig(0.7, top_k=4)),
    ("mtp", SamplingConfig(1.3, top_p=0.8))])
def test_sampled_distribution_matches_target(tiny_target, kind, sampling):
  target, tp = tiny_target
  spec, own = _random_head(kind, target)
  out = speculative_generate(target, tp, spec.drafter, spec.draft_params(own, target, tp),
                             *pad_prompts([PROMPT] * SAMPLES), gamma=2, max_new_tokens=DEPTH,
                             sampling=sampling, key=jax.random.key(1))
  _check_distribution(target, tp, out, sampling)


@pytest.mark.parametrize("kind", list(SMALL_TREES))
def test_tree_sampled_distribution_matches_target(tiny_target, kind):
  target, tp = tiny_target
  spec, own = _random_head(kind, target)
  drafter = SMALL_TREES[kind](spec.model)
  sampling = SamplingConfig(1.0)
  out = tree_speculative_generate(target, tp, drafter, spec.draft_params(own, target, tp),
                                  *pad_prompts([PROMPT] * SAMPLES), max_new_tokens=DEPTH,
                                  sampling=sampling, key=jax.random.key(2))
  _check_distribution(target, tp, out, sampling)


# --- the MTP tree drafts what the modules predict along each path ------------------------------

def _tree_paths(tree, b):
  """-> [(node, tokens of the path after the root)] for every node of row b."""
  parents, tokens = np.asarray(tree.parents_BN[b]), np.asarray(tree.tokens_BN[b])
  out = []
  for i in range(len(parents)):
    path, j = [], i
    while j > 0:
      path.append(int(tokens[j]))
      j = parents[j]
    out.append((i, path[::-1]))
  return out


def _check_mtp_tree_children(target, tp, spec, head_params, drafter, state, seq, lengths, pending):
  """Every node's token is among the top_k (static: is the rank-r) prediction of a plain
  teacher-forced MTP pass over the context + the path to its parent, with the target's true
  features: module d+1 at position L-1 predicts a depth-d node's children. So the drafter's
  per-module caches (exact windows, tree attention, positions, hidden chaining) are right."""
  ctx = DraftContext(jnp.asarray(seq), jnp.asarray(lengths), jnp.asarray(pending))
  propose = jax.jit(drafter.propose_tree, static_argnums=3)
  tree, _ = propose(head_params, state, ctx, SamplingConfig(), jax.random.key(0))
  rows, children, parents_at = [], [], []
  for b, length in enumerate(lengths):
    paths = dict(_tree_paths(tree, b))
    for node, path in paths.items():
      if node == 0:
        continue
      parent = int(tree.parents_BN[b, node])
      rows.append(list(seq[b, :length + 1]) + paths[parent])
      children.append((node, path[-1], len(paths[parent]), length))
  tokens_BT, _ = pad_prompts(rows)
  positions_BT = np.broadcast_to(np.arange(tokens_BT.shape[1], dtype=np.int32), tokens_BT.shape)
  _, hidden_BTD, _ = target.apply(tp, tokens_BT, positions_BT, target.init_cache(*tokens_BT.shape))
  logits_ABTV, _ = spec.model.apply(head_params, hidden_BTD, jnp.asarray(tokens_BT), positions_BT,
                                    spec.model.init_cache(*tokens_BT.shape))
  logits_ABTV = np.asarray(logits_ABTV)  # A: the MTP modules
  ranks = drafter.spec.ranks if drafter.choices is not None else None
  for c, (node, token, parent_depth, length) in enumerate(children):
    ranked = np.argsort(-logits_ABTV[parent_depth, c, length - 1])
    if ranks is None:
      assert token in ranked[:drafter.top_k], (c, node)
    else:
      assert ranked[ranks[node]] == token, (c, node)


@pytest.mark.parametrize("shape", [dict(depth=3, top_k=2, nodes=9),
                                   dict(choices=((0,), (1,), (0, 0), (0, 1), (1, 0), (0, 0, 0),
                                                 (0, 1, 0), (1, 0, 1)))])
def test_mtp_tree_children_follow_the_modules(tiny_target, shape):
  target, tp = tiny_target
  spec, own = _random_head("mtp", target, num_heads=3)
  head_params = spec.draft_params(own, target, tp)
  drafter = MTPTreeDrafter(spec.model, **shape)
  prompts = [[3, 1, 4, 1, 5, 2, 6], [5], [2, 7], [1, 2, 3, 4, 5, 6, 7, 0, 1, 2, 3], [6, 6, 6, 1]]
  cache_len = 48
  # at the start: the state from the prompt
  tokens, lengths = pad_prompts(prompts)
  positions = np.broadcast_to(np.arange(tokens.shape[1], dtype=np.int32), tokens.shape)
  _, hidden, _ = target.apply(tp, tokens, positions, target.init_cache(*tokens.shape))
  state = drafter.init(head_params, PromptInfo(jnp.asarray(tokens), jnp.asarray(lengths),
                                               cache_len, hidden))
  seq = np.zeros((len(prompts), cache_len), np.int32)
  seq[:, :tokens.shape[1]] = tokens
  pending = np.array([2, 3, 4, 5, 6], np.int32)
  seq[np.arange(len(prompts)), lengths] = pending
  _check_mtp_tree_children(target, tp, spec, head_params, drafter, state, seq, lengths, pending)
  # after many rounds: sampled, and with a verifier that accepts up to the whole depth (the
  # windows must cover a round that accepted every level)
  for verifier in (verify_tree, _accept_part_of_the_deepest_path):
    out, cache, state = tree_speculative_generate(
        target, tp, drafter, head_params, tokens, lengths, max_new_tokens=16,
        sampling=SamplingConfig(1.0), key=jax.random.key(3), cache_len=cache_len,
        return_state=True, verifier=verifier)
    assert summarize(out.metrics)["mean_accepted"] > 0.2
    seq = np.asarray(out.sequences)
    now = np.asarray(cache.length_B)
    _check_mtp_tree_children(target, tp, spec, head_params, drafter, state, seq, now,
                             seq[np.arange(len(prompts)), now])


def _accept_part_of_the_deepest_path(tree, target_logits_BNV, sampling, key):
  """Not a lossless verifier: keeps a random prefix (often all) of the path to the deepest
  node, whatever the target says; for checking drafter state after any acceptance length."""
  batch = tree.tokens_BN.shape[0]
  rows = jnp.arange(batch)
  node_B = jnp.argmax(tree.depth_BN, axis=1)
  deepest_B = tree.depth_BN[rows, node_B]
  keep_B = jnp.minimum(jax.random.randint(key, (batch,), 0, 2 * tree.max_depth), deepest_B)
  path_BR1 = jnp.zeros((batch, tree.max_depth + 1), jnp.int32)
  for d in range(tree.max_depth, 0, -1):  # walk up from the deepest node
    path_BR1 = path_BR1.at[:, d].set(jnp.where(d <= keep_B, node_B, 0))
    node_B = jnp.where(d <= deepest_B, tree.parents_BN[rows, node_B], node_B)
  last_B = jnp.take_along_axis(path_BR1, keep_B[:, None], axis=1)[:, 0]
  return path_BR1, keep_B, jnp.argmax(target_logits_BNV[rows, last_B], axis=-1).astype(jnp.int32)


# --- losses: alignment, checked with oracle drafters that copy the target -----------------

class _Oracle:
  """Stands in for a drafter model: returns the target's own predictions, aligned as each
  kind's convention says, so every token loss must be zero and every agreement one."""

  def __init__(self, t, kind):
    self.t, self.kind = t, kind

  def init_cache(self, batch, length):
    return None

  def apply(self, params, *args, **kw):
    logits, hidden = self.t.logits_BTV, self.t.hidden_BTD
    if self.kind == "draft_model":
      return logits, hidden, None
    if self.kind == "medusa":  # head k (0-based) at t predicts x_{t+2+k}: target logits at t+1+k
      return jnp.stack([shift_left(logits, 1 + k) for k in range(3)], axis=2)
    if self.kind == "eagle":  # element t predicts f_{t+1} and x_{t+2}
      return shift_left(logits, 1), shift_left(hidden, 1), None
    return jnp.stack([shift_left(logits, k) for k in range(1, 4)]), None  # mtp module k: x_{i+k+1}


class _BadMedusa:
  def __init__(self, t):
    self.t = t

  def apply(self, params, hidden):
    return jnp.stack([self.t.logits_BTV] * 3, axis=2)  # off by one: predicts x_{t+1}


@pytest.mark.parametrize("kind", ["draft_model", "medusa", "eagle", "mtp"])
@pytest.mark.parametrize("token", ["kl", "ce"])
def test_losses_are_aligned_with_each_kinds_convention(tiny_target, kind, token):
  from spec_jax.drafters.registry import trained_family
  target, tp = tiny_target
  tokens = jax.random.randint(jax.random.key(0), (3, 10), 0, VOCAB)
  t = target_outputs(target, tp, tokens)
  loss_fn = trained_family(kind).trained.loss
  loss, metrics = loss_fn(_Oracle(t, kind), None, t, token=token)
  for name, value in metrics.items():
    if name.startswith("agree"):
      assert float(value) == 1.0, (name, metrics)
    if token == "kl" and "loss" in name:
      assert abs(float(value)) < 1e-5, (name, metrics)
  if kind == "eagle":
    assert float(metrics["feature_loss"]) == 0.0
  if token == "kl":
    assert abs(float(loss)) < 1e-5
  # a wrong alignment is caught: the target's unshifted logits for a later token
  if kind == "medusa":
    bad, bad_metrics = loss_fn(_BadMedusa(t), None, t, token=token)
    assert float(bad_metrics["agree_1"]) < 1.0


def test_fresh_medusa_heads_are_the_targets_head(tiny_target):
  target, tp = tiny_target
  spec = td.make_spec("medusa", target, num_heads=2)
  own = spec.init_params(jax.random.key(0))
  t = target_outputs(target, tp, jnp.asarray([[3, 1, 4, 1, 5, 2]]))
  logits = spec.model.apply(HeadParams(own, shared_head(target, tp)), t.hidden_BTD)
  for k in range(2):
    np.testing.assert_allclose(logits[:, :, k], t.logits_BTV, rtol=1e-6, atol=1e-6)


# --- checkpoints ----------------------------------------------------------------------------------

class Interrupted(RuntimeError):
  pass


@pytest.mark.slow
def test_checkpoints_restore_and_interrupted_training_resumes_exactly(stories, corpus, tmp_path):
  model, params = stories
  spec = td.make_spec("eagle", model)
  trainer = td.Trainer(spec, model, params, corpus, steps=12, batch_size=4, learning_rate=1e-2,
                       warmup_steps=3)
  kw = dict(save_every=5, eval_every=4, best_by="loss", progress=False)
  whole, info = trainer.run(checkpoint_dir=str(tmp_path / "whole"), **kw)

  restored = restore_latest(str(tmp_path / "whole"), trainer.initial_state())
  assert int(restored.step) == 12
  jax.tree.map(np.testing.assert_array_equal, restored.params, whole)
  best_params, best_step = restore_best(str(tmp_path / "whole"), whole)
  losses = {e["step"]: e["heldout_loss"] for e in info["evals"]}
  assert sorted(losses) == [4, 8, 12] and best_step == min(losses, key=losses.get)
  assert trainer.heldout_loss(best_params) == losses[best_step]

  def crash_at_7(step):
    if step == 7:
      raise Interrupted
    return trainer.batch(step)

  with pytest.raises(Interrupted):  # dies after 7 steps; the last checkpoint is step 5
    trainer.run(checkpoint_dir=str(tmp_path / "resumed"), batch_fn=crash_at_7, **kw)
  resumed, resumed_info = trainer.run(checkpoint_dir=str(tmp_path / "resumed"), **kw)
  assert resumed_info["start_step"] == 5
  jax.tree.map(np.testing.assert_array_equal, resumed, whole)



@pytest.mark.slow
def test_command_line(tmp_path):
  model = str(require_shared(STORIES_DIR / "stories260K.bin"))
  args = ["--kind", "medusa", "--model", model, "--num-sequences", "8", "--heldout", "2",
          "--seq-len", "16", "--steps", "4", "--save-every", "2", "--eval-every", "2",
          "--best-by", "loss", "--eval-prompts", "2", "--eval-new-tokens", "8", "--gamma", "2",
          "--checkpoint-dir", str(tmp_path / "ckpt")]
  proc = subprocess.run([sys.executable, str(REPO / "scripts" / "train_drafter.py"), *args],
                        capture_output=True, text=True, timeout=600, cwd=REPO)
  assert proc.returncode == 0, proc.stderr
  report = json.loads(proc.stdout)
  assert report["start_step"] == 0 and [e["step"] for e in report["evals"]] == [2, 4]
  for name in ("untrained", "trained", "best"):
    assert report[name]["mean_accepted_with_bonus"] == report[name]["mean_accepted"] + 1
  assert "tok/s" in proc.stderr  # the progress bar
  assert {"drafter.json", "latest", "best"} <= {p.name for p in (tmp_path / "ckpt").iterdir()}


@pytest.mark.parametrize("kind", ["eagle", "mtp"])
def test_last_logits_only_is_the_last_row_of_the_full_logits(tiny_target, kind):
  """Drafters' windows ask their model for the last token's logits alone (XLA computes the
  whole [T, V] head product when only a slice of it is used): the same numbers, the same
  hidden states and cache. Checked for the target handle (draft models, layer skip) too."""
  target, tp = tiny_target
  spec, own = _random_head(kind, target)
  params = spec.draft_params(own, target, tp)
  batch, width = 2, 5
  tokens = jax.random.randint(jax.random.key(2), (batch, width), 0, VOCAB)
  positions = jnp.broadcast_to(jnp.arange(width, dtype=jnp.int32), (batch, width)) + 3
  hidden = jax.random.normal(jax.random.key(3), (batch, width, target.config.dim))
  model = spec.model
  cache = model.init_cache(batch, 16)
  if kind == "eagle":
    run = lambda last: model.apply(params, hidden, tokens, positions, cache, last_logits_only=last)
  else:
    run = lambda last: model.apply_module(params, 2, hidden, tokens, positions, cache,
                                          last_logits_only=last)
  runs = [(run(False), run(True)),
          (target.apply(tp, tokens, positions, target.init_cache(batch, 16)),
           target.apply(tp, tokens, positions, target.init_cache(batch, 16),
                        last_logits_only=True))]
  for (logits, feats, new_cache), (last_logits, last_feats, last_cache) in runs:
    assert last_logits.shape == (batch, 1, logits.shape[-1])
    np.testing.assert_allclose(last_logits, logits[:, -1:], rtol=1e-5, atol=1e-5)
    np.testing.assert_array_equal(last_feats, feats)
    jax.tree.map(np.testing.assert_array_equal, last_cache, new_cache)



@pytest.mark.parametrize("kind", ["eagle", "mtp", "medusa"])
def test_plain_stretches_keep_what_the_next_round_reads(stories, story_reference, trained,
                                                         kind):
  """gamma="auto"'s plain steps: EAGLE, MTP and Medusa skip rounds (the target's hidden state
  of each plain step is recorded, one catch_up_after per stretch runs the windows over it).
  The rounds after must draft exactly what they draft when the drafter catches up in every
  plain step (its catch_up, itself checked against propose's cache below): same tokens,
  same accepted drafts in every round."""
  import dataclasses
  from spec_jax.adaptive import AdaptiveConfig, AdaptiveRules
  from spec_jax.engine import speculate

  model, params = stories
  prompts, reference = story_reference
  spec, _, own = trained(kind)
  draft_params = spec.draft_params(own, model, params)
  cls = type(spec.drafter)

  @dataclasses.dataclass(frozen=True)
  class EveryStep(cls):
    skips_rounds = False

  assert spec.drafter.skips_rounds
  # costs where drafting pays only now and then: plain stretches between drafted rounds
  # (probes in both: a drafter that catches up every step has no stretch to watch)
  auto = AdaptiveConfig(gamma_max=HEADS, target_costs=(1.0, 1.6, 2.0, 2.2), draft_cost=0.3,
                        first_draft_cost=0.2, rules=AdaptiveRules(hindsight=False))
  drafters = (spec.drafter, EveryStep(spec.drafter.model))
  outs = [speculate(model, params, d, draft_params, *prompts, gamma=auto, max_new_tokens=NEW,
                    eos_id=1) for d in drafters]
  for out in outs:
    assert np.array_equal(out.tokens, reference.tokens)
    assert np.array_equal(out.num_tokens, reference.num_tokens)
  stretch, step = (summarize(o.metrics) for o in outs)
  widths = stretch["adaptive"]["width_rounds"]
  assert widths.get(1, 0) > 0, stretch["adaptive"]  # plain steps ran
  assert sum(widths.values()) > widths.get(1, 0)  # and drafted rounds
  assert (stretch["mean_accepted"], widths) == (step["mean_accepted"],
                                                 step["adaptive"]["width_rounds"])


def test_eagle_hindsight_is_its_greedy_first_draft(stories, story_reference, trained):
  """EAGLE's catch-up after a plain stretch says, for a round started at each pending
  position of the stretch, whether EAGLE's greedy first draft there would have been the
  token that followed: what propose drafts at that position. Its later drafts read EAGLE's
  own predicted features, so its hindsight speaks for the first draft alone."""
  model, params = stories
  prompts, reference = story_reference
  spec, _, own = trained("eagle")
  drafter, draft_params = spec.drafter, spec.draft_params(own, model, params)
  assert drafter.has_hindsight and not drafter.hindsight_speaks_for_later_drafts
  assert not EagleTreeDrafter(drafter.model, depth=2, top_k=2, nodes=4).has_hindsight
  seq_BS = jnp.asarray(reference.sequences)
  hidden, _ = _fresh_features(stories, seq_BS)
  # every entry of EAGLE's cache exact (true features over the whole sequence)
  state = drafter.init(draft_params, PromptInfo(seq_BS, jnp.asarray(prompts[1]),
                                                seq_BS.shape[1], hidden))
  rounds, steps = 8, 14
  at_B = np.asarray(prompts[1]) + steps
  rows = np.arange(len(at_B))
  ctx = lambda pos_B: DraftContext(seq_BS, jnp.asarray(pos_B), seq_BS[rows, pos_B])
  _, agree_BW = jax.jit(drafter.catch_up_with_hindsight, static_argnums=(3, 4))(
      draft_params, state, ctx(at_B), rounds, 4)
  seen = HINDSIGHT_WIDTH  # the stretch's last positions (rounds + 1 > that)
  assert agree_BW.shape == (len(at_B), seen) and rounds + 1 > seen
  propose = jax.jit(lambda ctx: drafter.propose(draft_params, state, ctx, 1, SamplingConfig(0.0),
                                                jax.random.key(0))[0][:, 0])
  for w in range(seen):
    pending_B = at_B - seen + w
    first_B = np.asarray(propose(ctx(pending_B)))
    np.testing.assert_array_equal(agree_BW[:, w], first_B == np.asarray(seq_BS)[rows, pending_B + 1])
  assert 0 < np.mean(agree_BW) < 1  # both outcomes occur: the comparison can fail
  # sampled (drafters.SampledHindsight): min(1, q(y) / p(y)) with q the distribution propose
  # draws its first draft from at that position, y the token that followed, p(y) as recorded
  assert drafter.has_sampled_hindsight
  sampling = SamplingConfig(1.0)
  prob_BS = jax.random.uniform(jax.random.key(1), seq_BS.shape, minval=0.05, maxval=1.0)
  sampled_ctx = ctx(at_B).replace(sampled_hindsight=SampledHindsight(prob_BS, sampling))
  _, score_BW = jax.jit(drafter.catch_up_with_hindsight, static_argnums=(3, 4))(
      draft_params, state, sampled_ctx, rounds, 4)
  q_first = jax.jit(lambda ctx: drafter.propose(draft_params, state, ctx, 1, sampling,
                                                jax.random.key(0))[1][:, 0])
  for w in range(seen):
    pending_B = at_B - seen + w
    y_B = np.asarray(seq_BS)[rows, pending_B + 1]
    q_B = np.asarray(q_first(ctx(pending_B)))[rows, y_B]
    np.testing.assert_allclose(score_BW[:, w], np.minimum(1.0, q_B / np.asarray(prob_BS)[
        rows, pending_B + 1]), rtol=1e-4, atol=1e-7)
  assert 0 < float(np.mean(score_BW)) < 1 and float(np.min(score_BW)) < 0.5


def _prompt_guesses(stories, story_reference, trained, kind):
  """A trained drafter's init_with_guesses at every position 0 .. min length - 1 of the
  story prompts -> (drafter, draft params, prompts (tokens, lengths), the target's hidden
  states [B, P, D] and greedy tokens [B, P] there, positions [B, A], guesses [B, A], and
  the first drafts' distributions at temperature 1 [B, A, V], from init_with_first_logits)."""
  model, params = stories
  prompts, _ = story_reference
  spec, _, own = trained(kind)
  drafter, draft_params = spec.drafter, spec.draft_params(own, model, params)
  assert drafter.guesses_at_init
  tokens_BP, lengths_B = (jnp.asarray(x) for x in prompts)
  positions_BP = np.broadcast_to(np.arange(tokens_BP.shape[1], dtype=np.int32), tokens_BP.shape)
  logits, hidden, _ = model.apply(params, tokens_BP, positions_BP,
                                  model.init_cache(*tokens_BP.shape))
  prompt = PromptInfo(tokens_BP, lengths_B, tokens_BP.shape[1] + 8, hidden)
  positions_BA = positions_BP[:, :int(np.min(lengths_B))]
  _, guess_BA = jax.jit(drafter.init_with_guesses)(draft_params, prompt, positions_BA)
  guess_BA = np.asarray(guess_BA)
  assert (guess_BA[:, 0] == -1).all()  # no guess where nothing precedes the pending token
  # (a sampled run's look reads the same first drafts' distributions)
  _, first_BAV, _ = jax.jit(drafter.init_with_first_logits)(draft_params, prompt, positions_BA)
  return (drafter, draft_params, (tokens_BP, lengths_B), hidden,
          np.argmax(np.asarray(logits), -1), positions_BA, guess_BA,
          np.asarray(warped_probs(first_BAV, SamplingConfig(1.0))))


def test_eagle_guesses_at_init_are_its_greedy_first_drafts(stories, story_reference, trained):
  """The look at the prompt for EAGLE: its prefill's guess at each prompt position q is the
  first draft propose makes greedily with the pending token at q (from the element
  (f_{q-1}, x_q), which the prefill ran with true features), and -1 at q = 0, where no
  element precedes the pending token."""
  drafter, draft_params, (_, lengths_B), _, _, positions_BA, guess_BA, q_BAV = _prompt_guesses(
      stories, story_reference, trained, "eagle")
  # propose from a state that knows the whole sequence's true features (every entry exact)
  seq_BS = jnp.asarray(story_reference[1].sequences)
  state = drafter.init(draft_params, PromptInfo(seq_BS, lengths_B, seq_BS.shape[1],
                                                _fresh_features(stories, seq_BS)[0]))
  rows = np.arange(len(lengths_B))
  propose = jax.jit(lambda pos_B, sampling: drafter.propose(
      draft_params, state, DraftContext(seq_BS, pos_B, seq_BS[rows, pos_B]), 1,
      sampling, jax.random.key(0))[:2], static_argnums=1)
  for a in range(1, positions_BA.shape[1]):
    pos_B = jnp.asarray(positions_BA[:, a])
    np.testing.assert_array_equal(guess_BA[:, a], propose(pos_B, SamplingConfig(0.0))[0][:, 0])
    # sampled: the distribution propose draws that first draft from
    np.testing.assert_allclose(q_BAV[:, a], propose(pos_B, SamplingConfig(1.0))[1][:, 0],
                               rtol=1e-4, atol=1e-6)
  target_BA = np.asarray(seq_BS)[rows[:, None], positions_BA + 1]
  agree = guess_BA[:, 1:] == target_BA[:, 1:]
  assert 0 < agree.mean() < 1  # both outcomes occur: the comparison can fail


def test_medusa_guesses_at_init_are_its_greedy_first_drafts(stories, story_reference, trained):
  """The look at the prompt for Medusa: its guess at each prompt position q is head 1 of the
  target's hidden state at q - 1, the first draft propose makes greedily with the pending
  token at q, where the prompt's x_q is the target's greedy token after q - 1 (as in a
  greedy run: head 1 never sees x_q); -1 elsewhere and at q = 0."""
  from spec_jax.drafters.medusa import MedusaState
  (drafter, draft_params, (tokens_BP, lengths_B), hidden, target_greedy_BP, positions_BA,
   guess_BA, q_BAV) = _prompt_guesses(stories, story_reference, trained, "medusa")
  rows = np.arange(len(lengths_B))
  propose = jax.jit(lambda h_BD, pos_B, sampling: drafter.propose(
      draft_params, MedusaState(h_BD), DraftContext(tokens_BP, pos_B, tokens_BP[rows, pos_B]),
      1, sampling, jax.random.key(0))[:2], static_argnums=2)
  width = positions_BA.shape[1]
  followed = 0
  for a in range(1, width):
    first_B = np.asarray(propose(hidden[:, a - 1], jnp.asarray(positions_BA[:, a]),
                                 SamplingConfig(0.0))[0][:, 0])
    np.testing.assert_allclose(q_BAV[:, a], propose(hidden[:, a - 1], jnp.asarray(
        positions_BA[:, a]), SamplingConfig(1.0))[1][:, 0], rtol=1e-4, atol=1e-6)
    greedy_B = target_greedy_BP[:, a - 1] == np.asarray(tokens_BP)[:, a]
    np.testing.assert_array_equal(guess_BA[:, a], np.where(greedy_B, first_B, -1))
    followed += greedy_B.sum()
  assert 0 < followed < (width - 1) * len(lengths_B)  # both kinds of positions occur


def test_eagle_watches_in_hindsight_and_stays_exact(stories, story_reference, trained):
  """gamma="auto" with EAGLE, greedy: plain stretches learn the first draft's estimate in
  hindsight (no probes), drafting resumes where it pays, and the output is the target's."""
  from spec_jax.adaptive import AdaptiveConfig, AdaptiveRules
  from spec_jax.engine import speculate
  model, params = stories
  prompts, reference = story_reference
  spec, _, own = trained("eagle")
  # a prior below break-even (one draft: 1.2 tokens for 1.25 plain steps): only what the
  # stretches see can make drafting pay
  # (and no look at the prompt, which would learn before the first round)
  auto = AdaptiveConfig(gamma_max=HEADS, target_costs=(1.0, 1.2, 1.4, 1.6), draft_cost=0.1,
                        first_draft_cost=0.05,
                        rules=AdaptiveRules(prior=0.2, probe_every=4, prompt_look=False))
  out = speculate(model, params, spec.drafter, spec.draft_params(own, model, params), *prompts,
                  gamma=auto, max_new_tokens=NEW, eos_id=1)
  assert np.array_equal(out.tokens, reference.tokens)
  assert np.array_equal(out.num_tokens, reference.num_tokens)
  m = summarize(out.metrics)["adaptive"]
  widths = m["width_rounds"]
  # the prior plans no drafts and a watched run never probes: drafted rounds came from what
  # the stretches learned
  assert widths.get(1, 0) > 0 and sum(widths.values()) > widths[1], m


def test_medusa_hindsight_is_its_greedy_first_draft(stories, story_reference, trained):
  """Medusa's catch-up after a plain stretch says, for a round started at each pending
  position of the stretch, whether its greedy first draft there (head 1 of the hidden state
  before that pending token, kept in its register of recent states) would have been the token
  that followed: what propose drafts at that position; sampled, min(1, q(y) / p(y)) with q
  head 1's distribution there. Later heads are not head 1 one position on, so its hindsight
  speaks for the first draft alone."""
  model, params = stories
  prompts, reference = story_reference
  spec, _, own = trained("medusa")
  drafter, draft_params = spec.drafter, spec.draft_params(own, model, params)
  assert drafter.has_hindsight and not drafter.hindsight_speaks_for_later_drafts
  seq_BS = jnp.asarray(reference.sequences)
  hidden, _ = _fresh_features(stories, seq_BS)
  tree = MedusaTreeDrafter(drafter.model, choices=((0,), (1,), (0, 0)))
  assert not tree.has_hindsight and tree.init(draft_params, PromptInfo(
      seq_BS, jnp.asarray(prompts[1]), seq_BS.shape[1], hidden)).recent_BRD is None
  rows = np.arange(seq_BS.shape[0])
  # the state at a round whose pending token sits at pos_B (the true hidden states before)
  state_at = lambda pos_B: drafter.init(draft_params, PromptInfo(seq_BS, jnp.asarray(pos_B),
                                                                 seq_BS.shape[1], hidden))
  ctx = lambda pos_B: DraftContext(seq_BS, jnp.asarray(pos_B), seq_BS[rows, pos_B])
  at_B = np.asarray(prompts[1]) + 14
  rounds = 8
  _, agree_BW = jax.jit(drafter.catch_up_with_hindsight, static_argnums=(3, 4))(
      draft_params, state_at(at_B), ctx(at_B), rounds, 4)
  seen = HINDSIGHT_WIDTH
  assert agree_BW.shape == (len(at_B), seen) and rounds + 1 > seen
  propose = jax.jit(lambda pos_B: drafter.propose(draft_params, state_at(pos_B), ctx(pos_B), 1,
                                                  SamplingConfig(0.0), jax.random.key(0))[0][:, 0])
  for w in range(seen):
    pending_B = at_B - seen + w
    first_B = np.asarray(propose(pending_B))
    np.testing.assert_array_equal(agree_BW[:, w],
                                  first_B == np.asarray(seq_BS)[rows, pending_B + 1])
  assert 0 < np.mean(agree_BW) < 1  # both outcomes occur: the comparison can fail
  # sampled (drafters.SampledHindsight): min(1, q(y) / p(y)) with q head 1's distribution,
  # what propose draws its first draft from at that position, and p(y) as recorded
  assert drafter.has_sampled_hindsight
  sampling = SamplingConfig(1.0)
  prob_BS = jax.random.uniform(jax.random.key(1), seq_BS.shape, minval=0.05, maxval=1.0)
  sampled_ctx = ctx(at_B).replace(sampled_hindsight=SampledHindsight(prob_BS, sampling))
  _, score_BW = jax.jit(drafter.catch_up_with_hindsight, static_argnums=(3, 4))(
      draft_params, state_at(at_B), sampled_ctx, rounds, 4)
  q_first = jax.jit(lambda pos_B: drafter.propose(draft_params, state_at(pos_B), ctx(pos_B), 1,
                                                  sampling, jax.random.key(0))[1][:, 0])
  for w in range(seen):
    pending_B = at_B - seen + w
    y_B = np.asarray(seq_BS)[rows, pending_B + 1]
    q_B = np.asarray(q_first(pending_B))[rows, y_B]
    np.testing.assert_allclose(score_BW[:, w], np.minimum(1.0, q_B / np.asarray(prob_BS)[
        rows, pending_B + 1]), rtol=1e-4, atol=1e-7)
  assert 0 < float(np.mean(score_BW)) < 1 and float(np.min(score_BW)) < 0.5


def test_medusa_commit_shifts_in_the_positions_a_round_kept(trained):
  """A drafted round's commit shifts the verify block's kept entries (positions L .. L' - 1)
  into the register: none for a row that kept nothing, one, or the whole block; the hidden
  state the heads read next is the register's newest."""
  from spec_jax.drafters.base import RoundOutcome
  from spec_jax.drafters.medusa import RECENT, MedusaState
  spec, _, _ = trained("medusa")
  rows, width, dim = 3, 4, 2
  old_BRD = jnp.arange(rows * RECENT * dim, dtype=jnp.float32).reshape(rows, RECENT, dim)
  block_BWD = -1.0 - jnp.arange(rows * width * dim, dtype=jnp.float32).reshape(rows, width, dim)
  position_B, kept_B = jnp.array([10, 20, 30]), np.array([0, 1, width])
  ctx = DraftContext(jnp.zeros((rows, 40), jnp.int32), position_B, jnp.zeros(rows, jnp.int32))
  outcome = RoundOutcome(ctx, jnp.zeros((rows, width - 1), jnp.int32),
                         jnp.asarray(np.maximum(kept_B - 1, 0)), jnp.zeros(rows, jnp.int32),
                         position_B + jnp.asarray(kept_B), block_BWD)
  new = spec.drafter.commit(None, MedusaState(old_BRD[:, -1], old_BRD), outcome)
  for b in range(rows):
    expected = np.concatenate([old_BRD[b], block_BWD[b, :kept_B[b]]])[-RECENT:]
    np.testing.assert_array_equal(new.recent_BRD[b], expected)
    np.testing.assert_array_equal(new.hidden_BD[b], expected[-1])


def test_medusa_keeps_the_true_recent_hidden_states_and_watches_exactly(stories,
                                                                       story_reference, trained):
  """gamma="auto" with Medusa, greedy, through drafted rounds (commit) and plain steps
  (record_plain_step): the output is the target's, drafting came from what the stretches
  saw in hindsight, and the register of recent hidden states hindsight reads holds, at the end,
  the target's true hidden state at each of the positions before the pending token."""
  from spec_jax.adaptive import AdaptiveConfig, AdaptiveRules
  from spec_jax.drafters.medusa import RECENT
  from spec_jax.engine import speculate
  model, params = stories
  prompts, reference = story_reference
  spec, _, own = trained("medusa")
  # a prior below break-even (one draft: 1.05 tokens for 1.06 plain steps), cheap drafting
  # above it: only what the stretches see can make drafting pay
  auto = AdaptiveConfig(gamma_max=HEADS, target_costs=(1.0, 1.05, 1.1, 1.15), draft_cost=0.02,
                        first_draft_cost=0.01, rules=AdaptiveRules(prior=0.05, probe_every=4))
  out, cache, state = speculate(model, params, spec.drafter,
                                spec.draft_params(own, model, params), *prompts, gamma=auto,
                                max_new_tokens=NEW, eos_id=1, return_state=True)
  assert np.array_equal(out.tokens, reference.tokens)
  assert np.array_equal(out.num_tokens, reference.num_tokens)
  widths = summarize(out.metrics)["adaptive"]["width_rounds"]
  assert widths.get(1, 0) > 0 and sum(widths.values()) > widths[1], widths
  seq_BS = jnp.asarray(out.sequences)
  hidden, _ = _fresh_features(stories, seq_BS)
  # the register ends before the pending token, at the target cache's last position
  for b, last in enumerate(np.asarray(cache.length_B) - 1):
    np.testing.assert_allclose(state.recent_BRD[b], hidden[b, last - RECENT + 1:last + 1],
                               **CACHE_TOL)


# (EAGLE records its features with the same store_step_features as MTP: one family is
# enough, and this test compiles three programs)
@pytest.mark.parametrize("kind", ["mtp"])
def test_a_stretch_to_the_end_records_no_features_unless_the_state_is_read(
    stories, story_reference, trained, kind):
  """Drafting that never pays: one plain stretch to the end. Nothing reads the drafter's
  state after it, so its target features are not recorded (nor prefilled): the state stays
  zero. A caller that reads the final state (return_state) gets every step's features, as
  a drafter that catches up in every plain step keeps them. Same tokens either way."""
  import dataclasses
  from spec_jax.adaptive import AdaptiveConfig
  from spec_jax.engine import prepare_program, speculate
  from spec_jax.speculative import speculative_jit

  model, params = stories
  prompts, reference = story_reference
  spec, _, own = trained(kind)
  draft_params = spec.draft_params(own, model, params)
  never = AdaptiveConfig(gamma_max=HEADS, target_costs=(1.0, 1.6, 2.0, 2.2), draft_cost=1e3)
  program, args = prepare_program(model, spec.drafter, *prompts, gamma=never,
                                  max_new_tokens=NEW, eos_id=1)
  out, _, state = speculative_jit(program, params, draft_params, *args)
  assert np.array_equal(out.tokens, reference.tokens)
  assert summarize(out.metrics)["adaptive"]["undrafted_rounds"] == summarize(out.metrics)["rounds"]
  assert not np.any(np.asarray(state.features_BSD))

  @dataclasses.dataclass(frozen=True)
  class EveryStep(type(spec.drafter)):
    skips_rounds = False

  kept = [speculate(model, params, d, draft_params, *prompts, gamma=never, max_new_tokens=NEW,
                    eos_id=1, return_state=True) for d in (spec.drafter,
                                                           EveryStep(spec.drafter.model))]
  for out, _, _ in kept:
    assert np.array_equal(out.tokens, reference.tokens)
  lengths = np.asarray(prompts[1]) + np.asarray(reference.num_tokens) - 1  # fed tokens
  (_, _, stretch), (_, _, every) = kept
  for row, length in enumerate(lengths):
    np.testing.assert_allclose(stretch.features_BSD[row, :length],
                               every.features_BSD[row, :length], rtol=1e-5, atol=1e-5)
    assert np.any(np.asarray(stretch.features_BSD[row, :length]))


@pytest.mark.parametrize("kind", ["medusa", "mtp"])
def test_auto_drafts_at_most_what_the_heads_can(stories, story_reference, trained, kind,
                                                monkeypatch):
  """gamma="auto" caps its gamma_max at the drafter's max_gamma (HEADS heads or modules draft
  at most HEADS tokens a round; the default 8 was refused), and stays greedy-identical."""
  from spec_jax import adaptive
  from spec_jax.drafters.combined import FallbackDrafter
  from spec_jax.drafters.prompt_lookup import PromptLookupDrafter
  from spec_jax.engine import prepare_program, speculate
  model, params = stories
  prompts, reference = story_reference
  spec, _, own = trained(kind)
  drafter = spec.drafter
  assert drafter.max_gamma == HEADS
  assert FallbackDrafter(PromptLookupDrafter(), drafter).max_gamma == HEADS
  program, _ = prepare_program(model, drafter, *prompts, gamma="auto", max_new_tokens=NEW)
  assert program.gamma == program.adaptive.gamma_max == HEADS
  assert program.adaptive.widths == (1, 2, 3, HEADS + 1)
  # a config that only changes rules gets the same cap
  rules_only = adaptive.AdaptiveConfig(rules=adaptive.AdaptiveRules(probe_every=4))
  program, _ = prepare_program(model, drafter, *prompts, gamma=rules_only, max_new_tokens=NEW)
  assert program.adaptive.gamma_max == HEADS and program.adaptive.rules.probe_every == 4
  # an explicit gamma_max is taken as asked, and refused in the drafter's own words
  with pytest.raises(ValueError, match=rf"drafts at most {HEADS} tokens per round \(one draft "
                                       rf"per (head|module), {HEADS} "):
    prepare_program(model, drafter, *prompts, gamma=adaptive.AdaptiveConfig(gamma_max=8),
                    max_new_tokens=NEW)
  # a fixed table (what measure_costs returns) where drafting pays: drafted rounds run.
  # Without the look at the prompt: it rightly finds two of the five rows' first drafts
  # mostly wrong (at gamma 3, trained heads accept 4-5 drafts in 40 tokens there, against
  # 22-25 on the others), and a batch waits for its slowest rows, so it would draft little.
  monkeypatch.setattr(adaptive.costs, "measure_costs",
                      lambda *a, **k: ((1.0, 1.1, 1.2, 1.3), 0.1, 0.05))
  no_look = adaptive.AdaptiveConfig(rules=adaptive.AdaptiveRules(prompt_look=False))
  out = speculate(model, params, drafter, spec.draft_params(own, model, params), *prompts,
                  gamma=no_look, max_new_tokens=NEW, eos_id=1)
  assert np.array_equal(out.tokens, reference.tokens)
  assert np.array_equal(out.num_tokens, reference.num_tokens)
  m = summarize(out.metrics)["adaptive"]
  assert m["width_rounds"].get(HEADS + 1, 0) > 0, m


@pytest.mark.parametrize("kind", ["eagle", "mtp", "eagle_tree", "mtp_tree"])
def test_catch_up_leaves_the_exact_cache_entries_propose_leaves(tiny_target, kind):
  """EAGLE's and MTP's catch_up (no drafting, no heads) leave the drafter's cache as propose
  does at every slot propose marks exact (below its length), with at least that length; the
  entries past it are provisional and the next window rewrites them. From a state after a
  few sampled rounds, so the windows start mid-sequence."""
  from spec_jax.speculative import speculative_generate
  target, tp = tiny_target
  spec, own = _random_head(kind.removesuffix("_tree"), target, num_heads=3)
  head_params = spec.draft_params(own, target, tp)
  drafter = spec.drafter
  tokens, lengths = pad_prompts([[3, 1, 4, 1, 5, 2, 6], [5], [2, 7, 1, 0]])
  out, cache, state = speculative_generate(
      target, tp, drafter, head_params, tokens, lengths, gamma=3, max_new_tokens=9,
      sampling=SamplingConfig(1.0), key=jax.random.key(3), cache_len=40, return_state=True)
  seq, now = jnp.asarray(out.sequences), cache.length_B
  ctx = DraftContext(seq, now, seq[jnp.arange(3), now])
  args = (head_params, state, ctx, 3, SamplingConfig(), jax.random.key(0))
  proposed = jax.jit(drafter.propose, static_argnums=(3, 4))(*args)[2].cache
  if kind.endswith("_tree"):  # the tree's windows (depth 3) on the chain drafter's state
    tree_class = EagleTreeDrafter if kind == "eagle_tree" else MTPTreeDrafter
    drafter = tree_class(drafter.model, depth=3, top_k=2, nodes=7)
    proposed = jax.jit(drafter.propose_tree, static_argnums=3)(
        head_params, state, ctx, SamplingConfig(), jax.random.key(0))[1].cache
  caught_up = jax.jit(drafter.catch_up, static_argnums=(3, 4))(*args).cache
  assert (np.asarray(caught_up.length_B) >= np.asarray(proposed.length_B)).all()
  slot = np.arange(proposed.k_LBKES.shape[-1])
  for b, length in enumerate(np.asarray(proposed.length_B)):
    assert length > 0
    for a, c in ((proposed.k_LBKES, caught_up.k_LBKES), (proposed.v_LBKES, caught_up.v_LBKES)):
      np.testing.assert_allclose(np.asarray(c)[:, b][..., slot < length],
                                 np.asarray(a)[:, b][..., slot < length], rtol=1e-5, atol=1e-6)


def test_a_medusa_tree_with_auto_is_greedy_identical(stories, story_reference, trained):
  """gamma="auto" with a trained Medusa tree (a static tree of its heads' top choices): rounds
  choose a node budget (the tree cut to its first nodes) or plain steps, both happen, and
  the output is identical to autoregressive decoding."""
  from spec_jax.adaptive import AdaptiveConfig, tree_widths
  from spec_jax.engine import speculate
  model, params = stories
  prompts, reference = story_reference
  spec, _, own = trained("medusa")
  drafter = TREES["medusa"](spec.model)
  widths = tree_widths(drafter.num_nodes)
  out = speculate(model, params, drafter, spec.draft_params(own, model, params), *prompts,
                  gamma=AdaptiveConfig(widths=widths, target_costs=(1.0, 2.0, 2.1, 2.3, 2.5),
                                       draft_cost=0.2),
                  max_new_tokens=NEW, eos_id=1)
  assert np.array_equal(out.tokens, reference.tokens)
  assert np.array_equal(out.num_tokens, reference.num_tokens)
  m = summarize(out.metrics)
  rounds = m["adaptive"]["width_rounds"]
  assert rounds[1] > 0 and sum(rounds.values()) > rounds[1], rounds
  assert sum(rounds.values()) == m["rounds"] and m["mean_accepted"] > 0


@pytest.mark.parametrize("kind", ["eagle", "mtp"])
def test_trees_with_auto_are_greedy_identical(stories, story_reference, trained, kind):
  """gamma="auto" with a trained EAGLE or MTP tree: rounds choose a node budget or plain
  steps (the whole tree costs 2.5 steps, cut ones 2-2.3: each pays only while it is
  accepted, so both happen), output identical
  to autoregressive; plain stretches (one catch_up_after each) draft what catching up in
  every plain step drafts."""
  import dataclasses
  from spec_jax.adaptive import AdaptiveConfig
  from spec_jax.engine import speculate
  model, params = stories
  prompts, reference = story_reference
  spec, _, own = trained(kind)
  cls = EagleTreeDrafter if kind == "eagle" else MTPTreeDrafter

  @dataclasses.dataclass(frozen=True)
  class EveryStep(cls):
    skips_rounds = False

  outs = [speculate(model, params, c(spec.drafter.model, depth=3, top_k=2, nodes=8),
                    spec.draft_params(own, model, params), *prompts,
                    gamma=AdaptiveConfig(widths=(1, 2, 3, 5, 8),
                                         target_costs=(1.0, 2.0, 2.1, 2.3, 2.5), draft_cost=0.2),
                    max_new_tokens=NEW, eos_id=1) for c in (cls, EveryStep)]
  for out in outs:
    assert np.array_equal(out.tokens, reference.tokens)
    assert np.array_equal(out.num_tokens, reference.num_tokens)
  stretch, step = (summarize(o.metrics) for o in outs)
  widths = stretch["adaptive"]["width_rounds"]
  assert widths[1] > 0 and sum(widths.values()) > widths[1], widths
  assert (stretch["mean_accepted"], widths) == (step["mean_accepted"],
                                                 step["adaptive"]["width_rounds"])
