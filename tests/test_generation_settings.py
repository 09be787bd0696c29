"""Generation settings real checkpoints need: several EOS ids, min_new_tokens, repetition /
presence / frequency penalties, and generation_config.json; for chains and trees alike.

The penalties are checked against a plain numpy reference of their semantics, against HF
transformers' generate, and for exactness: greedy speculative output equals autoregressive
output, and sampled output follows the target's penalised distribution (a verifier that
forgets the earlier drafts of a round fails the same test).
"""

from __future__ import annotations

import collections
import dataclasses
import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from scipy import stats

from conftest import perturbed, tiny_llama
from spec_jax.core.sampling import SamplingConfig, TokenCounts, TokenHistory
from spec_jax.drafters.draft_model import DraftModelDrafter
from spec_jax.drafters.draft_model_tree import DraftModelTreeDrafter
from spec_jax.generate import eos_array, generate, pad_prompts
from spec_jax.metrics import summarize
from spec_jax.models.generation_config import generation_defaults, read_generation_config
from spec_jax.speculative import prepare, speculative_generate, speculative_jit
from spec_jax.streaming import speculative_chunks
from spec_jax.tree_speculative import tree_speculative_generate
from spec_jax.verify import verify

SIGNIFICANCE = 1e-3  # fixed before running: a correct sampler fails 1 run in 1000


def reference_logits(logits, context, generated, cfg: SamplingConfig, eos_ids):
  """The settings' semantics, written out in numpy for one position (float64)."""
  out = np.array(logits, np.float64)
  for t in set(context):  # HF: in prompt + generated, > 0 divided, < 0 multiplied
    out[t] = out[t] / cfg.repetition_penalty if out[t] > 0 else out[t] * cfg.repetition_penalty
  for t, n in collections.Counter(generated).items():  # OpenAI / vLLM: generated tokens only
    out[t] -= cfg.frequency_penalty * n + cfg.presence_penalty
  if len(generated) < cfg.min_new_tokens:
    out[list(eos_ids)] = -np.inf
  return out


# --- greedy: the reference, speculative == autoregressive, several EOS ids ------------------

VOCAB, NEW = 64, 24
PENALISED = SamplingConfig(repetition_penalty=1.3, presence_penalty=0.2, frequency_penalty=0.1,
                           min_new_tokens=3)
EOS = (42, 36, 2)
PROMPTS = [[1, 5, 7, 5], [3, 3, 9], [4], [8, 60, 2, 33, 8]]
# For this model and these prompts (asserted below): row 0 fills its budget, the others stop
# at 36 or 42; row 1 would have ended with 2 at each of its first three tokens, forbidden by
# min_new_tokens.
EXPECTED_ENDS = [NEW, 36, 42, 36]


@pytest.fixture(scope="module")
def tiny():
  return tiny_llama(vocab_size=VOCAB, dim=32, seed=1)


@pytest.fixture(scope="module")
def penalised_ar(tiny):
  """Greedy autoregressive output with PENALISED and several EOS ids."""
  model, params = tiny
  prompts = pad_prompts(PROMPTS)
  return prompts, generate(model, params, *prompts, max_new_tokens=NEW, sampling=PENALISED,
                           eos_id=EOS)


def _rows(out):
  return [np.asarray(out.tokens[r, :int(out.num_tokens[r])]).tolist()
          for r in range(out.tokens.shape[0])]


def test_greedy_penalties_eos_ids_and_min_new_tokens(tiny, penalised_ar):
  """Each token is the argmax of the reference-processed logits of a full forward pass; a
  row stops at the first token that is any of the EOS ids, none before min_new_tokens."""
  model, params = tiny
  _, ar = penalised_ar
  width = max(map(len, PROMPTS)) + NEW
  forward = jax.jit(lambda seq_1W: model.apply(params, seq_1W, jnp.arange(width)[None, :],
                                               model.init_cache(1, width))[0][0])
  ended_by, forbidden_eos = [], []
  for prompt, generated in zip(PROMPTS, _rows(ar)):
    seq = np.zeros((1, width), np.int32)
    seq[0, :len(prompt) + len(generated)] = prompt + generated
    logits_WV = np.asarray(forward(seq))
    for i, token in enumerate(generated):
      ref = reference_logits(logits_WV[len(prompt) + i - 1], prompt + generated[:i],
                             generated[:i], PENALISED, EOS)
      assert token == int(np.argmax(ref)), (prompt, i)
      no_min = dataclasses.replace(PENALISED, min_new_tokens=0)
      unforced = reference_logits(logits_WV[len(prompt) + i - 1], prompt + generated[:i],
                                  generated[:i], no_min, EOS)
      if int(np.argmax(unforced)) in EOS and i < PENALISED.min_new_tokens:
        forbidden_eos.append((len(ended_by), i))
    assert not set(generated[:-1]) & set(EOS)  # stopped at the first EOS of any id
    ended_by.append(generated[-1] if generated[-1] in EOS else len(generated))
  assert ended_by == EXPECTED_ENDS and (1, 0) in forbidden_eos


def test_speculative_greedy_identity_with_penalties(tiny, penalised_ar):
  """Chain and tree drafters, a draft that agrees part of the time: same tokens as ar."""
  model, params = tiny
  prompts, ar = penalised_ar
  draft_params = perturbed(params, 0.05, seed=2)
  chain = speculative_generate(model, params, DraftModelDrafter(model), draft_params, *prompts,
                               gamma=3, max_new_tokens=NEW, sampling=PENALISED, eos_id=EOS)
  tree = tree_speculative_generate(
      model, params, DraftModelTreeDrafter(model, depth=3, top_k=2, nodes=6), draft_params,
      *prompts, max_new_tokens=NEW, sampling=PENALISED, eos_id=list(EOS))
  for out in (chain, tree):
    np.testing.assert_array_equal(out.tokens, ar.tokens)
    np.testing.assert_array_equal(out.num_tokens, ar.num_tokens)
    assert summarize(out.metrics)["mean_accepted"] > 1.0  # later block positions verified


# --- sampling: the distribution with penalties on ------------------------------------------

S_VOCAB, S_PROMPT, S_DEPTH, SAMPLES = 8, [3, 1, 4], 3, 6000
# strong penalties, so that forgetting a round's earlier drafts moves the distribution; EOS
# is allowed only at the third token (min_new_tokens 2), so every row has S_DEPTH tokens
SAMPLED = SamplingConfig(0.9, repetition_penalty=1.6, presence_penalty=0.8,
                         frequency_penalty=0.4, min_new_tokens=2)
S_EOS = (5, 6)


@pytest.fixture(scope="module")
def small_pair():
  target, target_params = tiny_llama(vocab_size=S_VOCAB, dim=16, n_layers=2, n_heads=2,
                                     n_kv_heads=1, hidden_dim=32, seed=11)
  return target, target_params, perturbed(target_params, 0.7, seed=3)


def exact_joint(model, params):
  """The probability of every sequence of S_DEPTH tokens under the reference semantics."""
  seqs = np.array([S_PROMPT + list(p) for p in itertools.product(range(S_VOCAB),
                                                                 repeat=S_DEPTH - 1)], np.int32)
  pos = np.broadcast_to(np.arange(seqs.shape[1]), seqs.shape)
  logits = np.asarray(jax.jit(lambda s: model.apply(params, s, pos, model.init_cache(*s.shape))[0])(
      seqs))
  joint = np.zeros([S_VOCAB] * S_DEPTH)
  for row, seq in enumerate(seqs):
    gen = seq[len(S_PROMPT):].tolist()
    prob = 1.0
    for i, token in enumerate(gen + [None]):  # the distribution of generated token i
      ref = reference_logits(logits[row, len(S_PROMPT) + i - 1], S_PROMPT + gen[:i], gen[:i],
                             SAMPLED, S_EOS) / SAMPLED.temperature
      p = np.exp(ref - ref.max())
      p /= p.sum()
      if token is None:
        joint[tuple(gen)] = prob * p
      else:
        prob *= p[token]
  return joint.reshape(-1)


def pvalue_vs_exact(tokens, joint):
  """Chi-square of the sampled sequences against their exact probabilities (bins expected
  to hold fewer than 5 samples pooled)."""
  codes = np.asarray(tokens)[:, :S_DEPTH] @ (S_VOCAB ** np.arange(S_DEPTH)[::-1])
  counts = np.bincount(codes, minlength=joint.size)
  expected = joint * counts.sum()
  big = expected >= 5
  obs = np.append(counts[big], counts[~big].sum())
  exp = np.append(expected[big], expected[~big].sum())
  return stats.chisquare(obs, exp * obs.sum() / exp.sum()).pvalue


def _stale_along_chain(self, tokens_BT):
  """A wrong rule: every block position penalised from the round's start (drafts forgotten)."""
  right = _ALONG_CHAIN(self, tokens_BT)
  width = tokens_BT.shape[1]
  return right.replace(counts=jax.tree.map(
      lambda c: jnp.broadcast_to(c[:, None], (c.shape[0], width) + c.shape[1:]), self.counts))


_ALONG_CHAIN = TokenHistory.along_chain


def test_sampled_distribution_with_penalties(small_pair, monkeypatch):
  target, tp, dp = small_pair
  joint = exact_joint(target, tp)
  prompts = pad_prompts([S_PROMPT] * SAMPLES)
  kw = dict(max_new_tokens=S_DEPTH, sampling=SAMPLED, eos_id=S_EOS, key=jax.random.key(1))
  chain = speculative_generate(target, tp, DraftModelDrafter(target), dp, *prompts, gamma=2, **kw)
  tree = tree_speculative_generate(
      target, tp, DraftModelTreeDrafter(target, depth=2, top_k=2, nodes=5), dp, *prompts, **kw)
  for out in (chain, tree):
    assert (np.asarray(out.num_tokens) == S_DEPTH).all()
    # drafts drawn from penalised logits too: the later block positions get verified
    assert summarize(out.metrics)["mean_accepted"] > 0.4
    assert pvalue_vs_exact(out.tokens, joint) > SIGNIFICANCE
  assert np.isin(np.asarray(chain.tokens)[:, 2], S_EOS).any()  # EOS allowed at the third
  # the control: a round that forgets its earlier drafts fails the same test
  monkeypatch.setattr(TokenHistory, "along_chain", _stale_along_chain)
  speculative_jit.clear_cache()
  try:
    wrong = speculative_generate(target, tp, DraftModelDrafter(target), dp, *prompts, gamma=2,
                                 **kw)
  finally:
    monkeypatch.undo()
    speculative_jit.clear_cache()
  assert pvalue_vs_exact(wrong.tokens, joint) < SIGNIFICANCE


# --- HF transformers' generate: repetition_penalty, several EOS ids, min_new_tokens ---------

def test_matches_hf_generate_from_its_generation_config(tmp_path):
  torch = pytest.importorskip("torch")
  transformers = pytest.importorskip("transformers")
  from spec_jax.models.hf import load_hf
  torch.set_num_threads(2)
  config = transformers.LlamaConfig(vocab_size=96, hidden_size=64, num_hidden_layers=2,
                                    num_attention_heads=4, num_key_value_heads=2,
                                    intermediate_size=128, max_position_embeddings=128,
                                    tie_word_embeddings=False, bos_token_id=None,
                                    eos_token_id=None, pad_token_id=None)
  hf_model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="eager")
  gen = torch.Generator().manual_seed(0)
  with torch.no_grad():  # realistic scales (HF's own init is tiny)
    for name, p in hf_model.named_parameters():
      noise = torch.randn(p.shape, generator=gen)
      p.copy_(1.0 + 0.2 * noise if name.endswith("norm.weight") else
              0.1 * noise if "embed" in name else noise / p.shape[1] ** 0.5)
  hf_model = hf_model.float().eval()
  new, lengths = 16, [7, 5, 6]
  prompts = np.random.default_rng(3).integers(0, 96, (3, 7)).astype(np.int32)
  hf_model.generation_config = transformers.GenerationConfig(
      do_sample=False, repetition_penalty=1.3, min_new_tokens=3, max_new_tokens=new)
  hf_model.save_pretrained(tmp_path)

  def hf_generate(row):
    ids = torch.as_tensor(prompts[row:row + 1, :lengths[row]], dtype=torch.long)
    with torch.no_grad():
      out = hf_model.generate(ids, attention_mask=torch.ones_like(ids), pad_token_id=0)
    return out[0, lengths[row]:].tolist()

  free_rows = [hf_generate(row) for row in range(len(lengths))]
  # ids that row 0 meets at its 6th token and row 1 at its 2nd (where min_new_tokens forbids it)
  eos = [free_rows[0][5], free_rows[1][1]]
  hf_model.generation_config.eos_token_id = eos
  hf_model.generation_config.save_pretrained(tmp_path)
  model, params = load_hf(str(tmp_path))
  defaults = read_generation_config(str(tmp_path))
  assert defaults.sampling == SamplingConfig(repetition_penalty=1.3, min_new_tokens=3)
  assert (defaults.eos_id, defaults.max_new_tokens, defaults.ignored) == (tuple(eos), new, ())
  ours = _rows(generate(model, params, prompts, lengths, max_new_tokens=defaults.max_new_tokens,
                        sampling=defaults.sampling, eos_id=defaults.eos_id))
  for row in range(len(lengths)):
    assert ours[row] == hf_generate(row), f"row {row}"
  assert ours[0][-1] in eos and len(ours[0]) <= 6 and ours[1] != free_rows[1][:len(ours[1])]
  assert len(set(free_rows[0])) > 8, "degenerate continuation: the test would prove little"


# --- settings: validation, the reader, nothing changes without them -------------------------

def test_settings_validation_and_reader():
  for bad in (dict(repetition_penalty=0.0), dict(presence_penalty=float("nan")),
              dict(frequency_penalty=float("inf")), dict(min_new_tokens=-1),
              dict(min_new_tokens=1.5)):
    with pytest.raises(ValueError):
      SamplingConfig(**bad)
  assert eos_array(None).tolist() == [-1] and eos_array(np.int64(3), 8).tolist() == [3]
  assert eos_array([7, 2], 8).tolist() == [7, 2]
  for bad in ([], [1.5], [True], [8], [-2], "2"):
    with pytest.raises(ValueError):
      eos_array(bad, 8)
  with pytest.raises(ValueError, match="vocabulary"):  # streaming takes the same eos_id
    model, params = tiny_llama(vocab_size=8)
    next(speculative_chunks(model, params, DraftModelDrafter(model), params,
                            *pad_prompts([[1, 2]]), gamma=2, max_new_tokens=4, eos_id=[3, 8]))
  d = generation_defaults({"do_sample": True, "temperature": 0.6, "top_p": 0.9,
                           "eos_token_id": [128001, 128009], "bos_token_id": 128000,
                           "max_length": 4096, "num_beams": 1, "no_repeat_ngram_size": 3})
  assert d.sampling == SamplingConfig(0.6, top_k=50, top_p=0.9)  # HF's default top_k
  assert (d.eos_id, d.bos_id, d.max_length, d.max_new_tokens) == ((128001, 128009), 128000,
                                                                  4096, None)
  assert d.ignored == ("no_repeat_ngram_size",)
  greedy = generation_defaults({"temperature": 0.6, "eos_token_id": 2, "top_k": 0})
  assert greedy.sampling == SamplingConfig() and greedy.eos_id == (2,)  # no do_sample: greedy
  for bad in ({"do_sample": True, "temperature": 0.0}, {"eos_token_id": "</s>"},
              {"repetition_penalty": -1}, {"max_new_tokens": 0}):
    with pytest.raises(ValueError):
      generation_defaults(bad)


def test_no_counts_without_penalties(tiny):
  """Default settings carry no count buffers; a penalty carries only what it reads."""
  model, params = tiny
  prompts = pad_prompts(PROMPTS)
  for sampling, expect in [(SamplingConfig(), None), (SamplingConfig(min_new_tokens=2), None),
                           (SamplingConfig(repetition_penalty=1.2), (bool, None)),
                           (SamplingConfig(presence_penalty=0.5), (None, jnp.int32))]:
    program, args = prepare(model, DraftModelDrafter(model), *prompts, gamma=2,
                            max_new_tokens=4, sampling=sampling, eos_id=None, key=None,
                            budgets_B=None, pad_id=0, cache_len=None, verifier=verify)
    state = jax.eval_shape(program.init, params, params, *args[:4], args[5])  # shapes only
    counts = state.counts
    if expect is None:
      assert counts is None
    else:
      got = tuple(None if c is None else c.dtype for c in (counts.in_context_BV,
                                                           counts.generated_BV))
      assert got == tuple(None if e is None else jnp.dtype(e) for e in expect)
      assert isinstance(counts, TokenCounts)
