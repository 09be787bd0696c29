"""Logit warpers: temperature, top-k, top-p against a direct numpy construction."""

from __future__ import annotations

import jax
import numpy as np
import pytest

from spec_jax.core.sampling import SamplingConfig, greedy, sample, warped_probs


def _reference_warp(logits: np.ndarray, t: float, k: int, p: float) -> np.ndarray:
  z = logits / t
  if k:
    z = np.where(z >= np.sort(z)[-k], z, -np.inf)
  probs = np.exp(z - z.max()); probs /= probs.sum()
  if p < 1:
    order = np.argsort(-probs, kind="stable")
    before = np.cumsum(probs[order]) - probs[order]
    keep = np.zeros_like(probs, bool); keep[order[before < p]] = True
    threshold = probs[keep].min()
    probs = np.where(probs >= threshold, probs, 0); probs /= probs.sum()
  return probs


def test_greedy_is_argmax_exactly():
  # greedy's two-reduction argmax must pick jnp.argmax's index in every case: ties (the
  # first), NaN (the first NaN), +-inf, all -inf, and small integer-valued logits (many ties)
  rng = np.random.default_rng(0)
  rows = [rng.integers(-3, 4, size=(64, 7)).astype(np.float32),
          rng.normal(size=(32, 513)).astype(np.float32),
          np.array([[1, np.nan, 3, np.nan], [-np.inf] * 4, [2, 5, 5, 1], [np.inf, 1, np.inf, 0],
                    [-np.inf, -1, -np.inf, -1], [np.nan] * 4], np.float32)]
  for logits in rows:
    np.testing.assert_array_equal(np.asarray(greedy(logits)), np.argmax(logits, -1))
  logits = rng.normal(size=(3, 5, 17)).astype(np.float32)  # leading axes are batch axes
  np.testing.assert_array_equal(np.asarray(greedy(logits)), np.argmax(logits, -1))


@pytest.mark.parametrize("t,k,p", [(1.0, 0, 1.0), (0.5, 0, 1.0), (1.0, 3, 1.0), (1.0, 0, 0.7),
                                   (2.0, 5, 0.5), (0.8, 1, 1.0), (1.0, 0, 1e-6)])
def test_warp_matches_reference(t, k, p):
  logits = np.random.default_rng(0).normal(size=(6, 10)).astype(np.float32) * 2
  got = np.asarray(warped_probs(logits, SamplingConfig(temperature=t, top_k=k, top_p=p)))
  want = np.stack([_reference_warp(row, t, k, p) for row in logits])
  np.testing.assert_allclose(got, want, atol=1e-6)


def test_top_k_one_and_tiny_top_p_are_greedy():
  logits = np.random.default_rng(1).normal(size=(32, 20)).astype(np.float32)
  for cfg in (SamplingConfig(1.0, top_k=1), SamplingConfig(1.0, top_p=1e-9)):
    drawn = sample(jax.random.key(0), logits, cfg)
    assert np.array_equal(drawn, greedy(logits))


def test_greedy_distribution_is_one_hot():
  logits = np.random.default_rng(2).normal(size=(4, 9)).astype(np.float32)
  probs = np.asarray(warped_probs(logits, SamplingConfig()))
  assert np.array_equal(probs, np.eye(9)[logits.argmax(-1)])


@pytest.mark.parametrize("kw,msg", [
    ({"temperature": -0.1}, "temperature"), ({"top_k": -1}, "top_k"), ({"top_p": 0.0}, "top_p"),
    ({"top_p": 1.5}, "top_p"),
    # an infinite temperature made every warped logit nan or 0: top_k and top_p cut nothing
    ({"temperature": float("inf"), "top_k": 1}, "temperature must be >= 0 and finite"),
    ({"temperature": "0.5"}, "temperature must be a number"), ({"top_p": "1"}, "top_p must be"),
    ({"top_k": True}, "top_k must be a non-negative integer"), ({"top_k": 2.5}, "top_k"),
    ({"top_k": 4.0}, "top_k"), ({"temperature": 10 ** 400}, "temperature"),
    ({"top_k": float("inf")}, "top_k"), ({"min_new_tokens": True}, "min_new_tokens"),
    ({"repetition_penalty": None}, "repetition_penalty must be a number")])
def test_bad_settings_raise(kw, msg):
  with pytest.raises(ValueError, match=msg):
    SamplingConfig(**kw)


# --- tiny temperatures (issue 16): warped as (logits - max) / T, one-hot in float32 ------------

@pytest.mark.parametrize("t", [1e-9, 1e-30, 1e-45, 1e-300])
def test_tiny_temperature_samples_the_argmax(t):
  logits = np.array([[10.0, 17.8, -10.0]], np.float32)
  cfg = SamplingConfig(t)
  jitted = jax.jit(lambda k, l: sample(k, l, cfg))  # as inside the loops' one jit
  assert np.asarray(sample(jax.random.key(0), logits, cfg)).tolist() == [1]
  assert np.asarray(jitted(jax.random.key(0), logits)).tolist() == [1]  # was token 0
  for warp in (warped_probs, jax.jit(warped_probs, static_argnums=1)):
    np.testing.assert_array_equal(np.asarray(warp(logits, cfg)), [[0.0, 1.0, 0.0]])
  rows = np.random.default_rng(4).normal(size=(64, 50)).astype(np.float32) * 5
  for key in range(3):
    assert np.array_equal(jitted(jax.random.key(key), rows), greedy(rows))
  assert np.isfinite(np.asarray(warped_probs(rows, SamplingConfig(t, top_k=3, top_p=0.5)))).all()


def test_tiny_temperature_verifiers_equal_greedy():
  """The chain and tree verifiers warp with the same function: at T = 1e-9 they accept and
  correct exactly as the greedy ones do."""
  from spec_jax.tree import TokenTree
  from spec_jax.tree_verify import verify_tree
  from spec_jax.verify import verify
  verify, verify_tree = jax.jit(verify, static_argnums=3), jax.jit(verify_tree, static_argnums=2)
  rng = np.random.default_rng(5)
  logits_BG1V = rng.normal(size=(16, 4, 12)).astype(np.float32) * 3
  argmax_BG1 = logits_BG1V.argmax(-1)  # a draft matches it 60% of the time
  drafts_BG = np.where(rng.random((16, 3)) < 0.6, argmax_BG1[:, :3],
                       rng.integers(0, 12, (16, 3))).astype(np.int32)
  q_BGV = np.asarray(warped_probs(rng.normal(size=(16, 3, 12)).astype(np.float32),
                                  SamplingConfig(1.0)))
  want = verify(drafts_BG, None, logits_BG1V, SamplingConfig(), None)
  for probs in (None, q_BGV):  # a deterministic drafter, and one that sampled from q
    got = verify(drafts_BG, probs, logits_BG1V, SamplingConfig(1e-9), jax.random.key(1))
    assert np.array_equal(got[0], want[0]) and np.array_equal(got[1], want[1])
  # a chain as a tree: node i's parent is i - 1
  tree = TokenTree(np.concatenate([np.zeros((16, 1), np.int32), drafts_BG], 1),
                   np.broadcast_to(np.arange(-1, 3, dtype=np.int32), (16, 4)),
                   np.broadcast_to(np.arange(4, dtype=np.int32), (16, 4)), 3)
  greedy_out = verify_tree(tree, logits_BG1V, SamplingConfig(), None)
  tiny_out = verify_tree(tree, logits_BG1V, SamplingConfig(1e-30), jax.random.key(2))
  for a, b in zip(greedy_out, tiny_out):
    assert np.array_equal(a, b)


def test_rows_draw_with_their_own_keys():
  """Row b's draw depends on the key and its own logits only, not on the batch size."""
  rows = np.random.default_rng(6).normal(size=(8, 30)).astype(np.float32)
  key = jax.random.key(3)
  cfg = SamplingConfig(1.0)
  batch = np.asarray(sample(key, rows, cfg))
  assert np.asarray(sample(key, rows[:1], cfg))[0] == batch[0]
  assert np.array_equal(np.asarray(sample(key, rows[:5], cfg)), batch[:5])
