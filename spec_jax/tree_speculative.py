"""Token-tree speculative generation: the chain loop with a tree round in place of the chain one.

One tree round, fixed shapes whatever each row accepts:
  1. draft:   the drafter proposes a tree of N nodes (node 0 = the pending token);
  2. verify:  one target pass over all N nodes, node i written at slot L+i, at position
              L+depth(i), attending to the prefix and its own ancestors (tree mask);
  3. accept:  `verify_tree` returns the accepted path (root first), its length, the next token;
  4. compact: slot L+d <- slot L+path[d] in every layer (gather, then scatter), so the cache
              is laid out as if the accepted path had been a chain; then the chain's commit
              (tokens, budgets, EOS, cache length, drafter commit, metrics) runs unchanged,
              with the drafter told the path (RoundOutcome.tree_path_BR1).
The loop, prefill, output and metrics are speculative.py's (SpeculativeProgram with this
round; its `gamma` is the tree's max depth, the most drafts a round can accept).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from spec_jax.drafters.base import TreeDrafter
from spec_jax.core.interface import CausalLM
from spec_jax.core.kv_cache import KVCache, tree_mask
from spec_jax.core.sampling import SamplingConfig, nonfinite_rows, process_logits
from spec_jax.generate import EosIds, finite_prefix
from spec_jax.speculative import (SpecState, commit_round, prepare, round_inputs,
                                  passed_draft_params, speculative_jit)
from spec_jax.tree import TokenTree
from spec_jax.tree_verify import verify_tree


def compact_path(cache: KVCache, start_B: jax.Array, path_BR1: jax.Array) -> KVCache:
  """Moves the accepted path's entries to consecutive slots: slot start+d <- start+path[d].

  All sources are read before any write, so a path may read a slot it also overwrites.
  Padding entries of the path (past the accepted length) copy the root into stale slots.
  Rows are indexed with an iota: a vmap over the batch axis instead made XLA:CPU carry the
  caches in a batch-minor layout, with two whole-cache copies of k and v every round.
  """
  depth_R1 = jnp.arange(path_BR1.shape[1], dtype=jnp.int32)
  src_BR1 = start_B[:, None] + path_BR1
  dst_BR1 = start_B[:, None] + depth_R1[None, :]
  row_BR1 = jnp.broadcast_to(jnp.arange(path_BR1.shape[0], dtype=jnp.int32)[:, None],
                             path_BR1.shape)

  def move(kv_LBKES):  # the indexed entries come out as [B, R1, L, K, E]
    return kv_LBKES.at[:, row_BR1, :, :, dst_BR1].set(kv_LBKES[:, row_BR1, :, :, src_BR1],
                                                      mode="drop")

  return cache.replace(k_LBKES=move(cache.k_LBKES), v_LBKES=move(cache.v_LBKES))


def propose_tree_round(drafter: TreeDrafter, max_depth: int, sampling: SamplingConfig,
                       verifier, draft_params, eos_id, s: SpecState):
  """Step 1: the drafter's tree, its root set to the pending token -> (ctx, the next round's
  key, the verify key, tree, draft_state)."""
  ctx, key, draft_key, verify_key = round_inputs(s, sampling, eos_id, verifier)
  tree, draft_state = drafter.propose_tree(draft_params, s.draft_state, ctx, sampling, draft_key)
  if tree.max_depth != max_depth:
    raise ValueError(f"the drafter's tree has max_depth {tree.max_depth}, expected {max_depth}")
  tree = tree.replace(tokens_BN=tree.tokens_BN.at[:, 0].set(s.pending_B))
  return ctx, key, verify_key, tree, draft_state


def first_nodes(tree: TokenTree, num_nodes: int) -> TokenTree:
  """The tree cut to its first num_nodes nodes (static). Nodes are in topological order, so
  this is a tree; the cut depends on nothing drawn, so verifying it is as lossless as
  verifying the whole. A dynamic tree (grow_dynamic_tree: best first) cut to k nodes is the
  tree a budget of k would have grown; a static one keeps its first choices. max_depth
  stays: the accepted path keeps its shape."""
  if num_nodes == tree.num_nodes:
    return tree
  cut = lambda x: None if x is None else x[:, :num_nodes]
  return tree.replace(tokens_BN=cut(tree.tokens_BN), parents_BN=cut(tree.parents_BN),
                      depth_BN=cut(tree.depth_BN), probs_BNV=cut(tree.probs_BNV))


def verify_tree_round(target: CausalLM, sampling: SamplingConfig, verifier, params, ctx, tree,
                      cache: KVCache, verify_key):
  """Steps 2-4 up to the commit: one target pass over the tree's nodes, the verdict, the
  cache compacted -> (cache, path_BR1, num_accepted_B, next_B, the path's hidden states
  [B, R1, D], num_finite_B)."""
  length_B, history = ctx.position_B, ctx.history
  num_nodes = tree.num_nodes
  positions_BN = length_B[:, None] + tree.depth_BN
  slots_BN = length_B[:, None] + jnp.arange(num_nodes, dtype=jnp.int32)[None, :]
  ancestors_BNN = tree.ancestors()
  mask_BNS = tree_mask(length_B, ancestors_BNN, cache.max_len)
  logits_BNV, hidden_BND, cache = target.apply(params, tree.tokens_BN, positions_BN, cache,
                                               slots_BT=slots_BN, mask_BTS=mask_BNS)
  if history is not None:  # node i's logits: processed after the context + its path
    logits_BNV = process_logits(logits_BNV, sampling,
                                history.along_tree(tree.tokens_BN, ancestors_BNN, tree.depth_BN))
  path_BR1, num_accepted_B, next_B = verifier(tree, logits_BNV, sampling, verify_key)
  # the logits each kept token was chosen from: those of the path's nodes (root first)
  num_finite_B = finite_prefix(jnp.take_along_axis(nonfinite_rows(logits_BNV), path_BR1, axis=1))
  cache = compact_path(cache, length_B, path_BR1)
  path_hidden_BR1D = jnp.take_along_axis(hidden_BND, path_BR1[:, :, None], axis=1)
  return cache, path_BR1, num_accepted_B, next_B, path_hidden_BR1D, num_finite_B


def commit_tree_round(drafter, draft_params, lengths_B, budget_B, eos_id, s: SpecState, key,
                      ctx, tree, draft_state, verified, reach_B=None) -> SpecState:
  """Step 5: the chain's commit, told the accepted path (`verified`: verify_tree_round's).
  reach_B [B] (a tree cut by gamma="auto"): the depth of each row's deepest verified node,
  for the metrics (no depth past it was reached)."""
  cache, path_BR1, num_accepted_B, next_B, path_hidden_BR1D, num_finite_B = verified
  path_tokens_BR = jnp.take_along_axis(tree.tokens_BN, path_BR1[:, 1:], axis=1)
  return commit_round(drafter=drafter, draft_params=draft_params, lengths_B=lengths_B,
                      budget_B=budget_B, eos_id=eos_id, state=s, key=key, ctx=ctx, cache=cache,
                      draft_state=draft_state, draft_tokens_BG=path_tokens_BR,
                      num_accepted_B=num_accepted_B, next_B=next_B,
                      hidden_BG1D=path_hidden_BR1D, num_finite_B=num_finite_B,
                      verified_B=reach_B, tree_path_BR1=path_BR1)


def tree_speculative_round(target: CausalLM, drafter: TreeDrafter, max_depth: int,
                           sampling: SamplingConfig, verifier, params, draft_params, lengths_B,
                           budget_B, eos_id, s: SpecState) -> SpecState:
  """One round over a token tree; the signature of speculative.speculative_round."""
  ctx, key, verify_key, tree, draft_state = propose_tree_round(
      drafter, max_depth, sampling, verifier, draft_params, eos_id, s)
  verified = verify_tree_round(target, sampling, verifier, params, ctx, tree, s.cache, verify_key)
  return commit_tree_round(drafter, draft_params, lengths_B, budget_B, eos_id, s, key, ctx, tree,
                           draft_state, verified)


def tree_speculative_generate(target: CausalLM, params, drafter: TreeDrafter, draft_params,
                              prompt_tokens_BP, prompt_lengths_B, *, max_new_tokens: int,
                              sampling: SamplingConfig = SamplingConfig(),
                              eos_id: EosIds = None, key: jax.Array | None = None,
                              budgets_B=None, pad_id: int = 0, cache_len: int | None = None,
                              return_state: bool = False, verifier=verify_tree):
  """Token-tree speculative generation; arguments and output as `speculative_generate`.

  The tree's shape and node budget belong to the drafter (static fields). The metrics are
  a SpecMetrics whose "gamma" is the tree's max depth: accept_hist counts accepted path
  lengths, position_acceptance the rate at which each depth was accepted once reached.
  `verifier` (static; default verify_tree) has verify_tree's signature.
  """
  program, args = prepare_tree(target, drafter, prompt_tokens_BP, prompt_lengths_B,
                               max_new_tokens=max_new_tokens, sampling=sampling, eos_id=eos_id,
                               key=key, budgets_B=budgets_B, pad_id=pad_id, cache_len=cache_len,
                               verifier=verifier)
  out, cache, draft_state = speculative_jit(program, params,
                                            passed_draft_params(params, draft_params), *args,
                                            keep_state=return_state)
  return (out, cache, draft_state) if return_state else out


def prepare_tree(target: CausalLM, drafter: TreeDrafter, prompt_tokens_BP, prompt_lengths_B, *,
                 max_new_tokens: int, sampling: SamplingConfig, eos_id, key, budgets_B,
                 pad_id: int, cache_len: int | None, verifier=verify_tree):
  """`speculative.prepare` for tree drafters: a program whose rounds are tree rounds."""
  if not isinstance(drafter, TreeDrafter):
    raise TypeError(f"tree speculation needs a TreeDrafter (with propose_tree), got "
                    f"{type(drafter).__name__}")
  program, args = prepare(target, drafter, prompt_tokens_BP, prompt_lengths_B,
                          gamma=drafter.max_depth, max_new_tokens=max_new_tokens,
                          sampling=sampling, eos_id=eos_id, key=key, budgets_B=budgets_B,
                          pad_id=pad_id, cache_len=cache_len, verifier=verifier)
  return dataclasses.replace(program, round_fn=tree_speculative_round), args
