"""Logits processing and sampling helpers (temperature, top-k, top-p, Gumbel tricks)."""

from .gumbel import gumbel_like, gumbel_top_k, sample_without_replacement, truncated_gumbel, truncated_gumbel_below
from .processors import SamplingConfig, logits_to_probs

__all__ = ["SamplingConfig", "logits_to_probs", "gumbel_like", "gumbel_top_k", "truncated_gumbel",
           "sample_without_replacement", "truncated_gumbel_below"]
