"""speculant: exact speculative decoding (LayerSkip self-speculation, Recursive Speculative Decoding).

Public API::

    from speculant import load_model, build_generator, GenerationConfig, SamplingConfig
    model = load_model("smollm2-135m")
    gen = build_generator(model, method="early-exit", exit_layer=8, num_speculations=4)
    result = gen.generate("Write a haiku about autumn.", GenerationConfig(max_new_tokens=64))
    print(result.text, result.stats.block_efficiency)
"""

from .errors import SpeculantError

__version__ = "0.1.0"
__all__ = ["load_model", "build_generator", "MethodSpec", "SpeculativeGenerator", "GenerationConfig",
           "GenerationResult", "GenerationStats", "SamplingConfig", "SpeculantError"]

_LAZY = {"load_model": "runtime.loader", "SamplingConfig": "sampling",
         **{name: "engine" for name in ("build_generator", "MethodSpec", "SpeculativeGenerator", "GenerationConfig",
                                        "GenerationResult", "GenerationStats")}}


def __getattr__(name: str):
    """The public names, imported on first use (PEP 562), so that ``speculant --help`` and bad command lines answer
    without importing torch.

    Raises:
        AttributeError: ``name`` is not a public name of the package.
    """
    if name not in _LAZY:
        raise AttributeError(f"module 'speculant' has no attribute {name!r}")
    import importlib
    value = getattr(importlib.import_module(f".{_LAZY[name]}", __name__), name)
    globals()[name] = value
    return value
