"""The three error families every loader and entry point raises, and the checks behind them.

  CheckpointError  a model or drafter checkpoint is missing, truncated, corrupt, malformed,
                   inconsistent or unsupported (file, tensor or config field named)
  TokenizerError   a tokenizer file is missing or malformed, or text cannot be tokenized
  BadArgument      an argument has the wrong type or is out of range (argument named)

All three are ValueErrors, so `except ValueError` still catches them. Loaders raise nothing
else for malformed input (a missing file is a `CheckpointNotFound`, also a
FileNotFoundError); the command lines turn each into one line (spec_jax.cli).
"""

from __future__ import annotations

import math
import numbers
from typing import Any, Callable


class CheckpointError(ValueError):
  """A checkpoint file is missing, truncated, corrupt, malformed, inconsistent or unsupported."""


class CheckpointNotFound(CheckpointError, FileNotFoundError):
  """No checkpoint at the given path."""


class TokenizerError(ValueError):
  """A tokenizer file is missing, malformed, or does not fit what the caller expects; or the
  text to encode is not valid Unicode (e.g. a lone surrogate)."""


class BadArgument(ValueError):
  """An argument has the wrong type or is outside its range."""


Error = Callable[[str], Exception]


def is_int(value: Any) -> bool:
  """True for Python and NumPy integers; False for bools, floats (even 4.0) and strings."""
  return isinstance(value, numbers.Integral) and not isinstance(value, bool) and \
      type(value).__name__ != "bool_"


def is_real(value: Any) -> bool:
  """True for real numbers (Python's and NumPy's ints and floats); False for bools and
  strings."""
  return isinstance(value, numbers.Real) and not isinstance(value, bool) and \
      type(value).__name__ != "bool_"


def check_int(value: Any, name: str, *, minimum: int | None = None, maximum: int | None = None,
              error: Error = BadArgument) -> int:
  """`value` as an int, or `error` naming `name` and what was expected."""
  if not is_int(value):
    raise error(f"{name} must be an integer, got {value!r} ({type(value).__name__})")
  value = int(value)
  if (minimum is not None and value < minimum) or (maximum is not None and value > maximum):
    lo = "" if minimum is None else f">= {minimum}"
    hi = "" if maximum is None else f"<= {maximum}"
    raise error(f"{name} must be an integer {' and '.join(x for x in (lo, hi) if x)}, "
                f"got {value}")
  return value


def check_real(value: Any, name: str, *, positive: bool = False, minimum: float | None = None,
               error: Error = BadArgument) -> float:
  """`value` as a finite float (ints accepted, bools and strings not), or `error`."""
  if not is_real(value):
    raise error(f"{name} must be a number, got {value!r} ({type(value).__name__})")
  value = float(value)
  if not math.isfinite(value):
    raise error(f"{name} must be finite, got {value}")
  if positive and value <= 0:
    raise error(f"{name} must be > 0, got {value}")
  if minimum is not None and value < minimum:
    raise error(f"{name} must be >= {minimum}, got {value}")
  return value


def check_bool(value: Any, name: str, *, error: Error = BadArgument) -> bool:
  """`value` as a bool (Python or NumPy bools only: 0, 1 and "true" are not bools)."""
  if not (isinstance(value, bool) or type(value).__name__ == "bool_"):
    raise error(f"{name} must be true or false, got {value!r} ({type(value).__name__})")
  return bool(value)
