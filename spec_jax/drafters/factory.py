"""make_drafter: any registered drafter kind, built with its draft params, from the registry.

    drafter, draft_params = make_drafter("eagle", target, params, checkpoint="runs/eagle")
    out = speculate(target, params, drafter, draft_params, tokens, lengths, ...)

The kinds are `spec_jax.drafters.registry.kinds()`: every family, and "lookup+<model family>"
combinations. A trained family loads from a folder written by scripts/train_drafter.py
--export-dir (`checkpoint=`); a draft_model also loads from one. `tree=TreeOptions(...)`
asks for the family's token-tree drafter.
"""

from __future__ import annotations

import dataclasses

from spec_jax.core.errors import BadArgument
from spec_jax.drafters import registry
from spec_jax.drafters.files import load_drafter
from spec_jax.drafters.registry import BuildOptions, TreeOptions

__all__ = ["make_drafter", "TreeOptions"]


def _build(fam: registry.DrafterFamily, target_model, target_params, checkpoint,
           opts: BuildOptions):
  if opts.tree is not None and not fam.tree:
    raise ValueError(f"drafter {fam.name!r} has no tree variant; trees: "
                     f"{', '.join(registry.tree_kinds())}")
  if checkpoint is None and fam.build is not None:
    return fam.build(target_model, target_params, opts)
  if fam.trained is None:
    raise ValueError(f"drafter {fam.name!r} is not trained: it takes no checkpoint")
  if checkpoint is None:
    raise ValueError(f"drafter {fam.name!r} is trained: pass checkpoint=<folder written by "
                     "scripts/train_drafter.py --export-dir>")
  stored_kind, model, params = load_drafter(checkpoint, target_model, target_params)
  if stored_kind != fam.name:
    raise ValueError(f"{checkpoint} holds a {stored_kind} drafter, not {fam.name}")
  if opts.tree is None:
    return fam.trained.chain(model), params
  return fam.trained.tree(model, opts.tree), params


def make_drafter(kind: str, target_model, target_params, *, draft_model=None, draft_params=None,
                 checkpoint=None, tree: TreeOptions | None = None, num_layers: int | None = None,
                 max_ngram: int = 3, min_ngram: int | None = None):
  """-> (drafter, draft_params) for `speculate` (a chain, or a tree with `tree`).

  Options a kind does not use are ignored (command lines pass them uniformly).
  """
  for name, model in (("target_model", target_model), ("draft_model", draft_model)):
    if model is not None and not all(hasattr(model, a) for a in ("apply", "vocab_size")):
      raise BadArgument(f"{name} must be a model handle (load_model's first result), got "
                        f"{type(model).__name__}")
  fam, combined = registry.resolve(kind)
  if target_model is None and registry.model_family(kind).reads_target:
    raise BadArgument(f"drafter {kind!r} needs the target model (load_model's first result)")
  opts = BuildOptions(draft_model, draft_params, num_layers, max_ngram, min_ngram, tree)
  if combined is None:
    drafter, params = _build(fam, target_model, target_params, checkpoint, opts)
  else:
    if tree is not None:
      raise ValueError(f"drafter {kind!r} has no tree variant; trees: "
                       f"{', '.join(registry.tree_kinds())}")
    drafter, params = fam.combine(*_build(combined, target_model, target_params, checkpoint,
                                          dataclasses.replace(opts, tree=None)), opts)
  drafter.check_params(params)  # another model's params: named here, not deep in a trace
  return drafter, params
