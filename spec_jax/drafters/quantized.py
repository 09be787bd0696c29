"""The quantized target as draft: the same model, its weights int8 (weight-only, per channel).

Nothing new runs here: the draft is a DraftModelDrafter over the target's own model handle,
and its params are `spec_jax.core.quantize.quantize_params(target_params)`, which turns every
projection matrix into int8 values with one float scale per output channel. Models in
`models/` multiply through `quantize.dense`, so they run such params as they are.
"""

from __future__ import annotations

from typing import Callable

from spec_jax.drafters.draft_model import DraftModelDrafter
from spec_jax.core.quantize import quantize_params
from spec_jax.drafters.registry import DrafterFamily, register


def quantized_target_drafter(target_model, target_params,
                             should_quantize: Callable | None = None):
  """-> (drafter, draft_params): the target with int8 weights, drafting for itself.

  `should_quantize(path, leaf)` picks the leaves (default: quantize_params' choice, every
  2-D `kernel`; embeddings, the tied head and norms stay float).
  """
  kw = {} if should_quantize is None else {"should_quantize": should_quantize}
  return DraftModelDrafter(target_model), quantize_params(target_params, **kw)


register(DrafterFamily(
    name="quantized", summary="the target with int8 weights (weight-only, per output channel)",
    build=lambda target, params, opts: quantized_target_drafter(target, params),
    combinable=True))
