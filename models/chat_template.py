"""Chat templates (the jinja2 `chat_template` a model ships), rendered as HF transformers does.

Same environment as transformers' `apply_chat_template`: a sandboxed jinja2 environment with
trim_blocks and lstrip_blocks, the loopcontrols extension, HF's `tojson` filter (no HTML
escaping), `raise_exception`, `strftime_now`, and the tokenizer's special tokens
(`bos_token`, `eos_token`, ...) as variables. Messages are dicts with "role" and "content";
keys whose value is None are dropped, as HF does, so templates see them as absent.
"""

from __future__ import annotations

import datetime
import functools
import json
from collections.abc import Mapping, Sequence
from typing import Any

from spec_jax.models.tokenizer import TokenizerError


@functools.lru_cache(maxsize=16)
def _compile(template: str):
  import jinja2  # deferred: only chat users need it
  import jinja2.ext
  from jinja2.sandbox import ImmutableSandboxedEnvironment

  def raise_exception(message):
    raise jinja2.exceptions.TemplateError(message)

  def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                      sort_keys=sort_keys)

  env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                      extensions=[jinja2.ext.loopcontrols])
  env.filters["tojson"] = tojson
  env.globals["raise_exception"] = raise_exception
  env.globals["strftime_now"] = lambda fmt: datetime.datetime.now().strftime(fmt)
  return env.from_string(template)


def as_messages(messages: str | Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
  """A plain string is one user message; otherwise a list of {"role", "content"} dicts."""
  if isinstance(messages, str):
    return [{"role": "user", "content": messages}]
  out = []
  for i, message in enumerate(messages):
    if not isinstance(message, Mapping) or "role" not in message:
      raise TokenizerError(f"chat message {i} is not a dict with a 'role': {message!r}")
    out.append({k: v for k, v in message.items() if v is not None})
  if not out:
    raise TokenizerError("cannot apply a chat template to an empty conversation")
  return out


def render_chat_template(template: str, messages: str | Sequence[Mapping[str, Any]], *,
                         add_generation_prompt: bool = True,
                         special_tokens: Mapping[str, str | None] | None = None,
                         source: str = "chat_template", **kwargs: Any) -> str:
  """The template's text for `messages`; `kwargs` reach the template (e.g. tools=...)."""
  import jinja2

  try:
    compiled = _compile(template)
  except jinja2.TemplateError as e:
    raise TokenizerError(f"{source}: invalid chat template: {e}") from e
  variables = {k: v for k, v in (special_tokens or {}).items() if v is not None}
  variables.update(kwargs)
  variables.setdefault("tools", None)
  variables.setdefault("documents", None)
  try:
    return compiled.render(messages=as_messages(messages),
                           add_generation_prompt=add_generation_prompt, **variables)
  except jinja2.TemplateError as e:
    raise TokenizerError(f"{source}: the chat template failed: {e}") from e


def chat_prompt(tokenizer: Any, messages: str | Sequence[Mapping[str, Any]]) -> list[int]:
  """Prompt ids for a chat: `messages` (a string is one user message) through the tokenizer's
  chat template, ending with the header of the assistant's turn. A tokenizer without a
  template (llama2.c, or a file that ships none) raises TokenizerError in one line."""
  if getattr(tokenizer, "chat_template", None) and hasattr(tokenizer, "encode_chat"):
    return tokenizer.encode_chat(messages)
  source = getattr(tokenizer, "source", type(tokenizer).__name__)
  raise TokenizerError(f"{source}: this tokenizer has no chat template; pass the prompt as "
                       "plain text instead, or use a chat model (e.g. --model smollm2)")
