"""Drafters behind one protocol (base.py), one file per family, registered (registry.py).

Chain drafters propose `gamma` tokens a round; tree drafters propose a token tree; both run
through `spec_jax.speculate`. The synthetic drafter (synthetic.py) is for engine benchmarks
only and is deliberately not registered or exported here.

A new family: its own file ending in `register(DrafterFamily(...))`, plus one import line
below. Nothing else in the library or the scripts names it.
"""

# the families, in the order the command lines list them (one line each)
from spec_jax.drafters import prompt_lookup, draft_model, layer_skip, quantized, combined  # noqa: F401,E501
from spec_jax.drafters import medusa, eagle, mtp  # noqa: F401
from spec_jax.drafters import dflash, dspark  # noqa: F401

from spec_jax.drafters.base import DraftContext, Drafter, PromptInfo, RoundOutcome, TreeDrafter
from spec_jax.drafters.combined import FallbackDrafter, ResyncDraftModelDrafter
from spec_jax.drafters.draft_model import DraftModelDrafter
from spec_jax.drafters.draft_model_tree import DraftModelTreeDrafter
from spec_jax.drafters.eagle import EagleDrafter, EagleTreeDrafter
from spec_jax.drafters.factory import make_drafter
from spec_jax.drafters.files import export_drafter, load_drafter, read_drafter
from spec_jax.drafters.layer_skip import LayerSkipDrafter
from spec_jax.drafters.medusa import MedusaDrafter, MedusaTreeDrafter
from spec_jax.drafters.mtp import MTPDrafter, MTPTreeDrafter
from spec_jax.drafters.prompt_lookup import PromptLookupDrafter, found_match, ngram_lookup
from spec_jax.drafters.quantized import quantized_target_drafter
from spec_jax.drafters.registry import (BuildOptions, DrafterFamily, DrafterSizes, Trained,
                                        TreeOptions, families, kinds, register, trained_kinds,
                                        tree_kinds)

__all__ = ["DraftContext", "Drafter", "TreeDrafter", "PromptInfo", "RoundOutcome",
           "DraftModelDrafter", "DraftModelTreeDrafter", "PromptLookupDrafter", "ngram_lookup",
           "found_match", "LayerSkipDrafter", "quantized_target_drafter", "FallbackDrafter",
           "ResyncDraftModelDrafter", "MedusaDrafter", "MedusaTreeDrafter", "EagleDrafter",
           "EagleTreeDrafter", "MTPDrafter", "MTPTreeDrafter", "make_drafter", "export_drafter",
           "load_drafter", "read_drafter", "BuildOptions", "DrafterFamily", "DrafterSizes",
           "Trained", "TreeOptions", "families", "kinds", "register", "trained_kinds",
           "tree_kinds"]
