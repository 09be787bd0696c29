"""The target's layer features (LlamaModel.with_feature_layers, the `feature_layers` option of
`apply`): what block drafters (DFlash, DSpark) and EAGLE-3-style drafters read. Asking for
them changes nothing else, and without the request the program is unchanged."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from conftest import tiny_llama
from spec_jax.models.drafter_heads import shared_head


def test_feature_layers_leave_logits_and_hidden_bit_identical():
  target, params = tiny_llama(n_layers=4, seed=3)
  tokens = jax.random.randint(jax.random.key(0), (3, 9), 0, target.vocab_size)
  positions = jnp.broadcast_to(jnp.arange(9, dtype=jnp.int32), tokens.shape)
  cache = target.init_cache(3, 16)
  with_features = target.with_feature_layers((2, 0))
  run = jax.jit(lambda m, p, c: m.apply(p, tokens, positions, c), static_argnums=0)
  logits, hidden, new_cache = run(target, params, cache)
  f_logits, f_hidden, f_cache = run(with_features, params, cache)
  dim = target.config.dim
  assert f_hidden.shape == (3, 9, 3 * dim)
  np.testing.assert_array_equal(f_logits, logits)
  np.testing.assert_array_equal(f_hidden[..., :dim], hidden)
  jax.tree.map(np.testing.assert_array_equal, f_cache, new_cache)
  # the features are those layers' outputs: normalised, they are what a target cut after that
  # layer returns as its hidden state (the layer-skip handle)
  head = shared_head(target, params)
  for slot, layer in enumerate((2, 0)):
    cut = dataclasses.replace(target, num_layers=layer + 1)
    _, cut_hidden, _ = run(cut, params, cut.init_cache(3, 16))
    feature = f_hidden[..., (1 + slot) * dim:(2 + slot) * dim]
    np.testing.assert_allclose(head.final_norm(feature), cut_hidden, rtol=1e-6, atol=1e-6)
  # the keyword asks for the same; without any request the handle and its program are unchanged
  _, k_hidden, _ = jax.jit(lambda p: target.apply(p, tokens, positions, cache,
                                                  feature_layers=(2, 0)))(params)
  np.testing.assert_array_equal(k_hidden, f_hidden)
  assert target.with_feature_layers(()) == target
  lowered = [jax.jit(m.apply).lower(params, tokens, positions, cache).as_text()
             for m in (target, target.with_feature_layers(()))]
  assert lowered[0] == lowered[1]
  with pytest.raises(ValueError, match="feature layer 4 is not a layer of this model"):
    target.with_feature_layers((1, 4))
  with pytest.raises(ValueError, match="distinct"):
    target.with_feature_layers((1, 1))
