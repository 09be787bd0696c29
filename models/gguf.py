"""Reader for GGUF checkpoints (llama.cpp, Ollama): Llama-architecture models and their tokenizer.

Files are parsed and dequantised by the `gguf` package, llama.cpp's own Python reader, so
every block format decodes exactly as llama.cpp defines it; weights arrive here as float32.
llama.cpp's converter stores wq/wk rows permuted for its adjacent-pair RoPE (as llama2.c
does); they are permuted back to our half-split layout, as HF transformers does when it
loads a GGUF. The tokenizer is rebuilt from the `tokenizer.ggml.*` metadata as a
byte-level BPE (`tokenizers`), with the chat template (`tokenizer.chat_template`) rendered
as HF does.

GGUF -> ours:  token_embd -> embed, output_norm -> final_norm, output -> lm_head (absent:
tied), blk.N.{attn_norm, attn_q, attn_k, attn_v, attn_output, ffn_norm, ffn_gate, ffn_up,
ffn_down} -> layers.N.{attn_norm, attn.wq, ..., mlp.w_down}. Matrices are stored [out, in].
"""

from __future__ import annotations

import math
import os
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from spec_jax.models.llama import LlamaConfig, LlamaModel
from spec_jax.models.params_io import CheckpointError, params_from_flat, permute_adjacent_to_half
from spec_jax.models.tokenizer import HFTokenizer, TokenizerError

ARCHITECTURES = ("llama",)
# Storage types we dequantise (through gguf.quants.dequantize); the tests compare each one
# with that package on files they write. Others (IQ*, TQ*, integer tensors) are refused.
SUPPORTED_TYPES = ("F32", "F16", "BF16", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0",
                   "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K")

_REQUIRED = object()


def _gguf():
  try:
    import gguf
  except ImportError as e:  # a declared dependency; only a broken install lacks it
    raise ImportError("reading GGUF files needs the `gguf` package: pip install gguf") from e
  return gguf


# ---- reading ----------------------------------------------------------------------------------

def _checked_reader_class():
  gguf = _gguf()

  class CheckedReader(gguf.GGUFReader):
    """GGUFReader that names the tensor when its type id is unknown or the file ends inside
    its data (the plain reader fails there with an anonymous reshape or enum error)."""

    def __init__(self, path: str):
      self._source = path
      super().__init__(path, "r")

    def _build_tensors(self, start_offs, fields, *args, **kwargs):
      size = len(self.data)
      for field in fields:
        _, name_data, _, dims, raw_type, offset = field.parts
        name = bytes(name_data).decode("utf-8", "replace")
        type_id = int(raw_type[0])
        try:
          qtype = gguf.GGMLQuantizationType(type_id)
        except ValueError:
          raise CheckpointError(f"{self._source}: tensor {name} has unknown ggml type id {type_id} "
                                f"(supported: {', '.join(SUPPORTED_TYPES)})") from None
        block, type_size = gguf.GGML_QUANT_SIZES[qtype]
        n = math.prod(int(d) for d in dims)
        if n % block:
          raise CheckpointError(f"{self._source}: tensor {name} has {n} elements, not a multiple "
                                f"of its {qtype.name} block size {block}")
        end = start_offs + int(offset[0]) + n // block * type_size
        if end > size:
          raise CheckpointError(f"{self._source}: truncated: tensor {name} ({qtype.name}, shape "
                                f"{tuple(int(d) for d in reversed(dims))}) ends at byte {end}, "
                                f"the file has {size}")
      return super()._build_tensors(start_offs, fields, *args, **kwargs)

  return CheckedReader


def open_gguf(path: str):
  """A `gguf.GGUFReader` over `path`; any parse failure becomes a CheckpointError naming it."""
  if not os.path.isfile(path):
    raise CheckpointError(f"{path}: no such GGUF file")
  try:
    return _checked_reader_class()(path)
  except CheckpointError:
    raise
  except Exception as e:  # the reader raises ValueError, KeyError, IndexError... on bad bytes
    raise CheckpointError(f"{path}: not a readable GGUF file (truncated or malformed): "
                          f"{type(e).__name__}: {e}") from e


def metadata(reader, key: str, default: Any = _REQUIRED, *, source: str = "GGUF file") -> Any:
  """One metadata value (str, int, float, bool or list), `default` if absent."""
  field = reader.fields.get(key)
  if field is None:
    if default is _REQUIRED:
      raise CheckpointError(f"{source}: metadata lacks required key {key!r}")
    return default
  try:
    return field.contents()
  except Exception as e:
    raise CheckpointError(f"{source}: metadata key {key!r} is malformed: {e}") from e


def _int(reader, key, default=_REQUIRED, *, source):
  value = metadata(reader, key, default, source=source)
  if value is None:
    return None
  if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
    raise CheckpointError(f"{source}: metadata {key}={value!r} is not an integer "
                          "(per-layer values are unsupported)")
  return int(value)


def _float(reader, key, default=_REQUIRED, *, source):
  value = metadata(reader, key, default, source=source)
  if isinstance(value, bool) or not isinstance(value, (int, float, np.number)):
    raise CheckpointError(f"{source}: metadata {key}={value!r} is not a number")
  return float(value)


# ---- config -----------------------------------------------------------------------------------

def config_from_gguf(reader, *, dtype: str = "float32", source: str = "GGUF file") -> LlamaConfig:
  """Llama metadata -> LlamaConfig; anything we cannot compute exactly is refused."""
  arch = metadata(reader, "general.architecture", source=source)
  if arch not in ARCHITECTURES:
    raise CheckpointError(f"{source}: architecture {arch!r} is unsupported (supported: "
                          f"{', '.join(ARCHITECTURES)})")
  names = {t.name for t in reader.tensors}

  def key(k, default=_REQUIRED):
    return _int(reader, f"{arch}.{k}", default, source=source)

  if key("expert_count", 0) > 0:
    raise CheckpointError(f"{source}: mixture-of-experts models ({arch}.expert_count > 0) are "
                          "unsupported")
  scaling = metadata(reader, f"{arch}.rope.scaling.type", "none", source=source)
  factor = _float(reader, f"{arch}.rope.scaling.factor", 1.0, source=source)
  if scaling not in ("none", "") and factor != 1.0:
    raise CheckpointError(f"{source}: RoPE scaling {scaling!r} (factor {factor}) is unsupported "
                          "(only unscaled RoPE)")
  if "rope_freqs.weight" in names:
    raise CheckpointError(f"{source}: tensor rope_freqs.weight (Llama 3.1-style scaled RoPE) is "
                          "unsupported (only unscaled RoPE)")
  dim, heads = key("embedding_length"), key("attention.head_count")
  head_dim = key("attention.key_length", None)
  if head_dim is not None and key("attention.value_length", head_dim) != head_dim:
    raise CheckpointError(f"{source}: {arch}.attention.value_length differs from key_length; "
                          "unsupported")
  resolved = head_dim or (dim // heads if heads else 0)
  rot = key("rope.dimension_count", resolved)
  if rot != resolved:
    raise CheckpointError(f"{source}: {arch}.rope.dimension_count={rot} but head_dim="
                          f"{resolved}: partial rotary embeddings are unsupported")
  embed = next((t for t in reader.tensors if t.name == "token_embd.weight"), None)
  vocab = key("vocab_size", None)
  if vocab is None:  # older files: the tokenizer's length, else the embedding's rows
    tokens = reader.fields.get("tokenizer.ggml.tokens")
    vocab = (len(tokens.data) if tokens is not None else
             int(embed.shape[-1]) if embed is not None and len(embed.shape) == 2 else 0)
  try:
    return LlamaConfig(
        vocab_size=vocab, dim=dim, n_layers=key("block_count"), n_heads=heads,
        n_kv_heads=key("attention.head_count_kv", heads), hidden_dim=key("feed_forward_length"),
        head_dim=None if head_dim is None or head_dim * heads == dim else head_dim,
        max_seq_len=key("context_length"),
        rope_theta=_float(reader, f"{arch}.rope.freq_base", 10000.0, source=source),
        norm_eps=_float(reader, f"{arch}.attention.layer_norm_rms_epsilon", source=source),
        qkv_bias=False, tie_embeddings="output.weight" not in names, dtype=dtype)
  except (TypeError, ValueError) as e:
    if isinstance(e, CheckpointError):
      raise
    raise CheckpointError(f"{source}: inconsistent model metadata: {e}") from e


# ---- tensors ----------------------------------------------------------------------------------

def _layout(cfg: LlamaConfig) -> dict[str, tuple[str, str | None]]:
  """{GGUF tensor name: (our flat name, how to convert)}: None keeps it, "T" transposes
  [out, in] to our [in, out], "q"/"k" also undo llama.cpp's RoPE row permutation."""
  names = {"token_embd.weight": ("embed", None), "output_norm.weight": ("final_norm.scale", None)}
  if not cfg.tie_embeddings:
    names["output.weight"] = ("lm_head.kernel", "T")
  for i in range(cfg.n_layers):
    g, o = f"blk.{i}.", f"layers.{i}."
    names.update({
        g + "attn_norm.weight": (o + "attn_norm.scale", None),
        g + "ffn_norm.weight": (o + "mlp_norm.scale", None),
        g + "attn_q.weight": (o + "attn.wq.kernel", "q"),
        g + "attn_k.weight": (o + "attn.wk.kernel", "k"),
        g + "attn_v.weight": (o + "attn.wv.kernel", "T"),
        g + "attn_output.weight": (o + "attn.wo.kernel", "T"),
        g + "ffn_gate.weight": (o + "mlp.w_gate.kernel", "T"),
        g + "ffn_up.weight": (o + "mlp.w_up.kernel", "T"),
        g + "ffn_down.weight": (o + "mlp.w_down.kernel", "T"),
    })
  return names


def dequantize(tensor, *, source: str = "GGUF file") -> np.ndarray:
  """A reader tensor -> float32 numpy [rows..., cols] (GGUF's dims reversed), exactly as
  gguf.quants.dequantize; unsupported types and non-finite values raise CheckpointError."""
  gguf = _gguf()
  qtype = tensor.tensor_type
  if qtype.name not in SUPPORTED_TYPES:
    raise CheckpointError(f"{source}: tensor {tensor.name} is stored as {qtype.name}, which "
                          f"cannot be dequantised (supported: {', '.join(SUPPORTED_TYPES)})")
  shape = tuple(int(d) for d in reversed(tensor.shape.tolist()))
  try:
    w = np.asarray(gguf.quants.dequantize(tensor.data, qtype), np.float32).reshape(shape)
  except (ValueError, NotImplementedError) as e:
    raise CheckpointError(f"{source}: tensor {tensor.name} ({qtype.name}, shape {shape}) cannot "
                          f"be dequantised: {e}") from e
  finite = np.isfinite(w)
  if not finite.all():
    raise CheckpointError(f"{source}: tensor {tensor.name} holds {w.size - int(finite.sum())} "
                          "non-finite values (NaN or inf)")
  return w


def _flat_params(reader, cfg: LlamaConfig, source: str) -> dict[str, np.ndarray]:
  tensors = {t.name: t for t in reader.tensors}
  layout = _layout(cfg)
  missing = [n for n in layout if n not in tensors]
  if missing:
    raise CheckpointError(f"{source}: missing tensors {missing[:8]}"
                          f"{f' (and {len(missing) - 8} more)' if len(missing) > 8 else ''}")
  unexpected = sorted(set(tensors) - set(layout))
  if unexpected:
    raise CheckpointError(f"{source}: unexpected tensors {unexpected[:8]} for a {cfg.n_layers}-"
                          "layer Llama (biases and other extras are unsupported)")
  hd = cfg.resolved_head_dim
  want = {"embed": (cfg.vocab_size, cfg.dim), "lm_head.kernel": (cfg.vocab_size, cfg.dim),
          "final_norm.scale": (cfg.dim,), "attn_norm.scale": (cfg.dim,),
          "mlp_norm.scale": (cfg.dim,), "attn.wq.kernel": (cfg.n_heads * hd, cfg.dim),
          "attn.wk.kernel": (cfg.n_kv_heads * hd, cfg.dim),
          "attn.wv.kernel": (cfg.n_kv_heads * hd, cfg.dim),
          "attn.wo.kernel": (cfg.dim, cfg.n_heads * hd),
          "mlp.w_gate.kernel": (cfg.hidden_dim, cfg.dim), "mlp.w_up.kernel": (cfg.hidden_dim, cfg.dim),
          "mlp.w_down.kernel": (cfg.dim, cfg.hidden_dim)}
  flat = {}
  for gguf_name, (ours, how) in layout.items():
    t = tensors[gguf_name]
    shape = tuple(int(d) for d in reversed(t.shape.tolist()))
    expected = want[ours.split(".", 2)[-1] if ours.startswith("layers.") else ours]
    if shape != expected:  # checked before dequantising: a wrong shape needs no float copy
      raise CheckpointError(f"{source}: tensor {gguf_name} has shape {shape} ([out, in]), the "
                            f"metadata implies {expected}")
    w = dequantize(t, source=source)
    if how == "q":
      w = permute_adjacent_to_half(w, cfg.n_heads)
    elif how == "k":
      w = permute_adjacent_to_half(w, cfg.n_kv_heads)
    flat[ours] = w if how is None else w.T
  return flat


def load_gguf(path: str, *, dtype: str = "float32", reader=None) -> tuple[LlamaModel, Any]:
  """Reads a Llama-architecture GGUF file -> (LlamaModel, params), dequantised to float32
  (then cast to `dtype`). `reader`: an already open `open_gguf(path)`, to parse it once."""
  reader = reader if reader is not None else open_gguf(path)
  cfg = config_from_gguf(reader, dtype=dtype, source=path)
  flat = _flat_params(reader, cfg, path)
  model = LlamaModel(cfg)
  return model, params_from_flat(model, flat, source=path)


# ---- tokenizer --------------------------------------------------------------------------------

# Split regexes of the byte-level pre-tokenizers HF knows by `tokenizer.ggml.pre` (transformers'
# GGUF_PRE_TOKENIZER_SPLITS); any other name gets GPT-2's regex, as in HF.
_LLAMA3_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
                 r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_QWEN2_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
                r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_PRE_SPLITS = {**dict.fromkeys(("llama3", "llama-v3", "llama-bpe", "falcon3", "dbrx", "smaug-bpe"),
                               _LLAMA3_SPLIT),
               **dict.fromkeys(("qwen2", "deepseek-r1-qwen"), _QWEN2_SPLIT)}
_CONTROL, _USER_DEFINED = 3, 4  # llama.cpp token types


def _byte_chars() -> dict[int, str]:
  """GPT-2's byte -> printable character table (the spelling of byte-level vocabularies)."""
  keep = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1),
          *range(ord("®"), ord("ÿ") + 1)]
  table, extra = {b: chr(b) for b in keep}, 0
  for b in range(256):
    if b not in table:
      table[b] = chr(256 + extra)
      extra += 1
  return table


class GGUFTokenizer(HFTokenizer):
  """The byte-level BPE tokenizer of a GGUF file, with its chat template.

  As in llama.cpp and HF, BOS is prepended only where the file asks for it
  (`tokenizer.ggml.add_bos_token`; SmolLM2's does not): `encode(text)` gives HF's
  `tokenizer(text).input_ids`, and `add_bos=False` never adds one. Chat templates write their
  own special tokens: `encode_chat(messages)` encodes the rendered text with no BOS added, as
  HF's `apply_chat_template(..., tokenize=True)` does.
  """

  def __init__(self, tokenizer: Any, *, bos_id: int | None, eos_id: int | None,
               pad_id: int | None, add_bos_token: bool, chat_template: str | None,
               special_tokens: Mapping[str, str | None], source: str):
    super().__init__(tokenizer, bos_id=bos_id, eos_id=eos_id, pad_id=pad_id, source=source)
    self.add_bos_token = add_bos_token
    self.chat_template = chat_template
    self.special_tokens = dict(special_tokens)

  def encode(self, text: str, add_bos: bool = True, add_eos: bool = False) -> list[int]:
    return super().encode(text, add_bos=add_bos and self.add_bos_token, add_eos=add_eos)

  def apply_chat_template(self, messages: str | Sequence[Mapping[str, Any]], *,
                          add_generation_prompt: bool = True, **kwargs: Any) -> str:
    """The chat text for `messages` (a string is one user message), rendered as HF's
    `apply_chat_template(messages, tokenize=False)`; by default ending with the header of the
    assistant's turn (HF's default is add_generation_prompt=False)."""
    from spec_jax.models.chat_template import render_chat_template
    if not self.chat_template:
      raise TokenizerError(f"{self.source}: the file has no chat template "
                           "(tokenizer.chat_template)")
    return render_chat_template(self.chat_template, messages,
                                add_generation_prompt=add_generation_prompt,
                                special_tokens=self.special_tokens, source=self.source, **kwargs)

  def encode_chat(self, messages: str | Sequence[Mapping[str, Any]], *,
                  add_generation_prompt: bool = True, **kwargs: Any) -> list[int]:
    """Token ids of `apply_chat_template(messages)`, ready to prompt the model."""
    text = self.apply_chat_template(messages, add_generation_prompt=add_generation_prompt,
                                    **kwargs)
    return super().encode(text, add_bos=False)

  def __repr__(self) -> str:
    return f"GGUFTokenizer({self.source!r}, vocab_size={self.vocab_size})"


def _string_list(reader, key: str, source: str, default=_REQUIRED) -> list[str] | None:
  value = metadata(reader, key, default, source=source)
  if value is None:
    return None
  if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
    raise TokenizerError(f"{source}: metadata {key} is not a list of strings")
  return value


def load_gguf_tokenizer(path: str, *, reader=None) -> GGUFTokenizer:
  """The tokenizer described by a GGUF file's `tokenizer.ggml.*` metadata (byte-level BPE,
  `tokenizer.ggml.model == "gpt2"`), built as HF transformers builds it from the same file."""
  import tokenizers
  from tokenizers import AddedToken, Regex, decoders, pre_tokenizers

  try:
    reader = reader if reader is not None else open_gguf(path)
    kind = metadata(reader, "tokenizer.ggml.model", None, source=path)
    if kind is None:
      raise TokenizerError(f"{path}: the file holds no tokenizer (no tokenizer.ggml.model)")
    if kind != "gpt2":
      raise TokenizerError(f"{path}: tokenizer.ggml.model={kind!r} is unsupported (only 'gpt2', "
                           "byte-level BPE)")
    tokens = _string_list(reader, "tokenizer.ggml.tokens", path)
    merges = _string_list(reader, "tokenizer.ggml.merges", path, None)
    types = metadata(reader, "tokenizer.ggml.token_type", None, source=path)
    ids = {role: _int(reader, f"tokenizer.ggml.{key}", None, source=path)
           for role, key in (("bos", "bos_token_id"), ("eos", "eos_token_id"),
                             ("unk", "unknown_token_id"), ("pad", "padding_token_id"))}
    add_bos = metadata(reader, "tokenizer.ggml.add_bos_token", False, source=path)
    template = metadata(reader, "tokenizer.chat_template", None, source=path)
    pre = metadata(reader, "tokenizer.ggml.pre", "default", source=path)
  except CheckpointError as e:
    raise TokenizerError(str(e)) from e
  if merges is None:
    raise TokenizerError(f"{path}: byte-level BPE tokenizer without tokenizer.ggml.merges")
  if types is not None and len(types) != len(tokens):
    raise TokenizerError(f"{path}: {len(types)} token types for {len(tokens)} tokens")
  for role, i in ids.items():
    if i is not None and not 0 <= i < len(tokens):
      raise TokenizerError(f"{path}: tokenizer.ggml {role} id {i} is outside the "
                           f"{len(tokens)}-token vocabulary")

  spelling = _byte_chars()
  alphabet = set(spelling.values())
  # A token outside the byte alphabet is stored as its text; respell it as its bytes (HF too).
  vocab = {t if set(t) <= alphabet else "".join(spelling[b] for b in t.encode("utf-8")): i
           for i, t in enumerate(tokens)}
  pairs = [tuple(m.split(" ")) for m in merges]
  bad = next((m for m, p in zip(merges, pairs) if len(p) != 2), None)
  if bad is not None:
    raise TokenizerError(f"{path}: malformed merge {bad!r} (expected two tokens and one space)")
  tok = tokenizers.Tokenizer(tokenizers.models.BPE(vocab=vocab, merges=pairs, fuse_unk=False,
                                                   byte_fallback=False))
  split = _PRE_SPLITS.get(pre)
  tok.pre_tokenizer = (pre_tokenizers.ByteLevel(add_prefix_space=False) if split is None else
                       pre_tokenizers.Sequence([
                           pre_tokenizers.Split(Regex(split), behavior="isolated"),
                           pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)]))
  tok.decoder = decoders.ByteLevel()
  types = list(types or [])
  # Control tokens (<|im_start|>...) stay whole and are special (skipped by decode); in a
  # byte-level vocabulary one spelled outside the alphabet is a llama.cpp mislabel (HF skips it).
  special = {i for i, kind in enumerate(types) if kind == _CONTROL}
  special |= {i for i in ids.values() if i is not None}  # HF adds BOS/EOS/UNK/PAD as special too
  tok.add_special_tokens([AddedToken(tokens[i], normalized=False, special=True)
                          for i in sorted(special) if set(tokens[i]) <= alphabet])
  user = [tokens[i] for i, kind in enumerate(types) if kind == _USER_DEFINED]
  if user:
    tok.add_tokens([AddedToken(t, normalized=False, special=False) for t in user])
  names = {"bos": "bos_token", "eos": "eos_token", "unk": "unk_token", "pad": "pad_token"}
  return GGUFTokenizer(tok, bos_id=ids["bos"], eos_id=ids["eos"], pad_id=ids["pad"],
                       add_bos_token=bool(add_bos), chat_template=template or None,
                       special_tokens={names[r]: tokens[i] if i is not None else None
                                       for r, i in ids.items()},
                       source=path)


def load_gguf_with_tokenizer(path: str, *, dtype: str = "float32"
                             ) -> tuple[LlamaModel, Any, GGUFTokenizer]:
  """(model, params, tokenizer) from one GGUF file, parsing it once."""
  reader = open_gguf(path)
  model, params = load_gguf(path, dtype=dtype, reader=reader)
  return model, params, load_gguf_tokenizer(path, reader=reader)


__all__ = ["ARCHITECTURES", "SUPPORTED_TYPES", "GGUFTokenizer", "config_from_gguf", "dequantize",
           "load_gguf", "load_gguf_tokenizer", "load_gguf_with_tokenizer", "metadata", "open_gguf"]
