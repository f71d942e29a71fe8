"""speculant: exact speculative decoding (LayerSkip self-speculation, Recursive Speculative Decoding).

Public API::

    from speculant import load_model, build_generator, GenerationConfig, SamplingConfig
    model = load_model("smollm2-135m")
    gen = build_generator(model, method="early-exit", exit_layer=8, num_speculations=4)
    result = gen.generate("Write a haiku about autumn.", GenerationConfig(max_new_tokens=64))
    print(result.text, result.stats.block_efficiency)
"""

from .engine import GenerationConfig, GenerationResult, GenerationStats, MethodSpec, SpeculativeGenerator, build_generator
from .errors import SpeculantError
from .runtime.loader import load_model
from .sampling import SamplingConfig

__version__ = "0.1.0"
__all__ = ["load_model", "build_generator", "MethodSpec", "SpeculativeGenerator", "GenerationConfig",
           "GenerationResult", "GenerationStats", "SamplingConfig", "SpeculantError"]
