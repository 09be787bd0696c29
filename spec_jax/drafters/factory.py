"""make_drafter: one place that builds each drafter kind with its draft params, for scripts.

Kinds:
  draft_model         a separate draft model (draft_model, draft_params required)
  prompt_lookup       n-gram lookup in the row's own tokens (no params)
  layer_skip          the target's first num_layers layers (default: 3/4 of them, rounded up)
  quantized           the target with int8 weights
  lookup+<model kind> prompt lookup where it finds a match, else that model (rows choose)
  medusa, eagle, mtp  trained drafters, loaded from a folder written by
                      scripts/train_drafter.py --export-dir (checkpoint=...); draft_model
                      also loads from such a folder when given checkpoint instead of a model

`tree=TreeOptions(depth, top_k, nodes)` asks for the kind's token-tree drafter (draft_model,
eagle, mtp: dynamic EAGLE-2-style trees; medusa: the static tree of the same budget, see
static_choices), generated with tree_speculative_generate.
"""

from __future__ import annotations

import dataclasses
import itertools
import math

from spec_jax.drafters.combined import FallbackDrafter, ResyncDraftModelDrafter
from spec_jax.drafters.draft_model import DraftModelDrafter
from spec_jax.drafters.draft_model_tree import DraftModelTreeDrafter
from spec_jax.drafters.eagle import EagleTreeDrafter
from spec_jax.drafters.medusa import MedusaTreeDrafter
from spec_jax.drafters.layer_skip import LayerSkipDrafter
from spec_jax.drafters.prompt_lookup import PromptLookupDrafter
from spec_jax.drafters.quantized import quantized_target_drafter

MODEL_KINDS = ("draft_model", "layer_skip", "quantized")
TRAINED_KINDS = ("medusa", "eagle", "mtp")
TREE_KINDS = ("draft_model", "medusa", "eagle", "mtp")
KINDS = (("prompt_lookup",) + MODEL_KINDS + tuple(f"lookup+{k}" for k in MODEL_KINDS)
         + TRAINED_KINDS)
# In a combination a unigram match (min_ngram 1) exists nearly always, and would shut the
# model out; two tokens of context are the least evidence that lookup is worth trusting.
FALLBACK_MIN_NGRAM = 2
# Layers a layer-skip draft keeps by default, rounded up (and one fewer than the target's).
# Without early-exit training shallow exits predict poorly: on stories260K 2 of 5 layers
# accept 1% of drafts, 4 of 5 accept 30% (scripts/drafter_table.py).
DEFAULT_LAYER_FRACTION = 0.75


@dataclasses.dataclass(frozen=True)
class TreeOptions:
  """A token tree's budget: `depth` levels, `top_k` children per expanded node, `nodes`
  nodes in all (root included)."""
  depth: int = 4
  top_k: int = 3
  nodes: int = 16

  @classmethod
  def parse(cls, text: str) -> "TreeOptions":
    """'depth,top_k,nodes', e.g. '4,3,16'."""
    try:
      depth, top_k, nodes = (int(x) for x in text.split(","))
    except ValueError:
      raise ValueError(f"a tree is 'depth,top_k,nodes' (e.g. 4,3,16), got {text!r}") from None
    return cls(depth, top_k, nodes)


def static_choices(tree: TreeOptions) -> tuple[tuple[int, ...], ...]:
  """A static (Medusa-style) tree of the same budget: the `nodes - 1` paths of ranks < top_k
  and length <= depth with the smallest rank sums (shorter first on ties), so every path's
  parent is in the tree before it."""
  paths = [p for d in range(1, tree.depth + 1)
           for p in itertools.product(range(tree.top_k), repeat=d)]
  paths.sort(key=lambda p: (sum(p), len(p), p))
  return tuple(paths[:tree.nodes - 1])


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


def _trained_drafter(kind: str, target_model, target_params, checkpoint, tree):
  from spec_jax.training.distill import load_drafter
  from spec_jax.drafters import eagle, medusa, mtp
  stored_kind, model, params = load_drafter(checkpoint, target_model, target_params)
  if stored_kind != kind:
    raise ValueError(f"{checkpoint} holds a {stored_kind} drafter, not {kind}")
  if tree is None:
    chain = {"draft_model": DraftModelDrafter, "medusa": medusa.MedusaDrafter,
             "eagle": eagle.EagleDrafter, "mtp": mtp.MTPDrafter}[kind]
    return chain(model), params
  if kind == "medusa":
    return MedusaTreeDrafter(model, static_choices(tree)), params
  dynamic = {"draft_model": DraftModelTreeDrafter, "eagle": EagleTreeDrafter,
             "mtp": mtp.MTPTreeDrafter}[kind]
  return dynamic(model, tree.depth, tree.top_k, tree.nodes), params


def make_drafter(kind: str, target_model, target_params, *, draft_model=None, draft_params=None,
                 checkpoint=None, tree: TreeOptions | None = None, num_layers: int | None = None,
                 max_ngram: int = 3, min_ngram: int | None = None):
  """-> (drafter, draft_params) for speculative_generate (tree_speculative_generate with `tree`).

  `min_ngram` defaults to 1 for prompt_lookup alone and FALLBACK_MIN_NGRAM in combinations.
  Options a kind does not use are ignored (the CLI passes them uniformly).
  """
  if kind not in KINDS:
    raise ValueError(f"unknown drafter kind {kind!r}; one of {', '.join(KINDS)}")
  if tree is not None and kind not in TREE_KINDS:
    raise ValueError(f"drafter {kind!r} has no tree variant; trees: {', '.join(TREE_KINDS)}")
  if kind in TRAINED_KINDS or (kind == "draft_model" and checkpoint is not None):
    if checkpoint is None:
      raise ValueError(f"drafter {kind!r} is trained: pass checkpoint=<folder written by "
                       "scripts/train_drafter.py --export-dir>")
    return _trained_drafter(kind, target_model, target_params, checkpoint, tree)
  if tree is not None:  # an in-memory draft model
    if draft_model is None or draft_params is None:
      raise ValueError("drafter 'draft_model' needs draft_model and draft_params")
    return DraftModelTreeDrafter(draft_model, tree.depth, tree.top_k, tree.nodes), draft_params
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
