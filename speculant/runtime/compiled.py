"""Compiled decoding steps: the decoder layer's two halves through ``torch.compile`` (inductor).

A SmolLM2 decoding step is ~30 layers x ~30 small torch calls; in eager mode their dispatch costs about
as much as the projections themselves.  :func:`enable_compile` compiles the two halves of a decoder layer
around attention (:func:`~speculant.models.llama.attention_inputs`: norm, q/k/v projection, RoPE;
:func:`~speculant.models.llama.layer_output`: output projection, residual, norm, MLP) into fused C++
kernels.  One compiled graph serves every layer (the layer's tensors are graph inputs), every exit
layer range (early-exit drafting, verification from layer E), and every block size: one graph for one
token, one with a dynamic token count for verification blocks and tree frontiers (2-16 rows and more).
Attention and the KV cache update stay outside the graphs (they depend on the cache and the tree mask).

Compiled artifacts are cached on disk by inductor's FX graph cache under ``$SPECULANT_CACHE/inductor``
(unless ``TORCHINDUCTOR_CACHE_DIR`` is set), so later loads skip the C++ compilation.  Without a C++
compiler the model stays eager, with one warning.  ``w4a8`` models need none of this: their layers run as one
call into our kernels (:mod:`speculant.kernels.decode_step`).  Sources: gpt-fast (torch.compile of a decoder step);
PyTorch's inductor CPU backend.
"""

from __future__ import annotations

import os
import shutil
import sys
import time
import warnings

import torch

from .steps import decoder_layer_step

_COMPILED: dict[str, object] = {}
_USER_CACHE_DIR = os.environ.get("TORCHINDUCTOR_CACHE_DIR")   # read before torch may set its default


def compiler_available() -> bool:
    """Whether a C++ compiler inductor can use is on ``PATH`` (``$CXX``, ``c++``, ``g++`` or ``clang++``)."""
    names = [os.environ.get("CXX")] if os.environ.get("CXX") else []
    return any(shutil.which(n) for n in names + ["c++", "g++", "clang++"])


def inductor_cache_dir() -> str:
    """Where compiled kernels are cached: ``$TORCHINDUCTOR_CACHE_DIR`` as set by the user, else
    ``$SPECULANT_CACHE/inductor``."""
    from ..models.loading import cache_root
    return _USER_CACHE_DIR or str(cache_root() / "inductor")


def _compiled_step(key: str):
    """The compiled :func:`~speculant.runtime.steps.decoder_layer_step` for one model-shape/format signature ``key``."""
    if key not in _COMPILED:
        import torch._dynamo
        torch._dynamo.config.cache_size_limit = max(torch._dynamo.config.cache_size_limit, 64)
        _COMPILED[key] = torch.compile(decoder_layer_step, dynamic=None)
    return _COMPILED[key]


def compiled_halves(executor):
    """The two halves of a decoder layer around attention, each compiled on its own (for the ragged
    multi-sequence forward, :func:`speculant.runtime.ragged.ragged_run_layers`, whose attention runs per
    sequence between them): ``(attention_inputs, layer_output)``, eager ones when ``executor``'s steps are not
    compiled."""
    from ..models.llama import attention_inputs, layer_output
    if executor.layer_step is decoder_layer_step:
        return attention_inputs, layer_output
    key = f"{executor.config}|{executor.weight_format}|halves"
    if key not in _COMPILED:
        _COMPILED[key] = (torch.compile(attention_inputs, dynamic=None), torch.compile(layer_output, dynamic=None))
    return _COMPILED[key]


def enable_compile(executor, warm_up: bool = True, log=None, blocks: bool = True) -> bool:
    """Route the layers of ``executor`` (a :class:`~speculant.runtime.executor.Executor`) through compiled graphs; returns False (eager, one warning) without a C++ compiler.

    ``warm_up`` compiles the one-token graph now, and the multi-token graph too when ``blocks`` (printing
    progress to ``log``, default stderr), instead of at the first generation.  Autoregressive decoding never
    runs a multi-token block (prefills are eager), so ``blocks=False`` saves it the second graph's load.
    """
    if not compiler_available():
        warnings.warn("no C++ compiler found (c++/g++/clang++): running the decoder eagerly, without "
                      "torch.compile (install g++ for the compiled runtime)", RuntimeWarning, stacklevel=2)
        return False
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = inductor_cache_dir()
    decoder = executor.decoder
    key = f"{decoder.config}|{decoder.weight_format}|" + ",".join(sorted({type(m).__name__ for m in decoder.layers.modules()}))
    executor.layer_step = _compiled_step(key)
    executor.halves = compiled_halves(executor)
    if warm_up:
        warm_up_compiled(executor, log, blocks)
    return True


def warm_up_compiled(executor, log=None, blocks: bool = True) -> float:
    """Run the compiled layer step once per graph (one token; a multi-token block when ``blocks``).

    Returns the seconds it took (compilation, or loading cached kernels).
    """
    log = log or sys.stderr
    t0 = time.perf_counter()
    hidden = executor.config.hidden_size
    cache = executor.new_cache(16)
    with torch.inference_mode():
        graphs = ((1, 3, "one-token step"), (3, 4, "verification blocks (2+ tokens)"))
        for t, start, label in graphs if blocks else graphs[:1]:
            print(f"speculant: compiling the {label} ...", file=log, flush=True)
            executor.run_layers(torch.zeros(1, t, hidden), 0, 1, torch.arange(start, start + t), None, cache, start)
    seconds = time.perf_counter() - t0
    print(f"speculant: compiled steps ready in {seconds:.1f} s (cache: {os.environ.get('TORCHINDUCTOR_CACHE_DIR')})",
          file=log, flush=True)
    return seconds
