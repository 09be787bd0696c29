"""Params layouts (spec_jax.models.params_io.LAYOUTS): the same function, fused and/or [out, in].

Each layout is a conversion of the checkpoint layout (and back, exactly); these tests pin
that it computes the same logits, that every consumer of a target's params (drafters
sharing them, int8 quantization, the drafter heads' shared head, the sharding table, the
checkpoint writers) reads each layout right, and that bad conversions raise.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from conftest import tiny_llama
from spec_jax.models.params_io import LAYOUTS, flat_names, params_to_flat, to_layout
from spec_jax.drafters import make_drafter
from spec_jax.generate import generate, pad_prompts
from spec_jax.core.quantize import QuantizedArray, QuantizedArrayOI, dense, quantize_params
from spec_jax.speculative import speculative_generate

# fixed before running: the layouts reorder float32 sums only (concatenated matmul outputs,
# transposed operands); logits of these models are O(1-10)
LOGIT_TOL = 1e-4
LAYOUT_NAMES = sorted(LAYOUTS)


def _logits(model, params, tokens_BT):
  positions = jnp.broadcast_to(jnp.arange(tokens_BT.shape[1]), tokens_BT.shape)
  return model.apply(params, tokens_BT, positions, model.init_cache(tokens_BT.shape[0], 32))[0]


@pytest.mark.parametrize("layout", LAYOUT_NAMES)
@pytest.mark.parametrize("bias_untied", [False, True])
def test_every_layout_computes_the_same_logits(layout, bias_untied):
  model, params = tiny_llama(qkv_bias=bias_untied, tie_embeddings=not bias_untied, seed=3)
  new_model, new_params = to_layout(model, params, layout)
  tokens = jnp.asarray(np.random.default_rng(0).integers(0, 32, (2, 9)), jnp.int32)
  ref, got = _logits(model, params, tokens), _logits(new_model, new_params, tokens)
  assert float(jnp.max(jnp.abs(ref - got))) < LOGIT_TOL
  names = flat_names(new_model)
  fused, out_in = LAYOUTS[layout]["fused_projections"], LAYOUTS[layout]["kernels_out_in"]
  kernel = "kernel_OI" if out_in else "kernel"
  assert (f"layers.0.attn.wqkv.{kernel}" in names) == fused
  assert (f"layers.0.attn.wq.{kernel}" in names) == (not fused)
  if fused:  # [q | k | v] and [gate | up] outputs, in the kernel's orientation
    cfg = model.config
    qkv = (cfg.n_heads + 2 * cfg.n_kv_heads) * cfg.resolved_head_dim
    shape = (qkv, cfg.dim) if out_in else (cfg.dim, qkv)
    assert names[f"layers.0.attn.wqkv.{kernel}"].shape == shape
    assert ("layers.0.attn.wqkv.bias" in names) == bias_untied
    gate_up = (2 * cfg.hidden_dim, cfg.dim) if out_in else (cfg.dim, 2 * cfg.hidden_dim)
    assert names[f"layers.0.mlp.w_gate_up.{kernel}"].shape == gate_up
  if bias_untied:
    assert f"lm_head.{kernel}" in names


@pytest.mark.parametrize("layout", ["fused", "fused_out_in"])
def test_stories260k_greedy_output_is_the_same_in_every_layout(stories, story_prompts, layout):
  model, params = stories
  prompts = pad_prompts(story_prompts, width=12)
  ref = generate(model, params, *prompts, max_new_tokens=40, eos_id=1)
  new_model, new_params = to_layout(model, params, layout)
  got = generate(new_model, new_params, *prompts, max_new_tokens=40, eos_id=1)
  assert np.array_equal(ref.tokens, got.tokens)
  assert np.array_equal(ref.num_tokens, got.num_tokens)


@pytest.mark.parametrize("kind", ["draft_model", "layer_skip", "quantized", "lookup+layer_skip"])
def test_speculative_on_a_fused_out_in_target_equals_its_autoregressive_output(
    stories, story_prompts, kind):
  """Drafters that share the target's params (layer skip) or transform them (int8) read the
  [out, in] layout; a separate draft model may be in any layout."""
  model, params = to_layout(*stories, "fused_out_in")
  prompts = pad_prompts(story_prompts, width=12)
  ref = generate(model, params, *prompts, max_new_tokens=40, eos_id=1)
  opts = dict(num_layers=4)
  if kind == "draft_model":
    opts.update(draft_model=stories[0], draft_params=stories[1])  # checkpoint layout draft
  drafter, draft_params = make_drafter(kind, model, params, **opts)
  out = speculative_generate(model, params, drafter, draft_params, *prompts, gamma=3,
                             max_new_tokens=40, eos_id=1)
  assert np.array_equal(out.tokens, ref.tokens)
  assert np.array_equal(out.num_tokens, ref.num_tokens)


def test_int8_quantization_follows_the_kernel_orientation():
  model, params = tiny_llama(seed=5)
  fused, fused_params = to_layout(model, params, "fused")
  out_in, out_in_params = to_layout(model, params, "fused_out_in")
  q_io, q_oi = quantize_params(fused_params), quantize_params(out_in_params)
  a = q_io["layers"][0]["mlp"]["w_gate_up"]["kernel"].get_value()
  b = q_oi["layers"][0]["mlp"]["w_gate_up"]["kernel_OI"].get_value()
  assert isinstance(a, QuantizedArray) and isinstance(b, QuantizedArrayOI)
  # one scale per output channel either way: identical values, transposed
  np.testing.assert_array_equal(np.asarray(a.values_IO), np.asarray(b.values_OI).T)
  np.testing.assert_array_equal(np.asarray(a.scale_O), np.asarray(b.scale_O))
  np.testing.assert_allclose(np.asarray(b.dequantize()), np.asarray(a.dequantize()).T)
  tokens = jnp.asarray([[1, 5, 9, 2, 7]], jnp.int32)
  diff = _logits(fused, q_io, tokens) - _logits(out_in, q_oi, tokens)
  assert float(jnp.max(jnp.abs(diff))) < LOGIT_TOL
  x = jnp.ones((3, a.shape[0]))
  with pytest.raises(ValueError, match="out_in"):
    dense(x, a, out_in=True)
  with pytest.raises(ValueError, match="out_in"):
    dense(x, b)


def test_bad_conversions_raise():
  model, params = tiny_llama()
  with pytest.raises(ValueError, match="unknown layout"):
    to_layout(model, params, "transposed")
  fused, fused_params = to_layout(model, params, "fused")
  assert to_layout(fused, fused_params, "fused")[0] is fused  # already there: unchanged
  with pytest.raises(ValueError, match="quantized"):
    to_layout(model, quantize_params(params), "fused")
  with pytest.raises(ValueError, match="quantized"):
    to_layout(fused, quantize_params(fused_params), "checkpoint")


@pytest.mark.parametrize("bias_untied", [False, True])
def test_conversions_between_any_two_layouts_are_exact(bias_untied):
  """Layout A -> layout B equals checkpoint -> B bit for bit, and back to the checkpoint
  layout returns the original params: fused kernels (and QKV biases) split where they were
  joined, [out, in] kernels transposed back."""
  kw = dict(qkv_bias=True, tie_embeddings=False) if bias_untied else {}
  model, params = tiny_llama(**kw)
  original = params_to_flat(params)
  for a in LAYOUT_NAMES:
    model_a, params_a = to_layout(model, params, a)
    for b in LAYOUT_NAMES:
      model_b, params_b = to_layout(model_a, params_a, b)
      assert model_b.config.layout == LAYOUTS[b]
      direct = params_to_flat(to_layout(model, params, b)[1])
      got = params_to_flat(params_b)
      assert got.keys() == direct.keys() and all(np.array_equal(got[k], direct[k]) for k in got)
      back = params_to_flat(to_layout(model_b, params_b, "checkpoint")[1])
      assert back.keys() == original.keys()
      assert all(np.array_equal(back[k], original[k]) for k in original), (a, b)


@pytest.mark.parametrize("layout", ["fused", "fused_out_in"])
def test_writers_save_any_layout_as_the_checkpoint_layout(tmp_path, layout):
  """save_model and save_hf write the checkpoint layout whatever layout the params are in:
  the files are the ones the checkpoint-layout params write."""
  from spec_jax.models.builtin import load_model, save_model
  from spec_jax.models.hf import load_hf, save_hf
  model, params = tiny_llama(qkv_bias=True)
  decoding = to_layout(model, params, layout)
  for name, (m, p) in {"checkpoint": (model, params), layout: decoding}.items():
    save_model(tmp_path / name, "target", m, p)
    save_hf(str(tmp_path / f"{name}-hf"), m, p, architecture="Qwen2ForCausalLM")
  for suffix in ("", "-hf"):
    for file in sorted((tmp_path / f"checkpoint{suffix}").iterdir()):
      assert (tmp_path / f"{layout}{suffix}" / file.name).read_bytes() == file.read_bytes(), file
  loaded, loaded_params = load_model(tmp_path / layout, "target")
  assert loaded.config.layout == LAYOUTS["checkpoint"]
  hf_model, hf_params = load_hf(str(tmp_path / f"{layout}-hf"))
  want = params_to_flat(params)
  got = params_to_flat(hf_params)
  assert all(np.array_equal(got[k], want[k]) for k in want)  # float32 both ways: exact


def test_drafter_heads_read_an_out_in_target():
  """EAGLE/MTP blocks keep the checkpoint layout; the shared head reads an [out, in] head."""
  from spec_jax.models.drafter_heads import EagleConfig, MTPConfig, shared_head
  model, params = tiny_llama(tie_embeddings=False, seed=2)
  out_in, out_in_params = to_layout(model, params, "fused_out_in")
  for cfg in (EagleConfig.for_target(out_in.config).layer,
              MTPConfig.for_target(out_in.config).layer):
    assert not cfg.fused_projections and not cfg.kernels_out_in
  hidden = jax.random.normal(jax.random.key(0), (2, 3, model.config.dim))
  ref = shared_head(model, params).logits(hidden)
  got = shared_head(out_in, out_in_params).logits(hidden)
  assert float(jnp.max(jnp.abs(ref - got))) < LOGIT_TOL


def test_sharding_table_reads_every_layout():
  from spec_jax.sharding import param_logical_axes
  assert param_logical_axes("layers.0.attn.wq.kernel") == ("embed", "q_heads")
  assert param_logical_axes("layers.0.attn.wq.kernel_OI") == ("q_heads", "embed")
  assert param_logical_axes("layers.0.mlp.w_down.kernel_OI") == ("embed", "mlp")
  assert param_logical_axes("lm_head.kernel_OI") == ("vocab", "embed")
  # fused projections stay whole over `model` (their columns mix heads or gate/up)
  assert param_logical_axes("layers.0.attn.wqkv.kernel") == ("embed", None)
  assert param_logical_axes("layers.0.attn.wqkv.kernel_OI") == (None, "embed")
  assert param_logical_axes("layers.0.mlp.w_gate_up.kernel_OI") == (None, "embed")
  # int8 leaves: values as their kernel, one scale per output channel
  assert param_logical_axes("layers.0.attn.wo.kernel_OI.values_OI") == ("embed", "q_heads")
  assert param_logical_axes("layers.0.attn.wo.kernel_OI.scale_O") == ("embed",)
  assert param_logical_axes("layers.0.attn.wo.kernel.scale_O") == ("embed",)
  assert param_logical_axes("layers.0.attn.wq.kernel.scale_O") == ("q_heads",)
