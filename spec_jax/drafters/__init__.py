"""Drafters behind one protocol (see base.py)."""

from spec_jax.drafters.base import DraftContext, Drafter, PromptInfo, RoundOutcome
from spec_jax.drafters.combined import FallbackDrafter, ResyncDraftModelDrafter
from spec_jax.drafters.draft_model import DraftModelDrafter
from spec_jax.drafters.factory import make_drafter
from spec_jax.drafters.layer_skip import LayerSkipDrafter
from spec_jax.drafters.prompt_lookup import PromptLookupDrafter, found_match, ngram_lookup
from spec_jax.drafters.quantized import quantized_target_drafter

__all__ = ["DraftContext", "Drafter", "PromptInfo", "RoundOutcome", "DraftModelDrafter",
           "PromptLookupDrafter", "ngram_lookup", "found_match", "LayerSkipDrafter",
           "quantized_target_drafter", "FallbackDrafter", "ResyncDraftModelDrafter",
           "make_drafter"]
