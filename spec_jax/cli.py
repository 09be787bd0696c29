"""What every command line (scripts/*.py) shares: one-line errors, `--debug`, strict argument
types, and argv that is not valid UTF-8.

    def main(argv=None): args = parse_args(argv); ...
    if __name__ == "__main__":
      sys.exit(cli.run(main))

`run` turns every expected error into one line on stderr, `error: <message>`, and an exit
status: 2 for usage and bad arguments (argparse errors, BadArgument and other ValueErrors
from the API's argument checks), 1 for a bad file or model (CheckpointError,
TokenizerError, OSError) or a failed run. `--debug` shows the traceback instead.
Unexpected exceptions (bugs) always show theirs.

POSIX hands a program its arguments as bytes; Python decodes them as UTF-8 with
surrogateescape, so undecodable bytes arrive as lone surrogates that no tokenizer can
encode. `run` replaces each such byte with U+FFFD and warns once, on stderr.
"""

from __future__ import annotations

import argparse
import math
import os
import sys
from typing import Callable, Sequence

from spec_jax.core.errors import BadArgument, CheckpointError, TokenizerError

EPILOG = ("Errors print one line (exit status 2: bad arguments; 1: a bad file or model, or a "
          "failed run); --debug prints the traceback instead. Undecodable (non-UTF-8) bytes "
          "in arguments are replaced with U+FFFD, with a warning.")


class ArgumentParser(argparse.ArgumentParser):
  """argparse with one-line usage errors (BadArgument, exit 2 through `run`), `--debug`, and
  the notes above in --help."""

  def __init__(self, *args, **kwargs):
    kwargs.setdefault("epilog", EPILOG)
    super().__init__(*args, **kwargs)
    self.add_argument("--debug", action="store_true",
                      help="on an error, print the full traceback instead of one line")

  def error(self, message: str):
    raise BadArgument(message)


# ---- argument types (argparse `type=`): errors name the flag through argparse ----------------

def _parse_int(text: str) -> int:
  try:
    return int(text.strip(), 10)  # "4.5", "1e3", "true" are not integers
  except ValueError:
    raise argparse.ArgumentTypeError(f"must be an integer, got {text!r}") from None


def int_range(minimum: int | None = None, maximum: int | None = None) -> Callable[[str], int]:
  """An integer type in [minimum, maximum] (either bound optional)."""
  def parse(text: str) -> int:
    value = _parse_int(text)
    if (minimum is not None and value < minimum) or (maximum is not None and value > maximum):
      lo = "" if minimum is None else f">= {minimum}"
      hi = "" if maximum is None else f"<= {maximum}"
      raise argparse.ArgumentTypeError(
          f"must be an integer {' and '.join(x for x in (lo, hi) if x)}, got {value}")
    return value
  parse.__name__ = "integer"
  return parse


positive_int = int_range(1)
non_negative_int = int_range(0)
seed_int = int_range(0, 2 ** 63 - 1)


def real_range(minimum: float | None = None, maximum: float | None = None, *,
               open_minimum: bool = False) -> Callable[[str], float]:
  """A finite float type in [minimum, maximum], or (minimum, maximum] with open_minimum."""
  def parse(text: str) -> float:
    try:
      value = float(text)
    except ValueError:
      raise argparse.ArgumentTypeError(f"must be a number, got {text!r}") from None
    below = minimum is not None and (value <= minimum if open_minimum else value < minimum)
    if not math.isfinite(value) or below or (maximum is not None and value > maximum):
      lo = "" if minimum is None else f"{'>' if open_minimum else '>='} {minimum:g}"
      hi = "" if maximum is None else f"<= {maximum:g}"
      raise argparse.ArgumentTypeError(
          f"must be a finite number {' and '.join(x for x in (lo, hi) if x)}, got {text}")
    return value
  parse.__name__ = "number"
  return parse


def tree_spec(text: str) -> str:
  """--tree DEPTH,TOPK,NODES: three integers, depth and top-k >= 1, nodes >= 2 (root
  included) and within the budget depth and top-k allow. Returned unchanged."""
  from spec_jax.tree import check_dynamic_tree  # local: keeps --help free of jax
  parts = text.split(",")
  usage = f"a tree is DEPTH,TOPK,NODES, e.g. 4,3,16; got {text!r}"
  if len(parts) != 3:
    raise argparse.ArgumentTypeError(usage)
  try:
    depth, top_k, nodes = (int(p.strip(), 10) for p in parts)
  except ValueError:
    raise argparse.ArgumentTypeError(usage) from None
  try:
    check_dynamic_tree(depth, top_k, nodes)
  except ValueError as e:
    raise argparse.ArgumentTypeError(f"{e}; a tree is DEPTH,TOPK,NODES, e.g. 4,3,16") from None
  return text


# ---- running a main -----------------------------------------------------------------------------

def clean_argv(argv: Sequence[str], stream=None) -> list[str]:
  """argv with undecodable bytes (lone surrogates) replaced by U+FFFD; one warning if any."""
  out, changed = [], []
  for i, arg in enumerate(argv):
    try:
      raw = arg.encode("utf-8", "surrogateescape")
    except UnicodeEncodeError:  # a surrogate surrogateescape did not make
      raw = arg.encode("utf-8", "surrogatepass")
    fixed = raw.decode("utf-8", "replace")
    if fixed != arg:
      changed.append(i + 1)
    out.append(fixed)
  if changed:
    print(f"warning: argument(s) {', '.join(map(str, changed))} are not valid UTF-8; "
          "undecodable bytes replaced with U+FFFD", file=stream or sys.stderr)
  return out


def exit_status(error: BaseException) -> int | None:
  """The status for an expected error, None for an unexpected one (a bug: traceback)."""
  if isinstance(error, (CheckpointError, TokenizerError, OSError, MemoryError)):
    return 1  # a bad file or model; missing files and folders are OSErrors
  if isinstance(error, ValueError):
    return 2  # BadArgument, argparse, and the API's own argument checks
  if type(error).__name__ in ("JaxRuntimeError", "XlaRuntimeError"):
    return 1  # e.g. the device ran out of memory
  return None


def one_line(error: BaseException) -> str:
  text = " ".join(str(error).split())
  return text or type(error).__name__


def run(main: Callable[[list[str]], object], argv: Sequence[str] | None = None) -> int:
  """Runs main(argv) -> its exit status (0 unless it returns an int), each expected error
  as one line on stderr with status 1 or 2 (see the module doc); `--debug` re-raises."""
  argv = list(sys.argv[1:] if argv is None else argv)
  debug = "--debug" in argv
  argv = clean_argv(argv)
  try:
    status = main(argv)
  except KeyboardInterrupt:
    if debug:
      raise
    print("error: interrupted", file=sys.stderr)
    return 130
  except SystemExit as e:
    if isinstance(e.code, str):  # raise SystemExit("message") in a script
      print(f"error: {' '.join(e.code.split())}", file=sys.stderr)
      return 1
    raise
  except Exception as e:
    status = exit_status(e)
    if status is None or debug:
      raise
    print(f"error: {one_line(e)}", file=sys.stderr)
    return status
  return status if isinstance(status, int) else 0


# ---- the persistent compilation cache ----------------------------------------------------------

# where commands keep compiled programs unless told otherwise ("off": nowhere)
DEFAULT_COMPILE_CACHE = os.environ.get("SPEC_JAX_COMPILE_CACHE", "~/.cache/spec_jax/xla")
DEFAULT_COST_TABLES = os.environ.get("SPEC_JAX_COST_TABLES", "~/.cache/spec_jax/cost_tables")


def enable_cost_tables(folder: str | None) -> str | None:
  """Keeps gamma="auto"'s measured cost tables on disk (spec_jax.adaptive.cost_store), so a
  later run on this machine skips timing them and, the table being part of the program, can
  load the compiled program from the compilation cache. folder: a directory, or None / "off"
  for none. Returns the folder in use, or None."""
  from spec_jax.adaptive import keep_cost_tables
  return keep_cost_tables(None if folder in (None, "off") else folder)


def enable_compile_cache(folder: str | None) -> str | None:
  """Keeps compiled programs on disk (jax's persistent compilation cache), so a second run
  of a command loads them instead of compiling (the main job: tens of seconds on a CPU).

  folder: a directory, or None / "off" for none. A cache already configured (e.g. the
  JAX_COMPILATION_CACHE_DIR environment variable) is left as it is. Returns the folder in
  use, or None. Entries are keyed by the program, the compile options and jax's version,
  so a changed program never loads a stale one."""
  import jax
  configured = jax.config.jax_compilation_cache_dir
  if configured:
    return configured
  if folder is None or folder == "off":
    return None
  path = os.path.expanduser(folder)
  try:
    os.makedirs(path, exist_ok=True)
  except OSError as e:  # e.g. a read-only home: run without the cache, and say so
    print(f"warning: no compilation cache ({e})", file=sys.stderr)
    return None
  jax.config.update("jax_compilation_cache_dir", path)
  return path
