"""The generation defaults an HF folder declares (generation_config.json), as spec_jax settings.

    defaults = read_generation_config("path/to/hf_folder")
    out = generate(model, params, tokens, lengths, sampling=defaults.sampling,
                   eos_id=defaults.eos_id, max_new_tokens=defaults.max_new_tokens or 256)

HF's meaning is kept: without `do_sample: true` decoding is greedy whatever the temperature;
when sampling, an unset top_k is HF's default 50 (0 turns it off), an unset temperature or
top_p is 1. `eos_token_id` may be one id or a list (Llama 3 instruct models declare two);
generation stops at whichever comes first. repetition_penalty and min_new_tokens map to
SamplingConfig's fields of the same names (HF semantics). Settings that change the output
and that spec_jax does not apply (beam search, n-gram bans, min_length counted with the
prompt, ...) are listed in `ignored` rather than dropped silently.
"""

from __future__ import annotations

import dataclasses
import json
import numbers
import os
from typing import Any

from spec_jax.core.sampling import SamplingConfig

FILE_NAME = "generation_config.json"
HF_TOP_K = 50  # transformers' default top_k when sampling and the file sets none

# settings spec_jax does not apply, with the value at which they do nothing
_INERT = {"num_beams": 1, "num_beam_groups": 1, "diversity_penalty": 0.0, "penalty_alpha": None,
          "no_repeat_ngram_size": 0, "encoder_no_repeat_ngram_size": 0, "typical_p": 1.0,
          "epsilon_cutoff": 0.0, "eta_cutoff": 0.0, "min_p": None, "min_length": 0,
          "bad_words_ids": None, "sequence_bias": None, "suppress_tokens": None,
          "begin_suppress_tokens": None, "forced_bos_token_id": None,
          "forced_eos_token_id": None, "exponential_decay_length_penalty": None,
          "encoder_repetition_penalty": 1.0, "renormalize_logits": False,
          "stop_strings": None, "force_words_ids": None, "constraints": None}


@dataclasses.dataclass(frozen=True)
class GenerationDefaults:
  """What generation_config.json sets, read into spec_jax's arguments."""
  sampling: SamplingConfig  # temperature/top-k/top-p, repetition_penalty, min_new_tokens
  eos_id: tuple[int, ...] | None  # generate's eos_id (any of them stops a row); None: unset
  max_new_tokens: int | None  # None: unset (max_length, which counts the prompt, may be set)
  max_length: int | None  # HF's prompt + new tokens limit, as declared
  bos_id: int | None
  pad_id: int | None
  ignored: tuple[str, ...] = ()  # settings present that would change the output, not applied


def _int_or_none(config: dict, name: str) -> int | None:
  value = config.get(name)
  if value is None:
    return None
  if isinstance(value, bool) or not isinstance(value, numbers.Integral):
    raise ValueError(f"generation config: {name} must be an integer, got {value!r}")
  return int(value)


def _eos_ids(value: Any) -> tuple[int, ...] | None:
  if value is None:
    return None
  ids = [value] if not isinstance(value, (list, tuple)) else list(value)
  if any(isinstance(i, bool) or not isinstance(i, numbers.Integral) or i < 0 for i in ids):
    raise ValueError(f"generation config: eos_token_id must be an id >= 0 or a list of them, "
                     f"got {value!r}")
  return tuple(dict.fromkeys(int(i) for i in ids)) or None  # duplicates dropped, order kept


def _number(config: dict, name: str, default: float) -> float:
  value = config.get(name)
  if value is None:
    return default
  if isinstance(value, bool) or not isinstance(value, numbers.Real):
    raise ValueError(f"generation config: {name} must be a number, got {value!r}")
  return float(value)


def generation_defaults(config: dict) -> GenerationDefaults:
  """GenerationDefaults from the parsed contents of a generation_config.json."""
  if not isinstance(config, dict):
    raise ValueError(f"generation config must be a JSON object, got {type(config).__name__}")
  do_sample = config.get("do_sample") or False
  if not isinstance(do_sample, bool):
    raise ValueError(f"generation config: do_sample must be true or false, got {do_sample!r}")
  kw: dict[str, Any] = {}
  if do_sample:
    temperature = _number(config, "temperature", 1.0)
    if not temperature > 0.0:  # as HF's temperature warper, which refuses it
      raise ValueError(f"generation config: do_sample with temperature {temperature}; HF "
                       "needs a temperature > 0 to sample (set do_sample false for greedy)")
    top_k = _int_or_none(config, "top_k")
    kw.update(temperature=temperature, top_k=HF_TOP_K if top_k is None else top_k,
              top_p=_number(config, "top_p", 1.0))
  kw["repetition_penalty"] = _number(config, "repetition_penalty", 1.0)
  kw["min_new_tokens"] = _int_or_none(config, "min_new_tokens") or 0
  try:
    sampling = SamplingConfig(**kw)
  except ValueError as e:
    raise ValueError(f"generation config: {e}") from None
  max_new_tokens = _int_or_none(config, "max_new_tokens")
  if max_new_tokens is not None and max_new_tokens < 1:
    raise ValueError(f"generation config: max_new_tokens must be >= 1, got {max_new_tokens}")
  ignored = tuple(name for name, inert in _INERT.items()
                  if config.get(name, inert) not in (inert, None))
  return GenerationDefaults(sampling, _eos_ids(config.get("eos_token_id")), max_new_tokens,
                            _int_or_none(config, "max_length"),
                            _int_or_none(config, "bos_token_id"),
                            _int_or_none(config, "pad_token_id"), ignored)


def read_generation_config(path: str) -> GenerationDefaults:
  """Reads an HF folder's generation_config.json (or that file itself).

  A folder without one gets HF's defaults: greedy, nothing else set.
  """
  file = os.path.join(path, FILE_NAME) if os.path.isdir(path) else path
  if os.path.isdir(path) and not os.path.exists(file):
    return generation_defaults({})
  with open(file) as f:
    try:
      config = json.load(f)
    except json.JSONDecodeError as e:
      raise ValueError(f"{file} is not valid JSON: {e}") from None
  try:
    return generation_defaults(config)
  except ValueError as e:
    raise ValueError(f"{file}: {e}") from None
