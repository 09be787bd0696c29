"""Tests for models/tokenizer.py: llama2.c tok*.bin against the reference C output, a literal
port of llama2.c's `encode` as an independent oracle, strict file validation, and HF
tokenizer.json wrapping on a tiny BPE trained here."""

from __future__ import annotations

import codecs
import json
import random
import struct
from pathlib import Path

import numpy as np
import pytest

from spec_jax.models.tokenizer import (HFTokenizer, Llama2cTokenizer, TokenizerError,
                              check_same_tokenizer, check_vocab_compatible, load_tokenizer)

SHARED = Path(__file__).resolve().parents[1].parent / "shared"
TOK512 = SHARED / "models" / "stories260K" / "tok512.bin"
MODEL_BIN = SHARED / "models" / "stories260K" / "stories260K.bin"
REF = SHARED / "reference" / "stories260K_greedy_once_upon_a_time_n200"


@pytest.fixture(scope="module")
def tok512() -> Llama2cTokenizer:
  if not TOK512.is_file():
    pytest.skip(f"shared test data missing: {TOK512} (../shared beside the repository)")
  return Llama2cTokenizer.from_file(TOK512, vocab_size=512)


# -- helpers ---------------------------------------------------------------------------------


def _reserved_pieces() -> list[bytes]:
  return [b"<unk>", b"\n<s>\n", b"\n</s>\n"] + [b"<0x%02X>" % b for b in range(256)]


def _write_tok_bin(path: Path, pieces: list[bytes], scores: list[float],
                   max_len: int | None = None) -> Path:
  out = [struct.pack("<I", max_len or max(len(p) for p in pieces))]
  for piece, score in zip(pieces, scores):
    out.append(struct.pack("<fi", score, len(piece)) + piece)
  path.write_bytes(b"".join(out))
  return path


def _small_tokenizer_file(path: Path) -> Path:
  """A valid 265-token llama2.c tokenizer with tied merge scores (tests leftmost-first)."""
  pieces = _reserved_pieces() + [b" ", b"a", b"b", b"ab", b"ba", b" a"]
  scores = [0.0] * 259 + [0.0, 0.0, 0.0, -1.0, -1.0, -1.0]
  return _write_tok_bin(path, pieces, scores)


def c_encode(pieces: list[bytes], scores: list[float], text: str, bos: bool,
             eos: bool) -> list[int]:
  """Line-by-line port of llama2.c run.c `encode` (byte loop, O(n^2) merge)."""
  lookup: dict[bytes, int] = {}
  for i, p in enumerate(pieces):
    lookup.setdefault(p, i)
  tokens = [1] if bos else []
  if text:
    tokens.append(lookup.get(b" ", -1))
  raw, buf = text.encode("utf-8"), b""
  for k, c in enumerate(raw):
    if (c & 0xC0) != 0x80:
      buf = b""
    buf += bytes([c])
    nxt = raw[k + 1] if k + 1 < len(raw) else 0
    if (nxt & 0xC0) == 0x80 and len(buf) < 4:
      continue
    token = lookup.get(buf, -1)
    if token != -1:
      tokens.append(token)
    else:
      tokens.extend(b + 3 for b in buf)
    buf = b""
  while True:
    best_score, best_id, best_idx = -1e10, -1, -1
    for i in range(len(tokens) - 1):
      token = lookup.get(pieces[tokens[i]] + pieces[tokens[i + 1]], -1)
      if token != -1 and scores[token] > best_score:
        best_score, best_id, best_idx = scores[token], token, i
    if best_idx == -1:
      break
    tokens[best_idx] = best_id
    del tokens[best_idx + 1]
  if eos:
    tokens.append(2)
  return tokens


# -- llama2.c: the reference -----------------------------------------------------------------


def _reference() -> tuple[list[int], str]:
  tokens_file, text_file = REF.with_suffix(".tokens.txt"), REF.with_suffix(".txt")
  if not (tokens_file.is_file() and text_file.is_file()):
    pytest.skip(f"shared reference output missing: {REF}.*")
  tokens = [int(t) for t in tokens_file.read_text().split()]
  return tokens, text_file.read_bytes().decode("utf-8")


def test_once_upon_a_time_encodes_like_reference(tok512):
  assert tok512.encode("Once upon a time") == [1, 403, 407, 261, 378]
  assert tok512.encode("Once upon a time", add_bos=False) == [403, 407, 261, 378]
  assert tok512.encode("Once upon a time", add_eos=True)[-1] == 2  # C appends the </s> piece
  assert tok512.encode("") == [1]  # no dummy prefix for empty text
  assert tok512.encode("", add_bos=False) == []


def test_properties(tok512):
  assert (tok512.vocab_size, tok512.bos_id, tok512.eos_id, tok512.pad_id) == (512, 1, 1, 0)
  assert tok512.max_token_length == 7
  assert Llama2cTokenizer.from_file(TOK512).vocab_size == 512  # implied by the record count
  assert Llama2cTokenizer.from_file(TOK512, eos_id=2).eos_id == 2


def test_decode_reference_generation(tok512):
  tokens, text = _reference()
  assert tokens[0] == 1 and len(tokens) == 201
  # run.c prints decode(prev, next) for each token after the leading BOS (never BOS itself;
  # it stops if BOS is generated), then one "\n" when generation ends.
  assert tok512.decode(tokens) + "\n" == text
  assert tok512.decode(np.asarray(tokens, np.int32)) + "\n" == text


def test_reference_text_round_trips_to_its_tokens(tok512):
  # Greedy generation need not produce the canonical (merged) segmentation of its own text,
  # but for this output it does: encoding the decoded text reproduces every token.
  tokens, text = _reference()
  assert tok512.encode(text[:-1]) == tokens
  assert tok512.encode(text[:-1], add_bos=False) == tokens[1:]


def test_decode_piece_streams_like_decode(tok512):
  tokens, text = _reference()
  stream = codecs.getincrementaldecoder("utf-8")("replace")
  prev, parts = None, []
  for t in tokens:
    parts.append(stream.decode(tok512.decode_piece(prev, t)))
    prev = t
  parts.append(stream.decode(b"", final=True))
  assert "".join(parts) + "\n" == text


def test_byte_fallback_non_ascii(tok512):
  text = "café ☃"
  ids = tok512.encode(text)
  assert ids[-3:] == [0xE2 + 3, 0x98 + 3, 0x83 + 3]  # no piece for ☃: its UTF-8 bytes
  assert ids == c_encode(list(map(tok512.piece_bytes, range(512))), list(tok512.scores), text,
                         True, False)
  assert tok512.decode(ids) == text
  assert tok512.decode(ids[1:]) == " " + text  # no BOS before: the dummy space stays


def test_decode_invalid_utf8_is_replaced(tok512):
  assert tok512.decode([1, 0xE2 + 3, 0x41 + 3]) == "\ufffdA"
  assert tok512.decode([1, 2, 0]) == ""  # control tokens print nothing


def test_decode_rejects_bad_ids(tok512):
  with pytest.raises(TokenizerError, match="512 is outside"):
    tok512.decode([1, 512])
  with pytest.raises(TokenizerError, match="-1 is outside"):
    tok512.decode([-1])
  with pytest.raises(TokenizerError, match="1-D"):
    tok512.decode(np.zeros((2, 2), np.int32))


def test_encode_matches_c_port_on_random_text(tok512):
  pieces = [tok512.piece_bytes(i) for i in range(512)]
  scores = list(tok512.scores)
  rng = random.Random(0)
  alphabet = list("abcdefghijklmnopqrstuvwxyz   ..,!'\"\nTLO") + ["é", "☃", "日", "𝄞", "\t"]
  for _ in range(150):
    text = "".join(rng.choice(alphabet) for _ in range(rng.randint(0, 40)))
    ids = tok512.encode(text)
    assert ids == c_encode(pieces, scores, text, True, False), text
    assert tok512.decode(ids) == text  # the dummy prefix is the space decode drops


def test_tied_scores_merge_leftmost_first(tmp_path):
  path = _small_tokenizer_file(tmp_path / "tok.bin")
  tok = Llama2cTokenizer.from_file(path)
  pieces = [tok.piece_bytes(i) for i in range(tok.vocab_size)]
  rng = random.Random(1)
  for _ in range(200):
    text = "".join(rng.choice("ab ") for _ in range(rng.randint(0, 12)))
    assert tok.encode(text) == c_encode(pieces, list(tok.scores), text, True, False), text
  # " aba": " a", "ab" and "ba" all score -1; C merges the leftmost (" a") first, then "ba".
  assert tok.encode("aba", add_bos=False) == [264, 263]


# -- llama2.c: strict validation -------------------------------------------------------------


@pytest.fixture
def good_file(tmp_path) -> Path:
  return _small_tokenizer_file(tmp_path / "tok265.bin")


def _raises(path: Path, match: str, **kwargs) -> None:
  with pytest.raises(TokenizerError, match=match) as info:
    Llama2cTokenizer.from_file(path, **kwargs)
  assert path.name in str(info.value)


def test_truncated_file(good_file, tmp_path):
  data = good_file.read_bytes()
  bad = tmp_path / "truncated.bin"
  bad.write_bytes(data[:-3])
  _raises(bad, r"ends inside token record 264")
  bad.write_bytes(data[:-9])  # cut inside the last record's score/length
  _raises(bad, r"ends inside token record 264")
  _raises(bad, r"ends inside token record 264", vocab_size=265)
  bad.write_bytes(data[:2])
  _raises(bad, "too short")
  bad.write_bytes(data[:100])  # cut at a record boundary: too few tokens to be llama2.c's
  _raises(bad, "7 tokens, but a llama2.c tokenizer needs at least 259")
  _raises(bad, "holds 7 tokens, expected vocab_size=265", vocab_size=265)


def test_trailing_garbage(good_file, tmp_path):
  bad = tmp_path / "garbage.bin"
  bad.write_bytes(good_file.read_bytes() + b"\x07\x00\x01")
  _raises(bad, "truncated or trailing garbage")
  _raises(bad, "3 trailing garbage bytes after the 265 tokens", vocab_size=265)


def test_wrong_vocab_size(good_file):
  _raises(good_file, "holds 265 tokens, expected vocab_size=300", vocab_size=300)
  _raises(good_file, "holds 265 tokens, expected vocab_size=260", vocab_size=260)


def test_absurd_lengths(good_file, tmp_path):
  data = bytearray(good_file.read_bytes())
  bad = tmp_path / "absurd.bin"
  bad.write_bytes(struct.pack("<I", 0xFFFFFFFF) + data[4:])
  _raises(bad, "absurd max_token_length=4294967295")
  bad.write_bytes(struct.pack("<I", 0) + data[4:])
  _raises(bad, "absurd max_token_length=0")
  data[8:12] = struct.pack("<i", 1_000_000)  # byte length of record 0
  bad.write_bytes(bytes(data))
  _raises(bad, "record 0 .* byte length 1000000")
  data[8:12] = struct.pack("<i", -5)
  bad.write_bytes(bytes(data))
  _raises(bad, "record 0 .* byte length -5")


def test_not_a_llama2c_tokenizer(tmp_path):
  pieces = _reserved_pieces() + [b" "]
  pieces[3], pieces[4] = pieces[4], pieces[3]
  _raises(_write_tok_bin(tmp_path / "swapped.bin", pieces, [0.0] * len(pieces)),
          "token 3 is b'<0x01>', expected <0x00>")
  _raises(_write_tok_bin(tmp_path / "tiny.bin", [b"a", b"b"], [0.0, 0.0]),
          "needs at least 259")
  _raises(_write_tok_bin(tmp_path / "nan.bin", _reserved_pieces(), [float("nan")] * 259),
          "NaN score")
  empty = tmp_path / "empty.bin"
  empty.write_bytes(b"")
  _raises(empty, "too short")
  _raises(tmp_path / "missing.bin", "cannot read")
  if MODEL_BIN.is_file():  # a model checkpoint passed by mistake
    with pytest.raises(TokenizerError, match="stories260K.bin"):
      Llama2cTokenizer.from_file(MODEL_BIN)


# -- HF tokenizer.json -----------------------------------------------------------------------


CORPUS = ["Once upon a time, there was a little girl named Lily.",
          "She loved to play outside in the sun with her friends.",
          "One day, she found a shiny stone near the river. Café au lait!"] * 20


def _train_bpe(folder: Path, specials: list[str]) -> Path:
  from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

  tok = Tokenizer(models.BPE())
  tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
  tok.decoder = decoders.ByteLevel()
  trainer = trainers.BpeTrainer(vocab_size=320, special_tokens=specials, show_progress=False,
                                initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
  tok.train_from_iterator(CORPUS, trainer)
  folder.mkdir(parents=True, exist_ok=True)
  tok.save(str(folder / "tokenizer.json"))
  return folder


@pytest.fixture(scope="module")
def hf_folder(tmp_path_factory) -> Path:
  return _train_bpe(tmp_path_factory.mktemp("hf") / "bpe", ["<s>", "</s>"])


def test_hf_round_trip_and_specials(hf_folder):
  tok = HFTokenizer.from_file(hf_folder / "tokenizer.json")
  assert (tok.bos_id, tok.eos_id, tok.pad_id) == (0, 1, None)  # specials come first
  text = "Once upon a time, Lily found a café ☃ by the river."
  ids = tok.encode(text)
  assert ids[0] == tok.bos_id and tok.bos_id not in ids[1:]
  assert tok.decode(ids) == text  # byte-level BPE is lossless; specials are skipped
  assert tok.encode(text, add_bos=False, add_eos=True) == ids[1:] + [tok.eos_id]
  assert tok.vocab_size == len(tok.pieces) <= 320
  assert tok.pieces[:2] == ("<s>", "</s>")
  assert tok.decode(np.asarray(ids)) == text


def test_hf_specials_from_config_files(tmp_path):
  folder = _train_bpe(tmp_path / "cfg", ["<s>", "</s>", "<|end|>", "<pad>"])
  (folder / "tokenizer_config.json").write_text(json.dumps(
      {"eos_token": {"content": "<|end|>"}, "bos_token": None}))
  (folder / "config.json").write_text(json.dumps({"bos_token_id": 1, "pad_token_id": None}))
  tok = HFTokenizer.from_file(folder)
  # eos from tokenizer_config, bos from config.json, pad from its name
  assert (tok.bos_id, tok.eos_id, tok.pad_id) == (1, 2, 3)


def test_hf_without_specials(tmp_path):
  tok = HFTokenizer.from_file(_train_bpe(tmp_path / "plain", []))
  assert (tok.bos_id, tok.eos_id, tok.pad_id) == (None, None, None)
  assert tok.decode(tok.encode("hello there")) == "hello there"  # add_bos: none to add
  with pytest.raises(TokenizerError, match="no EOS"):
    tok.encode("hello", add_eos=True)


def test_hf_malformed(tmp_path, hf_folder):
  bad = tmp_path / "tokenizer.json"
  bad.write_text("{not json")
  with pytest.raises(TokenizerError, match="malformed JSON"):
    HFTokenizer.from_file(bad)
  bad.write_text(json.dumps({"version": "1.0"}))
  with pytest.raises(TokenizerError, match="no 'model' entry"):
    HFTokenizer.from_file(bad)
  bad.write_text(json.dumps({"version": "1.0", "model": {"type": "NoSuchModel"}}))
  with pytest.raises(TokenizerError, match="invalid tokenizer.json"):
    HFTokenizer.from_file(bad)
  with pytest.raises(TokenizerError, match="no such tokenizer file"):
    HFTokenizer.from_file(tmp_path / "nothing" / "tokenizer.json")
  folder = tmp_path / "badcfg"
  folder.mkdir()
  (folder / "tokenizer.json").write_bytes((hf_folder / "tokenizer.json").read_bytes())
  (folder / "tokenizer_config.json").write_text("{")
  with pytest.raises(TokenizerError, match="tokenizer_config.json: malformed JSON"):
    HFTokenizer.from_file(folder)


# -- loading and compatibility ---------------------------------------------------------------


def test_load_tokenizer_dispatch(tmp_path, hf_folder, good_file):
  assert isinstance(load_tokenizer(good_file), Llama2cTokenizer)
  assert isinstance(load_tokenizer(hf_folder), HFTokenizer)
  assert isinstance(load_tokenizer(hf_folder / "tokenizer.json"), HFTokenizer)
  (tmp_path / "vocab.txt").write_text("a\n")
  with pytest.raises(TokenizerError, match="unknown tokenizer format"):
    load_tokenizer(tmp_path / "vocab.txt")
  (tmp_path / "empty").mkdir()
  with pytest.raises(TokenizerError, match="no tokenizer.json"):
    load_tokenizer(tmp_path / "empty")
  with pytest.raises(TokenizerError, match="no such file"):
    load_tokenizer(tmp_path / "absent.bin")


def test_check_vocab_compatible(good_file, hf_folder):
  small = Llama2cTokenizer.from_file(good_file)
  check_vocab_compatible(small, 265)
  for model_vocab in (264, 512):
    with pytest.raises(ValueError, match=f"vocab_size=265 != model vocab_size={model_vocab}"):
      check_vocab_compatible(small, model_vocab)
  hf = HFTokenizer.from_file(hf_folder)
  check_vocab_compatible(hf, hf.vocab_size)
  check_vocab_compatible(hf, hf.vocab_size + 64)  # padded embedding is fine
  with pytest.raises(ValueError, match=f"{hf.vocab_size} > model vocab_size=100"):
    check_vocab_compatible(hf, 100)


def test_check_same_tokenizer(good_file, tmp_path, hf_folder):
  a = Llama2cTokenizer.from_file(good_file)
  check_same_tokenizer(a, Llama2cTokenizer.from_file(good_file))
  pieces = [a.piece_bytes(i) for i in range(a.vocab_size)]
  pieces[262] = b"c"
  other = Llama2cTokenizer.from_file(_write_tok_bin(tmp_path / "o.bin", pieces,
                                                    list(a.scores)))
  with pytest.raises(ValueError, match="differ at id 262: 'ab' vs 'c'"):
    check_same_tokenizer(a, other)
  with pytest.raises(ValueError, match="vocab_size 265 vs"):
    check_same_tokenizer(a, HFTokenizer.from_file(hf_folder))
