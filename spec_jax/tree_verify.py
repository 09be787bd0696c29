"""Tree verification: which root-to-node path of a token tree the target keeps, and the next token.

A pure function of (tree, target logits at every node, sampling settings, key). Both rules
walk the tree from the root: one `lax.scan` over nodes 1..N-1 in index order. Because the
nodes are in topological order, the children of the current node come after it, in
sibling order; once a child is accepted the walk moves to it and its later siblings (whose
parent is no longer the current node) are skipped.

Greedy: at node u take the first child whose token equals the target's argmax at u; stop
when none does; the next token is the argmax at the last accepted node. This is the
longest path matching the target's greedy continuation, so output equals greedy decoding.

Sampling (recursive rejection sampling over siblings; SpecInfer, Miao et al. 2024; Chen
et al. 2023's multi-draft form): at node u the residual starts as r = p_u, the warped
target distribution after u's path. For each child c in sibling order, accept its token x_c
with probability min(1, r(x_c) / q_c(x_c)); if rejected, r <- norm(max(r - q_c, 0)) and try
the next sibling. If all children are rejected, the next token is drawn from r; if u has no
children (all accepted down to a leaf), the bonus token is drawn from p_u. For a
deterministic child (q_c one-hot at x_c) this is: accept with probability r(x_c), else set
r(x_c) = 0 and renormalise.

When it is lossless (output distributed exactly as sampling from the warped target): at
every node, given the path to it, the children's tokens must be independent of the
verifier's randomness and of each other's acceptance, and each child's x_c must be
distributed as its recorded q_c. This holds for
  * deterministic trees: any tree that is a function of the context alone (top-k children,
    static or EAGLE-2-style dynamic shapes; duplicate siblings are harmless, a repeated
    token has r = 0 after its first rejection), with probs_BNV = None;
  * sampled children drawn independently (e.g. i.i.d. from one q, or each from its own
    q_c) given the parent's path, with a tree shape that does not depend on the drawn
    tokens.
It does NOT hold for siblings drawn without replacement (e.g. Gumbel-top-k samples) or for
trees pruned by their sampled tokens' scores: their q_c is not the distribution recorded.

Numerics: acceptance is `u * q(x) < r(x)` (no division); an all-zero residual (r == q up
to rounding, where acceptance is certain anyway) keeps r, so zeros in r or q give no NaN.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from spec_jax.core.sampling import (SamplingConfig, greedy, sample_from_probs, uniform_rows,
                                    warped_probs)
from spec_jax.tree import TokenTree


def check_tree_shapes(tree: TokenTree, target_logits_BNV) -> None:
  batch, num_nodes = tree.tokens_BN.shape
  if num_nodes < 1 or tree.parents_BN.shape != (batch, num_nodes) or \
      tree.depth_BN.shape != (batch, num_nodes):
    raise ValueError(f"tree tokens, parents and depths must all be [batch, nodes]; got "
                     f"{tree.tokens_BN.shape}, {tree.parents_BN.shape}, {tree.depth_BN.shape}")
  if target_logits_BNV.shape[:2] != (batch, num_nodes):
    raise ValueError(f"target logits must be [batch, nodes, vocab] = [{batch}, {num_nodes}, V], "
                     f"got {target_logits_BNV.shape}")
  if tree.probs_BNV is not None and tree.probs_BNV.shape != target_logits_BNV.shape:
    raise ValueError(f"tree probs must be [batch, nodes, vocab] = {target_logits_BNV.shape}, "
                     f"got {tree.probs_BNV.shape}")


def _take_B(values_BN, index_B):
  return jnp.take_along_axis(values_BN, index_B[:, None], axis=1)[:, 0]


def _extend_path(path_BR1, num_accepted_B, accept_B, node):
  """Writes `node` at depth num_accepted + 1 of the rows that accept it."""
  depth_R1 = jnp.arange(path_BR1.shape[1], dtype=jnp.int32)
  hit_BR1 = accept_B[:, None] & (depth_R1[None, :] == num_accepted_B[:, None] + 1)
  return jnp.where(hit_BR1, node, path_BR1)


def _walk_inputs(tree: TokenTree):
  """Per-step scan inputs for nodes 1..N-1: (node index, token [B], parent [B])."""
  nodes = jnp.arange(1, tree.num_nodes, dtype=jnp.int32)
  return nodes, tree.tokens_BN[:, 1:].T, tree.parents_BN[:, 1:].T


def _start(tree: TokenTree):
  batch = tree.tokens_BN.shape[0]
  zeros_B = jnp.zeros((batch,), jnp.int32)
  return zeros_B, zeros_B, jnp.zeros((batch, tree.max_depth + 1), jnp.int32)


def verify_tree_greedy(tree: TokenTree, target_logits_BNV: jax.Array):
  """-> (path [B, R+1], num_accepted [B], next_token [B]): the longest path matching argmax."""
  target_BN = greedy(target_logits_BNV)

  def step(carry, inputs):
    node_B, num_B, path_BR1 = carry
    child, token_B, parent_B = inputs
    accept_B = (parent_B == node_B) & (token_B == _take_B(target_BN, node_B))
    path_BR1 = _extend_path(path_BR1, num_B, accept_B, child)
    return (jnp.where(accept_B, child, node_B), num_B + accept_B, path_BR1), None

  (node_B, num_B, path_BR1), _ = jax.lax.scan(step, _start(tree), _walk_inputs(tree))
  return path_BR1, num_B, _take_B(target_BN, node_B)


def _normalised_residual(r_BV, q_BV):
  residual_BV = jnp.maximum(r_BV - q_BV, 0.0)
  total_B1 = jnp.sum(residual_BV, axis=-1, keepdims=True)
  return jnp.where(total_B1 > 0, residual_BV / jnp.where(total_B1 > 0, total_B1, 1.0), r_BV)


def verify_tree_probs(tree: TokenTree, target_probs_BNV: jax.Array, key: jax.Array):
  """Recursive rejection sampling on probabilities -> (path [B, R+1], num_accepted [B], next [B]).

  tree.probs_BNV None means each draft's q is one-hot at its token.
  """
  batch, num_nodes, vocab = target_probs_BNV.shape
  p_NBV = target_probs_BNV.astype(jnp.float32).transpose(1, 0, 2)
  accept_key, residual_key = jax.random.split(key)
  # a key per row ([B, N-1], then node-major for the scan): a row's numbers do not depend on B
  u_NB = uniform_rows(accept_key, (batch, num_nodes - 1)).T
  q_NBV = None if tree.probs_BNV is None else (
      tree.probs_BNV.astype(jnp.float32).transpose(1, 0, 2)[1:])

  def step(carry, inputs):
    node_B, num_B, path_BR1, r_BV = carry
    (child, token_B, parent_B), p_child_BV, u_B, q_BV = inputs
    if q_BV is None:
      q_BV = jax.nn.one_hot(token_B, vocab, dtype=jnp.float32)
    tried_B = parent_B == node_B
    r_x_B = _take_B(r_BV, token_B)
    q_x_B = _take_B(q_BV, token_B)
    accept_B = tried_B & (u_B * q_x_B < r_x_B)
    rejected_BV = _normalised_residual(r_BV, q_BV)
    r_BV = jnp.where(accept_B[:, None], p_child_BV,
                     jnp.where(tried_B[:, None], rejected_BV, r_BV))
    path_BR1 = _extend_path(path_BR1, num_B, accept_B, child)
    return (jnp.where(accept_B, child, node_B), num_B + accept_B, path_BR1, r_BV), None

  carry = _start(tree) + (p_NBV[0],)
  (node_B, num_B, path_BR1, r_BV), _ = jax.lax.scan(
      step, carry, (_walk_inputs(tree), p_NBV[1:], u_NB, q_NBV))
  return path_BR1, num_B, sample_from_probs(residual_key, r_BV)


def verify_tree(tree: TokenTree, target_logits_BNV: jax.Array, sampling: SamplingConfig,
                key: jax.Array):
  """-> (path_BR1, num_accepted_B, next_token_B).

  path_BR1 [B, max_depth + 1]: node indices along the accepted path, root (0) first; entries
  past num_accepted are padding (0). num_accepted_B [B] in [0, max_depth]: drafts kept.
  next_token_B [B]: the correction or bonus token, the next round's pending token.
  target_logits_BNV are the target's logits at every node (the distribution of the token
  after it); they are warped here with `sampling`, as the tree's probs must already be (the
  round has already processed them: penalties, min_new_tokens, from each node's path).
  """
  check_tree_shapes(tree, target_logits_BNV)
  if sampling.is_greedy:
    return verify_tree_greedy(tree, target_logits_BNV)
  return verify_tree_probs(tree, warped_probs(target_logits_BNV, sampling), key)
