"""Reader and writer for Hugging Face Llama / Mistral / Qwen2 checkpoints (safetensors).

A checkpoint folder holds `config.json` and either `model.safetensors` or a sharded
`model.safetensors.index.json` plus its shards. HF stores linear weights [out, in]; we
transpose them to our [in, out] kernels. Our RoPE is HF's half-split layout, so q/k need
no permutation. Anything the model cannot compute exactly (scaled RoPE, an effective
sliding window, other activations) is rejected rather than silently approximated.
"""

from __future__ import annotations

import json
import os
from typing import Any

import ml_dtypes  # noqa: F401  registers bfloat16 & co. so safetensors' numpy reader knows them
import numpy as np
import safetensors
import safetensors.numpy

from spec_jax.core.errors import check_bool, check_int, check_real
from spec_jax.models.llama import LlamaConfig, LlamaModel
from spec_jax.models.params_io import (CheckpointError, check_finite, check_layer_count,
                                      check_widths, flat_names, params_from_flat,
                                      params_to_flat, read_json, to_layout)

CONFIG_FILE = "config.json"
WEIGHTS_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"

_MODEL_TYPES = {"LlamaForCausalLM": "llama", "MistralForCausalLM": "mistral",
                "Qwen2ForCausalLM": "qwen2"}
# Tensors HF may store that carry no weights of ours.
_IGNORED_SUFFIXES = (".rotary_emb.inv_freq",)


# ---- config ---------------------------------------------------------------------------------

def _read_config(folder: str) -> dict[str, Any]:
  path = os.path.join(folder, CONFIG_FILE)
  if not os.path.isfile(path):
    raise CheckpointError(f"{folder}: no {CONFIG_FILE}; not a Hugging Face checkpoint folder")
  hf = read_json(path)
  if not isinstance(hf, dict):
    raise CheckpointError(f"{path}: config is not a JSON object")
  return hf


def _field_error(path: str):
  return lambda message: CheckpointError(f"{path}: config field {message}")


def _int(hf: dict[str, Any], key: str, path: str, default: Any = ..., minimum: int = 1) -> int:
  """A required (default ...) or optional integer field; null counts as absent."""
  value = hf.get(key)
  if value is None:
    if default is ...:
      raise CheckpointError(f"{path}: config lacks required field {key!r}")
    return default
  return check_int(value, key, minimum=minimum, error=_field_error(path))


def _real(hf: dict[str, Any], key: str, path: str, default: float) -> float:
  value = hf.get(key)
  return default if value is None else check_real(value, key, positive=True,
                                                  error=_field_error(path))


def _bool(hf: dict[str, Any], key: str, path: str, default: bool = False) -> bool:
  value = hf.get(key)
  return default if value is None else check_bool(value, key, error=_field_error(path))


def _architecture(hf: dict[str, Any], path: str) -> str:
  archs = hf.get("architectures") or []
  if not isinstance(archs, list) or len(archs) != 1 or not isinstance(archs[0], str) \
      or archs[0] not in _MODEL_TYPES:
    raise CheckpointError(f"{path}: unsupported architectures {archs!r}; supported: "
                          f"{sorted(_MODEL_TYPES)}")
  return archs[0]


def _rope_theta(hf: dict[str, Any], path: str) -> float:
  """RoPE base; rejects any scaling (transformers 5 `rope_parameters` or legacy `rope_scaling`)."""
  params = hf.get("rope_parameters") or {}
  scaling = hf.get("rope_scaling") or {}
  for name, d in (("rope_parameters", params), ("rope_scaling", scaling)):
    if not isinstance(d, dict):
      raise CheckpointError(f"{path}: {name}={d!r} is not a dict")
    kind = d.get("rope_type", d.get("type", "default"))
    if kind not in (None, "default"):
      raise CheckpointError(f"{path}: {name} type {kind!r} is unsupported (only unscaled RoPE)")
    if _real(d, "partial_rotary_factor", path, 1.0) != 1.0:
      raise CheckpointError(f"{path}: partial rotary embeddings are unsupported")
  legacy = _real(hf, "rope_theta", path, 10000.0)  # checked even where rope_parameters wins
  if params.get("rope_theta") is not None:
    return _real(params, "rope_theta", path, 10000.0)
  return legacy


def _layer_types(hf: dict[str, Any], n_layers: int, path: str) -> list[str] | None:
  layer_types = hf.get("layer_types")
  if layer_types is None:
    return None
  if not isinstance(layer_types, list) or len(layer_types) != n_layers:
    raise CheckpointError(f"{path}: config field layer_types must be a list of "
                          f"num_hidden_layers={n_layers} strings, got {str(layer_types)[:80]}")
  for layer_type in layer_types:
    if layer_type not in ("full_attention", "sliding_attention"):
      raise CheckpointError(f"{path}: layer type {layer_type!r} is unsupported")
  return layer_types


def _check_sliding_window(hf: dict[str, Any], arch: str, n_layers: int, max_pos: int,
                          path: str):
  """Rejects a sliding window that would bite before the model's maximum context."""
  window = _int(hf, "sliding_window", path, None)
  if arch == "Qwen2ForCausalLM":
    window = window if _bool(hf, "use_sliding_window", path) else None
    layer_types = _layer_types(hf, n_layers, path)
    if layer_types is None:  # HF's default: layers from max_window_layers on slide
      sliding = window is not None and n_layers > _int(hf, "max_window_layers", path, 28,
                                                       minimum=0)
    else:
      sliding = "sliding_attention" in layer_types
    window = window if sliding else None
  elif arch == "LlamaForCausalLM":
    window = None  # Llama has no sliding window
  if window is not None and window < max_pos:
    raise CheckpointError(f"{path}: sliding_window={window} < max_position_embeddings={max_pos} "
                          "is unsupported (our attention is full causal)")


def config_from_hf(hf: dict[str, Any], *, dtype: str = "float32",
                   path: str = CONFIG_FILE) -> tuple[LlamaConfig, str]:
  """HF config dict -> (LlamaConfig, architecture). Raises CheckpointError naming the field
  if unsupported, of the wrong type (ints must be ints: 64.5 is not truncated) or out of
  range (positive sizes, finite positive rms_norm_eps and rope_theta)."""
  if not isinstance(hf, dict):
    raise CheckpointError(f"{path}: config is not a JSON object")
  arch = _architecture(hf, path)
  if hf.get("hidden_act", "silu") != "silu":
    raise CheckpointError(f"{path}: hidden_act={hf['hidden_act']!r} is unsupported (only silu)")
  if _bool(hf, "mlp_bias", path):
    raise CheckpointError(f"{path}: mlp_bias=True is unsupported")
  attention_bias = _bool(hf, "attention_bias", path)
  if arch == "MistralForCausalLM" and attention_bias:
    raise CheckpointError(f"{path}: attention_bias is unsupported for Mistral")
  n_layers = _int(hf, "num_hidden_layers", path)
  if arch != "Qwen2ForCausalLM":
    _layer_types(hf, n_layers, path)
  heads = _int(hf, "num_attention_heads", path)
  max_pos = _int(hf, "max_position_embeddings", path, 2048)
  _check_sliding_window(hf, arch, n_layers, max_pos, path)
  dim = _int(hf, "hidden_size", path)
  head_dim = _int(hf, "head_dim", path, None)
  head_dim = None if head_dim is None or head_dim * heads == dim else head_dim
  try:
    cfg = LlamaConfig(
        vocab_size=_int(hf, "vocab_size", path), dim=dim, n_layers=n_layers,
        n_heads=heads, n_kv_heads=_int(hf, "num_key_value_heads", path, heads),
        hidden_dim=_int(hf, "intermediate_size", path), head_dim=head_dim, max_seq_len=max_pos,
        rope_theta=_rope_theta(hf, path), norm_eps=_real(hf, "rms_norm_eps", path, 1e-6),
        qkv_bias=arch == "Qwen2ForCausalLM" or attention_bias,
        tie_embeddings=_bool(hf, "tie_word_embeddings", path), dtype=dtype)
  except CheckpointError:
    raise
  except ValueError as e:  # LlamaConfig's consistency checks (heads, even head_dim)
    raise CheckpointError(f"{path}: invalid config: {e}") from e
  return cfg, arch


# ---- tensor names -----------------------------------------------------------------------------

def _hf_layout(cfg: LlamaConfig) -> dict[str, tuple[str, bool]]:
  """{HF tensor name: (our flat name, transpose?)} for every tensor the model needs."""
  names = {"model.embed_tokens.weight": ("embed", False),
           "model.norm.weight": ("final_norm.scale", False)}
  if not cfg.tie_embeddings:
    names["lm_head.weight"] = ("lm_head.kernel", True)
  for i in range(cfg.n_layers):
    hf, ours = f"model.layers.{i}.", f"layers.{i}."
    names[hf + "input_layernorm.weight"] = (ours + "attn_norm.scale", False)
    names[hf + "post_attention_layernorm.weight"] = (ours + "mlp_norm.scale", False)
    for proj, w in (("q", "wq"), ("k", "wk"), ("v", "wv"), ("o", "wo")):
      names[f"{hf}self_attn.{proj}_proj.weight"] = (f"{ours}attn.{w}.kernel", True)
      if cfg.qkv_bias and proj != "o":
        names[f"{hf}self_attn.{proj}_proj.bias"] = (f"{ours}attn.{w}.bias", False)
    for proj, w in (("gate", "w_gate"), ("up", "w_up"), ("down", "w_down")):
      names[f"{hf}mlp.{proj}_proj.weight"] = (f"{ours}mlp.{w}.kernel", True)
  return names


# ---- safetensors reading ----------------------------------------------------------------------

def _inside(folder: str, path: str) -> bool:
  """Whether `path`, symlinks resolved, lies inside `folder` (also resolved). A Hugging Face
  hub cache snapshot (.../snapshots/<revision>/) may link into its repository's blobs/."""
  real, root = os.path.realpath(path), os.path.realpath(folder)
  if os.path.commonpath([real, root]) == root:
    return True
  parent = os.path.dirname(os.path.abspath(folder))
  if os.path.basename(parent) == "snapshots":
    blobs = os.path.realpath(os.path.join(parent, os.pardir, "blobs"))
    return os.path.commonpath([real, blobs]) == blobs
  return False


def _weight_files(folder: str) -> list[str]:
  single, index = os.path.join(folder, WEIGHTS_FILE), os.path.join(folder, INDEX_FILE)
  if os.path.isfile(single):
    shards, source = [WEIGHTS_FILE], folder
  elif not os.path.isfile(index):
    raise CheckpointError(f"{folder}: neither {WEIGHTS_FILE} nor {INDEX_FILE} found")
  else:
    weight_map = read_json(index)
    weight_map = weight_map.get("weight_map") if isinstance(weight_map, dict) else None
    if not isinstance(weight_map, dict) or not weight_map or not all(
        isinstance(k, str) and isinstance(v, str) for k, v in weight_map.items()):
      raise CheckpointError(f"{index}: malformed shard index: expected a non-empty "
                            "\"weight_map\" object of tensor name -> shard file name")
    shards, source = sorted(set(weight_map.values())), index
  for shard in shards:
    path = os.path.join(folder, shard)
    if os.path.basename(shard) != shard or shard in (".", "..") or not _inside(folder, path):
      raise CheckpointError(f"{source}: shard {shard!r} resolves outside the checkpoint "
                            f"folder {folder} (symlinks included); refusing to read it")
    if not os.path.isfile(path):
      raise CheckpointError(f"{source}: shard {shard!r} is missing from {folder}")
  return [os.path.join(folder, s) for s in shards]


def _tensor_shapes(paths: list[str]) -> dict[str, tuple[int, ...]]:
  """{name: shape} from the safetensors headers alone (no tensor data is read)."""
  shapes: dict[str, tuple[int, ...]] = {}
  for path in paths:
    try:
      with safetensors.safe_open(path, framework="numpy") as f:
        for name in f.keys():
          if name in shapes:
            raise CheckpointError(f"{path}: tensor {name} also appears in another shard")
          shapes[name] = tuple(f.get_slice(name).get_shape())
    except safetensors.SafetensorError as e:
      raise CheckpointError(f"{path}: truncated or malformed safetensors file: {e}") from e
    except (OSError, TypeError, ValueError) as e:
      if isinstance(e, CheckpointError):
        raise
      raise CheckpointError(f"{path}: unreadable safetensors file: {e}") from e
  return shapes


def _read_tensors(paths: list[str]) -> dict[str, np.ndarray]:
  """All tensors of the given safetensors files (bf16 arrives as ml_dtypes.bfloat16)."""
  tensors: dict[str, np.ndarray] = {}
  for path in paths:
    try:
      with safetensors.safe_open(path, framework="numpy") as f:
        for name in f.keys():
          if name in tensors:
            raise CheckpointError(f"{path}: tensor {name} also appears in another shard")
          tensors[name] = f.get_tensor(name)
    except safetensors.SafetensorError as e:
      raise CheckpointError(f"{path}: truncated or malformed safetensors file: {e}") from e
    except (OSError, TypeError, ValueError) as e:  # TypeError: a dtype numpy cannot represent
      if isinstance(e, CheckpointError):
        raise
      raise CheckpointError(f"{path}: unsupported or unreadable tensor: {e}") from e
  return tensors


def _check_tied_head(tensors: dict[str, np.ndarray], path: str):
  """A tied checkpoint may still store lm_head.weight; accept it only if it is the embedding."""
  head = tensors.pop("lm_head.weight", None)
  if head is None:
    return
  embed = tensors.get("model.embed_tokens.weight")
  if embed is None or head.shape != embed.shape or not np.array_equal(
      head.astype(np.float32), embed.astype(np.float32)):
    raise CheckpointError(f"{path}: tie_word_embeddings is set but lm_head.weight differs from "
                          "model.embed_tokens.weight")


def _check_zero_o_bias(tensors: dict[str, np.ndarray], n_layers: int, path: str):
  """Llama's attention_bias also adds an o_proj bias, which we lack; accept only zeros."""
  for i in range(n_layers):
    bias = tensors.pop(f"model.layers.{i}.self_attn.o_proj.bias", None)
    if bias is not None and np.any(bias.astype(np.float32) != 0):
      raise CheckpointError(f"{path}: model.layers.{i}.self_attn.o_proj.bias is nonzero; "
                            "an output-projection bias is unsupported")


def load_hf(folder: str, *, dtype: str = "float32") -> tuple[LlamaModel, Any]:
  """Reads a Hugging Face Llama / Mistral / Qwen2 checkpoint folder -> (LlamaModel, params).

  Cheap checks come first: the config's fields, then its layer count and every tensor's
  shape against the safetensors headers, before any tensor data is read or any per-layer
  structure is built; then every tensor must be finite.
  """
  hf = _read_config(folder)
  cfg, _ = config_from_hf(hf, dtype=dtype, path=os.path.join(folder, CONFIG_FILE))
  files = _weight_files(folder)
  source = files[0] if len(files) == 1 else os.path.join(folder, INDEX_FILE)
  shapes = _tensor_shapes(files)
  check_layer_count(cfg.n_layers, shapes, source, field="num_hidden_layers")
  check_widths(cfg, shapes, source)
  layout = _hf_layout(cfg)
  expected = flat_names(LlamaModel(cfg))
  optional = {n for n in shapes if n.endswith(_IGNORED_SUFFIXES) or n == "lm_head.weight"
              or n.endswith(".self_attn.o_proj.bias")}
  missing = [n for n in layout if n not in shapes]
  if missing:
    raise CheckpointError(f"{source}: missing tensors {missing[:8]}"
                          f"{f' (and {len(missing) - 8} more)' if len(missing) > 8 else ''}")
  unexpected = sorted(set(shapes) - set(layout) - optional)
  if unexpected:
    raise CheckpointError(f"{source}: unexpected tensors {unexpected[:8]} for this config")
  for hf_name, (ours, transpose) in layout.items():
    want = expected[ours].shape[::-1] if transpose else expected[ours].shape
    if shapes[hf_name] != tuple(want):
      raise CheckpointError(f"{source}: tensor {hf_name} has shape {shapes[hf_name]}, "
                            f"the config implies {tuple(want)}")

  tensors = _read_tensors(files)
  for name in [n for n in tensors if n.endswith(_IGNORED_SUFFIXES)]:
    del tensors[name]
  if cfg.tie_embeddings:
    _check_tied_head(tensors, source)
  if hf.get("attention_bias") is True:  # a bool: config_from_hf checked it
    _check_zero_o_bias(tensors, cfg.n_layers, source)
  unexpected = sorted(set(tensors) - set(layout))
  if unexpected:
    raise CheckpointError(f"{source}: unexpected tensors {unexpected[:8]} for this config")
  flat = {}
  for hf_name, (ours, transpose) in layout.items():
    array = tensors.pop(hf_name)
    check_finite(hf_name, array, source)
    flat[ours] = array.T if transpose else array
  model = LlamaModel(cfg)
  return model, params_from_flat(model, flat, source=source)


# ---- writing ----------------------------------------------------------------------------------

def config_to_hf(cfg: LlamaConfig, architecture: str = "LlamaForCausalLM") -> dict[str, Any]:
  """LlamaConfig -> an HF config.json dict that transformers builds the same function from."""
  if architecture not in _MODEL_TYPES:
    raise ValueError(f"unsupported architecture {architecture!r}; supported: {sorted(_MODEL_TYPES)}")
  if architecture == "MistralForCausalLM" and cfg.qkv_bias:
    raise ValueError("MistralForCausalLM has no QKV bias; use Llama or Qwen2")
  hf = {
      "architectures": [architecture], "model_type": _MODEL_TYPES[architecture],
      "vocab_size": cfg.vocab_size, "hidden_size": cfg.dim, "num_hidden_layers": cfg.n_layers,
      "num_attention_heads": cfg.n_heads, "num_key_value_heads": cfg.n_kv_heads,
      "head_dim": cfg.resolved_head_dim, "intermediate_size": cfg.hidden_dim,
      "max_position_embeddings": cfg.max_seq_len, "hidden_act": "silu",
      "rms_norm_eps": cfg.norm_eps, "rope_theta": cfg.rope_theta,
      "rope_parameters": {"rope_type": "default", "rope_theta": cfg.rope_theta},
      "tie_word_embeddings": cfg.tie_embeddings, "dtype": "float32", "torch_dtype": "float32",
      "bos_token_id": None, "eos_token_id": None, "pad_token_id": None,
  }
  if architecture == "LlamaForCausalLM":
    hf.update(attention_bias=cfg.qkv_bias, mlp_bias=False)
  elif architecture == "MistralForCausalLM":
    hf.update(sliding_window=None)
  else:
    hf.update(use_sliding_window=False, sliding_window=None,
              layer_types=["full_attention"] * cfg.n_layers)
  return hf


def save_hf(folder: str, model: LlamaModel, params, *,
            architecture: str = "LlamaForCausalLM") -> None:
  """Writes config.json + model.safetensors (float32) loadable by transformers' from_pretrained.

  Llama with QKV bias gets zero o_proj biases (HF's attention_bias has one); Qwen2 without
  QKV bias gets zero q/k/v biases (Qwen2 always has them).
  """
  model, params = to_layout(model, params, "checkpoint")  # HF's separate [out, in] weights
  cfg = model.config
  hf = config_to_hf(cfg, architecture)
  flat = params_to_flat(params)
  expected = flat_names(LlamaModel(cfg))
  if set(flat) != set(expected):
    raise ValueError("save_hf needs the model's plain float params (dequantize first); got "
                     f"names {sorted(set(flat) ^ set(expected))[:8]} differing")
  tensors = {}
  for hf_name, (ours, transpose) in _hf_layout(cfg).items():
    array = np.asarray(flat[ours], np.float32)
    tensors[hf_name] = np.ascontiguousarray(array.T if transpose else array)
  for i in range(cfg.n_layers):
    attn = f"model.layers.{i}.self_attn."
    if architecture == "LlamaForCausalLM" and cfg.qkv_bias:
      tensors[attn + "o_proj.bias"] = np.zeros(cfg.dim, np.float32)
    if architecture == "Qwen2ForCausalLM" and not cfg.qkv_bias:
      for proj in ("q", "k", "v"):
        out_features = tensors[f"{attn}{proj}_proj.weight"].shape[0]
        tensors[f"{attn}{proj}_proj.bias"] = np.zeros(out_features, np.float32)
  os.makedirs(folder, exist_ok=True)
  with open(os.path.join(folder, CONFIG_FILE), "w") as f:
    json.dump(hf, f, indent=2)
  safetensors.numpy.save_file(tensors, os.path.join(folder, WEIGHTS_FILE),
                              metadata={"format": "pt"})
