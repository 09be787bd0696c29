"""Token trees: builders, the tree verifier, and tree speculative generation (lossless, caches)."""

from __future__ import annotations

import itertools

import hypothesis.extra.numpy as hnp
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from conftest import perturbed
from test_speculative import (  # noqa: F401 (small_pair, story_reference: shared fixtures)
    DEPTH, NEW, PROMPT, SAMPLES, SIGNIFICANCE, VOCAB, _draft, exact_joint,
    assert_cache_prefix_close, pvalue_vs_exact, small_pair, story_reference)
from spec_jax.drafters.base import DraftContext, PromptInfo
from spec_jax.drafters.draft_model import DraftModelDrafter
from spec_jax.drafters.draft_model_tree import DraftModelTreeDrafter
from spec_jax.generate import generate, pad_prompts
from spec_jax.core.kv_cache import KVCache, tree_mask
from spec_jax.metrics import summarize
from spec_jax.core.sampling import SamplingConfig, sample_from_probs, warped_probs
from spec_jax.speculative import speculative_jit
from spec_jax.tree import (TokenTree, ancestor_mask, grow_dynamic_tree, static_tree,
                           tokens_from_topk)
from spec_jax.tree_speculative import compact_path, tree_speculative_generate
from spec_jax.tree_verify import verify_tree, verify_tree_greedy, verify_tree_probs

_verify_probs_jit = jax.jit(verify_tree_probs)


def _tree(tokens, parents, probs=None, max_depth=None):
  """A TokenTree from per-row python lists; depths computed from the parents."""
  parents = np.asarray(parents, np.int32)
  depth = np.zeros_like(parents)
  for b, i in itertools.product(range(parents.shape[0]), range(1, parents.shape[1])):
    depth[b, i] = depth[b, parents[b, i]] + 1
  max_depth = int(depth.max()) if max_depth is None else max_depth
  return TokenTree(jnp.asarray(tokens, jnp.int32), jnp.asarray(parents), jnp.asarray(depth),
                   max_depth, None if probs is None else jnp.asarray(probs, jnp.float32))


def _node_path(tree: TokenTree, b: int, node: int) -> list[int]:
  path = []
  while node >= 0:
    path.append(node)
    node = int(tree.parents_BN[b, node])
  return path[::-1]


# --- builders ---------------------------------------------------------------------------------

def test_static_tree_from_choices():
  spec = static_tree([(1, 0), (0,), (1,), (0, 1), (0, 0), (0, 0, 0)])
  assert spec.choices == ((0,), (1,), (0, 0), (0, 1), (1, 0), (0, 0, 0))
  assert spec.parents == (-1, 0, 0, 1, 1, 2, 3)
  assert spec.depths == (0, 1, 1, 2, 2, 2, 3)
  assert spec.ranks == (0, 0, 1, 0, 1, 0, 0)
  assert (spec.num_nodes, spec.max_depth, spec.max_rank) == (7, 3, 1)
  anc = spec.ancestors()
  assert anc[6].tolist() == [True, True, False, True, False, False, True]
  tree = spec.tree(jnp.zeros((2, 7), jnp.int32))
  np.testing.assert_array_equal(tree.ancestors()[1], anc)
  for bad, msg in [([(0, 1)], "no parent"), ([(0,), (0,)], "duplicates"), ([()], "non-empty"),
                   ([], "at least one")]:
    with pytest.raises(ValueError, match=msg):
      static_tree(bad)


def test_tokens_from_topk():
  spec = static_tree([(0,), (1,), (0, 0), (0, 1), (1, 0)])
  pending_B = jnp.array([7, 8])
  cand_BRC = jnp.array([[[10, 11], [20, 21]], [[30, 31], [40, 41]]])
  np.testing.assert_array_equal(tokens_from_topk(spec, pending_B, cand_BRC),
                                [[7, 10, 11, 20, 21, 20], [8, 30, 31, 40, 41, 40]])


def test_ancestor_mask_and_per_row_tree_mask():
  parents = [[-1, 0, 0, 1, 3, 2], [-1, 0, 1, 2, 3, 4]]  # a branching tree and a chain
  anc = np.asarray(ancestor_mask(jnp.asarray(parents), 5))
  for b, i in itertools.product(range(2), range(6)):
    assert set(np.flatnonzero(anc[b, i])) == set(_node_path(_tree([[0] * 6] * 2, parents), b, i))
  lengths = jnp.array([3, 5])
  per_row = np.asarray(tree_mask(lengths, jnp.asarray(anc), 16))
  for b in range(2):  # the shared-ancestor form gives the same rows
    np.testing.assert_array_equal(per_row[b], tree_mask(lengths, jnp.asarray(anc[b]), 16)[b])
  assert per_row[0, 4].tolist() == [s < 3 or s - 3 in (0, 1, 3, 4) for s in range(16)]
  # fewer queries than block slots: rows 4 and 5 of the tree only
  np.testing.assert_array_equal(tree_mask(lengths, jnp.asarray(anc[:, 4:]), 16), per_row[:, 4:])


def _path_model(seed=0, vocab=7):
  """A 'draft model' whose next-token log-probs depend on the sum of the path's tokens."""
  logits = np.random.default_rng(seed).normal(size=(vocab, vocab)) * 2
  return np.asarray(jax.nn.log_softmax(jnp.asarray(logits, jnp.float32), axis=-1))


def _reference_dynamic_tree(table, root, depth, k, nodes):
  """EAGLE-2 selection, written plainly: -> {path of tokens after the root: score}."""
  vocab = table.shape[0]
  logp = lambda path: table[sum(path) % vocab]
  cands = {}
  frontier = [((root,), 0.0)]
  for d in range(1, depth + 1):
    level = {}
    for path, score in frontier:
      lp = logp(path)
      for t in np.argsort(-lp, kind="stable")[:k]:
        level[path + (int(t),)] = score + float(lp[t])
    cands.update(level)
    frontier = sorted(level.items(), key=lambda kv: -kv[1])[:k]
  best = sorted(cands.items(), key=lambda kv: -kv[1])[:nodes - 1]
  return {path[1:]: s for path, s in best}


@pytest.mark.parametrize("depth,k,nodes", [(4, 3, 16), (3, 2, 7), (1, 3, 3), (3, 1, 4)])
def test_dynamic_tree_matches_reference(depth, k, nodes):
  table = _path_model()
  vocab = table.shape[0]
  pending_B = jnp.array([0, 3, 5])
  batch = pending_B.shape[0]
  num_block = 1 + (depth - 1) * k

  def expand_fn(carry, level):
    # attends like a model would: the tokens of the block slots the node may see
    block_BM, levels = carry
    assert level.tokens_BT.shape == (batch, k)
    block_BM = block_BM.at[:, level.block_ids].set(level.tokens_BT)
    path_sum_BT = jnp.einsum("btm,bm->bt", level.ancestors_BTM.astype(jnp.int32), block_BM)
    return jnp.asarray(table)[path_sum_BT % vocab], (block_BM, levels + [level])

  @jax.jit
  def grow(pending_B):
    block_BM = jnp.zeros((batch, num_block), jnp.int32).at[:, 0].set(pending_B)
    root_logp = jnp.asarray(table)[pending_B % vocab]
    tree, (_, levels) = grow_dynamic_tree(root_logp, pending_B, expand_fn, (block_BM, []),
                                          depth=depth, top_k=k, num_nodes=nodes)
    return tree, levels

  tree, levels = grow(pending_B)
  assert tree.tokens_BN.shape == (batch, nodes) and tree.max_depth == depth
  assert [level.depth for level in levels] == list(range(1, depth))
  for level in levels:  # each node sees the root, its ancestors and itself; its parent is one
    anc_BTM, parent_BT = np.asarray(level.ancestors_BTM), np.asarray(level.parent_block_BT)
    assert anc_BTM[:, :, 0].all() and (anc_BTM.sum(-1) == level.depth + 1).all()
    assert np.take_along_axis(anc_BTM, parent_BT[..., None], axis=2).all()
    assert (parent_BT[..., None] != level.block_ids).all()
  for b in range(batch):
    want = _reference_dynamic_tree(table, int(pending_B[b]), depth, k, nodes)
    parents = np.asarray(tree.parents_BN[b])
    assert parents[0] == -1 and (parents[1:] < np.arange(1, nodes)).all()
    got = {tuple(int(tree.tokens_BN[b, j]) for j in _node_path(tree, b, i)[1:])
           for i in range(1, nodes)}
    assert got == set(want)
    assert [len(_node_path(tree, b, i)) - 1 for i in range(nodes)] == tree.depth_BN[b].tolist()


# --- the verifier on hand-built trees ---------------------------------------------------------

V = 12


def _logits_with_argmax(argmax_BN):
  return jax.nn.one_hot(jnp.asarray(argmax_BN), V) * 5.0


def test_greedy_tree_verification_follows_the_argmax():
  #        0
  #      /   \
  #     1(5)  2(7)
  #     |     |
  #     3(2)  4(3)
  #           |
  #           5(9)
  parents = [[-1, 0, 0, 1, 2, 4]] * 4
  tokens = [[0, 5, 7, 2, 3, 9]] * 3 + [[0, 7, 7, 2, 3, 9]]  # last row: twin siblings
  argmax = [[7, 0, 3, 0, 9, 11],   # deepest branch: 0 -> 2 -> 4 -> 5, bonus 11
            [5, 4, 0, 0, 0, 0],    # first branch, then the target says 4
            [1, 0, 0, 0, 0, 0],    # nothing accepted
            [7, 0, 3, 0, 9, 11]]   # twins: the first sibling (1, a leaf here) wins
  tree = _tree(tokens, parents)
  path, num, nxt = verify_tree(tree, _logits_with_argmax(argmax), SamplingConfig(), None)
  assert path.tolist() == [[0, 2, 4, 5], [0, 1, 0, 0], [0, 0, 0, 0], [0, 1, 0, 0]]
  assert num.tolist() == [3, 1, 0, 1]
  assert nxt.tolist() == [11, 4, 1, 0]


def test_sampling_tries_siblings_in_order():
  # p at the root: half on 5, half on 7; deterministic children [5, 7] or [7, 5]
  batch = 4000
  p = np.zeros((batch, 3, V), np.float32)
  p[:, :, [5, 7]] = 0.5
  for first, second in [(5, 7), (7, 5)]:
    tree = _tree([[0, first, second]] * batch, [[-1, 0, 0]] * batch)
    path, num, nxt = _verify_probs_jit(tree, jnp.asarray(p), jax.random.key(first))
    chosen = np.asarray(path[:, 1])
    assert (np.asarray(num) == 1).all()  # the second sibling takes all the rest
    assert abs((chosen == 1).mean() - 0.5) < 0.04
  # a child the target gives no mass is never accepted; its sibling with all the mass is
  p_one = np.zeros((1, 3, V), np.float32)
  p_one[0, :, 7] = 1.0
  tree = _tree([[0, 5, 7]], [[-1, 0, 0]])
  path, num, nxt = verify_tree_probs(tree, jnp.asarray(p_one), jax.random.key(0))
  assert path.tolist() == [[0, 2]] and num.tolist() == [1] and nxt.tolist() == [7]


def test_no_nan_with_zeros():
  # the residual after rejecting q_c equal to r is all zero: fall back to r, never NaN
  p = np.zeros((2, 3, V), np.float32)
  p[:, 0, [1, 2]] = 0.5
  p[:, 1:, 3] = 1.0
  q = np.zeros((2, 3, V), np.float32)
  q[:, 1, [1, 2]] = 0.5  # child 1 carries token 4, which neither p nor q gives mass
  q[:, 2, 4] = 1.0
  tree = _tree([[0, 4, 4]] * 2, [[-1, 0, 0]] * 2, probs=q)
  for key in range(5):
    path, num, nxt = _verify_probs_jit(tree, jnp.asarray(p), jax.random.key(key))
    assert num.tolist() == [0, 0] and set(np.asarray(nxt).tolist()) <= {1, 2}
  logits = jnp.log(jnp.asarray(p))  # -inf logits too
  _, num, nxt = verify_tree(tree, logits, SamplingConfig(1.0, top_k=3), jax.random.key(1))
  assert np.isfinite(np.asarray(nxt)).all() and set(np.asarray(nxt).tolist()) <= {1, 2}


# --- the sampling verifier is exact: tree drafts from bigram models ---------------------------

def _bigram(rng, zeros: bool):
  w = rng.gamma(0.6, size=(VOCAB, VOCAB))
  if zeros:
    w[rng.random(w.shape) < 0.25] = 0.0
    w[:, 0] += 1e-3  # every row keeps some mass
  return w / w.sum(-1, keepdims=True)


@pytest.mark.parametrize("mode", ["iid", "independent", "deterministic"])
def test_tree_verifier_is_exact_on_bigram_trees(mode):
  """Root with two children, the first with two children and the second with one.

  The first three emitted tokens (past the tree: sampled from the target directly) must
  follow the target's bigram chain exactly.
  """
  rng = np.random.default_rng(7)
  p_tab, q_tab, q2_tab = _bigram(rng, True), _bigram(rng, True), _bigram(rng, False)
  batch, root = 30000, 2
  parents = [-1, 0, 0, 1, 1, 2]
  qs = {"iid": [q_tab, q_tab], "independent": [q_tab, q2_tab],
        "deterministic": [q_tab, q_tab]}[mode]
  tokens = np.zeros((batch, 6), np.int64)
  probs = np.zeros((batch, 6, VOCAB))
  tokens[:, 0] = root

  def draw(dists):
    return (dists.cumsum(-1) > rng.random((len(dists), 1))).argmax(-1)

  for node, sibling in [(1, 0), (2, 1), (3, 0), (4, 1), (5, 0)]:
    dist = qs[sibling][tokens[:, parents[node]]]
    if mode == "deterministic":  # the (sibling)-th most likely draft token
      tokens[:, node] = np.argsort(-dist, axis=-1, kind="stable")[:, sibling]
    else:
      tokens[:, node] = draw(dist)
      probs[:, node] = dist
  tree = _tree(tokens, [parents] * batch, None if mode == "deterministic" else probs)
  target_probs = jnp.asarray(p_tab[tokens], jnp.float32)
  path, num, nxt = _verify_probs_jit(tree, target_probs, jax.random.key(3))
  path, num, nxt = np.asarray(path), np.asarray(num), np.asarray(nxt)
  emitted = np.zeros((batch, DEPTH), np.int64)
  for b in range(batch):
    seq = [int(tokens[b, j]) for j in path[b, 1:num[b] + 1]] + [int(nxt[b])]
    emitted[b, :len(seq[:DEPTH])] = seq[:DEPTH]
  for i in range(DEPTH):  # what later rounds would give: plain samples from the target
    later = (num + 1) <= i
    prev = emitted[:, i - 1] if i else np.full(batch, root)
    emitted[later, i] = draw(p_tab[prev[later]])
  joint = p_tab[root]
  for _ in range(DEPTH - 1):  # joint over sequences; the last token is index % VOCAB
    joint = (joint[:, None] * p_tab[np.arange(joint.size) % VOCAB]).reshape(-1)
  assert pvalue_vs_exact(emitted, joint) > SIGNIFICANCE
  assert 0 < num.mean() < 2  # the tree was actually used


# --- property test --------------------------------------------------------------------------

N_P, V_P, B_P = 7, 5, 3
weights = hnp.arrays(np.float32, (B_P, N_P, V_P),
                     elements=st.sampled_from([0.0, 0.0, 1e-6, 0.1, 0.5, 1.0, 3.0]))


def _normalise(w):
  w = w.copy()
  w[..., 0] += (w.sum(-1) == 0)
  return w / w.sum(-1, keepdims=True)


@settings(max_examples=60, deadline=None)
@given(p_w=weights, q_w=weights,
       parent_u=hnp.arrays(np.float64, (B_P, N_P), elements=st.floats(0, 0.999)),
       tokens=hnp.arrays(np.int32, (B_P, N_P), elements=st.integers(0, V_P - 1)),
       seed=st.integers(0, 2**31 - 1), deterministic=st.booleans())
def test_sampling_verifier_properties(p_w, q_w, parent_u, tokens, seed, deterministic):
  p, q = _normalise(p_w), _normalise(q_w)
  parents = np.floor(parent_u * np.arange(N_P)).astype(np.int32)  # parent < own index
  parents[:, 0] = -1
  if not deterministic:  # a sampling drafter only proposes tokens its q gives mass to
    tokens = np.argmax(q, -1).astype(np.int32)
  tree = _tree(tokens, parents, None if deterministic else q, max_depth=N_P - 1)
  path, num, nxt = _verify_probs_jit(tree, jnp.asarray(p), jax.random.key(seed))
  path, num, nxt = np.asarray(path), np.asarray(num), np.asarray(nxt)
  assert ((0 <= num) & (num <= N_P - 1)).all() and ((0 <= nxt) & (nxt < V_P)).all()
  depth = np.asarray(tree.depth_BN)
  for b in range(B_P):
    assert path[b, 0] == 0 and (path[b, num[b] + 1:] == 0).all()
    for d in range(1, num[b] + 1):
      node, parent = path[b, d], path[b, d - 1]
      assert parents[b, node] == parent and depth[b, node] == d  # a root-to-node path
      assert p[b, parent, tokens[b, node]] > 0  # accepted tokens have target mass
    assert p[b, path[b, num[b]], nxt[b]] > 0  # so does the next token


def test_greedy_verifier_is_sampling_at_temperature_zero():
  rng = np.random.default_rng(0)
  parents = [[-1, 0, 0, 1, 1, 2, 5]] * 64
  tokens = rng.integers(0, 3, (64, 7))
  logits = jnp.asarray(rng.normal(size=(64, 7, 3)), jnp.float32)
  greedy_out = verify_tree_greedy(_tree(tokens, parents), logits)
  probs = warped_probs(logits, SamplingConfig())  # one-hot at the argmax
  sampled_out = verify_tree_probs(_tree(tokens, parents), probs, jax.random.key(1))
  for g, s in zip(greedy_out, sampled_out):
    np.testing.assert_array_equal(g, s)
  assert 0 < float(np.asarray(greedy_out[1]).mean()) < 3


# --- the cache: compaction, and after generation ---------------------------------------------

def test_compact_path_moves_the_path_to_consecutive_slots():
  k = jax.random.normal(jax.random.key(0), (2, 3, 1, 2, 20))  # [L, B, K, H, S]
  v = -k[:, :, :, ::-1]  # [L, B, K, H, S], distinct from k
  cache = KVCache(k, v, jnp.zeros((3,), jnp.int32))
  start = jnp.array([2, 5, 0])
  path = jnp.array([[0, 3, 4, 0], [0, 2, 0, 0], [0, 1, 3, 6]])
  out = compact_path(cache, start, path)
  for b in range(3):
    s = int(start[b])
    for d in range(4):
      src = s + int(path[b, d])
      np.testing.assert_array_equal(out.k_LBKES[:, b, ..., s + d], k[:, b, ..., src])
      np.testing.assert_array_equal(out.v_LBKES[:, b, ..., s + d], v[:, b, ..., src])
    outside = np.r_[0:s, s + 4:20]
    np.testing.assert_array_equal(out.k_LBKES[:, b, ..., outside], k[:, b, ..., outside])
    np.testing.assert_array_equal(out.v_LBKES[:, b, ..., outside], v[:, b, ..., outside])


def _check_caches_match_prefill(model, params, draft_params, out, cache, draft_state, lengths_B,
                                max_depth):
  """Target and draft caches up to their lengths equal a fresh prefill of the same tokens."""
  seq = np.asarray(out.sequences)
  lengths = np.asarray(lengths_B) + np.asarray(out.num_tokens)
  positions = np.broadcast_to(np.arange(seq.shape[1], dtype=np.int32), seq.shape)
  for name, p, c, lag in [("target", params, cache, 1),
                          ("draft", draft_params, draft_state.cache, 1 + max_depth)]:
    _, _, fresh = model.apply(p, seq, positions, model.init_cache(*seq.shape))
    for row, length in enumerate(np.asarray(c.length_B)):
      assert lengths[row] - lag <= length <= lengths[row], (name, row)
      assert_cache_prefix_close(c, fresh, row, length, f"{name} cache, row {row}")


# --- tree speculative generation: greedy identity on stories260K ------------------------------

SHAPES = {
    "dynamic": dict(depth=4, top_k=3, nodes=16),  # EAGLE-2 style, 15 drafts of 30 candidates
    # static: the top-1 chain of depth 4 plus branches
    "static": dict(choices=((0,), (1,), (0, 0), (0, 1), (1, 0), (0, 0, 0), (0, 0, 1),
                            (0, 0, 0, 0))),
}


@pytest.mark.parametrize("kind", ["self", "noisy", "random"])
@pytest.mark.parametrize("shape", list(SHAPES))
def test_greedy_identity_stories260k(stories, story_reference, kind, shape):
  model, params = stories
  prompts, reference = story_reference
  draft_model, draft_params = _draft(kind, stories)
  drafter = DraftModelTreeDrafter(draft_model, **SHAPES[shape])
  out, cache, draft_state = tree_speculative_generate(
      model, params, drafter, draft_params, *prompts, max_new_tokens=NEW, eos_id=1,
      return_state=True)
  assert np.array_equal(out.tokens, reference.tokens)
  assert np.array_equal(out.num_tokens, reference.num_tokens)
  m = summarize(out.metrics)
  assert m["tokens_per_row"] == np.asarray(reference.num_tokens).tolist()
  if kind == "self":
    assert m["accept_hist"][0] == 0  # the draft's top-1 child is always in the tree
    if shape == "static":  # the tree holds the draft's greedy chain: always all accepted
      assert m["accept_hist"][:-1] == [0] * drafter.max_depth
  elif kind == "random":
    assert m["mean_accepted"] < 0.2
  else:
    assert 0.3 < m["mean_accepted"] < 0.95 * drafter.max_depth
    _check_caches_match_prefill(model, params, draft_params, out, cache, draft_state,
                                prompts[1], drafter.max_depth)


@pytest.mark.parametrize("shape", ["dynamic", "static"])
def test_draft_tree_holds_the_draft_models_top_k_children(stories, story_prompts, shape):
  """Every node is one of the top_k tokens of the draft at its parent (static: its rank).

  Checked against a plain causal forward of each node's path, so the draft's tree
  attention (masks, positions, slots of the expanded nodes) must be right.
  """
  model, params = stories
  kw = dict(depth=3, top_k=2, nodes=8) if shape == "dynamic" else SHAPES["static"]
  drafter = DraftModelTreeDrafter(model, **kw)
  tokens, lengths = pad_prompts(story_prompts, width=12)
  cache_len = 32
  state = drafter.init(params, PromptInfo(jnp.asarray(tokens), jnp.asarray(lengths), cache_len))
  seq = np.zeros((len(lengths), cache_len), np.int32)
  seq[:, :12] = tokens
  pending = np.array([7, 300, 42, 260, 501], np.int32)
  seq[np.arange(len(lengths)), lengths] = pending
  ctx = DraftContext(jnp.asarray(seq), jnp.asarray(lengths), jnp.asarray(pending))
  tree, _ = jax.jit(drafter.propose_tree, static_argnums=3)(params, state, ctx,
                                                           SamplingConfig(), jax.random.key(0))
  # one causal batch: each node's context (prefix + path to its parent), right-padded
  contexts, drafts, nodes = [], [], []
  for b, i in itertools.product(range(len(lengths)), range(1, drafter.num_nodes)):
    path = [int(tree.tokens_BN[b, j]) for j in _node_path(tree, b, i)[1:]]
    contexts.append(list(seq[b, :lengths[b] + 1]) + path[:-1])
    drafts.append(path[-1])
    nodes.append(i)
  tokens_BT, context_len_B = pad_prompts(contexts)
  positions_BT = np.broadcast_to(np.arange(tokens_BT.shape[1]), tokens_BT.shape)
  logits, _, _ = model.apply(params, tokens_BT, positions_BT, model.init_cache(*tokens_BT.shape))
  last_BV = np.asarray(logits)[np.arange(len(contexts)), context_len_B - 1]
  ranked_BV = np.argsort(-last_BV, axis=-1)
  if shape == "dynamic":
    assert all(d in ranked[:drafter.top_k] for d, ranked in zip(drafts, ranked_BV))
  else:
    ranks = drafter.spec.ranks
    assert [ranked[ranks[i]] for ranked, i in zip(ranked_BV, nodes)] == drafts


def test_one_compilation_and_bad_drafter(stories, story_prompts):
  model, params = stories
  drafter = DraftModelTreeDrafter(model, **SHAPES["static"])
  run = lambda prompts, eos: tree_speculative_generate(
      model, params, drafter, params, *pad_prompts(prompts, width=12), max_new_tokens=NEW,
      eos_id=eos)
  run(story_prompts, 1)  # the program of test_greedy_identity_stories260k[static-*]
  compiled = speculative_jit._cache_size()
  run(story_prompts[::-1], 2)
  assert speculative_jit._cache_size() == compiled
  with pytest.raises(TypeError, match="TreeDrafter"):
    tree_speculative_generate(model, params, DraftModelDrafter(model), params,
                              *pad_prompts([[1, 2]]), max_new_tokens=4)
  with pytest.raises(ValueError, match="2..7 nodes"):
    tree_speculative_generate(model, params, DraftModelTreeDrafter(model, 2, 2, 9), params,
                              *pad_prompts([[1, 2]]), max_new_tokens=4)
  with pytest.raises(ValueError, match="no parent"):
    tree_speculative_generate(model, params, DraftModelTreeDrafter(model, choices=((1, 0),)),
                              params, *pad_prompts([[1, 2]]), max_new_tokens=4)


# --- distribution identity when sampling ------------------------------------------------------

def accept_first_positive(tree: TokenTree, target_logits_BNV, sampling, key):
  """A wrong tree verifier: takes the first child the target gives any mass, no rejection."""
  p_BNV = warped_probs(target_logits_BNV, sampling)
  batch, num_nodes = tree.tokens_BN.shape
  rows = jnp.arange(batch)
  node_B = num_B = jnp.zeros((batch,), jnp.int32)
  path_BR1 = jnp.zeros((batch, tree.max_depth + 1), jnp.int32)
  for j in range(1, num_nodes):
    ok_B = (tree.parents_BN[:, j] == node_B) & (p_BNV[rows, node_B, tree.tokens_BN[:, j]] > 0)
    path_BR1 = path_BR1.at[rows, jnp.where(ok_B, num_B + 1, path_BR1.shape[1])].set(j, mode="drop")
    node_B, num_B = jnp.where(ok_B, j, node_B), num_B + ok_B
  return path_BR1, num_B, sample_from_probs(key, p_BNV[rows, node_B])


SMALL_SHAPES = {"dynamic": dict(depth=2, top_k=2, nodes=5),  # always both depth-1 children
                "static": dict(choices=((0,), (1,), (2,), (0, 0), (1, 0)))}


def _sample_tree(small_pair, sampling, shape, verifier=verify_tree, seed=1):
  target, tp, draft, dp = small_pair
  out = tree_speculative_generate(target, tp, DraftModelTreeDrafter(draft, **SMALL_SHAPES[shape]),
                                  dp, *pad_prompts([PROMPT] * SAMPLES), max_new_tokens=DEPTH,
                                  sampling=sampling, key=jax.random.key(seed), verifier=verifier)
  assert (np.asarray(out.num_tokens) == DEPTH).all()
  return out


@pytest.mark.parametrize("sampling,shape", [(SamplingConfig(1.0), "dynamic"),
                                            (SamplingConfig(0.8, top_k=5), "static")])
def test_sampled_distribution_matches_target(small_pair, sampling, shape):
  target, tp = small_pair[:2]
  joint = exact_joint(target, tp, PROMPT, DEPTH, sampling)
  out = _sample_tree(small_pair, sampling, shape)
  assert pvalue_vs_exact(out.tokens, joint) > SIGNIFICANCE
  assert summarize(out.metrics)["mean_accepted"] > 0.3  # drafts were accepted, not only bonus


def test_distribution_test_catches_a_wrong_tree_verifier(small_pair):
  sampling = SamplingConfig(1.0)
  target, tp = small_pair[:2]
  joint = exact_joint(target, tp, PROMPT, DEPTH, sampling)
  out = _sample_tree(small_pair, sampling, "dynamic", verifier=accept_first_positive)
  assert pvalue_vs_exact(out.tokens, joint) < SIGNIFICANCE


def test_draft_model_tree_catch_up_is_the_catch_up_block(small_pair):
  """DraftModelTreeDrafter's catch_up (gamma="auto"'s plain steps) runs only the catch-up
  block: the draft cache it leaves equals propose_tree's at every slot up to the root (the
  valid ones), with the same length; the tree levels past it are not run."""
  target, tp, draft, dp = small_pair
  drafter = DraftModelTreeDrafter(draft, **SMALL_SHAPES["dynamic"])
  tokens, lengths = pad_prompts([[3, 1, 4, 1, 5], [2], [6, 2, 7]])
  out, cache, state = tree_speculative_generate(
      target, tp, drafter, dp, tokens, lengths, max_new_tokens=6, sampling=SamplingConfig(1.0),
      key=jax.random.key(3), cache_len=32, return_state=True)
  seq, now = jnp.asarray(out.sequences), cache.length_B
  ctx = DraftContext(seq, now, seq[jnp.arange(3), now])
  proposed = jax.jit(drafter.propose_tree, static_argnums=3)(
      dp, state, ctx, SamplingConfig(), jax.random.key(0))[1].cache
  caught_up = jax.jit(drafter.catch_up, static_argnums=(3, 4))(
      dp, state, ctx, drafter.max_depth, SamplingConfig(), jax.random.key(0)).cache
  np.testing.assert_array_equal(caught_up.length_B, proposed.length_B)
  slot = np.arange(proposed.k_LBKES.shape[-1])
  for b, length in enumerate(np.asarray(proposed.length_B)):
    for a, c in ((proposed.k_LBKES, caught_up.k_LBKES), (proposed.v_LBKES, caught_up.v_LBKES)):
      np.testing.assert_allclose(np.asarray(c)[:, b][..., slot < length],
                                 np.asarray(a)[:, b][..., slot < length], rtol=1e-5, atol=1e-6)
