"""Drafters: early-exit self-drafting (LayerSkip), a separate draft model, prompt lookup, a draft head (EAGLE)."""

from .base import DecodingState, Drafter, DrafterCapabilities, ModelDrafterBase
from .draft_model import DraftModelDrafter, truncated_copy
from .eagle import DraftHeadDrafter
from .early_exit import EarlyExitDrafter
from .prompt_lookup import PromptLookupDrafter

__all__ = ["DecodingState", "Drafter", "DrafterCapabilities", "ModelDrafterBase", "DraftModelDrafter", "truncated_copy",
           "DraftHeadDrafter", "EarlyExitDrafter", "PromptLookupDrafter"]
