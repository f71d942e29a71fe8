"""Acceptance rules as pure functions over draft trees and probability tensors."""

from .rules import greedy_accept, recursive_rejection_sampling, residual

__all__ = ["greedy_accept", "recursive_rejection_sampling", "residual"]
