"""models/hf.py against Hugging Face transformers: logits, cached decoding, greedy generation.

Tiny HF models get seeded random weights of realistic scale (HF's own init is tiny and
zeroes biases, which would hide bias and layout bugs), are saved with save_pretrained, and
loaded with load_hf. Float32 logits must agree with HF's eager float32 forward to ATOL.
"""

from __future__ import annotations

import functools
import json
import os
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import safetensors.numpy

torch = pytest.importorskip("torch", reason="HF conformance tests need torch")
transformers = pytest.importorskip("transformers", reason="HF conformance tests need transformers")

from spec_jax.models.hf import config_from_hf, load_hf, save_hf  # noqa: E402
from spec_jax.models.llama import LlamaConfig, LlamaModel  # noqa: E402
from spec_jax.models.params_io import CheckpointError, params_to_flat  # noqa: E402

torch.set_num_threads(2)

ATOL = 1e-4  # float32 logits of magnitude ~1-10; decided up front, not to be loosened
_BASE = dict(vocab_size=96, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, intermediate_size=128, max_position_embeddings=256,
             bos_token_id=None, eos_token_id=None, pad_token_id=None)
SPECS = {
    "llama_gqa_untied": (transformers.LlamaConfig,
                         dict(tie_word_embeddings=False, rope_theta=500.0, rms_norm_eps=1e-5)),
    "llama_gqa_tied": (transformers.LlamaConfig, dict(tie_word_embeddings=True)),
    "qwen2_bias_tied": (transformers.Qwen2Config,
                        dict(tie_word_embeddings=True, rope_theta=1e6, use_sliding_window=False)),
    "qwen2_bias_untied": (transformers.Qwen2Config,
                          dict(tie_word_embeddings=False, num_key_value_heads=1)),
    "mistral_head_dim": (transformers.MistralConfig,
                         dict(tie_word_embeddings=False, sliding_window=None, head_dim=32)),
}


def _randomize_(hf_model, seed: int):
  """Overwrites every HF parameter with seeded values of realistic scale (biases nonzero)."""
  gen = torch.Generator().manual_seed(seed)
  with torch.no_grad():
    for name, p in hf_model.named_parameters():
      noise = torch.randn(p.shape, generator=gen, dtype=torch.float32)
      if name.endswith("norm.weight"):
        p.copy_(1.0 + 0.2 * noise)
      elif name.endswith(".bias"):
        p.copy_(0.5 * noise)
      elif name.endswith("embed_tokens.weight"):  # small, so tied heads don't echo the input
        p.copy_(0.1 * noise)
      else:  # a Linear weight [out, in]
        p.copy_(noise / p.shape[1] ** 0.5)


def _build_hf(spec: str, seed: int = 0):
  config_cls, overrides = SPECS[spec]
  config = config_cls(**{**_BASE, **overrides})
  hf_model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="eager")
  hf_model = hf_model.float().eval()
  _randomize_(hf_model, seed)
  hf_model.generation_config.eos_token_id = None
  return hf_model


@pytest.fixture(scope="module")
def hf_checkpoints(tmp_path_factory):
  """{spec: (hf_model, folder)}, built lazily once per module."""
  cache = {}

  def get(spec: str):
    if spec not in cache:
      hf_model = _build_hf(spec, seed=sorted(SPECS).index(spec))
      folder = str(tmp_path_factory.mktemp(spec))
      hf_model.save_pretrained(folder)
      cache[spec] = hf_model, folder
    return cache[spec]

  return get


@functools.partial(jax.jit, static_argnums=0)
def _forward(model, params, tokens_BT, positions_BT, cache):
  logits_BTV, _, cache = model.apply(params, tokens_BT, positions_BT, cache)
  return logits_BTV, cache


def _our_logits(model, params, tokens_BT) -> np.ndarray:
  B, T = tokens_BT.shape
  positions_BT = jnp.broadcast_to(jnp.arange(T, dtype=jnp.int32), (B, T))
  return np.asarray(_forward(model, params, jnp.asarray(tokens_BT), positions_BT,
                             model.init_cache(B, T))[0])


def _hf_logits(hf_model, tokens_BT) -> np.ndarray:
  with torch.no_grad():
    return hf_model(torch.as_tensor(np.asarray(tokens_BT), dtype=torch.long)).logits.numpy()


def _tokens(shape, seed: int, vocab: int = 96) -> np.ndarray:
  return np.random.default_rng(seed).integers(0, vocab, shape).astype(np.int32)


# ---- conformance ----------------------------------------------------------------------------

@pytest.mark.parametrize("spec", sorted(SPECS))
def test_prefill_logits_match_hf(hf_checkpoints, spec):
  hf_model, folder = hf_checkpoints(spec)
  model, params = load_hf(folder)
  cfg = hf_model.config
  assert model.config.tie_embeddings == cfg.tie_word_embeddings
  assert model.config.qkv_bias == spec.startswith("qwen2")
  tokens = _tokens((2, 7), seed=1)
  expected = _hf_logits(hf_model, tokens)
  assert np.abs(expected).max() > 1.0  # weights of realistic scale, so ATOL is meaningful
  np.testing.assert_allclose(_our_logits(model, params, tokens), expected, rtol=0, atol=ATOL)


@pytest.mark.parametrize("spec", sorted(SPECS))
def test_cached_decoding_matches_hf(hf_checkpoints, spec):
  """Prefill 5 tokens, then decode 10 one at a time through the cache; compare every position."""
  hf_model, folder = hf_checkpoints(spec)
  model, params = load_hf(folder)
  prefill, steps, B = 5, 10, 2
  tokens = _tokens((B, prefill + steps), seed=2)
  expected = _hf_logits(hf_model, tokens)
  cache = model.init_cache(B, prefill + steps)
  positions = jnp.broadcast_to(jnp.arange(prefill, dtype=jnp.int32), (B, prefill))
  logits, cache = _forward(model, params, jnp.asarray(tokens[:, :prefill]), positions, cache)
  got = [np.asarray(logits)]
  for p in range(prefill, prefill + steps):
    positions = jnp.full((B, 1), p, jnp.int32)
    logits, cache = _forward(model, params, jnp.asarray(tokens[:, p:p + 1]), positions, cache)
    got.append(np.asarray(logits))
  np.testing.assert_allclose(np.concatenate(got, axis=1), expected, rtol=0, atol=ATOL)


@pytest.mark.parametrize("spec", sorted(SPECS))
def test_greedy_generation_matches_hf_generate(hf_checkpoints, spec):
  from spec_jax.generate import generate
  from spec_jax.core.sampling import SamplingConfig

  hf_model, folder = hf_checkpoints(spec)
  model, params = load_hf(folder)
  new = 20
  lengths = np.array([7, 5], np.int32)
  prompts = _tokens((2, 7), seed=3)
  prompts[1, lengths[1]:] = 0  # right padding
  out = generate(model, params, prompts, lengths, max_new_tokens=new,
                 sampling=SamplingConfig(temperature=0.0), eos_id=None)
  np.testing.assert_array_equal(np.asarray(out.num_tokens), [new, new])
  hf_tokens = set()
  for row, length in enumerate(lengths):
    ids = torch.as_tensor(prompts[row:row + 1, :length], dtype=torch.long)
    with torch.no_grad():
      hf_out = hf_model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                                 max_new_tokens=new, min_new_tokens=new, eos_token_id=None,
                                 pad_token_id=0)
    np.testing.assert_array_equal(np.asarray(out.tokens[row]), hf_out[0, length:].numpy(),
                                  err_msg=f"row {row}")
    hf_tokens.update(hf_out[0, length:].tolist())
  assert len(hf_tokens) >= 3, "degenerate continuation: the test would prove little"


def test_sharded_checkpoint_matches_single_file(hf_checkpoints, tmp_path):
  hf_model, folder = hf_checkpoints("llama_gqa_untied")
  hf_model.save_pretrained(tmp_path, max_shard_size="20KB")
  assert os.path.isfile(tmp_path / "model.safetensors.index.json")
  assert not os.path.exists(tmp_path / "model.safetensors")
  assert len(list(tmp_path.glob("model-*.safetensors"))) > 2
  sharded_model, sharded = load_hf(str(tmp_path))
  model, single = load_hf(folder)
  assert sharded_model == model
  for name, value in params_to_flat(single).items():
    np.testing.assert_array_equal(params_to_flat(sharded)[name], value, err_msg=name)


def test_bf16_checkpoint_loads_exactly(tmp_path):
  hf_model = _build_hf("qwen2_bias_untied", seed=5).to(torch.bfloat16)
  hf_model.save_pretrained(tmp_path)
  with open(tmp_path / "config.json") as f:
    assert json.load(f).get("dtype", "bfloat16") == "bfloat16"
  _, params = load_hf(str(tmp_path))
  flat = params_to_flat(params)
  state = {k: v.float().numpy() for k, v in hf_model.state_dict().items()}
  np.testing.assert_array_equal(flat["embed"], state["model.embed_tokens.weight"])
  np.testing.assert_array_equal(flat["layers.1.attn.wk.kernel"],
                                state["model.layers.1.self_attn.k_proj.weight"].T)
  np.testing.assert_array_equal(flat["layers.0.attn.wq.bias"],
                                state["model.layers.0.self_attn.q_proj.bias"])
  assert flat["embed"].dtype == np.float32


# ---- save_hf -> transformers ------------------------------------------------------------------

ROUND_TRIPS = {
    "llama_untied": ("LlamaForCausalLM", dict(qkv_bias=False, tie_embeddings=False)),
    "llama_qkv_bias_tied": ("LlamaForCausalLM", dict(qkv_bias=True, tie_embeddings=True)),
    "qwen2_bias": ("Qwen2ForCausalLM", dict(qkv_bias=True, tie_embeddings=False)),
    "qwen2_no_bias": ("Qwen2ForCausalLM", dict(qkv_bias=False, tie_embeddings=True)),
    "mistral_head_dim": ("MistralForCausalLM", dict(head_dim=32, tie_embeddings=False)),
}


def _with_random_biases(params, seed: int):
  """Our init zeroes biases; make them nonzero so the round trip actually tests them."""
  keys = iter(jax.random.split(jax.random.key(seed), 64))
  return jax.tree_util.tree_map_with_path(
      lambda path, x: (0.5 * jax.random.normal(next(keys), x.shape, x.dtype)
                       if "bias" in jax.tree_util.keystr(path) else x), params)


@pytest.mark.parametrize("case", sorted(ROUND_TRIPS))
def test_save_hf_round_trip_through_transformers(tmp_path, case):
  architecture, overrides = ROUND_TRIPS[case]
  cfg = LlamaConfig(vocab_size=96, dim=64, n_layers=2, n_heads=4, n_kv_heads=2, hidden_dim=128,
                    max_seq_len=128, rope_theta=2000.0, norm_eps=1e-5, **overrides)
  model = LlamaModel(cfg)
  params = _with_random_biases(model.init_params(jax.random.key(7)), seed=8)
  save_hf(str(tmp_path), model, params, architecture=architecture)

  hf_model = transformers.AutoModelForCausalLM.from_pretrained(
      str(tmp_path), attn_implementation="eager", dtype=torch.float32).eval()
  assert type(hf_model).__name__ == architecture
  tokens = _tokens((2, 7), seed=4)
  ours = _our_logits(model, params, tokens)
  np.testing.assert_allclose(_hf_logits(hf_model, tokens), ours, rtol=0, atol=ATOL)

  loaded_model, loaded = load_hf(str(tmp_path))
  np.testing.assert_allclose(_our_logits(loaded_model, loaded, tokens), ours, rtol=0, atol=ATOL)
  if loaded_model.config == cfg:  # Qwen2 without bias reloads with (zero) biases
    for name, value in params_to_flat(params).items():
      np.testing.assert_array_equal(params_to_flat(loaded)[name], value, err_msg=name)


# ---- errors -----------------------------------------------------------------------------------

@pytest.fixture
def checkpoint_copy(hf_checkpoints, tmp_path):
  """A writable copy of the untied Llama checkpoint folder."""
  _, folder = hf_checkpoints("llama_gqa_untied")
  return shutil.copytree(folder, tmp_path / "ckpt")


def _rewrite_weights(folder, edit):
  path = os.path.join(folder, "model.safetensors")
  tensors = safetensors.numpy.load_file(path)
  edit(tensors)
  safetensors.numpy.save_file(tensors, path, metadata={"format": "pt"})


def _edit_config(folder, **changes):
  path = os.path.join(folder, "config.json")
  with open(path) as f:
    hf = json.load(f)
  hf.update(changes)
  with open(path, "w") as f:
    json.dump(hf, f)


def test_truncated_safetensors_is_rejected(checkpoint_copy):
  path = checkpoint_copy / "model.safetensors"
  data = path.read_bytes()
  path.write_bytes(data[:len(data) - 100])
  with pytest.raises(CheckpointError, match=r"model\.safetensors: truncated or malformed"):
    load_hf(str(checkpoint_copy))


def test_garbage_safetensors_is_rejected(checkpoint_copy):
  (checkpoint_copy / "model.safetensors").write_bytes(b"\x05\x00\x00\x00\x00\x00\x00\x00{oops")
  with pytest.raises(CheckpointError, match=r"model\.safetensors: truncated or malformed"):
    load_hf(str(checkpoint_copy))


def test_missing_tensor_is_named(checkpoint_copy):
  _rewrite_weights(checkpoint_copy, lambda t: t.pop("model.layers.1.mlp.up_proj.weight"))
  with pytest.raises(CheckpointError, match=r"missing tensors \['model\.layers\.1\.mlp\.up_proj"):
    load_hf(str(checkpoint_copy))


def test_wrong_shape_is_named(checkpoint_copy):
  def edit(tensors):
    tensors["model.layers.0.self_attn.k_proj.weight"] = np.zeros((64, 64), np.float32)
  _rewrite_weights(checkpoint_copy, edit)
  with pytest.raises(CheckpointError,
                     match=r"model\.layers\.0\.self_attn\.k_proj\.weight has shape \(64, 64\)"):
    load_hf(str(checkpoint_copy))


def test_unexpected_tensor_is_named(checkpoint_copy):
  _rewrite_weights(checkpoint_copy,
                   lambda t: t.update({"model.layers.0.mlp.up_proj.bias": np.ones(128, np.float32)}))
  with pytest.raises(CheckpointError, match=r"unexpected tensors \['model\.layers\.0\.mlp"):
    load_hf(str(checkpoint_copy))


def test_unsupported_architecture_is_rejected(checkpoint_copy):
  _edit_config(checkpoint_copy, architectures=["GPT2LMHeadModel"])
  with pytest.raises(CheckpointError, match=r"unsupported architectures \['GPT2LMHeadModel'\]"):
    load_hf(str(checkpoint_copy))


def test_missing_config_is_rejected(checkpoint_copy):
  os.remove(checkpoint_copy / "config.json")
  with pytest.raises(CheckpointError, match=r"no config\.json"):
    load_hf(str(checkpoint_copy))


def test_missing_weights_are_rejected(checkpoint_copy):
  os.remove(checkpoint_copy / "model.safetensors")
  with pytest.raises(CheckpointError, match=r"neither model\.safetensors nor"):
    load_hf(str(checkpoint_copy))


def test_missing_shard_is_named(hf_checkpoints, tmp_path):
  hf_model, _ = hf_checkpoints("llama_gqa_untied")
  hf_model.save_pretrained(tmp_path, max_shard_size="20KB")
  shard = sorted(tmp_path.glob("model-*.safetensors"))[1]
  os.remove(shard)
  with pytest.raises(CheckpointError, match=f"shard '{shard.name}' is missing"):
    load_hf(str(tmp_path))


def test_tied_checkpoint_accepts_equal_lm_head_only(hf_checkpoints, tmp_path):
  hf_model, folder = hf_checkpoints("llama_gqa_tied")
  ckpt = shutil.copytree(folder, tmp_path / "ckpt")
  _rewrite_weights(ckpt, lambda t: t.update({"lm_head.weight": t["model.embed_tokens.weight"]}))
  model, params = load_hf(str(ckpt))
  tokens = _tokens((1, 6), seed=6)
  np.testing.assert_allclose(_our_logits(model, params, tokens), _hf_logits(hf_model, tokens),
                             rtol=0, atol=ATOL)
  _rewrite_weights(ckpt, lambda t: t.update({"lm_head.weight": t["lm_head.weight"] + 1.0}))
  with pytest.raises(CheckpointError, match=r"lm_head\.weight differs"):
    load_hf(str(ckpt))


def test_nonzero_o_proj_bias_is_rejected(tmp_path):
  hf_model = _build_hf("llama_gqa_untied")
  hf_model.config.attention_bias = True
  hf_model = transformers.AutoModelForCausalLM.from_config(hf_model.config)
  _randomize_(hf_model, 0)
  hf_model.save_pretrained(tmp_path)
  with pytest.raises(CheckpointError, match=r"o_proj\.bias is nonzero"):
    load_hf(str(tmp_path))


# ---- config mapping ---------------------------------------------------------------------------

def _hf_config(**changes):
  return {"architectures": ["LlamaForCausalLM"], **_BASE, **changes}


def test_config_mapping_reads_legacy_and_v5_rope_theta():
  assert config_from_hf(_hf_config(rope_theta=123.0))[0].rope_theta == 123.0
  v5 = _hf_config(rope_parameters={"rope_type": "default", "rope_theta": 77.0})
  cfg, arch = config_from_hf(v5)
  assert (cfg.rope_theta, arch, cfg.n_kv_heads, cfg.head_dim) == (77.0, "LlamaForCausalLM", 2, None)
  assert config_from_hf(_hf_config(num_key_value_heads=None))[0].n_kv_heads == 4


@pytest.mark.parametrize("changes, message", [
    (dict(rope_scaling={"rope_type": "llama3", "factor": 8.0}), r"rope_scaling type 'llama3'"),
    (dict(rope_parameters={"rope_type": "yarn", "rope_theta": 1e4}), r"rope_parameters type 'yarn'"),
    (dict(architectures=["MistralForCausalLM"], sliding_window=64), r"sliding_window=64"),
    (dict(architectures=["Qwen2ForCausalLM"], use_sliding_window=True, sliding_window=64,
          max_window_layers=1), r"sliding_window=64"),
    (dict(hidden_act="gelu"), r"hidden_act='gelu'"),
    (dict(num_attention_heads=None), r"lacks required field .num_attention_heads"),
])
def test_unsupported_configs_are_rejected(changes, message):
  with pytest.raises(CheckpointError, match=message):
    config_from_hf(_hf_config(**changes))


def test_inactive_sliding_windows_are_accepted():
  # Qwen2: the window applies only from max_window_layers on, and only if use_sliding_window
  config_from_hf(_hf_config(architectures=["Qwen2ForCausalLM"], use_sliding_window=True,
                            sliding_window=64, max_window_layers=2))
  config_from_hf(_hf_config(architectures=["Qwen2ForCausalLM"], sliding_window=64))
  config_from_hf(_hf_config(architectures=["MistralForCausalLM"], sliding_window=256))
