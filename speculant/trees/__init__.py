"""Draft trees and the builders that grow them (chain, RSD-C, RSD-S, SpecInfer i.i.d.)."""

from .builders import ChainBuilder, ConstantBranchingBuilder, IIDTreeBuilder, StochasticBeamBuilder, TreeBuilder
from .tree import DraftTree

__all__ = ["DraftTree", "TreeBuilder", "ChainBuilder", "ConstantBranchingBuilder", "IIDTreeBuilder",
           "StochasticBeamBuilder"]
