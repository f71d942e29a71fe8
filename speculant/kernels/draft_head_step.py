"""An EAGLE draft head's forward as one C call (``spec_draft_head`` in ``decode_step.c``).

Li et al. 2024, "EAGLE", Sec. 3 (:mod:`speculant.drafters.draft_head` has the torch module): per row,
``x = fc([embed(token); feature])`` (a projection with bias), ``f^ = layer(x)`` (one Llama decoder layer without its
input RMSNorm), ``logits = W_sub (out_norm(f^))`` (the target's LM-head rows of the draft vocabulary; ``out_norm`` for a
pre-norm head only).  Done from Python, that is six w8a8 products, RMSNorm, RoPE and attention glue and a torch call
per step: ~1.4 ms a draft on SmolLM2 (issue 25), most of it call path.  Here it is the fused step's own C code
(:mod:`speculant.kernels.decode_step`: the same projections, RoPE, attention and MLP, the layer's input norm absent),
with the embedding gather, ``fc``, the out norm and the LM-head rows around it, in one call.

Each row is computed on its own with a fixed order of operations (as in the fused step), so a row's features and
logits do not depend on how many rows share the call.  They match the torch head's within rounding (the torch
RMSNorm and RoPE round differently; ``tests/test_draft_head_fused.py``).  This module knows no torch modules: the
drafter hands it plain buffers (:class:`DraftHeadBuffers`).
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass

import torch

from . import attention as attention_kernel
from .decode_step import FusedLayers, ModelBuffers, ProjectionBuffers, why_not


@dataclass(frozen=True)
class DraftHeadBuffers:
    """What :class:`FusedDraftHead` runs.

    Attributes:
        layer: the head's decoder layer as a one-layer :class:`~speculant.kernels.decode_step.ModelBuffers` (its
            ``input_norm`` ``None``; its own RoPE tables ``[P, Dh]``).
        fc: the projection ``[2D] -> [D]`` with its bias, input ``[embed(token); feature]``.
        lm_head: the LM-head rows of the draft vocabulary, ``[D] -> [V']`` (no bias).
        embed: the target's token embedding ``[V, D]`` float32.
        out_norm: the out RMSNorm scale ``[D]`` float32 of a pre-norm head, else ``None``; ``out_eps`` its epsilon.
    """

    layer: ModelBuffers
    fc: ProjectionBuffers
    lm_head: ProjectionBuffers
    embed: torch.Tensor
    out_norm: torch.Tensor | None = None
    out_eps: float = 1e-6


def why_not_head(head: DraftHeadBuffers, cache_dtype: torch.dtype) -> str | None:
    """Why :class:`FusedDraftHead` cannot run ``head`` over a KV cache of ``cache_dtype``, or ``None``."""
    reason = why_not(head.layer, cache_dtype)
    if reason is not None:
        return reason
    d = head.layer.hidden
    if len(head.layer.layers) != 1 or head.layer.layers[0].input_norm is not None:
        return "needs one decoder layer without its input norm"
    if head.fc.in_features != 2 * d or head.fc.out_features != d or head.lm_head.in_features != d:
        return (f"needs fc [{2 * d}] -> [{d}] and LM-head rows on [{d}]; got fc [{head.fc.in_features}] -> "
                f"[{head.fc.out_features}], LM head on [{head.lm_head.in_features}]")
    if head.lm_head.bias is not None:
        return "needs LM-head rows without bias"
    if any(not (t.is_contiguous() and t.device.type == "cpu") for t in head.fc.tensors() + head.lm_head.tensors()):
        return "needs fc and LM-head buffers that are contiguous CPU tensors"
    tensors = [head.embed] + ([head.out_norm] if head.out_norm is not None else [])
    if any(t.dtype != torch.float32 or not t.is_contiguous() or t.device.type != "cpu" for t in tensors):
        return "needs a float32 contiguous CPU embedding and out norm"
    if head.embed.dim() != 2 or head.embed.shape[1] != d:
        return f"needs an embedding [V, {d}], got {tuple(head.embed.shape)}"
    return None


class FusedDraftHead:
    """An EAGLE draft head's forward (:class:`DraftHeadBuffers`) as one C call per frontier.

    It holds pointers into the buffers' tensors (and keeps them alive): build it after the head is packed.

    Raises:
        SpeculantError: the kernels cannot run here.
        ValueError: the head cannot run this way over a ``cache_dtype`` cache (:func:`why_not_head` says why).
    """

    def __init__(self, head: DraftHeadBuffers, cache_dtype: torch.dtype = torch.float32, weight_prefetch: int = 0):
        reason = why_not_head(head, cache_dtype)
        if reason is not None:
            raise ValueError(f"fused draft head: {reason}")
        self.layer = FusedLayers(head.layer, cache_dtype, weight_prefetch)
        self.lib = self.layer.lib
        self.buffers = head
        self._keep: list = []
        self._fc = head.fc.struct(self._keep)
        self._lm = head.lm_head.struct(self._keep)
        self.hidden = head.layer.hidden
        self.vocab_out = head.lm_head.out_features

    def forward(self, features: torch.Tensor, tokens: torch.Tensor, positions: torch.Tensor, cache,
                cache_position: int, mask: torch.Tensor | None = None,
                logit_rows: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Rows ``features`` ``[R, D]`` (float32) and ``tokens`` ``[R]`` (int64) at RoPE ``positions`` ``[R]``, new
        keys/values to slots ``cache_position ..`` of ``cache`` (a float32/float16
        :class:`~speculant.models.kv_cache.KVCache` of one layer), attending where ``mask`` ``[R, cache_position + R]``
        (bool) is True, or causally (``None``); logits of the last ``logit_rows`` rows only (``None``: all).

        Returns:
            ``(predicted features [R, D], draft-vocabulary logits [L, V'])``, both float32 (``L = logit_rows``).
        Raises:
            IndexError: a position outside the RoPE tables or a token outside the embedding.
            ValueError: the rows would write past the cache's ``max_length``.
            MemoryError: a workspace cannot be allocated.
        """
        r = features.shape[0]
        lr = r if logit_rows is None else logit_rows
        if not 0 <= lr <= r:
            raise ValueError(f"fused draft head: logit_rows={logit_rows}; allowed: 0 .. {r}")
        if cache_position + r > cache.max_length:
            raise ValueError(f"fused draft head: slots {cache_position}..{cache_position + r - 1}; allowed: "
                             f"below max_length={cache.max_length}")
        x = features if features.dtype == torch.float32 and features.is_contiguous() else features.float().contiguous()
        tokens = tokens.to(torch.int64).contiguous()
        positions = positions.to(torch.int64).contiguous()
        if mask is not None:
            mask = mask.contiguous()
        out, logits = torch.empty(r, self.hidden), torch.empty(lr, self.vocab_out)
        b, (cos, sin) = self.buffers, self.layer._rope
        status = self.lib.spec_draft_head(
            ctypes.byref(self.layer.model), ctypes.byref(self._fc), ctypes.byref(self._lm),
            None if b.out_norm is None else b.out_norm.data_ptr(), b.out_eps, r, tokens.data_ptr(), b.embed.data_ptr(),
            b.embed.shape[0], x.data_ptr(), cache_position, cache.max_length, cache.keys.data_ptr(),
            cache.values.data_ptr(), cache.keys.stride(0), attention_kernel.kv_bytes(cache.dtype),
            None if mask is None else mask.data_ptr(), cos.data_ptr(), sin.data_ptr(), cos.shape[0],
            positions.data_ptr(), lr, out.data_ptr(), logits.data_ptr())
        if status in (-2, -5):
            raise IndexError(f"fused draft head: positions {positions.tolist()} (allowed: 0 .. {cos.shape[0] - 1}) or "
                             f"tokens {tokens.tolist()} (allowed: 0 .. {b.embed.shape[0] - 1}) out of range")
        if status != 0:
            raise MemoryError("fused draft head: cannot allocate its workspace")
        return out, logits
