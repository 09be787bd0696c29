"""Native checkpoint round trips, load_model dispatch, and checkpoint error cases."""

from __future__ import annotations

import json
import os
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from spec_jax.models.llama import LlamaConfig, LlamaModel
from spec_jax.models.llama2c import load_llama2c
from spec_jax.models.loading import find_tokenizer_path, load_model
from spec_jax.models.native import load_native, save_native
from spec_jax.models.params_io import CheckpointError, params_to_flat

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
STORIES = os.path.join(REPO, "..", "shared", "models", "stories260K")
STORIES_BIN = os.path.join(STORIES, "stories260K.bin")
needs_stories = pytest.mark.skipif(
    not os.path.isfile(STORIES_BIN),
    reason=f"llama2.c stories260K checkpoint not found at {STORIES_BIN} (../shared missing)")


def small_config(**overrides) -> LlamaConfig:
  base = dict(vocab_size=64, dim=32, n_layers=2, n_heads=4, n_kv_heads=2, hidden_dim=48,
              max_seq_len=32)
  return LlamaConfig(**{**base, **overrides})


@jax.jit(static_argnums=0)
def _forward(model: LlamaModel, params) -> jax.Array:
  tokens = jnp.array([[1, 5, 9, 33, 2, 60]], jnp.int32)
  positions = jnp.arange(tokens.shape[1], dtype=jnp.int32)[None]
  return model.apply(params, tokens, positions, model.init_cache(1, 16))[0]


def logits(model: LlamaModel, params) -> np.ndarray:
  return np.asarray(_forward(model, params))  # equal models share one compilation


def assert_same_params(a, b):
  assert jax.tree_util.tree_structure(a) == jax.tree_util.tree_structure(b)
  fa, fb = params_to_flat(a), params_to_flat(b)
  assert fa.keys() == fb.keys()
  for name in fa:
    assert fa[name].dtype == fb[name].dtype, name
    np.testing.assert_array_equal(fa[name], fb[name], err_msg=name)


@pytest.mark.parametrize("overrides", [
    dict(tie_embeddings=True),
    dict(tie_embeddings=False),
    dict(tie_embeddings=False, qkv_bias=True, dtype="bfloat16"),
], ids=["tied", "untied", "qkv_bias-bf16"])
def test_round_trip_is_exact(tmp_path, overrides):
  model = LlamaModel(small_config(**overrides))
  params = model.init_params(jax.random.key(0))
  save_native(str(tmp_path / "ckpt"), model, params)
  loaded_model, loaded = load_native(str(tmp_path / "ckpt"))
  assert loaded_model == model
  assert_same_params(params, loaded)
  np.testing.assert_array_equal(logits(model, params), logits(loaded_model, loaded))


def test_dtype_and_sharding_on_restore(tmp_path):
  model = LlamaModel(small_config(tie_embeddings=False))
  params = model.init_params(jax.random.key(1))
  save_native(str(tmp_path), model, params)
  device = jax.sharding.SingleDeviceSharding(jax.devices()[-1])
  seen = []
  loaded_model, loaded = load_native(str(tmp_path), dtype="bfloat16",
                                     sharding=lambda leaf: seen.append(leaf.shape) or device)
  assert loaded_model.config.dtype == "bfloat16"
  assert len(seen) == len(jax.tree_util.tree_leaves(params))
  for leaf in jax.tree_util.tree_leaves(loaded):
    assert leaf.dtype == jnp.bfloat16 and leaf.sharding == device
  # one Sharding for all leaves, and a pytree of Shardings shaped like the params
  tree = jax.tree_util.tree_map(lambda _: device, model.abstract_params())
  for spec in (device, tree):
    _, loaded = load_native(str(tmp_path), sharding=spec)
    assert_same_params(params, loaded)
    assert all(leaf.sharding == device for leaf in jax.tree_util.tree_leaves(loaded))


def test_save_refuses_to_overwrite(tmp_path):
  model = LlamaModel(small_config())
  params = model.init_params(jax.random.key(0))
  save_native(str(tmp_path), model, params)
  with pytest.raises(FileExistsError):
    save_native(str(tmp_path), model, params)
  other = model.init_params(jax.random.key(1))
  save_native(str(tmp_path), model, other, overwrite=True)
  assert_same_params(other, load_native(str(tmp_path))[1])


def test_load_model_dispatches_native(tmp_path):
  model = LlamaModel(small_config())
  params = model.init_params(jax.random.key(2))
  save_native(str(tmp_path), model, params)
  loaded_model, loaded = load_model(str(tmp_path), dtype=None)
  assert loaded_model == model
  assert_same_params(params, loaded)
  assert find_tokenizer_path(str(tmp_path)) is None
  (tmp_path / "tokenizer.json").write_text("{}")
  assert find_tokenizer_path(str(tmp_path)) == str(tmp_path / "tokenizer.json")


@needs_stories
def test_load_model_dispatches_llama2c_and_converts(tmp_path):
  model, params = load_model(STORIES_BIN)
  direct_model, direct = load_llama2c(STORIES_BIN)
  assert model == direct_model and model.config.vocab_size == 512
  assert_same_params(params, direct)
  assert os.path.samefile(find_tokenizer_path(STORIES_BIN), os.path.join(STORIES, "tok512.bin"))
  # llama2.c -> native -> identical logits
  save_native(str(tmp_path), model, params)
  native_model, native = load_model(str(tmp_path))
  np.testing.assert_array_equal(logits(model, params), logits(native_model, native))


def test_load_model_unknown_inputs(tmp_path):
  with pytest.raises(FileNotFoundError):
    load_model(str(tmp_path / "nope"))
  (tmp_path / "weights.npz").write_bytes(b"x")
  with pytest.raises(CheckpointError, match="no config.json.*weights.npz"):
    load_model(str(tmp_path))
  with pytest.raises(CheckpointError, match="unsupported checkpoint file"):
    load_model(str(tmp_path / "weights.npz"))
  (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama"}))
  with pytest.raises(CheckpointError, match="neither spec_jax-native"):
    load_model(str(tmp_path))


def test_missing_config(tmp_path):
  with pytest.raises(CheckpointError, match="no config.json"):
    load_native(str(tmp_path))


def test_foreign_config(tmp_path):
  (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama"}))
  with pytest.raises(CheckpointError, match="not a spec_jax-native config"):
    load_native(str(tmp_path))


def _saved_small(folder) -> str:
  model = LlamaModel(small_config())
  save_native(str(folder), model, model.init_params(jax.random.key(0)))
  return str(folder / "params")


def _remove(path: str) -> None:
  shutil.rmtree(path) if os.path.isdir(path) else os.unlink(path)


def test_params_data_truncated(tmp_path):
  params_dir = _saved_small(tmp_path)
  files = [os.path.join(root, f) for root, _, names in os.walk(params_dir) for f in names]
  largest = max(files, key=os.path.getsize)  # an array data file
  with open(largest, "r+b") as f:
    f.truncate(os.path.getsize(largest) // 2)
  with pytest.raises(CheckpointError, match="failed to restore params, corrupt"):
    load_native(str(tmp_path))


def test_params_dir_emptied_or_missing(tmp_path):
  params_dir = _saved_small(tmp_path)
  for entry in os.listdir(params_dir):
    _remove(os.path.join(params_dir, entry))
  with pytest.raises(CheckpointError, match="corrupt checkpoint"):
    load_native(str(tmp_path))
  shutil.rmtree(params_dir)
  with pytest.raises(CheckpointError, match="missing params directory"):
    load_native(str(tmp_path))


def test_wrong_shape_params(tmp_path):
  model = LlamaModel(small_config(hidden_dim=48))
  save_native(str(tmp_path), model, model.init_params(jax.random.key(0)))
  config_path = tmp_path / "config.json"
  config = json.loads(config_path.read_text())
  config["hidden_dim"] = 40
  config_path.write_text(json.dumps(config))
  with pytest.raises(CheckpointError,
                     match=r"parameter layers\.0\.mlp\.w_\w+\.kernel has shape "
                           r"\((48, 32|32, 48)\), config\.json expects \((40, 32|32, 40)\)"):
    load_native(str(tmp_path))


def test_invalid_config_values(tmp_path):
  model = LlamaModel(small_config())
  save_native(str(tmp_path), model, model.init_params(jax.random.key(0)))
  config = json.loads((tmp_path / "config.json").read_text())
  (tmp_path / "config.json").write_text(json.dumps({**config, "n_kv_heads": 3}))
  with pytest.raises(CheckpointError, match="invalid LlamaConfig"):
    load_native(str(tmp_path))
  (tmp_path / "config.json").write_text(json.dumps({**config, "version": 99}))
  with pytest.raises(CheckpointError, match="version 99"):
    load_native(str(tmp_path))


@needs_stories
@pytest.mark.parametrize("n_bytes", [10, 28, 1000, 1_056_539])
def test_truncated_llama2c(tmp_path, n_bytes):
  path = tmp_path / "stories260K.bin"
  with open(STORIES_BIN, "rb") as f:
    path.write_bytes(f.read(n_bytes))
  with pytest.raises(CheckpointError, match="too short|truncated"):
    load_llama2c(str(path))
  with pytest.raises(CheckpointError):
    load_model(str(path))


@pytest.mark.parametrize("header", [
    [64, 172, 5, 8, 4, 512, 0],  # zero seq_len
    [64, 172, -5, 8, 4, 512, 512],  # negative layers
    [1 << 30, 172, 5, 8, 4, 512, 512],  # absurd dim
    [64, 172, 5, 7, 4, 512, 512],  # dim not divisible by heads
], ids=["zero", "negative", "huge", "inconsistent"])
def test_absurd_llama2c_header(tmp_path, header):
  path = tmp_path / "bad.bin"
  path.write_bytes(np.asarray(header, "<i4").tobytes() + b"\0" * 4096)
  with pytest.raises(CheckpointError, match="absurd|inconsistent"):
    load_llama2c(str(path))
