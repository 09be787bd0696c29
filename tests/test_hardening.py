"""Issue 16's bad inputs: loaders check values (finite tensors, typed and bounded configs),
raise one error family each, stay bounded in memory before validating; native checkpoints
carry checksums; shards stay inside their folder; tokenizers refuse invalid text; every
command line turns an expected error into one line. Fuzzed with hypothesis over config
fields and byte-level corruption of tiny files in every format."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
import tracemalloc
from pathlib import Path

import jax
import numpy as np
import pytest
import safetensors.numpy
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from spec_jax.core.errors import BadArgument, CheckpointError, TokenizerError
from spec_jax.models import builtin, hf, llama2c, native
from spec_jax.models.llama import LlamaConfig, LlamaModel
from spec_jax.models.loading import load_model
from spec_jax.models.params_io import params_to_flat
from spec_jax.models.tokenizer import load_tokenizer

# orbax leaves a coroutine per array unawaited when a damaged checkpoint fails to restore
pytestmark = pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")

REPO = Path(__file__).resolve().parents[1]
# modest and deterministic by default; SPEC_JAX_FUZZ_EXAMPLES=500 explores (randomly) further
FUZZ_EXAMPLES = int(os.environ.get("SPEC_JAX_FUZZ_EXAMPLES", 0))
FUZZ = settings(max_examples=FUZZ_EXAMPLES or 20, deadline=None, derandomize=not FUZZ_EXAMPLES,
                database=None, suppress_health_check=list(HealthCheck))


def small(**overrides) -> tuple[LlamaModel, object]:
  cfg = dict(vocab_size=32, dim=16, n_layers=2, n_heads=2, n_kv_heads=1, hidden_dim=24,
             max_seq_len=16, tie_embeddings=False)
  model = LlamaModel(LlamaConfig(**{**cfg, **overrides}))
  return model, model.init_params(jax.random.key(0))


def write_llama2c(path: Path, header: dict[str, int], seed: int = 0) -> dict[str, int]:
  """A llama2.c v0 file of random weights -> {array name: its byte offset}."""
  rng = np.random.default_rng(seed)
  parts, offsets, offset = [np.asarray(list(header.values()), "<i4").tobytes()], {}, 28
  for name, shape in llama2c._layout(header):
    data = rng.standard_normal(shape).astype("<f4").tobytes()
    offsets[name], offset = offset, offset + len(data)
    parts.append(data)
  path.write_bytes(b"".join(parts))
  return offsets


HEADER = dict(dim=16, hidden_dim=24, n_layers=2, n_heads=2, n_kv_heads=2, vocab_size=32,
              seq_len=16)


def all_finite(params) -> bool:
  return all(np.isfinite(np.asarray(a, np.float32)).all() for a in params_to_flat(params).values())


# ---- finite weights and typed, bounded configs, format by format -----------------------------

def test_llama2c_nan_in_one_weight_and_odd_head_dim(tmp_path):
  path = tmp_path / "m.bin"
  offsets = write_llama2c(path, HEADER)
  load_model(str(path))
  data = bytearray(path.read_bytes())
  data[offsets["w1"] + 4 * 37:offsets["w1"] + 4 * 38] = np.float32(np.nan).tobytes()
  path.write_bytes(bytes(data))
  with pytest.raises(CheckpointError, match=r"m\.bin: tensor w1 holds 1 non-finite"):
    load_model(str(path))
  write_llama2c(path, dict(HEADER, dim=18, n_heads=2, n_kv_heads=2))  # head_dim 9: odd
  with pytest.raises(CheckpointError, match=r"m\.bin: .*head_dim must be even"):
    load_model(str(path))


@pytest.fixture(scope="module")
def hf_folder(tmp_path_factory) -> Path:
  folder = tmp_path_factory.mktemp("hf")
  hf.save_hf(str(folder), *small())
  return folder


def _hf_copy(hf_folder: Path, tmp: Path, **config_changes) -> Path:
  folder = tmp / "hf"
  shutil.copytree(hf_folder, folder)
  if config_changes:
    path = folder / "config.json"
    path.write_text(json.dumps({**json.loads(path.read_text()), **config_changes}))
  return folder


def _set_tensor(folder: Path, name: str, index, value) -> None:
  path = folder / "model.safetensors"
  tensors = safetensors.numpy.load_file(str(path))
  tensors[name][index] = value
  safetensors.numpy.save_file(tensors, str(path), metadata={"format": "pt"})


@pytest.mark.parametrize("tensor, value", [
    ("model.layers.1.mlp.up_proj.weight", np.nan), ("model.embed_tokens.weight", np.inf)])
def test_hf_non_finite_weight(hf_folder, tmp_path, tensor, value):
  folder = _hf_copy(hf_folder, tmp_path)
  _set_tensor(folder, tensor, (3, 5), value)
  with pytest.raises(CheckpointError, match=rf"tensor {tensor} holds 1 non-finite .*\(3, 5\)"):
    load_model(str(folder))


@pytest.mark.parametrize("changes, message", [
    (dict(rms_norm_eps=float("nan")), r"rms_norm_eps must be finite"),
    (dict(rms_norm_eps=0), r"rms_norm_eps must be > 0"),
    (dict(rms_norm_eps=-1e-5), r"rms_norm_eps must be > 0"),
    (dict(rope_theta=float("nan")), r"rope_theta must be finite"),
    (dict(rope_theta=0.0), r"rope_theta must be > 0"),
    (dict(rope_theta=-10000.0), r"rope_theta must be > 0"),
    (dict(rope_parameters={"rope_type": "default", "rope_theta": float("inf")}),
     r"rope_theta must be finite"),
    (dict(head_dim=0), r"head_dim must be an integer >= 1, got 0"),
    (dict(layer_types=5), r"layer_types must be a list"),
    (dict(hidden_size=16.5), r"hidden_size must be an integer, got 16.5"),
    (dict(hidden_size=16.0), r"hidden_size must be an integer, got 16.0"),
    (dict(num_hidden_layers="2"), r"num_hidden_layers must be an integer, got '2'"),
    (dict(num_hidden_layers=True), r"num_hidden_layers must be an integer, got True"),
    (dict(tie_word_embeddings="no"), r"tie_word_embeddings must be true or false"),
    (dict(vocab_size=2 ** 70), r"vocab_size=\d+ exceeds every tensor dimension"),
])
def test_hf_config_values(hf_folder, tmp_path, changes, message):
  folder = _hf_copy(hf_folder, tmp_path, **changes)
  with pytest.raises(CheckpointError, match=message):
    load_model(str(folder))


def test_config_of_random_bytes(hf_folder, tmp_path):
  folder = _hf_copy(hf_folder, tmp_path)
  (folder / "config.json").write_bytes(bytes(np.random.default_rng(0).integers(0, 256, 300,
                                                                               np.uint8)))
  with pytest.raises(CheckpointError, match=r"config\.json: not UTF-8 text"):
    load_model(str(folder))
  with pytest.raises(CheckpointError, match=r"config\.json: not UTF-8 text"):
    hf.load_hf(str(folder))


def _bounded(fn, *, seconds: float = 5.0, megabytes: float = 500.0) -> Exception:
  """Runs fn, which must raise; checks time and peak Python memory -> the exception."""
  tracemalloc.start()
  start = time.perf_counter()
  try:
    fn()
  except Exception as e:  # noqa: BLE001  returned to the caller to check
    error = e
  else:
    raise AssertionError("expected an error")
  finally:
    elapsed = time.perf_counter() - start
    peak = tracemalloc.get_traced_memory()[1] / 2 ** 20
    tracemalloc.stop()
  assert elapsed < seconds and peak < megabytes, (elapsed, peak)
  return error


def test_hf_with_ten_million_layers_fails_fast_and_small(hf_folder, tmp_path):
  folder = _hf_copy(hf_folder, tmp_path, num_hidden_layers=10 ** 7)
  error = _bounded(lambda: load_model(str(folder)))
  assert isinstance(error, CheckpointError)
  assert "num_hidden_layers=10000000, but the file holds tensors for layers 0..1" in str(error)


def _sharded(hf_folder: Path, tmp: Path) -> Path:
  folder = _hf_copy(hf_folder, tmp)
  tensors = safetensors.numpy.load_file(str(folder / "model.safetensors"))
  (folder / "model.safetensors").unlink()
  names = sorted(tensors)
  shards = {"model-00001-of-00002.safetensors": names[:len(names) // 2],
            "model-00002-of-00002.safetensors": names[len(names) // 2:]}
  for shard, part in shards.items():
    safetensors.numpy.save_file({n: tensors[n] for n in part}, str(folder / shard))
  weight_map = {n: shard for shard, part in shards.items() for n in part}
  (folder / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
  return folder


def test_shards_resolve_inside_the_folder(hf_folder, tmp_path):
  folder = _sharded(hf_folder, tmp_path)
  load_model(str(folder))
  shard = folder / "model-00002-of-00002.safetensors"
  # a symlink whose target stays inside the folder is fine
  (folder / "blobs").mkdir()
  shard.rename(folder / "blobs" / "x")
  shard.symlink_to(folder / "blobs" / "x")
  load_model(str(folder))
  # one that leads outside is refused, though the file is a perfectly good shard
  outside = tmp_path / "elsewhere.safetensors"
  (folder / "blobs" / "x").rename(outside)
  shard.unlink()
  shard.symlink_to(outside)
  with pytest.raises(CheckpointError, match="resolves outside the checkpoint folder"):
    load_model(str(folder))
  index = folder / "model.safetensors.index.json"
  weight_map = json.loads(index.read_text())["weight_map"]
  for bad in ("../elsewhere.safetensors", str(outside), 5):
    index.write_text(json.dumps({"weight_map": {**weight_map, "lm_head.weight": bad}}))
    with pytest.raises(CheckpointError, match="outside the checkpoint folder|malformed shard"):
      load_model(str(folder))


@pytest.fixture(scope="module")
def native_folder(tmp_path_factory) -> Path:
  folder = tmp_path_factory.mktemp("native")
  native.save_native(str(folder), *small())
  return folder


def _data_files(folder: Path) -> list[Path]:
  """The ocdbt data files (under a `d/` folder) that hold the compressed tensor chunks."""
  return [Path(r) / f for r, _, names in os.walk(folder / "params") for f in names
          if Path(r).name == "d"]


def test_native_checksums_catch_changed_tensor_bytes(native_folder, tmp_path):
  # A data file whose bytes changed yet still decode (what zstd without a content checksum
  # lets through): only the saved crc32 can tell. Built deterministically, as a valid orbax
  # tree of other values under the original config.json, since where orbax puts which chunk
  # (and so where a random flip lands) varies from machine to machine.
  folder = tmp_path / "n"
  shutil.copytree(native_folder, folder)
  assert len(json.loads((folder / "config.json").read_text())["tensor_crc32"]) == 2 + 9 * 2 + 1
  model, params = small()
  flat = params_to_flat(params)
  name = "layers.0.attn.wq.kernel"
  nudged = float(np.asarray(flat[name]).reshape(-1)[3]) + 1e-3  # finite, plausible, wrong
  native.save_native(str(tmp_path / "other"), model, _with(model, flat, name, nudged))
  shutil.rmtree(folder / "params")
  shutil.copytree(tmp_path / "other" / "params", folder / "params")
  with pytest.raises(CheckpointError, match=rf"tensor {name} fails its checksum .*corrupt"):
    load_model(str(folder))


def test_native_flipped_bytes_in_every_data_file(native_folder, tmp_path):
  folder = tmp_path / "n"
  shutil.copytree(native_folder, folder)
  files = _data_files(folder)
  assert files, "orbax wrote no ocdbt data files: the layout this test assumes changed"
  for path in files:  # 64 bytes at a quarter, the middle and three quarters of each file
    data = bytearray(path.read_bytes())
    for at in (len(data) // 4, len(data) // 2, 3 * len(data) // 4):
      data[at:at + 64] = bytes(b ^ 0x5A for b in data[at:at + 64])
    path.write_bytes(bytes(data))
  # a chunk that no longer decodes, or decodes to other values: either way named as corrupt
  with pytest.raises(CheckpointError, match=r"corrupt"):
    load_model(str(folder))


def test_native_non_finite_weights_with_or_without_checksums(tmp_path, monkeypatch):
  model, params = small()
  flat = params_to_flat(params)
  with pytest.raises(CheckpointError, match=r"save_native: tensor embed holds 1 non-finite"):
    native.save_native(str(tmp_path / "refused"), model, _with(model, flat, "embed", np.nan))
  # written anyway (as an older version, or another writer, could): the load still refuses
  monkeypatch.setattr(native, "check_finite", lambda *a: None)
  folder = tmp_path / "n"
  native.save_native(str(folder), model, _with(model, flat, "layers.1.mlp.w_up.kernel", np.inf))
  monkeypatch.undo()
  with pytest.raises(CheckpointError, match=r"tensor layers\.1\.mlp\.w_up\.kernel holds 1 non"):
    load_model(str(folder))
  config = json.loads((folder / "config.json").read_text())
  del config["tensor_crc32"]  # as written before checksums existed: loads silently if finite
  (folder / "config.json").write_text(json.dumps(config))
  with pytest.raises(CheckpointError, match=r"tensor layers\.1\.mlp\.w_up\.kernel holds 1 non"):
    load_model(str(folder))


def _with(model, flat: dict, name: str, value):
  from spec_jax.models.params_io import params_from_flat
  changed = dict(flat)
  changed[name] = np.array(flat[name])
  changed[name].reshape(-1)[3] = value
  return params_from_flat(model, changed)


@pytest.mark.parametrize("changes, message", [
    (dict(n_layers="5"), r"n_layers must be an integer, got '5'"),
    (dict(n_layers=10 ** 7), r"n_layers=10000000, but the file holds tensors for layers 0..1"),
    (dict(norm_eps=float("nan")), r"norm_eps must be finite"),
    (dict(rope_theta=-1.0), r"rope_theta must be > 0"),
    (dict(dim=2 ** 60), r"dim=\d+ exceeds every tensor dimension"),
    (dict(head_dim=0), r"head_dim must be an integer >= 1"),
    (dict(tensor_crc32={"embed": "zz"}), r"malformed tensor_crc32"),
])
def test_native_config_values(native_folder, tmp_path, changes, message):
  folder = tmp_path / "n"
  shutil.copytree(native_folder, folder)
  path = folder / "config.json"
  path.write_text(json.dumps({**json.loads(path.read_text()), **changes}))
  _bounded(lambda: load_model(str(folder)), seconds=30)  # orbax's metadata read is not free
  with pytest.raises(CheckpointError, match=message):
    load_model(str(folder))


@pytest.fixture(scope="module")
def builtin_folder(tmp_path_factory) -> Path:
  folder = tmp_path_factory.mktemp("builtin")
  builtin.save_model(folder, "target", *small())
  return folder


def test_builtin_format_values(builtin_folder, tmp_path):
  folder = tmp_path / "b"
  shutil.copytree(builtin_folder, folder)
  builtin.load_model(folder, "target")
  config = json.loads((folder / "target.json").read_text())
  (folder / "target.json").write_text(json.dumps({**config, "n_layers": 10 ** 7}))
  error = _bounded(lambda: builtin.load_model(folder, "target"))
  assert isinstance(error, CheckpointError) and "n_layers=10000000" in str(error)
  (folder / "target.json").write_text(json.dumps({**config, "hidden_dim": 24.0}))
  with pytest.raises(CheckpointError, match="hidden_dim must be an integer, got 24.0"):
    builtin.load_model(folder, "target")


@pytest.fixture(scope="module")
def drafter_folders(tmp_path_factory) -> dict[str, Path]:
  from spec_jax.drafters.files import export_drafter
  from spec_jax.models.drafter_heads import MedusaConfig, MedusaModel
  medusa = MedusaModel(MedusaConfig(vocab_size=32, dim=16, num_heads=2))
  draft = LlamaModel(LlamaConfig(vocab_size=32, dim=16, n_layers=1, n_heads=2, n_kv_heads=1,
                                 hidden_dim=24, max_seq_len=16))
  folders = {}
  for kind, model in (("medusa", medusa), ("draft_model", draft)):
    folders[kind] = tmp_path_factory.mktemp(kind)
    export_drafter(folders[kind], kind, model, model.init_params(jax.random.key(1)))
  return folders


@pytest.mark.parametrize("kind, changes, message", [
    ("medusa", dict(dim="64"), r"MedusaConfig\.dim must be an integer, got '64'"),
    ("medusa", dict(num_heads=10 ** 7), r"num_heads=10000000, but the file holds only"),
    ("medusa", dict(dim=2 ** 40), r"dim=\d+, more than any tensor dimension"),
    ("medusa", dict(num_heads=2.0), r"num_heads must be an integer, got 2.0"),
    ("draft_model", dict(n_layers=10 ** 7), r"n_layers=10000000, but the file holds only"),
    ("draft_model", dict(rope_theta=float("nan")), r"rope_theta must be finite"),
])
def test_drafter_json_values(drafter_folders, tmp_path, kind, changes, message):
  from spec_jax.drafters.files import read_drafter
  folder = tmp_path / kind
  shutil.copytree(drafter_folders[kind], folder)
  path = folder / "drafter.json"
  meta = json.loads(path.read_text())
  meta["config"].update(changes)
  path.write_text(json.dumps(meta))
  error = _bounded(lambda: read_drafter(folder))
  assert isinstance(error, CheckpointError) and __import__("re").search(message, str(error)), error


def test_integer_arguments_of_the_loaders(tmp_path):
  path = tmp_path / "m.bin"
  write_llama2c(path, HEADER)
  for dtype in ("int32", 5, "nonsense"):
    with pytest.raises(BadArgument, match="dtype"):
      load_model(str(path), dtype=dtype)
  with pytest.raises(BadArgument, match="path must be a str"):
    load_model(3)
  for field, value in (("dim", True), ("dim", 16.0), ("n_layers", "2"), ("hidden_dim", 0)):
    with pytest.raises(BadArgument, match=f"LlamaConfig.{field}"):
      LlamaConfig(**{**dict(vocab_size=32, dim=16, n_layers=2, n_heads=2, n_kv_heads=1,
                            hidden_dim=24), field: value})
  assert LlamaConfig(vocab_size=np.int64(32), dim=16, n_layers=2, n_heads=2, n_kv_heads=1,
                     hidden_dim=24).vocab_size == 32  # numpy integers are integers


def test_nonexistent_checkpoint_is_in_the_family_and_a_file_not_found():
  with pytest.raises(CheckpointError) as caught:
    load_model("/nonexistent/model.bin")
  assert isinstance(caught.value, FileNotFoundError)


# ---- Medusa trees are bounded before they are built --------------------------------------------

def test_medusa_tree_depth_is_checked_before_enumeration_and_enumeration_is_lazy():
  from spec_jax.drafters import registry
  from spec_jax.drafters.medusa import static_choices
  from spec_jax.models.drafter_heads import MedusaConfig, MedusaModel
  model = MedusaModel(MedusaConfig(vocab_size=32, dim=16, num_heads=2))
  tree_of = registry.trained_family("medusa").trained.tree
  error = _bounded(lambda: tree_of(model, registry.TreeOptions(12, 10, 16)), seconds=1,
                   megabytes=5)
  assert "depth 12 needs as many heads; the model has 2" in str(error)
  tracemalloc.start()
  choices = static_choices(registry.TreeOptions(12, 10, 16))  # 10**12 paths of length <= 12
  peak = tracemalloc.get_traced_memory()[1]
  tracemalloc.stop()
  assert len(choices) == 15 and peak < 1 << 20
  assert choices[:4] == ((0,), (0, 0), (0, 0, 0), (0, 0, 0, 0))  # rank sum 0 first, shorter first
  with pytest.raises(ValueError, match="at most 7 nodes"):
    static_choices(registry.TreeOptions(2, 2, 8))


# ---- tokenizers ---------------------------------------------------------------------------------

def test_params_of_another_model_are_named_before_tracing():
  # "Incorrect number of leaves, expected 47", raised inside the trace, was all one got
  import jax.numpy as jnp
  from spec_jax import generate, speculate
  from spec_jax.drafters.draft_model import DraftModelDrafter
  from spec_jax.drafters.factory import make_drafter
  target, params = small()
  draft, draft_params = small(dim=8, hidden_dim=12)
  shallow, shallow_params = small(n_layers=1)
  tokens, lengths = jnp.ones((1, 4), jnp.int32), jnp.array([4])
  with pytest.raises(BadArgument, match=r"draft params for DraftModelDrafter: parameter embed "
                                        r"has shape \(32, 16\), the LlamaModel given expects "
                                        r"\(32, 8\)"):
    make_drafter("draft_model", target, params, draft_model=draft, draft_params=params)
  with pytest.raises(BadArgument, match=r"draft params .*missing \['layers\.1\."):
    speculate(target, params, DraftModelDrafter(target), shallow_params, tokens, lengths,
              gamma=2, max_new_tokens=4)
  with pytest.raises(BadArgument, match=r"^target params: parameter embed has shape"):
    speculate(target, draft_params, DraftModelDrafter(draft), draft_params, tokens, lengths,
              gamma=2, max_new_tokens=4)
  with pytest.raises(BadArgument, match=r"^params: parameter embed has shape \(32, 8\)"):
    generate(target, draft_params, tokens, lengths, max_new_tokens=4)
  from spec_jax.speculative import speculative_generate  # the chain entry point too
  with pytest.raises(BadArgument, match=r"^target params: parameter embed has shape"):
    speculative_generate(target, draft_params, DraftModelDrafter(draft), draft_params, tokens,
                         lengths, gamma=2, max_new_tokens=4)
  with pytest.raises(BadArgument, match=r"expected \(primary params, secondary params\)"):
    drafter, _ = make_drafter("lookup+draft_model", target, params, draft_model=draft,
                              draft_params=draft_params)
    speculate(target, params, drafter, draft_params, tokens, lengths, gamma=2,
              max_new_tokens=4)
  # what fits runs: int8 kernels count as the float tensors they stand for
  out = speculate(target, params, *make_drafter("quantized", target, params), tokens, lengths,
                  gamma=2, max_new_tokens=4)
  assert out.tokens.shape == (1, 4)


def test_lone_surrogate_is_a_tokenizer_error():
  tokenizers = [load_tokenizer(builtin.BUILTIN_DIR / "tokenizer.json")]
  tok512 = REPO.parent / "shared" / "models" / "stories260K" / "tok512.bin"
  if tok512.is_file():
    tokenizers.append(load_tokenizer(tok512))
  for tok in tokenizers:
    for text in ("ab\udcffc", "\ud800"):
      with pytest.raises(TokenizerError, match="lone surrogate"):
        tok.encode(text)
    with pytest.raises(TokenizerError, match="takes a str"):
      tok.encode(b"bytes")
    assert tok.decode(tok.encode("ab\ufffdc")) == "ab\ufffdc"  # U+FFFD itself is fine


# ---- fuzz: config fields -------------------------------------------------------------------------

JSON_VALUES = st.one_of(
    st.none(), st.booleans(), st.integers(-2 ** 70, 2 ** 70),
    st.sampled_from([0, 1, 2, 3, 16, 32, -1, 10 ** 7, 2 ** 31]),
    st.floats(allow_nan=True, allow_infinity=True), st.text(max_size=4),
    st.lists(st.integers(-3, 40), max_size=3),
    st.dictionaries(st.sampled_from(["rope_type", "rope_theta", "type", "x"]),
                    st.one_of(st.text(max_size=8), st.floats(), st.integers()), max_size=2))
HF_FIELDS = ["architectures", "vocab_size", "hidden_size", "num_hidden_layers",
             "num_attention_heads", "num_key_value_heads", "intermediate_size", "head_dim",
             "max_position_embeddings", "rms_norm_eps", "rope_theta", "rope_scaling",
             "rope_parameters", "tie_word_embeddings", "attention_bias", "mlp_bias",
             "hidden_act", "layer_types", "sliding_window", "use_sliding_window"]
LLAMA_FIELDS = ["vocab_size", "dim", "n_layers", "n_heads", "n_kv_heads", "hidden_dim",
                "head_dim", "max_seq_len", "rope_theta", "norm_eps", "qkv_bias",
                "tie_embeddings", "dtype", "fused_projections"]


def _loads_or_family_error(load) -> object:
  try:
    return load()
  except CheckpointError:
    return None


@FUZZ
@given(changes=st.dictionaries(st.sampled_from(HF_FIELDS), JSON_VALUES, min_size=1, max_size=3))
def test_fuzz_hf_config_fields(hf_folder, changes):
  with tempfile.TemporaryDirectory() as tmp:
    folder = _hf_copy(hf_folder, Path(tmp), **changes)
    loaded = _loads_or_family_error(lambda: load_model(str(folder)))
    assert loaded is None or all_finite(loaded[1])


@FUZZ
@given(changes=st.dictionaries(st.sampled_from(LLAMA_FIELDS), JSON_VALUES, min_size=1,
                               max_size=3))
def test_fuzz_native_and_builtin_config_fields(native_folder, builtin_folder, changes):
  with tempfile.TemporaryDirectory() as tmp:
    folder = Path(tmp) / "b"
    shutil.copytree(builtin_folder, folder)
    path = folder / "target.json"
    path.write_text(json.dumps({**json.loads(path.read_text()), **changes}))
    _loads_or_family_error(lambda: builtin.load_model(folder, "target"))
    folder = Path(tmp) / "n"
    shutil.copytree(native_folder, folder)
    path = folder / "config.json"
    path.write_text(json.dumps({**json.loads(path.read_text()), **changes}))
    _loads_or_family_error(lambda: load_model(str(folder)))


@FUZZ
@given(kind=st.sampled_from(["medusa", "draft_model"]),
       changes=st.dictionaries(st.sampled_from(LLAMA_FIELDS + ["num_heads", "kind", "config"]),
                               JSON_VALUES, min_size=1, max_size=3))
def test_fuzz_drafter_json_fields(drafter_folders, kind, changes):
  from spec_jax.drafters.files import read_drafter
  with tempfile.TemporaryDirectory() as tmp:
    folder = Path(tmp) / kind
    shutil.copytree(drafter_folders[kind], folder)
    path = folder / "drafter.json"
    meta = json.loads(path.read_text())
    for key, value in sorted(changes.items(), key=lambda kv: kv[0] in ("kind", "config")):
      (meta if key in ("kind", "config") else meta["config"])[key] = value  # whole config last
    path.write_text(json.dumps(meta))
    _loads_or_family_error(lambda: read_drafter(folder))


# ---- fuzz: bytes ----------------------------------------------------------------------------------

CORRUPTIONS = st.tuples(st.sampled_from(["truncate", "flip", "overwrite", "append", "ones"]),
                        st.floats(0, 1), st.integers(1, 64), st.binary(min_size=1, max_size=64))


def _corrupt(path: Path, corruption) -> None:
  op, where, count, junk = corruption
  data = bytearray(path.read_bytes())
  at = int(where * len(data))
  if op == "truncate":
    data = data[:at]
  elif op == "flip":
    for i in range(count):
      if data:
        data[(at + 7 * i) % len(data)] ^= junk[i % len(junk)] | 1
  elif op == "overwrite":
    data[at:at + len(junk)] = junk
  elif op == "append":
    data += junk
  else:  # 0xff bytes: NaN patterns in float data
    data[at:at + count] = b"\xff" * count
  path.write_bytes(bytes(data))


def _files(folder: Path) -> list[Path]:
  return sorted(p for p in folder.rglob("*") if p.is_file())


@pytest.fixture(scope="module")
def pristine(tmp_path_factory, hf_folder, native_folder, builtin_folder, drafter_folders):
  """{format: (folder, loader, check of a successful load)} over tiny files."""
  bin_folder = tmp_path_factory.mktemp("llama2c")
  write_llama2c(bin_folder / "m.bin", HEADER)
  tok_folder = tmp_path_factory.mktemp("tok")
  shutil.copy(builtin.BUILTIN_DIR / "tokenizer.json", tok_folder / "tokenizer.json")
  pieces = [b"<unk>", b"\n<s>\n", b"\n</s>\n"] + [b"<0x%02X>" % b for b in range(256)] + \
      [b" ", b"a", b"b", b"ab"]
  (tok_folder / "tok.bin").write_bytes(
      np.uint32(8).tobytes() + b"".join(np.float32(-i).tobytes() + np.int32(len(p)).tobytes() + p
                                        for i, p in enumerate(pieces)))
  from spec_jax.drafters.files import read_drafter
  model_check = lambda out: all_finite(out[1])  # noqa: E731
  # native: checksums guard the data, so a load that succeeds gives the saved params exactly
  saved = params_to_flat(native.load_native(str(native_folder))[1])
  native_check = lambda out: all(np.array_equal(saved[k], v)  # noqa: E731
                                 for k, v in params_to_flat(out[1]).items())
  return {
      "llama2c": (bin_folder, lambda f: load_model(str(f / "m.bin")), model_check),
      "hf": (hf_folder, lambda f: load_model(str(f)), model_check),
      "native": (native_folder, lambda f: load_model(str(f)), native_check),
      "builtin": (builtin_folder, lambda f: builtin.load_model(f, "target"), model_check),
      "medusa": (drafter_folders["medusa"], lambda f: read_drafter(f), lambda out: True),
      "draft_model": (drafter_folders["draft_model"], lambda f: read_drafter(f),
                      lambda out: True),
      "tokenizer.json": (tok_folder, lambda f: load_tokenizer(f / "tokenizer.json"),
                         lambda tok: tok.decode(tok.encode("def f(x):")) == "def f(x):"),
      "tok.bin": (tok_folder, lambda f: load_tokenizer(f / "tok.bin"),
                  lambda tok: tok.vocab_size == len(pieces)),
  }


@pytest.mark.parametrize("fmt", ["llama2c", "hf", "native", "builtin", "medusa", "draft_model",
                                 "tokenizer.json", "tok.bin"])
def test_fuzz_byte_corruption(pristine, fmt):
  folder, load, check = pristine[fmt]
  files = [p.relative_to(folder) for p in _files(folder)
           if fmt not in ("tokenizer.json", "tok.bin") or p.name == fmt]
  family = TokenizerError if fmt in ("tokenizer.json", "tok.bin") else CheckpointError

  @FUZZ
  @given(target=st.sampled_from(files), corruption=CORRUPTIONS)
  def run(target, corruption):
    with tempfile.TemporaryDirectory() as tmp:
      copy = Path(tmp) / "c"
      shutil.copytree(folder, copy)
      _corrupt(copy / target, corruption)
      try:
        out = load(copy)
      except family:
        return
      assert check(out), f"{target} {corruption}: loaded, but wrong"

  run()


# ---- the command lines ---------------------------------------------------------------------------

@pytest.fixture(scope="module")
def medusa_for_builtin(tmp_path_factory) -> Path:
  """An (untrained) 2-head Medusa drafter shaped for the built-in target."""
  from spec_jax.drafters.files import export_drafter
  from spec_jax.models.drafter_heads import MedusaConfig, MedusaModel
  target_cfg = json.loads((builtin.BUILTIN_DIR / "target.json").read_text())
  model = MedusaModel(MedusaConfig(target_cfg["vocab_size"], target_cfg["dim"], 2))
  return export_drafter(tmp_path_factory.mktemp("medusa"), "medusa", model,
                        model.init_params(jax.random.key(0)))


BAD_FLAGS = [  # (script, argv, exit status, what the one line must say)
    ("generate", ["hi", "--model", "/nonexistent"], 1, "no checkpoint at /nonexistent"),
    ("generate", ["hi", "--gamma", "0"], 2,
     "argument --gamma: must be an integer >= 1 or 'auto', got '0'"),
    ("generate", ["hi", "--gamma", "4.5"], 2,
     "argument --gamma: must be an integer >= 1 or 'auto', got '4.5'"),
    ("generate", ["hi", "--gamma", "autox"], 2,
     "argument --gamma: must be an integer >= 1 or 'auto', got 'autox'"),
    # flags that cannot work together, or that the run would ignore
    ("generate", ["hi", "there", "--stream"], 2,
     "--stream prints one prompt's text as it comes; got 2 prompts"),
    ("generate", ["hi", "--stream", "--json"], 2, "--stream and --json both write to stdout"),
    ("generate", ["hi", "--draft", "none", "--gamma", "3", "--compare"], 2,
     "--draft none decodes autoregressively: --gamma, --compare would do nothing"),
    ("generate", ["hi", "--draft", "prompt_lookup", "--draft-layers", "2"], 2,
     "--draft-layers is for --draft layer_skip or lookup+layer_skip; --draft prompt_lookup "
     "does not read it"),
    ("generate", ["hi", "--draft", "layer_skip", "--draft-model", "/nonexistent"], 2,
     "--draft-model is for --draft draft_model"),
    ("generate", ["hi", "--tree", "a,b"], 2, "argument --tree: a tree is DEPTH,TOPK,NODES"),
    ("generate", ["hi", "--tree=-1,3,16"], 2, "argument --tree: tree depth must be an integer"),
    ("generate", ["hi", "--temperature", "-1"], 2, "argument --temperature: must be a finite"),
    ("generate", ["hi", "--temperature", "nan"], 2, "argument --temperature: must be a finite"),
    ("generate", ["hi", "--top-p", "1.5"], 2, "argument --top-p: must be a finite number > 0"),
    ("generate", ["hi", "--top-k", "-2"], 2, "argument --top-k: must be an integer >= 0"),
    ("generate", ["hi", "--seed", str(2 ** 64)], 2, "argument --seed: must be an integer"),
    ("generate", ["hi", "--max-new-tokens", "100000"], 2, "longer than the model's context"),
    ("generate", ["hi", "--draft", "nope"], 2, "argument --draft: invalid choice"),
    ("generate", ["hi", "--stream", "--draft", "none"], 2, "--stream runs the speculative loop"),
    ("generate", ["hi", "--tree", "12,10,16", "--draft", "medusa", "--draft-checkpoint", "MEDUSA"],
     2, "a Medusa tree of depth 12 needs as many heads; the model has 2"),
    ("generate", ["hi", "--draft", "medusa", "--draft-checkpoint", "/nonexistent"], 1,
     "not an exported drafter"),
    ("generate", ["hi", "--draft", "lookup+medusa"], 2,
     "--draft lookup+medusa: medusa is a trained drafter and none ships for this model; pass "
     "--draft-checkpoint DIR"),
    ("generate", [], 2, "the following arguments are required: prompts"),
    ("train_drafter", ["--kind", "medusa", "--model", "x", "--steps", "0"], 2,
     "argument --steps: must be an integer >= 1, got 0"),
    ("train_drafter", ["--kind", "medusa", "--model", "x", "--lr", "-1"], 2, "argument --lr"),
    ("train_drafter", ["--kind", "medusa", "--model", "/nonexistent"], 1, "no checkpoint at"),
    ("train", ["--steps-target", "1.5"], 2, "argument --steps-target: must be an integer"),
    ("train", ["--seed", "-3"], 2, "argument --seed: must be an integer >= 0"),
    ("benchmark", ["--repeats", "0"], 2, "argument --repeats: must be an integer >= 1"),
    ("benchmark", ["--scenarios", "9"], 2, "unknown scenarios ['9']"),
]


def test_bad_flags_give_one_line_and_the_right_status(tmp_path, medusa_for_builtin):
  cases = [(script, [str(medusa_for_builtin) if a == "MEDUSA" else a for a in argv])
           for script, argv, _, _ in BAD_FLAGS]
  cases.append(("generate", ["--help"]))
  cases.append(("generate", ["hi", "--model", "/nonexistent", "--debug"]))
  (tmp_path / "cases.json").write_text(json.dumps(cases))
  subprocess.run([sys.executable, str(REPO / "tests" / "cli_driver.py"),
                  str(tmp_path / "cases.json"), str(tmp_path / "out.json")], check=True,
                 timeout=600, cwd=REPO)
  results = json.loads((tmp_path / "out.json").read_text())
  for (script, argv, status, message), result in zip(BAD_FLAGS, results):
    where = f"{script} {' '.join(argv)}: {result['stderr'][-2000:]}"
    assert result["status"] == status, where
    lines = result["stderr"].splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and message in lines[0], where
  help_text = " ".join(results[-2]["stdout"].split())
  assert results[-2]["status"] == 0 and "U+FFFD" in help_text and "--debug" in help_text
  assert results[-1]["status"] == "traceback" and "CheckpointNotFound" in results[-1]["stderr"]


def test_a_model_without_a_draft_model_names_the_flag_it_needs(tmp_path):
  """On a model with no draft model beside it, --draft draft_model and --tree (drafted by a
  model by default) name --draft-model; the factory's message named API arguments, and
  --tree fell back to prompt lookup, which has no tree. --draft-model alone drafts with it
  (it was ignored), and beside --draft-checkpoint, whose model would win, is an error."""
  from conftest import STORIES_DIR, require_shared
  model = str(require_shared(STORIES_DIR / "stories260K.bin"))
  cases = [("generate", ["hi", "--model", model, "--draft", "draft_model"]),
           ("generate", ["hi", "--model", model, "--tree", "4,3,16"]),
           ("generate", ["hi", "--model", model, "--draft-model", model, "--draft-checkpoint",
                         str(tmp_path)]),
           # a draft model given without --draft drafts (with lookup, as the built-in pair's)
           ("generate", ["hi", "--model", model, "--draft-model", model, "--max-new-tokens", "4",
                         "--json"])]
  (tmp_path / "cases.json").write_text(json.dumps(cases))
  subprocess.run([sys.executable, str(REPO / "tests" / "cli_driver.py"),
                  str(tmp_path / "cases.json"), str(tmp_path / "out.json")], check=True,
                 timeout=600, cwd=REPO)
  results = json.loads((tmp_path / "out.json").read_text())
  for asked, result in zip(["--draft draft_model", "--tree (drafted by a model by default)"],
                           results):
    assert result["status"] == 2 and result["stderr"] == (
        f"error: {asked} needs a draft model: pass --draft-model FILE (or --draft-checkpoint "
        "DIR of a trained one)\n"), result
  assert results[2]["status"] == 2 and results[2]["stderr"] == (
      "error: --draft-model and --draft-checkpoint both give the draft model: pass one of "
      "them\n"), results[2]
  assert results[3]["status"] == 0, results[3]
  assert json.loads(results[3]["stdout"])["drafter"] == "lookup+draft_model"


def test_cli_in_a_real_process_and_argv_that_is_not_utf8():
  generate = str(REPO / "scripts" / "generate.py")
  proc = subprocess.run([sys.executable, generate, "hi", "--model", "/nonexistent"],
                        capture_output=True, text=True, timeout=300, cwd=REPO)
  assert proc.returncode == 1 and proc.stderr == "error: no checkpoint at /nonexistent\n"
  # undecodable bytes in a prompt: replaced, with a warning, and encoding goes on (the run
  # then stops at a bad flag checked after encoding)
  proc = subprocess.run([sys.executable, generate, b"caf\xe9 \xff", "--max-new-tokens", "100000"],
                        capture_output=True, timeout=300, cwd=REPO)
  lines = proc.stderr.decode().splitlines()
  assert proc.returncode == 2, lines
  assert lines[0].startswith("warning: argument(s) 1 are not valid UTF-8") and "U+FFFD" in lines[0]
  assert lines[1].startswith("error: ") and "longer than the model's context" in lines[1]
