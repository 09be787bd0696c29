"""The verifier alone: properties on random distributions, and acceptance theory."""

from __future__ import annotations

import dataclasses

import hypothesis.extra.numpy as hnp
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings, strategies as st
from scipy import stats

from spec_jax.drafters.draft_model import DraftModelDrafter
from spec_jax.generate import pad_prompts
from spec_jax.core.kv_cache import KVCache
from spec_jax.metrics import summarize
from spec_jax.core.sampling import SamplingConfig
from spec_jax.speculative import speculative_generate
from spec_jax.verify import verify, verify_greedy, verify_probs

B, G, V = 4, 3, 6
_verify_probs = jax.jit(verify_probs)
_verify_greedy = jax.jit(verify_greedy)

weights = hnp.arrays(np.float32, (B, G + 1, V),
                     elements=st.sampled_from([0.0, 0.0, 1e-6, 0.1, 0.5, 1.0, 3.0]))
drafts = hnp.arrays(np.int32, (B, G), elements=st.integers(0, V - 1))


def _normalise(w):
  w = w.copy()
  w[..., 0] += (w.sum(-1) == 0)  # every row needs some mass
  return w / w.sum(-1, keepdims=True)


@settings(max_examples=60, deadline=None)
@given(p_w=weights, q_w=weights, d=drafts, seed=st.integers(0, 2**31 - 1),
       deterministic=st.booleans())
def test_outputs_in_range_and_consistent(p_w, q_w, d, seed, deterministic):
  p, q = _normalise(p_w), _normalise(q_w)[:, :G]
  if not deterministic:  # a sampling drafter only proposes tokens it gives mass to
    d = np.argmax(q, -1).astype(np.int32)
  n, nxt = _verify_probs(d, None if deterministic else q, p, jax.random.key(seed))
  n, nxt = np.asarray(n), np.asarray(nxt)
  assert ((0 <= n) & (n <= G)).all() and ((0 <= nxt) & (nxt < V)).all()
  for b in range(B):
    # every accepted draft has target mass; the next token has target mass too
    assert all(p[b, i, d[b, i]] > 0 for i in range(n[b]))
    assert p[b, n[b], nxt[b]] > 0
    if n[b] < G and deterministic:  # after rejecting d, the correction is never d itself
      assert nxt[b] != d[b, n[b]] or p[b, n[b], d[b, n[b]]] == 1.0


@settings(max_examples=40, deadline=None)
@given(logits=hnp.arrays(np.float32, (B, G + 1, V), elements=st.floats(-5, 5, width=32, allow_subnormal=False)),
       q_w=weights, d=drafts, seed=st.integers(0, 2**31 - 1))
def test_greedy_is_sampling_at_temperature_zero(logits, q_w, d, seed):
  # temperature 0 warps p to one-hot at the argmax; q may be anything that proposed d
  p_onehot = np.asarray(jax.nn.one_hot(np.argmax(logits, -1), V))
  n_s, next_s = _verify_probs(d, None, p_onehot, jax.random.key(seed))
  n_g, next_g = _verify_greedy(d, logits)
  assert np.array_equal(n_s, n_g) and np.array_equal(next_s, next_g)
  n_v, next_v = verify(d, None, logits, SamplingConfig(), jax.random.key(seed))
  assert np.array_equal(n_v, n_g) and np.array_equal(next_v, next_g)


def test_greedy_counts_leading_matches():
  logits = np.full((2, 4, 5), -1.0, np.float32)
  logits[0, [0, 1, 2, 3], [1, 2, 3, 4]] = 1.0
  logits[1, [0, 1, 2, 3], [0, 0, 0, 0]] = 1.0
  n, nxt = verify_greedy(jnp.array([[1, 2, 3], [0, 4, 0]]), logits)
  assert n.tolist() == [3, 1] and nxt.tolist() == [4, 0]


def test_no_nan_with_zero_probabilities():
  p = np.zeros((1, 3, 4), np.float32); p[..., 2] = 1.0
  q = np.zeros((1, 2, 4), np.float32); q[..., 2] = 1.0  # p == q: residual is all zero
  n, nxt = verify_probs(jnp.array([[2, 2]]), q, p, jax.random.key(0))
  assert int(n[0]) == 2 and int(nxt[0]) == 2


def test_shape_errors():
  with pytest.raises(ValueError, match="gamma \\+ 1"):
    verify(jnp.zeros((2, 3), jnp.int32), None, jnp.zeros((2, 3, 5)), SamplingConfig(),
           jax.random.key(0))
  with pytest.raises(ValueError, match="draft probs"):
    verify(jnp.zeros((2, 3), jnp.int32), jnp.zeros((2, 3, 4)), jnp.zeros((2, 4, 5)),
           SamplingConfig(1.0), jax.random.key(0))


@dataclasses.dataclass(frozen=True)
class ConstantModel:
  """A context-free 'model' whose next-token logits are its params: known p and q."""
  vocab_size: int
  max_seq_len: int = 1 << 16

  def init_cache(self, batch_size, max_len):
    return KVCache.zeros(num_layers=1, batch_size=batch_size, max_len=max_len, num_kv_heads=1,
                         head_dim=1)

  def apply(self, params, tokens_BT, positions_BT, cache, **kw):
    batch, steps = tokens_BT.shape
    logits = jnp.broadcast_to(params, (batch, steps, self.vocab_size))
    return logits, jnp.zeros((batch, steps, 1)), cache


@pytest.mark.parametrize("gamma", [2, 4])
def test_accepted_length_matches_theory(gamma):
  """E[tokens per round] = (1 - a^(g+1)) / (1 - a) with a = sum(min(p, q)) (Leviathan et al.)."""
  vocab, rows, new = 8, 2048, 24
  rng = np.random.default_rng(gamma)
  p_logits = rng.normal(size=vocab).astype(np.float32)
  q_logits = (p_logits + rng.normal(size=vocab) * 0.8).astype(np.float32)
  p, q = jax.nn.softmax(p_logits), jax.nn.softmax(q_logits)
  alpha = float(jnp.minimum(p, q).sum())
  model = ConstantModel(vocab)
  out = speculative_generate(model, jnp.asarray(p_logits), DraftModelDrafter(model),
                             jnp.asarray(q_logits), *pad_prompts([[0]] * rows), gamma=gamma,
                             max_new_tokens=new, sampling=SamplingConfig(1.0),
                             key=jax.random.key(7))
  hist = np.asarray(out.metrics.accept_hist_G1)
  expected_hist = np.array([alpha ** k * (1 - alpha) for k in range(gamma)] + [alpha ** gamma])
  mean_tokens = summarize(out.metrics)["mean_accepted_with_bonus"]
  k = np.arange(gamma + 1) + 1
  mean_theory = (1 - alpha ** (gamma + 1)) / (1 - alpha)
  sd = np.sqrt((expected_hist * (k - mean_theory) ** 2).sum() / hist.sum())
  assert abs(mean_tokens - mean_theory) < 4 * sd, (mean_tokens, mean_theory, sd)
  assert chi_square_pvalue(hist, expected_hist) > 1e-3
  # and every emitted token is still distributed as p
  counts = np.bincount(np.asarray(out.tokens).ravel(), minlength=vocab)
  assert chi_square_pvalue(counts, np.asarray(p)) > 1e-3


def chi_square_pvalue(counts, probs) -> float:
  probs = np.asarray(probs, np.float64)
  return float(stats.chisquare(counts, probs / probs.sum() * counts.sum()).pvalue)
