"""make_drafter: one place that builds each drafter kind with its draft params, for scripts.

Kinds:
  draft_model         a separate draft model (draft_model, draft_params required)
  prompt_lookup       n-gram lookup in the row's own tokens (no params)
  layer_skip          the target's first num_layers layers (default: 3/4 of them, rounded up)
  quantized           the target with int8 weights
  lookup+<model kind> prompt lookup where it finds a match, else that model (rows choose)
"""

from __future__ import annotations

import math

from spec_jax.drafters.combined import FallbackDrafter, ResyncDraftModelDrafter
from spec_jax.drafters.draft_model import DraftModelDrafter
from spec_jax.drafters.layer_skip import LayerSkipDrafter
from spec_jax.drafters.prompt_lookup import PromptLookupDrafter
from spec_jax.drafters.quantized import quantized_target_drafter

MODEL_KINDS = ("draft_model", "layer_skip", "quantized")
KINDS = ("prompt_lookup",) + MODEL_KINDS + tuple(f"lookup+{k}" for k in MODEL_KINDS)
# In a combination a unigram match (min_ngram 1) exists nearly always, and would shut the
# model out; two tokens of context are the least evidence that lookup is worth trusting.
FALLBACK_MIN_NGRAM = 2
# Layers a layer-skip draft keeps by default, rounded up (and one fewer than the target's).
# Without early-exit training shallow exits predict poorly: on stories260K 2 of 5 layers
# accept 1% of drafts, 4 of 5 accept 30% (scripts/drafter_table.py).
DEFAULT_LAYER_FRACTION = 0.75


def default_num_layers(n_layers: int) -> int:
  return max(1, min(n_layers - 1, math.ceil(DEFAULT_LAYER_FRACTION * n_layers)))


def _model_drafter(kind: str, target_model, target_params, *, draft_model, draft_params,
                   num_layers: int | None):
  """-> (standalone drafter, draft params, the draft's model handle)."""
  if kind == "draft_model":
    if draft_model is None or draft_params is None:
      raise ValueError("drafter 'draft_model' needs draft_model and draft_params")
    return DraftModelDrafter(draft_model), draft_params, draft_model
  if kind == "layer_skip":
    k = default_num_layers(target_model.config.n_layers) if num_layers is None else num_layers
    drafter = LayerSkipDrafter(target_model, k)
    return drafter, target_params, drafter.model
  drafter, params = quantized_target_drafter(target_model, target_params)
  return drafter, params, target_model


def make_drafter(kind: str, target_model, target_params, *, draft_model=None, draft_params=None,
                 num_layers: int | None = None, max_ngram: int = 3, min_ngram: int | None = None):
  """-> (drafter, draft_params) for speculative_generate.

  `min_ngram` defaults to 1 for prompt_lookup alone and FALLBACK_MIN_NGRAM in combinations.
  Options a kind does not use are ignored (the CLI passes them uniformly).
  """
  if kind not in KINDS:
    raise ValueError(f"unknown drafter kind {kind!r}; one of {', '.join(KINDS)}")
  if kind == "prompt_lookup":
    return PromptLookupDrafter(max_ngram, 1 if min_ngram is None else min_ngram), None
  model_kind = kind.removeprefix("lookup+")
  drafter, params, model = _model_drafter(model_kind, target_model, target_params,
                                          draft_model=draft_model, draft_params=draft_params,
                                          num_layers=num_layers)
  if model_kind == kind:
    return drafter, params
  if min_ngram is None:
    min_ngram = min(FALLBACK_MIN_NGRAM, max_ngram)
  lookup = PromptLookupDrafter(max_ngram, min_ngram)
  return FallbackDrafter(lookup, ResyncDraftModelDrafter(model)), (None, params)
