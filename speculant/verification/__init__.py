"""Acceptance rules as pure functions over draft trees and probability tensors."""

from .rules import greedy_accept, recursive_rejection_sampling, residual
from .sequence import (VERIFICATIONS, block_verification, sampling_accept, sequence_residual,
                       traversal_verification)

__all__ = ["greedy_accept", "recursive_rejection_sampling", "residual", "block_verification",
           "traversal_verification", "sequence_residual", "sampling_accept", "VERIFICATIONS"]
