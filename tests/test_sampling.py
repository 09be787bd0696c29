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


@pytest.mark.parametrize("kw,msg", [({"temperature": -0.1}, "temperature"), ({"top_k": -1}, "top_k"),
                                    ({"top_p": 0.0}, "top_p"), ({"top_p": 1.5}, "top_p")])
def test_bad_settings_raise(kw, msg):
  with pytest.raises(ValueError, match=msg):
    SamplingConfig(**kw)
