"""The decoding loop, its configuration, stats and method factory."""

from .generator import GenerationConfig, GenerationResult, SpeculativeGenerator
from .methods import METHODS, MethodSpec, build_generator
from .stats import GenerationStats

__all__ = ["GenerationConfig", "GenerationResult", "SpeculativeGenerator", "GenerationStats", "METHODS",
           "MethodSpec", "build_generator"]
