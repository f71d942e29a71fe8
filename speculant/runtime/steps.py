"""The torch layer steps the executor runs (:mod:`speculant.runtime.executor`): the model's layer halves
(:func:`~speculant.models.llama.attention_inputs`, :func:`~speculant.models.llama.layer_output`) around attention
through our batch-invariant kernel (:mod:`speculant.kernels.attention`) where it runs, SDPA elsewhere.

The semantics are the model's (the halves are called, not rewritten); what this module adds is where the KV cache
is written and which attention computes the rows, so that a row of a verification block or tree gets the bits
of the one-token step at its position.  :func:`decoder_layer_step` is what :mod:`speculant.runtime.compiled`
compiles.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ..errors import SpeculantError
from ..kernels import attention as attention_kernel
from ..models.kv_cache import KVCache
from ..models.llama import DecoderLayer, attention_inputs, dense_mask, layer_output

COMPILED_MAX_ROWS = 64
"""Forwards of more tokens run the eager layer step (as prefills do): they are compute-bound, and every
compiled graph fewer shortens loading."""


def decoder_layer_step(layer: DecoderLayer, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                       mask: torch.Tensor, slots: torch.Tensor, keys: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
    """One decoder layer over ``x`` ``[1, T, D]`` with a static KV cache (one sequence: decoding and verification).

    ``keys``/``values`` ``[1, Hkv, S_max, Dh]`` are the layer's cache; ``mask`` bool ``[T, S]`` says which of
    the first ``S`` slots each row attends (True = may attend); the new keys/values go to ``slots``
    ``[T]`` (``S - T .. S - 1``).  Attention runs in the cache's dtype (see :func:`attend`): a float32 cache through
    our row-by-row kernel (:mod:`speculant.kernels.attention`), a float64 one through SDPA.  Everything here is
    traceable by ``torch.compile`` with ``T`` and ``S`` dynamic.
    """
    q, k, v = attention_inputs(layer, x, cos, sin)
    keys.index_copy_(2, slots, k.to(keys.dtype))
    values.index_copy_(2, slots, v.to(values.dtype))
    return layer_output(layer, x, cache_attention(q, keys, values, mask).to(x.dtype))


def cache_attention(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Attention of one sequence's rows ``q`` ``[1, H, T, Dh]`` over the first ``S`` slots of one layer's cache
    ``keys``/``values`` ``[1, Hkv, S_max, Dh]`` where ``mask`` ``[T, S]`` (bool) is True -> ``[1, T, H * Dh]`` in the
    cache's dtype: a float32 cache through our row-by-row kernel (:mod:`speculant.kernels.attention`), a float64
    one through SDPA (see :attr:`speculant.runtime.executor.Executor.kv_dtype`); a float16 one through our kernel too (its keys and
    values read back as float32, every sum in float32).  Traceable by ``torch.compile``."""
    if keys.dtype in attention_kernel.CACHE_DTYPES:
        return torch.ops.speculant.attention(q, keys, values, mask, q.shape[-1] ** -0.5)
    visible = mask.shape[-1]
    out = F.scaled_dot_product_attention(q.to(keys.dtype), keys[:, :, :visible], values[:, :, :visible],
                                         attn_mask=mask, enable_gqa=True)
    return out.transpose(1, 2).reshape(1, q.shape[2], -1)


def prefill_layer_step(layer: DecoderLayer, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                       keys: torch.Tensor, values: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
    """One decoder layer over a whole prompt ``x`` ``[1, T, D]`` into an empty static KV cache (slots ``0 .. T-1``).

    Attention is causal over the prompt itself and runs in float32 (``is_causal``: the flash kernel skips the
    masked half), whatever the cache's dtype (:func:`decoder_layer_step` attends in it): a prompt's forward is the same call for every
    method and is never compared with a one-token step, so its rows need no batch invariance, and float64
    attention over an 800-token prompt took 1.6 s of SmolLM2's 4.7 s prefill on a 2-core AVX2 CPU.  The keys and
    values are stored in the cache's dtype (float32 -> float64 is exact).  ``mask`` bool ``[T, T]`` (True = may
    attend) replaces the causal one where given (a sliding-window layer's, Gemma 3).
    """
    t = x.shape[1]
    q, k, v = attention_inputs(layer, x, cos, sin)
    keys[:, :, :t] = k
    values[:, :, :t] = v
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=mask is None, enable_gqa=True)
    return layer_output(layer, x, out.transpose(1, 2).reshape(1, t, -1))


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None, is_causal: bool,
           cache: KVCache | None, layer: int, cache_position: int) -> torch.Tensor:
    """Scaled dot-product attention over the KV cache (new keys/values written at ``cache_position``).

    Computed in the cache's dtype: a float32 cache (one sequence, where our kernels run) through our row-by-row
    kernel, a float64 one through SDPA; either makes each row's result independent of how many rows share the call (batch invariance;
    see :attr:`speculant.runtime.executor.Executor.kv_dtype`).  ``q`` ``[B, H, T, Dh]`` -> ``[B, T, H * Dh]`` in ``q``'s dtype.
    """
    dtype = q.dtype
    if cache is not None:
        if q.shape[0] == 1 and attention_kernel.supports(q.shape[-1], cache.dtype):
            cache.write(layer, k, v, cache_position)       # in the cache's dtype (float16: rounded to nearest even)
            mask = dense_mask(mask, q.shape[2], cache_position, q.device)
            return cache_attention(q.float(), cache.layer_keys[layer], cache.layer_values[layer], mask).to(dtype)
        if cache.dtype == torch.float16:
            raise SpeculantError(f"a float16 KV cache is read by our attention kernel only (one sequence per call, "
                                 f"head size a multiple of 8); got batch {q.shape[0]}, head size {q.shape[-1]}; "
                                 "allowed here: a float32 or float64 cache")
        q, k, v = q.to(cache.dtype), k.to(cache.dtype), v.to(cache.dtype)
        k, v = cache.write(layer, k, v, cache_position)
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=is_causal, enable_gqa=True)
    b, h, t, d = out.shape
    return out.to(dtype).transpose(1, 2).reshape(b, t, h * d)
