"""A fixed-shape token tree, and the builders drafters use to grow one.

Node 0 is the root: the pending token (generated, not yet seen by the target). Nodes
1..N-1 are drafts in topological order (parent index < own index); siblings are ordered
as the verifier should try them. Per row:

    tokens_BN   [B, N] int32  token of each node (node 0: the pending token)
    parents_BN  [B, N] int32  parent node index; -1 for the root
    depth_BN    [B, N] int32  0 for the root; a draft at depth d is the d-th token after it
    probs_BNV   [B, N, V] or None: the (warped) distribution each node's token was drawn
                from; None when the tree is a deterministic function of the context (the
                verifier then treats q as one-hot at the token). Row 0 is unused.

Every row has the same N and the same static `max_depth` (so the accepted path has a fixed
shape); rows differ in their tokens and, for dynamic trees, their structure.

Shape letters (spec_jax.core): N nodes, R depth, C children per expanded node (top_k ranks),
M block slots; local to this module: Y all candidates of a dynamic tree, U the C * C
children of one level, Z the N - 1 drafted (non-root) nodes.

Builders:
  * static (Medusa-style) trees from "choices": paths of top-k ranks, e.g.
    [(0,), (1,), (0, 0), (0, 1), (1, 0)]; `tokens_from_topk` fills one from per-depth
    candidates [B, depth, top_k] (Medusa heads), `grow_static_tree` from a model that is run on
    each level of the tree (children = top-k of the node's own draft distribution);
  * dynamic (EAGLE-2-style) trees, `grow_dynamic_tree`: each depth expands the top_k nodes
    of the previous depth with the best cumulative draft log-prob, then the num_nodes - 1
    best candidates overall become the tree, best first. Fixed shapes throughout.
Both growers call back into the drafter (`expand_fn`) to score the nodes of one level, with
what it needs for tree attention over its own block of slots (see `Expansion`).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct


@struct.dataclass
class TokenTree:
  tokens_BN: jax.Array
  parents_BN: jax.Array
  depth_BN: jax.Array
  max_depth: int = struct.field(pytree_node=False)  # static bound on depth_BN
  probs_BNV: jax.Array | None = None

  @property
  def num_nodes(self) -> int:
    return self.tokens_BN.shape[1]

  def ancestors(self) -> jax.Array:
    """[B, N, N] bool: ancestors[b, i, j] iff node j is node i or one of its ancestors."""
    return ancestor_mask(self.parents_BN, self.max_depth)


def ancestor_mask(parents_BN: jax.Array, num_steps: int) -> jax.Array:
  """[B, N, N] ancestor-or-self mask from parent indices, walking up `num_steps` times.

  `num_steps` >= the tree's depth reaches the root from every node; a fixed count keeps it
  a fixed-shape computation (no while loop over data).
  """
  num_nodes = parents_BN.shape[1]
  anc_BNN = jnp.broadcast_to(jnp.eye(num_nodes, dtype=bool), parents_BN.shape + (num_nodes,))
  up_BN = parents_BN
  for _ in range(num_steps):
    anc_BNN = anc_BNN | jax.nn.one_hot(up_BN, num_nodes, dtype=bool)  # -1 gives no bit
    up_BN = jnp.where(up_BN >= 0,
                      jnp.take_along_axis(parents_BN, jnp.maximum(up_BN, 0), axis=1), -1)
  return anc_BNN


# --- static trees from choices ----------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class StaticTree:
  """A tree shape fixed in advance (host-side, hashable). Node i > 0 is choices[i - 1]."""
  # sorted by (depth, path): parents first, siblings by rank
  choices: tuple[tuple[int, ...], ...]
  parents: tuple[int, ...]  # per node, root first (-1)
  depths: tuple[int, ...]
  ranks: tuple[int, ...]  # top-k rank of each node among its candidates (root: 0)

  @property
  def num_nodes(self) -> int:
    return len(self.parents)

  @property
  def max_depth(self) -> int:
    return max(self.depths)

  @property
  def max_rank(self) -> int:
    return max(self.ranks)

  def nodes_at(self, depth: int) -> np.ndarray:
    return np.array([i for i, d in enumerate(self.depths) if d == depth], np.int32)

  def ancestors(self) -> np.ndarray:
    """[N, N] bool, as TokenTree.ancestors."""
    anc = np.eye(self.num_nodes, dtype=bool)
    for i in range(1, self.num_nodes):
      anc[i] |= anc[self.parents[i]]
    return anc

  def tree(self, tokens_BN: jax.Array, probs_BNV: jax.Array | None = None) -> TokenTree:
    batch = tokens_BN.shape[0]
    parents_BN = jnp.broadcast_to(jnp.array(self.parents, jnp.int32), (batch, self.num_nodes))
    depth_BN = jnp.broadcast_to(jnp.array(self.depths, jnp.int32), (batch, self.num_nodes))
    return TokenTree(tokens_BN.astype(jnp.int32), parents_BN, depth_BN, self.max_depth,
                     probs_BNV)


@functools.lru_cache(maxsize=None)
def _static_tree(choices: tuple[tuple[int, ...], ...]) -> StaticTree:
  if not choices:
    raise ValueError("a static tree needs at least one choice (path of top-k ranks)")
  for path in choices:
    if not path or any(int(r) != r or r < 0 for r in path):
      raise ValueError(f"each choice must be a non-empty path of ranks >= 0, got {path}")
  if len(set(choices)) != len(choices):
    raise ValueError("static tree choices contain duplicates")
  ordered = sorted(choices, key=lambda p: (len(p), p))
  index = {(): 0} | {p: i + 1 for i, p in enumerate(ordered)}
  missing = [p for p in ordered if p[:-1] not in index]
  if missing:
    raise ValueError(f"choice {missing[0]} has no parent {missing[0][:-1]} in the tree")
  return StaticTree(tuple(ordered), (-1,) + tuple(index[p[:-1]] for p in ordered),
                    (0,) + tuple(len(p) for p in ordered), (0,) + tuple(p[-1] for p in ordered))


def static_tree(choices: Sequence[Sequence[int]]) -> StaticTree:
  """The tree of Medusa-style `choices`, e.g. [(0,), (1,), (0, 0)]: root + one node per path."""
  return _static_tree(tuple(tuple(int(r) for r in p) for p in choices))


def tokens_from_topk(spec: StaticTree, pending_B: jax.Array,
                     candidates_BRC: jax.Array) -> jax.Array:
  """[B, N] tokens: the node at depth d with rank r takes candidates[:, d - 1, r].

  Medusa-style: each depth has its own top-k candidates (one head per depth), whatever the
  parent; the root is the pending token.
  """
  if candidates_BRC.shape[1] < spec.max_depth or candidates_BRC.shape[2] <= spec.max_rank:
    raise ValueError(f"candidates {candidates_BRC.shape} too small for a tree of depth "
                     f"{spec.max_depth} and ranks up to {spec.max_rank}")
  depth_idx = np.maximum(np.array(spec.depths[1:]) - 1, 0)
  drafts_BZ = candidates_BRC[:, depth_idx, np.array(spec.ranks[1:])]
  return jnp.concatenate([pending_B[:, None], drafts_BZ], axis=1).astype(jnp.int32)


# --- growing trees with a drafter -------------------------------------------------------------

@struct.dataclass
class Expansion:
  """One level of nodes to score, in the drafter's own block of cache slots.

  The drafter's block has slot 0 = the root (at the pending token's position) and one slot
  per node it ever runs; a node at depth d sits at position pending_position + d.
  """
  tokens_BT: jax.Array  # [B, T] tokens of the nodes to run
  ancestors_BTM: jax.Array  # [B, T, M] which block slots each node attends to (itself included)
  parent_block_BT: jax.Array  # [B, T] block slot of each node's parent (the root: 0)
  block_ids: np.ndarray = struct.field(pytree_node=False)  # [T] block slots of these nodes
  depth: int = struct.field(pytree_node=False)  # depth of these nodes (>= 1)


# expand_fn(carry, expansion) -> (log-probs [B, T, V] of each node's children, carry)
ExpandFn = Callable[[object, Expansion], tuple[jax.Array, object]]


def _best(score_BY: jax.Array, count: int) -> jax.Array:
  """Indices of the `count` highest scores per row (of any candidates, Y or U); ties go to
  the lower index."""
  iota_BY = jnp.broadcast_to(jnp.arange(score_BY.shape[1], dtype=jnp.int32), score_BY.shape)
  return jax.lax.sort((-score_BY, iota_BY), dimension=1, num_keys=2)[1][:, :count]


def dynamic_tree_candidates(depth: int, top_k: int) -> int:
  """How many candidates a dynamic tree of this depth and top-k chooses its nodes from."""
  return top_k + (depth - 1) * top_k * top_k


def check_dynamic_tree(depth: int, top_k: int, num_nodes: int) -> None:
  for name, value in (("depth", depth), ("top_k", top_k)):
    if int(value) != value or value < 1:
      raise ValueError(f"tree {name} must be an integer >= 1, got {value}")
  most = 1 + dynamic_tree_candidates(depth, top_k)
  if int(num_nodes) != num_nodes or not 2 <= num_nodes <= most:
    raise ValueError(f"a dynamic tree of depth {depth} and top-k {top_k} has 2..{most} nodes "
                     f"(root included), got num_nodes={num_nodes}")


def grow_dynamic_tree(root_logp_BV: jax.Array, pending_B: jax.Array, expand_fn: ExpandFn, carry,
                      *, depth: int, top_k: int, num_nodes: int) -> tuple[TokenTree, object]:
  """EAGLE-2-style dynamic tree (Li et al. 2024) with a fixed node budget.

  Candidates are scored by cumulative draft log-prob. Depth 1: the top_k children of the
  root. Depth d > 1: the top_k candidates of depth d-1 (the frontier) are run through
  `expand_fn`; each gets its top_k children. Finally the num_nodes - 1 best candidates of
  all depths form the tree. A child never scores above its parent (log-probs <= 0) and
  ties go to the earlier candidate, so every chosen node's parent is chosen too.

  The drafter's block (see Expansion) holds the root at slot 0 and frontier node i of depth
  d at slot 1 + (d - 1) * top_k + i: M = 1 + (depth - 1) * top_k slots.
  """
  check_dynamic_tree(depth, top_k, num_nodes)
  batch = root_logp_BV.shape[0]
  k = top_k
  num_block = 1 + (depth - 1) * k
  logp_BC, tokens_BC = jax.lax.top_k(root_logp_BV, k)
  score_BC = jnp.minimum(logp_BC, 0.0)
  cand_tokens, cand_scores = [tokens_BC], [score_BC]
  cand_parents = [jnp.full((batch, k), -1, jnp.int32)]
  cand_depths = [np.full(k, 1, np.int32)]
  frontier_cand_BC = jnp.broadcast_to(jnp.arange(k, dtype=jnp.int32), (batch, k))
  frontier_parent_BC = jnp.zeros((batch, k), jnp.int32)  # block slot of the parent (root)
  block_C = 1 + np.arange(k, dtype=np.int32)
  anc_BCM = jnp.broadcast_to(
      (np.arange(num_block)[None, :] == 0) | (np.arange(num_block)[None, :] == block_C[:, None]),
      (batch, k, num_block))
  offset = k
  for d in range(2, depth + 1):
    expansion = Expansion(tokens_BC, anc_BCM, frontier_parent_BC, block_C, d - 1)
    child_logp_BCV, carry = expand_fn(carry, expansion)
    child_logp_BCC, child_tokens_BCC = jax.lax.top_k(child_logp_BCV, k)
    child_score_BU = (score_BC[:, :, None] + jnp.minimum(child_logp_BCC, 0.0)).reshape(batch, k * k)
    child_tokens_BU = child_tokens_BCC.reshape(batch, k * k)
    cand_tokens.append(child_tokens_BU)
    cand_scores.append(child_score_BU)
    cand_parents.append(jnp.repeat(frontier_cand_BC, k, axis=1))
    cand_depths.append(np.full(k * k, d, np.int32))
    if d < depth:  # the next frontier: the best top_k children of this depth
      pick_BC = _best(child_score_BU, k)
      parent_row_BC = pick_BC // k  # which frontier node each one hangs from
      tokens_BC = jnp.take_along_axis(child_tokens_BU, pick_BC, axis=1)
      score_BC = jnp.take_along_axis(child_score_BU, pick_BC, axis=1)
      frontier_cand_BC = offset + pick_BC
      frontier_parent_BC = jnp.asarray(block_C)[parent_row_BC]
      block_C = 1 + (d - 1) * k + np.arange(k, dtype=np.int32)
      own_CM = np.arange(num_block)[None, :] == block_C[:, None]
      anc_BCM = jnp.take_along_axis(anc_BCM, parent_row_BC[:, :, None], axis=1) | own_CM
    offset += k * k

  scores_BY = jnp.concatenate(cand_scores, axis=1)
  # chosen candidates best first: a parent scores at least its child and wins ties (its
  # candidate index is lower), so parents precede children; siblings keep their rank order;
  # and the first k nodes are the tree a budget of k would have grown (gamma="auto" cuts it)
  chosen_BZ = _best(scores_BY, num_nodes - 1)
  tokens_BZ = jnp.take_along_axis(jnp.concatenate(cand_tokens, axis=1), chosen_BZ, axis=1)
  parent_cand_BZ = jnp.take_along_axis(jnp.concatenate(cand_parents, axis=1), chosen_BZ, axis=1)
  # node index of the parent: 1 + where it is among the chosen (a parent is always chosen)
  parent_node_BZ = 1 + jnp.argmax(chosen_BZ[:, None, :] == parent_cand_BZ[:, :, None], axis=2)
  parent_node_BZ = jnp.where(parent_cand_BZ < 0, 0, parent_node_BZ).astype(jnp.int32)
  depth_BZ = jnp.asarray(np.concatenate(cand_depths))[chosen_BZ]
  tree = TokenTree(
      jnp.concatenate([pending_B[:, None], tokens_BZ], axis=1).astype(jnp.int32),
      jnp.concatenate([jnp.full((batch, 1), -1, jnp.int32), parent_node_BZ], axis=1),
      jnp.concatenate([jnp.zeros((batch, 1), jnp.int32), depth_BZ], axis=1), depth)
  return tree, carry


def grow_static_tree(spec: StaticTree, root_logp_BV: jax.Array, pending_B: jax.Array,
                     expand_fn: ExpandFn, carry) -> tuple[TokenTree, object]:
  """Fills a static tree level by level: a node of rank r is its parent's r-th best child.

  The drafter's block is the tree itself (block slot i = node i, M = N); the nodes of each
  depth that have children are run through `expand_fn` together, once.
  """
  batch = root_logp_BV.shape[0]
  width = spec.max_rank + 1
  anc_NN = spec.ancestors()
  parents_N = np.array(spec.parents)
  tokens_BN = jnp.zeros((batch, spec.num_nodes), jnp.int32).at[:, 0].set(pending_B)
  # children_BTC[b, t] = best `width` children of the t-th node of the previous level
  children_BTC = jax.lax.top_k(root_logp_BV, width)[1][:, None, :]
  expanded = np.array([0], np.int32)  # the nodes whose children are in children_BTC
  for d in range(1, spec.max_depth + 1):
    nodes = spec.nodes_at(d)
    row = np.searchsorted(expanded, parents_N[nodes])  # the parent's row in children_BTC
    tokens_BN = tokens_BN.at[:, nodes].set(children_BTC[:, row, np.array(spec.ranks)[nodes]])
    if d == spec.max_depth:
      break
    expanded = np.unique(parents_N[spec.nodes_at(d + 1)]).astype(np.int32)  # leaves: not run
    anc_BTN = jnp.broadcast_to(anc_NN[expanded], (batch, len(expanded), spec.num_nodes))
    parent_BT = jnp.broadcast_to(jnp.asarray(parents_N[expanded]), (batch, len(expanded)))
    expansion = Expansion(tokens_BN[:, expanded], anc_BTN, parent_BT, expanded, d)
    logp_BTV, carry = expand_fn(carry, expansion)
    children_BTC = jax.lax.top_k(logp_BTV, width)[1]
  return spec.tree(tokens_BN), carry


@dataclasses.dataclass(frozen=True)
class TreeShape:
  """The fields, shape properties and checks of the tree drafters that rank a model's
  next-token log-probs: `model` (hashable; it names the vocabulary), depth, top_k, nodes,
  choices.

  `choices` (Medusa-style paths) gives a static tree and fixes the shape; otherwise the tree
  is grown dynamically to `nodes` nodes (root included), `depth` levels, `top_k` per parent.
  Listed before TreeDrafter in the bases, so `check`, `extra_slots` and `vocab_size` here
  take precedence.
  """
  model: object
  depth: int = 4
  top_k: int = 3
  nodes: int = 16
  choices: tuple | None = None

  @property
  def vocab_size(self) -> int:
    return self.model.vocab_size

  def check(self, target, gamma: int) -> None:
    super().check(target, gamma)
    if self.choices is None:
      check_dynamic_tree(self.depth, self.top_k, self.nodes)
    else:
      self.spec  # validates the choices

  @property
  def block_slots(self) -> int:
    """Slots of the drafter's own cache a round uses from the root on (default: the tree's
    block, see tree_block)."""
    return self.tree_block

  def extra_slots(self, gamma: int) -> int:
    # the target writes the whole tree, the drafter its block, past the committed prefix
    return max(self.num_nodes, self.block_slots)

  @property
  def spec(self) -> "StaticTree | None":
    return None if self.choices is None else static_tree(self.choices)

  @property
  def num_nodes(self) -> int:
    return self.nodes if self.choices is None else self.spec.num_nodes

  @property
  def max_depth(self) -> int:
    return self.depth if self.choices is None else self.spec.max_depth

  @property
  def tree_block(self) -> int:
    """Slots a round's tree occupies in the drafter's own block: all nodes of a static tree,
    the root plus top_k children per level of a dynamic one."""
    return self.num_nodes if self.choices is not None else 1 + (self.depth - 1) * self.top_k
