"""A text corpus every Python machine has (the standard library's own source), tokenised
into one token stream, and fixed-length random windows drawn from it.

Files are listed in sorted order and split into train / held-out by a hash of their path
relative to the stdlib root, so the split does not depend on which other files exist (a
file's side never changes between Python builds). Batches are a pure function of
(seed, step): resuming training at step k sees exactly the batches an uninterrupted run
would have seen.
"""

from __future__ import annotations

import sysconfig
import zlib
from pathlib import Path
from typing import Callable, Iterable, Sequence

import numpy as np

# Never: third-party code (site-packages). Also left out, to keep the corpus ordinary
# library code: the huge, repetitive regression suites (test/, */tests/, idle_test/),
# generated codec tables (encodings/) and pydoc's topic texts (pydoc_data/).
EXCLUDED_DIRS = frozenset({"site-packages", "dist-packages", "test", "tests", "idle_test",
                           "encodings", "pydoc_data", "__pycache__"})
HELDOUT_PERCENT = 5  # of files, chosen by crc32(relative path)


def stdlib_root() -> Path:
  return Path(sysconfig.get_paths()["stdlib"])


def stdlib_files(root: Path | None = None) -> list[Path]:
  """Every *.py under the stdlib root outside EXCLUDED_DIRS, sorted by relative path."""
  root = stdlib_root() if root is None else Path(root)
  files = [p for p in root.rglob("*.py")
           if p.is_file() and not EXCLUDED_DIRS.intersection(p.relative_to(root).parts[:-1])]
  return sorted(files, key=lambda p: p.relative_to(root).as_posix())


def is_heldout(relative_path: str, percent: int = HELDOUT_PERCENT) -> bool:
  return zlib.crc32(relative_path.encode()) % 100 < percent


def split_files(files: Sequence[Path], root: Path | None = None,
                percent: int = HELDOUT_PERCENT) -> tuple[list[Path], list[Path]]:
  """-> (train, heldout), each in the given order."""
  root = stdlib_root() if root is None else Path(root)
  train, heldout = [], []
  for p in files:
    (heldout if is_heldout(p.relative_to(root).as_posix(), percent) else train).append(p)
  return train, heldout


def read_texts(files: Iterable[Path]) -> list[str]:
  # A few stdlib files are not UTF-8; a replacement character beats dropping the file.
  return [Path(p).read_bytes().decode("utf-8", errors="replace") for p in files]


def token_stream(encode_batch: Callable[[list[str]], list[list[int]]], texts: Sequence[str],
                 sep_id: int, vocab_size: int) -> np.ndarray:
  """One stream [N] (uint16 when the vocabulary fits): sep, file 0, sep, file 1, ...

  The separator starts every file, so a prompt that begins with it looks like the start
  of a file to the model.
  """
  dtype = np.uint16 if vocab_size <= 2 ** 16 else np.int32
  parts = []
  for ids in encode_batch(list(texts)):
    parts.append(np.array([sep_id], dtype))
    parts.append(np.asarray(ids, dtype))
  return np.concatenate(parts) if parts else np.zeros((0,), dtype)


def random_windows(stream_N: np.ndarray, batch_size: int, seq_len: int, seed: int,
                   step: int) -> np.ndarray:
  """[batch, seq_len] int32 windows at uniformly random offsets; a function of (seed, step)."""
  if len(stream_N) < seq_len + 1:
    raise ValueError(f"token stream of {len(stream_N)} tokens is shorter than a window of "
                     f"{seq_len}")
  rng = np.random.default_rng([seed, step])
  starts_B = rng.integers(0, len(stream_N) - seq_len + 1, size=batch_size)
  return np.stack([stream_N[s:s + seq_len] for s in starts_B]).astype(np.int32)


def sequential_windows(stream_N: np.ndarray, seq_len: int, max_windows: int | None = None
                       ) -> np.ndarray:
  """[W, seq_len] int32 non-overlapping windows from the start of the stream (for evaluation)."""
  count = len(stream_N) // seq_len
  if max_windows is not None:
    count = min(count, max_windows)
  return stream_N[:count * seq_len].reshape(count, seq_len).astype(np.int32)
