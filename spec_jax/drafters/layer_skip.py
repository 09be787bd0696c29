"""Layer-skip self-speculation: the target's first k layers (then its final norm and head) draft.

No second set of weights: the draft params are the target params, and the draft model is
the target's handle with `num_layers=k` (see spec_jax.models.llama.LlamaModel), which reads only the
first k layers of them.

Cache decision: the draft keeps its own cache of its k layers and maintains it exactly as
DraftModelDrafter does (rollback is a length; see draft_model.py). It does not copy the
target's first-k-layer K/V, although for committed tokens they are the same numbers (same
weights, same inputs): the protocol gives `commit` the RoundOutcome, not the target cache,
and reuse would save little. The draft must compute K/V for its own drafts anyway, and per
round it re-feeds only one committed token (the catch-up at L - 1); what reuse would save is
the k-layer prefill of the prompt and k/L of the target's cache memory. The larger saving of
the LayerSkip paper, letting verification start from the draft's layer-k activations, needs
the loop to accept them from the drafter: a change to the round, not to a drafter.
"""

from __future__ import annotations

import dataclasses
import math

from spec_jax.drafters.draft_model import DraftModelDrafter
from spec_jax.drafters.registry import BuildOptions, DrafterFamily, register

# Layers a layer-skip draft keeps by default, rounded up (and one fewer than the target's).
# Without early-exit training shallow exits predict poorly: on stories260K 2 of 5 layers
# accept 1% of drafts, 4 of 5 accept 30% (scripts/drafter_table.py).
DEFAULT_LAYER_FRACTION = 0.75


def truncated_model(target_model, num_layers: int):
  """The target's handle running only its first num_layers layers (then norm and head)."""
  total = target_model.config.n_layers
  if not 1 <= num_layers <= total:
    raise ValueError(f"layer-skip draft needs 1 <= num_layers <= {total} (the target's layers), "
                     f"got {num_layers}")
  return dataclasses.replace(target_model, num_layers=int(num_layers))


@dataclasses.dataclass(frozen=True)
class LayerSkipDrafter(DraftModelDrafter):
  """DraftModelDrafter over the target's first `num_layers` layers. draft_params: target params."""
  model: object = dataclasses.field(init=False, repr=False)  # derived from the two below
  target_model: object
  num_layers: int

  def __post_init__(self):
    object.__setattr__(self, "model", truncated_model(self.target_model, self.num_layers))


def default_num_layers(n_layers: int) -> int:
  return max(1, min(n_layers - 1, math.ceil(DEFAULT_LAYER_FRACTION * n_layers)))


def _build(target, target_params, opts: BuildOptions):
  k = default_num_layers(target.config.n_layers) if opts.num_layers is None else opts.num_layers
  return LayerSkipDrafter(target, k), target_params


register(DrafterFamily(name="layer_skip", summary="the target's first k layers, then its norm and "
                       "head (default k: 3/4 of its layers)", build=_build, combinable=True,
                       options=("num_layers",)))
