"""A repeated `speculate` call reuses its program (spec_jax.recent_programs), and never where
the params, the objects or the settings changed, nor without checking its own arguments."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from spec_jax import recent_programs
from spec_jax.core.errors import BadArgument
from spec_jax.drafters.draft_model import DraftModelDrafter
from spec_jax.engine import measured_program, speculate
from spec_jax.generate import generate, pad_prompts
from spec_jax.testing import tiny_llama, perturbed


@pytest.fixture
def setup():
  recent_programs.forget_all()
  model, params = tiny_llama()
  draft, draft_params = DraftModelDrafter(model), perturbed(params, 0.5)
  return model, params, draft, draft_params, pad_prompts([[1, 2, 3], [4, 5]])


def test_a_repeated_call_finds_its_program_and_runs_the_same(setup):
  model, params, draft, draft_params, prompts = setup
  first, args = measured_program(model, params, draft, draft_params, *prompts, gamma=3,
                                 max_new_tokens=6)
  again, again_args = measured_program(model, params, draft, draft_params, *prompts, gamma=3,
                                       max_new_tokens=6)
  assert again is first
  for a, b in zip(args[:-1], again_args[:-1]):  # (the last is the PRNG key)
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
  np.testing.assert_array_equal(jax.random.key_data(args[-1]),
                                jax.random.key_data(again_args[-1]))
  out = speculate(model, params, draft, draft_params, *prompts, gamma=3, max_new_tokens=6)
  ref = generate(model, params, *prompts, max_new_tokens=6)
  np.testing.assert_array_equal(out.tokens, ref.tokens)
  # new prompts of the same shape: the same program, their own arguments
  other = pad_prompts([[7, 8, 9], [3]])
  program, other_args = measured_program(model, params, draft, draft_params, *other, gamma=3,
                                         max_new_tokens=6)
  assert program is first
  np.testing.assert_array_equal(other_args[0], other[0])


def test_changed_settings_or_objects_build_another_program(setup):
  model, params, draft, draft_params, prompts = setup
  first, _ = measured_program(model, params, draft, draft_params, *prompts, gamma=3,
                              max_new_tokens=6)
  for settings in (dict(gamma=2, max_new_tokens=6), dict(gamma=3, max_new_tokens=7),
                   dict(gamma=3, max_new_tokens=6, cache_len=32)):
    program, _ = measured_program(model, params, draft, draft_params, *prompts, **settings)
    assert program is not first and program.gamma == settings["gamma"]
  wider = pad_prompts([[1, 2, 3, 4], [4, 5]])
  assert measured_program(model, params, draft, draft_params, *wider, gamma=3,
                          max_new_tokens=6)[0].cache_len == first.cache_len + 1
  # prompts given as lists key no shape: the validated ones' must match, or it is rebuilt
  as_lists = [[1, 2, 3], [4, 5, 0]], [3, 2]
  listed, _ = measured_program(model, params, draft, draft_params, *as_lists, gamma=3,
                               max_new_tokens=6)
  assert listed.cache_len == first.cache_len
  longer = [[1, 2, 3, 4, 5], [4, 5, 0, 0, 0]], [5, 2]
  longer_program, longer_args = measured_program(model, params, draft, draft_params, *longer,
                                                 gamma=3, max_new_tokens=6)
  assert longer_program.cache_len == first.cache_len + 2 and longer_args[0].shape == (2, 5)
  out = speculate(model, params, draft, draft_params, *longer, gamma=3, max_new_tokens=6)
  ref = generate(model, params, *longer, max_new_tokens=6)
  np.testing.assert_array_equal(out.tokens, ref.tokens)


def test_every_call_checks_its_own_arguments(setup):
  model, params, draft, draft_params, prompts = setup
  speculate(model, params, draft, draft_params, *prompts, gamma=3, max_new_tokens=6)
  # 3.0 hashes as 3, but is no gamma; True is no max_new_tokens
  with pytest.raises(BadArgument, match="gamma"):
    speculate(model, params, draft, draft_params, *prompts, gamma=3.0, max_new_tokens=6)
  with pytest.raises(BadArgument, match="max_new_tokens"):
    speculate(model, params, draft, draft_params, *prompts, gamma=3, max_new_tokens=6.0)
  tokens, lengths = prompts
  bad = np.array(tokens).copy()
  bad[1, 0] = 99  # outside the vocabulary of 32
  with pytest.raises(BadArgument, match="vocabulary"):
    speculate(model, params, draft, draft_params, bad, lengths, gamma=3, max_new_tokens=6)
  with pytest.raises(BadArgument, match="budgets"):
    speculate(model, params, draft, draft_params, *prompts, gamma=3, max_new_tokens=6,
              budgets_B=np.array([1, 2, 3]))


def test_params_changed_in_place_are_checked_again(setup):
  """The same params container with a leaf swapped: the leaf is another array, so the call
  checks the tree again (a wrong shape is named, not met deep in the trace)."""
  model, params, draft, draft_params, prompts = setup
  speculate(model, params, draft, draft_params, *prompts, gamma=3, max_new_tokens=6)
  embed = params["embed"]
  params["embed"] = jnp.zeros((embed.shape[0] + 1, embed.shape[1]), embed.dtype)
  try:
    with pytest.raises(BadArgument, match="embed"):
      speculate(model, params, draft, draft_params, *prompts, gamma=3, max_new_tokens=6)
  finally:
    params["embed"] = embed
  # the draft's own params alike
  draft_embed = draft_params["embed"]
  draft_params["embed"] = jnp.zeros((3, 3), draft_embed.dtype)
  with pytest.raises(BadArgument, match="embed"):
    speculate(model, params, draft, draft_params, *prompts, gamma=3, max_new_tokens=6)
