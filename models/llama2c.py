"""Reader for llama2.c "version 0" checkpoints (`*.bin`).

Format (see ../shared/models/stories260K/README.md): 7 little-endian int32 header fields,
then float32 arrays stored (out_features, in_features); a negative vocab_size means an
untied classifier comes last. RoPE there rotates adjacent pairs, so wq/wk rows are
permuted into our half-split layout at load.
"""

from __future__ import annotations

import os

import numpy as np

from spec_jax.models.llama import LlamaConfig, LlamaModel
from spec_jax.models.params_io import (CheckpointError, check_all_finite, params_from_flat,
                                      permute_adjacent_to_half)

_HEADER_FIELDS = ("dim", "hidden_dim", "n_layers", "n_heads", "n_kv_heads", "vocab_size",
                  "seq_len")
_HEADER_BYTES = 4 * len(_HEADER_FIELDS)
_MAX_REASONABLE = 1 << 20


def read_header(path: str) -> dict[str, int]:
  size = os.path.getsize(path)
  if size < _HEADER_BYTES:
    raise CheckpointError(f"{path}: {size} bytes is too short for a llama2.c header "
                          f"({_HEADER_BYTES} bytes)")
  with open(path, "rb") as f:
    values = np.frombuffer(f.read(_HEADER_BYTES), "<i4")
  header = dict(zip(_HEADER_FIELDS, (int(v) for v in values)))
  for name, value in header.items():
    limit = _MAX_REASONABLE if name != "vocab_size" else _MAX_REASONABLE * 4
    if (value == 0 or value < 0 and name != "vocab_size") or abs(value) > limit:
      raise CheckpointError(f"{path}: absurd llama2.c header field {name}={value}; "
                            "not a llama2.c version-0 checkpoint?")
  if header["dim"] % header["n_heads"] or header["n_heads"] % header["n_kv_heads"]:
    raise CheckpointError(f"{path}: inconsistent header: dim={header['dim']}, "
                          f"n_heads={header['n_heads']}, n_kv_heads={header['n_kv_heads']}")
  return header


def _layout(h: dict[str, int]) -> list[tuple[str, tuple[int, ...]]]:
  dim, hid, L, V = h["dim"], h["hidden_dim"], h["n_layers"], abs(h["vocab_size"])
  head = dim // h["n_heads"]
  kv_dim = dim * h["n_kv_heads"] // h["n_heads"]
  layout = [
      ("token_embedding", (V, dim)), ("rms_att", (L, dim)), ("wq", (L, dim, dim)),
      ("wk", (L, kv_dim, dim)), ("wv", (L, kv_dim, dim)), ("wo", (L, dim, dim)),
      ("rms_ffn", (L, dim)), ("w1", (L, hid, dim)), ("w2", (L, dim, hid)),
      ("w3", (L, hid, dim)), ("rms_final", (dim,)),
      ("freq_cis_real", (h["seq_len"] * head // 2,)), ("freq_cis_imag", (h["seq_len"] * head // 2,)),
  ]
  if h["vocab_size"] < 0:
    layout.append(("wcls", (V, dim)))
  return layout


def load_llama2c(path: str, *, dtype: str = "float32") -> tuple[LlamaModel, object]:
  """Reads a llama2.c checkpoint -> (LlamaModel, params)."""
  header = read_header(path)
  layout = _layout(header)
  expected = _HEADER_BYTES + 4 * sum(int(np.prod(s)) for _, s in layout)
  size = os.path.getsize(path)
  if size != expected:
    raise CheckpointError(f"{path}: file has {size} bytes but its header "
                          f"({header}) implies {expected}: truncated or not version 0")
  data = np.fromfile(path, dtype="<f4", offset=_HEADER_BYTES)
  arrays, offset = {}, 0
  for name, shape in layout:
    n = int(np.prod(shape))
    arrays[name] = data[offset:offset + n].reshape(shape)
    offset += n
  check_all_finite(arrays, path)  # the RoPE tables too: unused, but NaN there means damage

  try:
    cfg = LlamaConfig(vocab_size=abs(header["vocab_size"]), dim=header["dim"],
                      n_layers=header["n_layers"], n_heads=header["n_heads"],
                      n_kv_heads=header["n_kv_heads"], hidden_dim=header["hidden_dim"],
                      max_seq_len=header["seq_len"], rope_theta=10000.0, norm_eps=1e-5,
                      tie_embeddings=header["vocab_size"] > 0, dtype=dtype)
  except ValueError as e:  # e.g. an odd head_dim, which RoPE cannot rotate
    raise CheckpointError(f"{path}: unsupported llama2.c header {header}: {e}") from e
  flat = {"embed": arrays["token_embedding"], "final_norm.scale": arrays["rms_final"]}
  for i in range(cfg.n_layers):
    p = f"layers.{i}."
    flat[p + "attn_norm.scale"] = arrays["rms_att"][i]
    flat[p + "mlp_norm.scale"] = arrays["rms_ffn"][i]
    flat[p + "attn.wq.kernel"] = permute_adjacent_to_half(arrays["wq"][i], cfg.n_heads).T
    flat[p + "attn.wk.kernel"] = permute_adjacent_to_half(arrays["wk"][i], cfg.n_kv_heads).T
    flat[p + "attn.wv.kernel"] = arrays["wv"][i].T
    flat[p + "attn.wo.kernel"] = arrays["wo"][i].T
    flat[p + "mlp.w_gate.kernel"] = arrays["w1"][i].T
    flat[p + "mlp.w_down.kernel"] = arrays["w2"][i].T
    flat[p + "mlp.w_up.kernel"] = arrays["w3"][i].T
  if not cfg.tie_embeddings:
    flat["lm_head.kernel"] = arrays["wcls"].T
  model = LlamaModel(cfg)
  return model, params_from_flat(model, flat, source=path)
