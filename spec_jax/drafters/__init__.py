"""Drafters behind one protocol (see base.py).

Chain drafters propose `gamma` tokens (speculative_generate); tree drafters propose a token
tree (tree_speculative.tree_speculative_generate). The synthetic drafter (synthetic.py) is
for engine benchmarks only and is deliberately not exported here.
"""

from spec_jax.drafters.base import DraftContext, Drafter, PromptInfo, RoundOutcome, TreeDrafter
from spec_jax.drafters.combined import FallbackDrafter, ResyncDraftModelDrafter
from spec_jax.drafters.draft_model import DraftModelDrafter
from spec_jax.drafters.draft_model_tree import DraftModelTreeDrafter
from spec_jax.drafters.eagle import EagleDrafter, EagleTreeDrafter
from spec_jax.drafters.factory import make_drafter
from spec_jax.drafters.layer_skip import LayerSkipDrafter
from spec_jax.drafters.medusa import MedusaDrafter, MedusaTreeDrafter
from spec_jax.drafters.mtp import MTPDrafter, MTPTreeDrafter
from spec_jax.drafters.prompt_lookup import PromptLookupDrafter, found_match, ngram_lookup
from spec_jax.drafters.quantized import quantized_target_drafter

__all__ = ["DraftContext", "Drafter", "TreeDrafter", "PromptInfo", "RoundOutcome",
           "DraftModelDrafter", "DraftModelTreeDrafter", "PromptLookupDrafter", "ngram_lookup",
           "found_match", "LayerSkipDrafter", "quantized_target_drafter", "FallbackDrafter",
           "ResyncDraftModelDrafter", "MedusaDrafter", "MedusaTreeDrafter", "EagleDrafter",
           "EagleTreeDrafter", "MTPDrafter", "MTPTreeDrafter", "make_drafter"]
