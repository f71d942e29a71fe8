"""The decoding loop, its configuration, stats and method factory."""

from .names import METHODS

__all__ = ["GenerationConfig", "GenerationResult", "SpeculativeGenerator", "GenerationStats", "METHODS",
           "MethodSpec", "build_generator"]

_LAZY = {"GenerationConfig": "generator", "GenerationResult": "generator", "SpeculativeGenerator": "generator",
         "MethodSpec": "methods", "build_generator": "methods", "GenerationStats": "stats"}


def __getattr__(name: str):
    """The loop's names, imported on first use (PEP 562): the method names alone do not import torch.

    Raises:
        AttributeError: ``name`` is not a name of the package.
    """
    if name not in _LAZY:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    import importlib
    value = getattr(importlib.import_module(f".{_LAZY[name]}", __name__), name)
    globals()[name] = value
    return value
