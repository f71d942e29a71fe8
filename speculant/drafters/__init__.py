"""Drafters: early-exit self-drafting (LayerSkip), a separate draft model, prompt lookup."""

from .base import DecodingState, Drafter, ModelDrafterBase
from .draft_model import DraftModelDrafter, truncated_copy
from .early_exit import EarlyExitDrafter
from .prompt_lookup import PromptLookupDrafter

__all__ = ["DecodingState", "Drafter", "ModelDrafterBase", "DraftModelDrafter", "truncated_copy",
           "EarlyExitDrafter", "PromptLookupDrafter"]
