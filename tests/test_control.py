"""Branches that update caches in place (spec_jax.core.control), and the rounds built on them:
no speculative loop copies a whole KV cache."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from conftest import tiny_llama
from spec_jax.adaptive import AdaptiveConfig
from spec_jax.core.control import cond_in_place, run_if, switch_in_place
from spec_jax.drafters.draft_model import DraftModelDrafter
from spec_jax.drafters.factory import make_drafter
from spec_jax.engine import lower
from spec_jax.generate import pad_prompts
from spec_jax.testing import compiled_text, whole_cache_copies


def test_in_place_branches_compute_what_lax_cond_and_switch_do():
  branches = [lambda c: (c[0] + 1, c[1] * 2), lambda c: (c[0] - 5, c[1] + 3),
              lambda c: (c[0] * 7, c[1] - 1)]
  carry = (jnp.arange(4), jnp.float32(1.5))

  @jax.jit
  def both(i, pred):
    return (switch_in_place(i, branches, carry), jax.lax.switch(i, branches, carry),
            cond_in_place(pred, branches[0], branches[1], carry),
            jax.lax.cond(pred, branches[0], branches[1], carry),
            run_if(pred, branches[2], carry))

  for i in (-1, 0, 1, 2, 3):  # out of range: clamped, as lax.switch does
    for pred in (True, False):
      ours, ref, ours_cond, ref_cond, ran = both(i, pred)
      jax.tree.map(np.testing.assert_array_equal, ours, ref)
      jax.tree.map(np.testing.assert_array_equal, ours_cond, ref_cond)
      jax.tree.map(np.testing.assert_array_equal, ran, branches[2](carry) if pred else carry)


@pytest.mark.parametrize("batch", [1, 3])
@pytest.mark.parametrize("kind,gamma", [("draft_model", "auto"), ("prompt_lookup", 3),
                                        ("lookup+draft_model", 3)])
def test_speculative_rounds_copy_no_whole_kv_cache(kind, gamma, batch):
  # A conditional's branches copy what they update: gamma="auto" (its width switch and its
  # drafted-or-plain choice), prompt lookup's all-rows-empty round and the combined
  # drafter's "lookup matched everywhere" branch copied the target's cache or the draft
  # model's (here of the same shape) up to ten times a round; the in-place branches copy none.
  model, params = tiny_llama(vocab_size=64, dim=128, n_heads=4, n_kv_heads=2, hidden_dim=64)
  drafter, draft_params = make_drafter(kind, model, params, draft_model=model,
                                       draft_params=params)
  if kind == "draft_model":
    assert isinstance(drafter, DraftModelDrafter)  # whose cache has the target's shape
  if gamma == "auto":  # a fixed cost table: nothing measured, the program is the same
    gamma = AdaptiveConfig(4, target_costs=(1.0, 1.1, 1.2, 1.3), draft_cost=0.5)
  tokens, lengths = pad_prompts([[1, 2, 3]] * batch, width=8)
  cache_len = 40
  text = compiled_text(lower(model, params, drafter, draft_params, tokens, lengths, gamma=gamma,
               max_new_tokens=16, cache_len=cache_len))
  assert whole_cache_copies(text, model.init_cache(batch, cache_len)) == []


@pytest.mark.parametrize("gamma,batch", [(None, 1), ("auto", 3)])
def test_tree_rounds_copy_no_whole_kv_cache(gamma, batch):
  # Compacting the accepted path with a vmap over the batch axis made XLA:CPU carry the
  # caches batch-minor, copying k and v whole twice a round; gamma="auto" adds a branch per
  # node budget, each of which must update in place too.
  from spec_jax.drafters.registry import TreeOptions
  model, params = tiny_llama(vocab_size=64, dim=128, n_heads=4, n_kv_heads=2, hidden_dim=64)
  draft, draft_params = tiny_llama(vocab_size=64, dim=32, n_heads=2, n_kv_heads=1,
                                   hidden_dim=32, n_layers=1, seed=3)
  drafter, draft_params = make_drafter("draft_model", model, params, draft_model=draft,
                                       draft_params=draft_params,
                                       tree=TreeOptions(depth=3, top_k=2, nodes=7))
  if gamma == "auto":
    gamma = AdaptiveConfig(target_costs=(1.0, 1.1, 1.2, 1.25, 1.3), draft_cost=0.5)
  tokens, lengths = pad_prompts([[1, 2, 3]] * batch, width=8)
  text = compiled_text(lower(model, params, drafter, draft_params, tokens, lengths, gamma=gamma,
                             max_new_tokens=16, cache_len=40))
  assert whole_cache_copies(text, model.init_cache(batch, 40)) == []
