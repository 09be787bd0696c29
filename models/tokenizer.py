"""Tokenizers: llama2.c `tok*.bin` files and HF `tokenizer.json`, behind one small interface.

Every tokenizer here offers `encode(text, add_bos=True, add_eos=False) -> list[int]`,
`decode(ids) -> str`, `vocab_size`, `bos_id`, `eos_id`, `pad_id` and `pieces` (the id -> piece
table, used to check that a draft and a target model share a vocabulary). Tokenization runs
on the host, before and after the jitted generation; nothing here touches JAX.

llama2.c format (see ../shared/models/stories260K/README.md): uint32 max_token_length, then per
token a float32 score, an int32 byte length and that many bytes. Ids 0..2 are <unk>, <s>, </s>;
3..258 are the byte-fallback tokens <0x00>..<0xFF>; pieces store spaces as plain ' '.
"""

from __future__ import annotations

import heapq
import json
import re
import struct
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

import numpy as np

from spec_jax.core.errors import TokenizerError, check_int


def check_text(text: str, source: str) -> None:
  """Text to encode must be a str that UTF-8 can encode: a lone surrogate (e.g. from bytes
  decoded with surrogateescape) is a TokenizerError, not a UnicodeEncodeError mid-encode."""
  if not isinstance(text, str):
    raise TokenizerError(f"{source}: encode takes a str, got {type(text).__name__}")
  try:
    text.encode("utf-8")
  except UnicodeEncodeError as e:
    raise TokenizerError(f"{source}: text is not valid Unicode: lone surrogate "
                         f"U+{ord(text[e.start]):04X} at index {e.start}; decode bytes with "
                         "errors='replace' first") from None


@runtime_checkable
class Tokenizer(Protocol):
  """What generation scripts and tests rely on; both tokenizer classes satisfy it."""

  @property
  def vocab_size(self) -> int: ...
  @property
  def bos_id(self) -> int | None: ...
  @property
  def eos_id(self) -> int | None: ...
  @property
  def pad_id(self) -> int | None: ...
  @property
  def pieces(self) -> tuple[str | None, ...]: ...
  def encode(self, text: str, add_bos: bool = True, add_eos: bool = False) -> list[int]: ...
  def decode(self, ids: Iterable[int]) -> str: ...


def _as_ids(ids: Iterable[int], vocab_size: int) -> list[int]:
  """Accepts lists, numpy or jax 1-D integer arrays; checks the range up front."""
  arr = np.asarray(list(ids) if not hasattr(ids, "__array__") else ids)
  if arr.size == 0:
    return []
  if arr.ndim != 1 or not np.issubdtype(arr.dtype, np.integer):
    raise TokenizerError(f"decode expects a 1-D sequence of integer ids, got shape {arr.shape} "
                         f"dtype {arr.dtype}")
  bad = arr[(arr < 0) | (arr >= vocab_size)]
  if bad.size:
    raise TokenizerError(f"token id {int(bad[0])} is outside the vocabulary [0, {vocab_size})")
  return arr.tolist()


# --------------------------------------------------------------------------------------------
# llama2.c


_BYTE_OFFSET = 3  # byte b is token b + 3 (after <unk>, <s>, </s>)
_N_RESERVED = _BYTE_OFFSET + 256
_MAX_TOKEN_LENGTH = 4096  # sentencepiece pieces are a few dozen bytes; beyond this is garbage
_MIN_MERGE_SCORE = -1e10  # llama2.c's initial best_score: pairs scoring <= this never merge
_BYTE_PIECE = re.compile(rb"<0x([0-9A-Fa-f]{2})>")


def _read_record(data: bytes, offset: int, index: int, max_len: int,
                 path: str) -> tuple[float, bytes, int]:
  """One (score, piece) record at `offset` -> (score, piece, next offset)."""
  if offset + 8 > len(data):
    raise TokenizerError(f"{path}: file ends inside token record {index} (offset {offset}, "
                         f"{len(data) - offset} stray bytes): truncated or trailing garbage")
  score, length = struct.unpack_from("<fi", data, offset)
  if not 1 <= length <= max_len:
    raise TokenizerError(f"{path}: token record {index} (offset {offset}) has byte length "
                         f"{length}, outside [1, max_token_length={max_len}]: corrupt file or "
                         "not a llama2.c tokenizer")
  if score != score:
    raise TokenizerError(f"{path}: token record {index} has a NaN score")
  end = offset + 8 + length
  if end > len(data):
    raise TokenizerError(f"{path}: file ends inside token record {index}: its piece needs "
                         f"{length} bytes, {len(data) - offset - 8} remain (truncated?)")
  return score, data[offset + 8:end], end


def _count_clean_records(data: bytes, offset: int, max_len: int) -> int | None:
  """How many well-formed records fill data[offset:] exactly, or None if they don't."""
  count = 0
  try:
    while offset < len(data):
      _, _, offset = _read_record(data, offset, count, max_len, "")
      count += 1
  except TokenizerError:
    return None
  return count


class Llama2cTokenizer:
  """llama2.c's sentencepiece-derived BPE tokenizer, encoding exactly like its C `encode`.

  `eos_id` is the id generation stops at. It defaults to 1 (BOS), not to the `</s>` piece
  (2): llama2.c models are trained on BOS-delimited stories and never emit 2, so a story
  ends by starting the next one and the reference generator stops on BOS. `encode(...,
  add_eos=True)` still appends the `</s>` piece, as the C `encode` does.
  """

  UNK_ID = 0
  BOS_ID = 1
  EOS_PIECE_ID = 2

  def __init__(self, pieces: Sequence[bytes], scores: Sequence[float], *,
               max_token_length: int | None = None, eos_id: int = 1,
               source: str = "<memory>"):
    if len(pieces) != len(scores):
      raise TokenizerError(f"{source}: {len(pieces)} pieces but {len(scores)} scores")
    if len(pieces) < _N_RESERVED:
      raise TokenizerError(f"{source}: {len(pieces)} tokens, but a llama2.c tokenizer needs at "
                           f"least {_N_RESERVED} (<unk>, <s>, </s> and 256 byte tokens)")
    for b in range(256):
      if pieces[_BYTE_OFFSET + b] != b"<0x%02X>" % b:
        raise TokenizerError(f"{source}: token {_BYTE_OFFSET + b} is "
                             f"{pieces[_BYTE_OFFSET + b]!r}, expected <0x{b:02X}>: byte-fallback "
                             "tokens must occupy ids 3..258")
    check_int(eos_id, f"{source}: eos_id", minimum=0, maximum=len(pieces) - 1,
              error=TokenizerError)
    self._pieces = tuple(bytes(p) for p in pieces)
    self._scores = tuple(float(s) for s in scores)
    self.max_token_length = max_token_length or max(len(p) for p in self._pieces)
    self.source = source
    self._eos_id = eos_id
    # C's bsearch over a sorted vocab picks an arbitrary id among duplicate pieces; we pick
    # the first (sentencepiece vocabularies have none).
    self._lookup: dict[bytes, int] = {}
    for i, p in enumerate(self._pieces):
      self._lookup.setdefault(p, i)
    self._raw_byte = tuple(self._byte_value(p) for p in self._pieces)

  @staticmethod
  def _byte_value(piece: bytes) -> int | None:
    m = _BYTE_PIECE.fullmatch(piece)
    return int(m.group(1), 16) if m else None

  @classmethod
  def from_file(cls, path: str | Path, vocab_size: int | None = None,
                eos_id: int = 1) -> Llama2cTokenizer:
    """Reads and strictly validates a `tok*.bin`; the vocab size is the record count
    unless `vocab_size` is given, in which case the file must hold exactly that many."""
    path = str(path)
    if vocab_size is not None:
      check_int(vocab_size, f"{path}: vocab_size", minimum=_N_RESERVED, error=TokenizerError)
    try:
      data = Path(path).read_bytes()
    except OSError as e:
      raise TokenizerError(f"{path}: cannot read tokenizer file: {e}") from e
    if len(data) < 4:
      raise TokenizerError(f"{path}: {len(data)} bytes is too short for a llama2.c tokenizer")
    (max_len,) = struct.unpack_from("<I", data, 0)
    if not 1 <= max_len <= _MAX_TOKEN_LENGTH:
      raise TokenizerError(f"{path}: absurd max_token_length={max_len} (expected 1.."
                           f"{_MAX_TOKEN_LENGTH}): not a llama2.c tokenizer file")
    pieces, scores, offset = [], [], 4
    while offset < len(data) and (vocab_size is None or len(pieces) < vocab_size):
      score, piece, offset = _read_record(data, offset, len(pieces), max_len, path)
      pieces.append(piece)
      scores.append(score)
    if vocab_size is not None:
      cls._check_count(data, offset, len(pieces), vocab_size, max_len, path)
    return cls(pieces, scores, max_token_length=max_len, eos_id=eos_id, source=path)

  @staticmethod
  def _check_count(data: bytes, offset: int, n_read: int, vocab_size: int, max_len: int,
                   path: str) -> None:
    if n_read < vocab_size:
      raise TokenizerError(f"{path}: file holds {n_read} tokens, expected vocab_size="
                           f"{vocab_size}")
    if offset == len(data):
      return
    extra = _count_clean_records(data, offset, max_len)
    if extra is not None:
      raise TokenizerError(f"{path}: file holds {vocab_size + extra} tokens, expected "
                           f"vocab_size={vocab_size}")
    raise TokenizerError(f"{path}: {len(data) - offset} trailing garbage bytes after the "
                         f"{vocab_size} tokens")

  @property
  def vocab_size(self) -> int:
    return len(self._pieces)

  @property
  def bos_id(self) -> int:
    return self.BOS_ID

  @property
  def eos_id(self) -> int:
    return self._eos_id

  @property
  def pad_id(self) -> int:
    return self.UNK_ID  # never a real input; masked out by lengths anyway

  @property
  def pieces(self) -> tuple[str, ...]:
    return tuple(p.decode("utf-8", "surrogateescape") for p in self._pieces)

  @property
  def scores(self) -> tuple[float, ...]:
    return self._scores

  def piece_bytes(self, token_id: int) -> bytes:
    return self._pieces[token_id]

  # -- encode ---------------------------------------------------------------------------------

  def encode(self, text: str, add_bos: bool = True, add_eos: bool = False) -> list[int]:
    """llama2.c `encode`: [BOS] + merge(" " + text as chars or bytes) [+ </s>].

    The dummy prefix is encoded like any character (C looks " " up once; the same unless
    " " is missing, where C would emit -1 and we fall back to its byte). Unlike C, a NUL
    character is encoded (as its byte) rather than ending the string.
    """
    check_text(text, self.source)
    ids = [self.BOS_ID] if add_bos else []
    if text:
      ids += self._chars_to_ids(" " + text)
    ids = self._merge(ids)  # C merges over BOS too; no piece starts with "\n<s>\n"
    if add_eos:
      ids.append(self.EOS_PIECE_ID)
    return ids

  def _chars_to_ids(self, text: str) -> list[int]:
    ids = []
    for ch in text:
      raw = ch.encode("utf-8")
      token = self._lookup.get(raw)
      if token is not None:
        ids.append(token)
      else:
        ids.extend(b + _BYTE_OFFSET for b in raw)
    return ids

  def _merge(self, ids: list[int]) -> list[int]:
    """C's loop (merge the best-scoring adjacent pair, leftmost on ties, until none is a
    piece) in O(n log n): a heap of candidate pairs over a linked list, stale entries skipped.
    Heap order (-score, left position) is C's choice because positions keep their order."""
    n = len(ids)
    tok, nxt, prv = list(ids), list(range(1, n + 1)), list(range(-1, n - 1))
    alive = [True] * n
    heap: list[tuple[float, int, int, int, int, int]] = []

    def push(i: int) -> None:
      j = nxt[i]
      if j >= n:
        return
      merged = self._lookup.get(self._pieces[tok[i]] + self._pieces[tok[j]])
      if merged is not None and self._scores[merged] > _MIN_MERGE_SCORE:
        heapq.heappush(heap, (-self._scores[merged], i, j, tok[i], tok[j], merged))

    for i in range(n - 1):
      push(i)
    while heap:
      _, i, j, ti, tj, merged = heapq.heappop(heap)
      # Pieces only grow and are non-empty, so unchanged tokens mean an unchanged pair.
      if not (alive[i] and alive[j] and nxt[i] == j and tok[i] == ti and tok[j] == tj):
        continue
      tok[i], alive[j] = merged, False
      nxt[i] = nxt[j]
      if nxt[j] < n:
        prv[nxt[j]] = i
      push(i)
      if prv[i] >= 0:
        push(prv[i])
    return [t for t, a in zip(tok, alive) if a]

  # -- decode ---------------------------------------------------------------------------------

  def decode_piece(self, prev_id: int | None, token_id: int) -> bytes:
    """Raw bytes printed for `token_id` after `prev_id` (llama2.c `decode`), for streaming:
    feed them to `codecs.getincrementaldecoder("utf-8")("replace")`.

    <unk>, <s> and </s> print nothing (as in sentencepiece; llama2.c would print the raw
    "\\n<s>\\n" pieces, but its generator stops at BOS instead). A piece right after BOS
    loses its leading space (the dummy prefix). Unlike llama2.c's safe_printf we keep
    control and non-ASCII bytes: that filter is for the terminal, not the text.
    """
    if token_id < _BYTE_OFFSET:
      return b""
    raw = self._raw_byte[token_id]
    if raw is not None:
      return bytes((raw,))
    piece = self._pieces[token_id]
    if prev_id == self.BOS_ID and piece.startswith(b" "):
      piece = piece[1:]
    return piece

  def decode(self, ids: Iterable[int]) -> str:
    """Ids -> text; BOS may lead. Bytes are assembled first so byte-fallback sequences
    form their UTF-8 characters; invalid UTF-8 becomes U+FFFD."""
    ids = _as_ids(ids, self.vocab_size)
    prev = [None] + ids[:-1]
    raw = b"".join(self.decode_piece(p, t) for p, t in zip(prev, ids))
    return raw.decode("utf-8", errors="replace")

  def __repr__(self) -> str:
    return f"Llama2cTokenizer({self.source!r}, vocab_size={self.vocab_size})"


# --------------------------------------------------------------------------------------------
# HF tokenizers


_BOS_NAMES = ("<s>", "<|begin_of_text|>", "<bos>", "<|startoftext|>", "[CLS]")
_EOS_NAMES = ("</s>", "<|end_of_text|>", "<eos>", "<|endoftext|>", "[SEP]")
_PAD_NAMES = ("<pad>", "<|pad|>", "[PAD]", "<|padding|>")


def _read_json(path: Path) -> Any:
  try:
    text = path.read_text(encoding="utf-8")
  except OSError as e:
    raise TokenizerError(f"{path}: cannot read: {e}") from e
  except UnicodeDecodeError as e:
    raise TokenizerError(f"{path}: not UTF-8 text (bad byte at offset {e.start})") from e
  try:
    return json.loads(text)
  except (json.JSONDecodeError, UnicodeDecodeError, RecursionError) as e:
    raise TokenizerError(f"{path}: malformed JSON: {str(e)[:200]}") from e


def _read_optional_config(path: Path) -> dict[str, Any]:
  if not path.is_file():
    return {}
  obj = _read_json(path)
  if not isinstance(obj, dict):
    raise TokenizerError(f"{path}: expected a JSON object, got {type(obj).__name__}")
  return obj


class HFTokenizer:
  """A `tokenizers.Tokenizer` (from `tokenizer.json`) behind the same interface.

  Specials come from tokenizer_config.json (`bos_token`...), then config.json
  (`bos_token_id`...), then well-known special-token names; each may be None (e.g. Qwen2
  has no BOS). `encode` never applies the file's own post-processor template, so BOS/EOS
  are added only as asked: add_bos adds BOS when the tokenizer has one, add_eos requires one.
  """

  def __init__(self, tokenizer: Any, *, bos_id: int | None = None, eos_id: int | None = None,
               pad_id: int | None = None, source: str = "<memory>"):
    self._tok = tokenizer
    self.source = source
    vocab = tokenizer.get_vocab(with_added_tokens=True)
    if not vocab:
      raise TokenizerError(f"{source}: empty vocabulary")
    # Added tokens may leave holes in the id range; max id + 1 bounds the embedding needed.
    self._vocab_size = max(vocab.values()) + 1
    for name, value in (("bos_id", bos_id), ("eos_id", eos_id), ("pad_id", pad_id)):
      if value is not None:  # an int inside the vocabulary: not 2.0, True or 10**12
        check_int(value, f"{source}: {name}", minimum=0, maximum=self._vocab_size - 1,
                  error=TokenizerError)
    self._bos_id, self._eos_id, self._pad_id = bos_id, eos_id, pad_id

  @classmethod
  def from_file(cls, path: str | Path) -> HFTokenizer:
    """`path` is a tokenizer.json or a folder holding one (and maybe the config files)."""
    import tokenizers  # deferred: llama2.c users need not import it

    path = Path(path)
    file = path / "tokenizer.json" if path.is_dir() else path
    if not file.is_file():
      raise TokenizerError(f"{file}: no such tokenizer file")
    obj = _read_json(file)
    if not isinstance(obj, dict) or "model" not in obj:
      raise TokenizerError(f"{file}: not a tokenizers JSON file (no 'model' entry)")
    try:
      tok = tokenizers.Tokenizer.from_str(json.dumps(obj))
    except Exception as e:  # tokenizers raises a bare Exception on schema errors
      raise TokenizerError(f"{file}: invalid tokenizer.json: {e}") from e
    specials = _find_specials(tok, file.parent)
    return cls(tok, **specials, source=str(file))

  @property
  def vocab_size(self) -> int:
    return self._vocab_size

  @property
  def bos_id(self) -> int | None:
    return self._bos_id

  @property
  def eos_id(self) -> int | None:
    return self._eos_id

  @property
  def pad_id(self) -> int | None:
    return self._pad_id

  @property
  def pieces(self) -> tuple[str | None, ...]:
    return tuple(self._tok.id_to_token(i) for i in range(self._vocab_size))

  def encode(self, text: str, add_bos: bool = True, add_eos: bool = False) -> list[int]:
    check_text(text, self.source)
    ids = self._tok.encode(text, add_special_tokens=False).ids
    if add_bos and self._bos_id is not None:
      ids = [self._bos_id] + ids
    if add_eos:
      if self._eos_id is None:
        raise TokenizerError(f"{self.source}: add_eos=True but the tokenizer has no EOS token")
      ids = ids + [self._eos_id]
    return ids

  def decode(self, ids: Iterable[int]) -> str:
    return self._tok.decode(_as_ids(ids, self._vocab_size), skip_special_tokens=True)

  def __repr__(self) -> str:
    return f"HFTokenizer({self.source!r}, vocab_size={self.vocab_size})"


def _token_id(tok: Any, value: Any) -> int | None:
  """A tokenizer_config.json special ("<s>" or {"content": "<s>", ...}) -> its id."""
  if isinstance(value, dict):
    value = value.get("content")
  return tok.token_to_id(value) if isinstance(value, str) else None


def _config_id(value: Any) -> int | None:
  """A config.json `*_token_id` (int, list of ints, or null) -> the first id."""
  if isinstance(value, list):
    value = value[0] if value else None
  return value if isinstance(value, int) and not isinstance(value, bool) else None


def _find_specials(tok: Any, folder: Path) -> dict[str, int | None]:
  tok_cfg = _read_optional_config(folder / "tokenizer_config.json")
  model_cfg = _read_optional_config(folder / "config.json")
  padding = tok.padding or {}
  found = {}
  for role, names in (("bos", _BOS_NAMES), ("eos", _EOS_NAMES), ("pad", _PAD_NAMES)):
    candidates = [_token_id(tok, tok_cfg.get(f"{role}_token")),
                  _config_id(model_cfg.get(f"{role}_token_id"))]
    if role == "pad":
      candidates.append(padding.get("pad_id"))
    candidates += [tok.token_to_id(name) for name in names]
    found[f"{role}_id"] = next((c for c in candidates if c is not None), None)
  return found


# --------------------------------------------------------------------------------------------
# Loading and compatibility checks


def load_tokenizer(path: str | Path) -> Llama2cTokenizer | HFTokenizer:
  """`*.bin` -> Llama2cTokenizer; a `*.json` file or a folder with tokenizer.json -> HFTokenizer;
  a `*.gguf` -> GGUFTokenizer (spec_jax.models.gguf, from the file's metadata)."""
  path = Path(path)
  if path.is_dir():
    if (path / "tokenizer.json").is_file():
      return HFTokenizer.from_file(path)
    raise TokenizerError(f"{path}: folder has no tokenizer.json (for a llama2.c tokenizer, "
                         "pass the tok*.bin file itself)")
  if not path.exists():
    raise TokenizerError(f"{path}: no such file or folder")
  if path.suffix == ".bin":
    return Llama2cTokenizer.from_file(path)
  if path.suffix == ".json":
    return HFTokenizer.from_file(path)
  if path.suffix == ".gguf":
    from spec_jax.models.gguf import load_gguf_tokenizer  # local: gguf imports this module
    return load_gguf_tokenizer(str(path))
  raise TokenizerError(f"{path}: unknown tokenizer format; expected a llama2.c *.bin, a "
                       "tokenizer.json, a folder containing tokenizer.json, or a *.gguf")


def check_vocab_compatible(tokenizer: Tokenizer, model_vocab_size: int) -> None:
  """HF checkpoints often pad the embedding past the tokenizer (ids beyond it are simply
  never produced by encode), so tokenizer <= model is fine; llama2.c files are exact."""
  n = tokenizer.vocab_size
  if isinstance(tokenizer, Llama2cTokenizer) and n != model_vocab_size:
    raise ValueError(f"tokenizer vocab_size={n} != model vocab_size={model_vocab_size}: a "
                     "llama2.c tokenizer must match its model exactly")
  if n > model_vocab_size:
    raise ValueError(f"tokenizer vocab_size={n} > model vocab_size={model_vocab_size}: the "
                     "tokenizer can produce ids the model has no embedding for")


def check_same_tokenizer(tok_a: Tokenizer, tok_b: Tokenizer) -> None:
  """Draft and target must agree on every id, or accepted drafts would mean other text.
  Compares the id -> piece tables, so equivalent tokenizers in different formats differ."""
  if tok_a.vocab_size != tok_b.vocab_size:
    raise ValueError(f"tokenizers differ: vocab_size {tok_a.vocab_size} vs {tok_b.vocab_size}")
  for i, (a, b) in enumerate(zip(tok_a.pieces, tok_b.pieces)):
    if a != b:
      raise ValueError(f"tokenizers differ at id {i}: {a!r} vs {b!r}")
