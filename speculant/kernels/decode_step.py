"""A Llama-family model's decoder layers as one C call per forward (``decode_step.c``), on ``w4a8`` weights.

Why (measured, ``python benchmarks/step_breakdown.py``, 2-core AMD EPYC with AVX2, 2026-12-01): a one-token
SmolLM2 forward over ``torch.compile``'d layers took 13.40 ms, 11.59 ms of it in the 30 layers, against 4.38 ms for
the same layers and kernels here (6.57 ms for the forward): ~240 us per layer went to the compiled layers' call
path (guards, wrappers, one dispatcher call per kernel).
:class:`FusedLayers` runs the same layers (RMSNorm, fused q/k/v projection, RoPE, KV-cache write, attention,
output projection, residual, RMSNorm, SwiGLU MLP, residual; Touvron et al. 2023; Qwen3's per-head q/k RMSNorm
before RoPE where the model has it; Gemma 3's sandwich norms, GeGLU, ``query_pre_attn_scalar`` and sliding-window
layers with their own RoPE base, Gemma Team 2025) as one call into our kernels
(:mod:`speculant.kernels.qgemm`'s products, :mod:`speculant.kernels.attention`'s rows), with no torch.compile
to trace or load.

Every row is computed on its own with a fixed sequence of operations, so a row's result does not depend on how
many rows or sequences share the call: verification blocks, tree frontiers and batched rounds give each row the
one-token step's bits (tested in ``tests/test_decode_step.py``).  Prompts (an empty cache) run here under a causal
mask up to the executor's ``fused_prompt_tokens`` (:mod:`speculant.runtime.executor`, measured per machine by
:func:`speculant.runtime.tune.measure_prompt_route`; each prompt row then gets the bits of a one-token step, and a
server's new prompts can share one call), longer ones through the torch path, the same for every method.
This module knows no torch modules: the executor hands it plain buffers and shapes (:class:`ModelBuffers`).

One sequence's forward (:meth:`FusedLayers.step`) also gathers its RoPE rows and builds its causal mask in C, and
the final norm and LM head are one call each (:meth:`FusedLayers.final_norm`, :meth:`FusedLayers.lm_head`): after
a step's ~100 MB weight stream has flushed the CPU caches, each torch call costs 20-300 us (its code and data
fetched again), ~1.2 ms of a 9 ms one-token step on the 2-core AMD EPYC before (BENCHMARKS.md X).
"""

from __future__ import annotations

import ctypes
from collections.abc import Callable
from dataclasses import dataclass

import torch

from . import attention as attention_kernel
from . import build

_i64, _ptr, _f32 = ctypes.c_int64, ctypes.c_void_p, ctypes.c_float


class _Projection(ctypes.Structure):
    pass


_Projection._fields_ = [("bits", _i64), ("in_features", _i64), ("out_features", _i64), ("codes", _ptr),
                        ("scales", _ptr), ("offsets", _ptr), ("bias", _ptr), ("scale_bytes", _i64), ("group", _i64),
                        ("parts", ctypes.POINTER(_Projection)), ("nparts", _i64)]


class _Layer(ctypes.Structure):
    _fields_ = [("input_norm", _ptr), ("post_norm", _ptr), ("qkv", _Projection), ("o", _Projection),
                ("gate_up", _Projection), ("down", _Projection), ("q_norm", _ptr), ("k_norm", _ptr),
                ("attn_out_norm", _ptr), ("mlp_out_norm", _ptr), ("local", _i64)]


class _Model(ctypes.Structure):
    _fields_ = [("hidden", _i64), ("heads", _i64), ("kv_heads", _i64), ("head_dim", _i64), ("intermediate", _i64),
                ("eps", _f32), ("scale", _f32), ("layers", ctypes.POINTER(_Layer)), ("weight_prefetch", _i64),
                ("gelu", _i64), ("window", _i64), ("q_scale", _f32)]

ACTIVATIONS = ("silu", "gelu_tanh")
"""The MLP gate activations the fused step runs: SwiGLU's ``silu`` and GeGLU's ``gelu_tanh`` (gelu with the tanh
approximation, transformers' ``gelu_pytorch_tanh``)."""


@dataclass(frozen=True)
class ProjectionBuffers:
    """One block-quantized projection as the C step reads it (W4A8: ``bits`` 4, codes + scales + offsets; W8A8:
    ``bits`` 8, codes + scales [+ offsets]; Q6_K in 6 bits, :class:`~speculant.runtime.formats.W6A8Linear`: ``bits``
    6, codes + int8 scales + its float32 super-block scales as ``offsets``; Q5_0 in 5 bits,
    :class:`~speculant.runtime.formats.W5A8Linear`: ``bits`` 5, codes + float16 scales), every tensor contiguous on the
    CPU; ``bias`` ``[out_features]`` float32 or None.  The scales' dtype says the layout (float16: Q4_0/Q4_1/Q8_0; float32: ``qgemm.c``'s K layouts,
    ``scale_group`` inputs per scale, 32 or 16).  A stacked projection has ``parts`` (its output columns in order;
    ``bits`` 0, no codes of its own) and at most a bias."""

    bits: int
    in_features: int
    out_features: int
    codes: torch.Tensor | None
    scales: torch.Tensor | None
    offsets: torch.Tensor | None = None
    bias: torch.Tensor | None = None
    scale_group: int = 32
    parts: tuple["ProjectionBuffers", ...] = ()

    def tensors(self) -> list[torch.Tensor]:
        own = [t for t in (self.codes, self.scales, self.offsets, self.bias) if t is not None]
        return own + [t for p in self.parts for t in p.tensors()]

    def struct(self, keep: list) -> _Projection:
        """The C struct; ``keep`` receives what must outlive it (a stack's array of parts)."""
        parts = None
        if self.parts:
            parts = (_Projection * len(self.parts))(*(p.struct(keep) for p in self.parts))
            keep.append(parts)
        ptr = lambda t: 0 if t is None else t.data_ptr()           # noqa: E731
        return _Projection(self.bits, self.in_features, self.out_features, ptr(self.codes), ptr(self.scales),
                           ptr(self.offsets), ptr(self.bias),
                           0 if self.scales is None else self.scales.element_size(),
                           self.scale_group, parts, len(self.parts))


@dataclass(frozen=True)
class LayerBuffers:
    """One decoder layer's buffers: the two RMSNorm scales ``[D]`` float32 (``input_norm`` before attention, ``None``
    for a layer without it: an EAGLE draft head's, :class:`FusedDraftHead`; ``post_norm`` before the MLP), the four projections, the per-head q/k RMSNorm scales ``[Dh]`` float32 of a model
    that has them (Qwen3, Gemma 3; applied after the q/k/v projection, before RoPE) or ``None``, Gemma 3's sandwich
    norms' scales ``[D]`` float32 (``attn_out_norm`` on the attention's output projection, ``mlp_out_norm`` on the
    MLP's output, each before its residual add) or ``None``, and ``local``: a sliding-window layer (its own RoPE
    tables and windowed masks).  Every scale is the one multiplied in (Gemma's ``1 + weight``, not its weight)."""

    input_norm: torch.Tensor | None
    post_norm: torch.Tensor
    qkv: ProjectionBuffers
    o: ProjectionBuffers
    gate_up: ProjectionBuffers
    down: ProjectionBuffers
    q_norm: torch.Tensor | None = None
    k_norm: torch.Tensor | None = None
    attn_out_norm: torch.Tensor | None = None
    mlp_out_norm: torch.Tensor | None = None
    local: bool = False


@dataclass(frozen=True)
class ModelBuffers:
    """What :class:`FusedLayers` runs: the shapes of a Llama-family decoder and its buffers.

    Attributes:
        hidden, heads, kv_heads, head_dim, intermediate: sizes (``D``, ``H``, ``Hkv``, ``Dh``, MLP width).
        eps: RMSNorm epsilon.
        layers: per-layer buffers, layer 0 first.
        rope_cos, rope_sin: RoPE tables ``[P, Dh]`` float32 (``sin`` signed, see the torch reference forward).
        norm: the final RMSNorm weight ``[D]`` float32; ``norm_eps`` its epsilon.
        head: the LM head's projection (no bias), or ``None`` where the torch head runs.
        activation: the MLP's gate activation, one of :data:`ACTIVATIONS`.
        q_scale: q is multiplied by it after RoPE (Gemma 3: ``(Dh / query_pre_attn_scalar) ** 0.5``; the softmax
            scale stays ``Dh ** -0.5``).
        window: the local layers' sliding window [tokens]: a row at position ``p`` attends the cache slots
            ``> p - window`` its mask allows (0 where no layer is local).
        rope_cos_local, rope_sin_local: the local layers' RoPE tables, the shape of ``rope_cos`` (``None`` where no
            layer is local).
        rope_filled: ``rope_filled()`` = the tables' rows computed so far (a decoder computes them as positions come
            into use, :meth:`~speculant.models.llama.LlamaDecoder.ensure_rope`); a position at or past it is refused
            as one outside the tables.  ``None``: every row is computed.
    """

    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    eps: float
    layers: list[LayerBuffers]
    rope_cos: torch.Tensor
    rope_sin: torch.Tensor
    norm: torch.Tensor
    norm_eps: float
    head: ProjectionBuffers | None = None
    activation: str = "silu"
    q_scale: float = 1.0
    window: int = 0
    rope_cos_local: torch.Tensor | None = None
    rope_sin_local: torch.Tensor | None = None
    rope_filled: Callable[[], int] | None = None

    @property
    def has_local(self) -> bool:
        """Whether some layer is a sliding-window one."""
        return any(layer.local for layer in self.layers)


def why_not(model: ModelBuffers, cache_dtype: torch.dtype) -> str | None:
    """Why :class:`FusedLayers` cannot run ``model`` over a KV cache of ``cache_dtype``, or ``None``."""
    if not build.available():
        return f"the kernels {build.unavailable_reason()}"
    if not attention_kernel.supports(model.head_dim, cache_dtype):
        return "needs a float32 or float16 KV cache and a head size that is a multiple of 8 (at most 256)"
    if model.hidden % 32 or model.intermediate % 32 or (model.heads * model.head_dim) % 32:
        return "needs hidden, intermediate and attention sizes that are multiples of 32"
    if model.activation not in ACTIVATIONS:
        return f"has activation {model.activation!r}; allowed: {', '.join(ACTIVATIONS)}"
    if model.has_local and (model.window < 1 or model.rope_cos_local is None or model.rope_sin_local is None
                            or model.rope_cos_local.shape != model.rope_cos.shape
                            or model.rope_sin_local.shape != model.rope_sin.shape):
        return "has sliding-window layers without a window >= 1 and local RoPE tables of the global ones' shape"
    for i, layer in enumerate(model.layers):
        for p in (layer.qkv, layer.o, layer.gate_up, layer.down):
            if not all(t.is_contiguous() and t.device.type == "cpu" for t in p.tensors()):
                return f"layer {i} has a projection whose buffers are not contiguous CPU tensors"
        norms = [w for w in (layer.input_norm, layer.post_norm, layer.q_norm, layer.k_norm, layer.attn_out_norm,
                             layer.mlp_out_norm) if w is not None]
        if any(w.dtype != torch.float32 or not w.is_contiguous() for w in norms):
            return "needs float32 norm weights"
        if (layer.q_norm is None) != (layer.k_norm is None) or \
                any(w.numel() != model.head_dim for w in (layer.q_norm, layer.k_norm) if w is not None):
            return f"layer {i} needs both q/k norms of head_dim values, or neither"
        if (layer.attn_out_norm is None) != (layer.mlp_out_norm is None):
            return f"layer {i} needs both sandwich norms (attention and MLP outputs), or neither"
    return None


class FusedLayers:
    """A decoder's layers (:class:`ModelBuffers`: W4A8/W8A8 projections, float32 or float16 KV cache) as one C
    call per forward.

    It holds pointers into the buffers' tensors (and keeps them alive): build it after the weights are packed and
    rebuild it if they are replaced.  ``weight_prefetch``: how many bytes ahead the products prefetch their codes
    (:func:`speculant.kernels.build.check_weight_prefetch`; never changes a result).

    Raises:
        SpeculantError: the kernels cannot run here.
        ValueError: the model cannot run this way over a ``cache_dtype`` cache (:func:`why_not` says why), or a bad
            ``weight_prefetch``.
    """

    def __init__(self, model: ModelBuffers, cache_dtype: torch.dtype = torch.float32, weight_prefetch: int = 0):
        self.lib = build.require("the fused decoding step", "the torch layer step")
        # blocks from `many_from` rows on in the variant kept for them (build.for_rows; the same bits), if any
        self.lib_many, _, self.many_from = build.many_rows() or (None, None, 0)
        reason = why_not(model, cache_dtype)
        if reason is not None:
            raise ValueError(f"fused decoding step: {reason}")
        self.buffers = model
        layers = (_Layer * len(model.layers))()
        self._keep: list = []           # the stacks' arrays of parts, which the layers point into
        for i, layer in enumerate(model.layers):
            layers[i] = _Layer(0 if layer.input_norm is None else layer.input_norm.data_ptr(),
                               layer.post_norm.data_ptr(),
                               *(p.struct(self._keep) for p in (layer.qkv, layer.o, layer.gate_up, layer.down)),
                               *(0 if w is None else w.data_ptr() for w in (layer.q_norm, layer.k_norm,
                                                                            layer.attn_out_norm, layer.mlp_out_norm)),
                               int(layer.local))
        self._layers = layers
        self.model = _Model(model.hidden, model.heads, model.kv_heads, model.head_dim, model.intermediate,
                            model.eps, model.head_dim ** -0.5, layers, build.check_weight_prefetch(weight_prefetch),
                            ACTIVATIONS.index(model.activation), model.window if model.has_local else 0,
                            model.q_scale)
        self.weight_prefetch = weight_prefetch
        self.hidden = model.hidden
        self.num_layers = len(model.layers)
        self._rope = (model.rope_cos, model.rope_sin)
        self._rope_filled = model.rope_filled
        self._rope_local = (model.rope_cos_local, model.rope_sin_local) if model.has_local else None
        self.local_layers = tuple(bool(layer.local) for layer in model.layers)
        self._norm = (model.norm, float(model.norm_eps))
        head = model.head
        self._head = None if head is None or head.bias is not None or head.parts else head

    def _lib_for(self, rows: int):
        """The library for a forward of ``rows`` rows: ``lib_many`` from ``many_from`` rows on, if set, else ``lib``
        (:func:`~speculant.kernels.build.for_rows` as captured at construction; benchmarks swap them)."""
        return self.lib_many if self.lib_many is not None and rows >= self.many_from else self.lib

    def run(self, x: torch.Tensor, start: int, end: int, cos: torch.Tensor, sin: torch.Tensor,
            plan: attention_kernel.RaggedPlan, local: tuple | None = None) -> torch.Tensor:
        """Layers ``start .. end-1`` over the rows ``x`` ``[R, D]`` (float32) of the sequences of ``plan``
        (one or more; rows in the plan's order), RoPE tables ``cos``/``sin`` ``[R, Dh]`` gathered at the rows'
        positions; ``local``: the sliding-window layers' ``(cos, sin, plan)`` (their RoPE rows and a plan over the
        same caches with the windowed masks), needed where the range has such a layer.  Writes each sequence's new
        keys/values to its cache; returns the hidden states ``[R, D]`` leaving layer ``end - 1`` (``x`` is not
        modified).

        Raises:
            ValueError: a layer range, row count or ``local`` that does not match.
            MemoryError: a workspace cannot be allocated.
        """
        rows = sum(plan.rows[j] for j in range(plan.n))
        if not 0 <= start <= end <= self.num_layers or x.shape != (rows, self.hidden) or cos.shape[0] != rows:
            raise ValueError(f"fused step: layers {start}..{end} of {self.num_layers}, x {tuple(x.shape)}, "
                             f"cos {tuple(cos.shape)}; allowed: rows = {rows}, hidden = {self.hidden}")
        if local is None and any(self.local_layers[start:end]):
            raise ValueError(f"fused step: layers {start}..{end} include sliding-window layers; allowed: with local "
                             "(cos, sin, plan)")
        out = x.detach().float().contiguous().clone()
        cos, sin = cos.float().contiguous(), sin.float().contiguous()
        local_args = (None, None, None)
        if local is not None:
            cos_l, sin_l, plan_l = local[0].float().contiguous(), local[1].float().contiguous(), local[2]
            if cos_l.shape != cos.shape or sin_l.shape != cos.shape or list(plan_l.rows) != list(plan.rows):
                raise ValueError(f"fused step: local cos {tuple(cos_l.shape)}, rows {list(plan_l.rows)}; allowed: "
                                 f"cos {tuple(cos.shape)}, rows {list(plan.rows)}")
            local_args = (plan_l.mask_ptrs, cos_l.data_ptr(), sin_l.data_ptr())
        lib = self._lib_for(rows)
        status = lib.spec_run_layers(ctypes.byref(self.model), start, end, plan.n, plan.rows, plan.starts,
                                     plan.smax, plan.keys, plan.values, plan.layer_stride, plan.kv_bytes,
                                     plan.mask_ptrs,
                                     out.data_ptr(), cos.data_ptr(), sin.data_ptr(), *local_args)
        if status != 0:
            raise MemoryError("fused decoding step: cannot allocate its workspace")
        return out

    def step(self, hidden: torch.Tensor, start: int, end: int, positions: torch.Tensor, cache, cache_position: int,
             mask: torch.Tensor | None) -> torch.Tensor:
        """Layers ``start .. end-1`` over one sequence's rows ``hidden`` ``[1, T, D]`` float32 (a decoding step, a
        verification block or tree) at RoPE ``positions`` ``[T]``, new keys/values to slots ``cache_position ..``
        of ``cache`` (a float32 or float16 :class:`~speculant.models.kv_cache.KVCache`, batch 1), attending where ``mask``
        ``[T, cache_position + T]`` (bool) is True, or causally when it is ``None`` (in sliding-window layers, of
        those only the slots ``> position - window``; their RoPE rows from the local tables).  :meth:`run` for one sequence
        with the RoPE gathers and the causal mask done in C (``spec_decode_layers``): each torch call in a step
        costs tens of microseconds on a CPU whose caches the weight stream has just flushed.  Returns the hidden
        states ``[1, T, D]`` leaving layer ``end - 1``.

        Raises:
            IndexError: a position outside the RoPE tables.
            MemoryError: a workspace cannot be allocated.
        """
        t = hidden.shape[1]
        x = hidden.reshape(t, self.hidden)
        if x.dtype != torch.float32 or not x.is_contiguous():
            x = x.float().contiguous()
        out = torch.empty(1, t, self.hidden)
        if positions.dtype != torch.int64 or not positions.is_contiguous():
            positions = positions.to(torch.int64).contiguous()
        if mask is not None:
            mask = mask.contiguous()
        cos, sin = self._rope
        rows = cos.shape[0] if self._rope_filled is None else self._rope_filled()
        cos_l, sin_l = (table.data_ptr() for table in self._rope_local) if self._rope_local else (None, None)
        lib = self._lib_for(t)
        status = lib.spec_decode_layers(ctypes.byref(self.model), start, end, t, cache_position, cache.max_length,
                                        cache.keys.data_ptr(), cache.values.data_ptr(), cache.keys.stride(0),
                                        attention_kernel.kv_bytes(cache.dtype),
                                        None if mask is None else mask.data_ptr(), x.data_ptr(), out.data_ptr(),
                                        cos.data_ptr(), sin.data_ptr(), rows, positions.data_ptr(),
                                        cos_l, sin_l)
        if status == -2:
            raise IndexError(f"fused step: positions {positions.tolist()} outside the RoPE tables' computed rows "
                             f"(allowed: 0 .. {rows - 1})")
        if status != 0:
            raise MemoryError("fused decoding step: cannot allocate its workspace")
        return out

    def final_norm(self, hidden: torch.Tensor) -> torch.Tensor:
        """The decoder's final RMSNorm of float32 ``hidden`` ``[..., D]`` in C, the code of the layers' norms
        (row by row, so batch-invariant): ``[..., D]`` float32."""
        x = hidden.contiguous()
        out = torch.empty_like(x)
        weight, eps = self._norm
        self.lib.spec_rms_norm(x.data_ptr(), weight.data_ptr(), x.numel() // self.hidden, self.hidden, eps,
                               out.data_ptr())
        return out

    @property
    def has_head(self) -> bool:
        """Whether :meth:`lm_head` applies (a w4a8/w8a8 LM head without bias)."""
        return self._head is not None

    def lm_head(self, hidden: torch.Tensor) -> torch.Tensor:
        """LM-head logits ``[..., V]`` float32 of float32 ``hidden`` ``[..., D]``: the head's own kernel
        (:func:`speculant.kernels.qgemm._product`, the same call its torch operator makes) without the
        dispatcher in between."""
        from .qgemm import _w4a8_mm, _w5a8_mm, _w6a8k_mm, _w8a8_mm, _w8a8k_mm
        head, x = self._head, hidden.reshape(-1, self.hidden).float()
        if head.bits == 5:
            y = _w5a8_mm(x, head.codes, head.scales, self.weight_prefetch)
        elif head.bits == 6:
            y = _w6a8k_mm(x, head.codes, head.scales, head.offsets, self.weight_prefetch)
        elif head.bits == 4:
            y = _w4a8_mm(x, head.codes, head.scales, head.offsets, self.weight_prefetch)
        elif head.scales.dtype == torch.float16:
            y = _w8a8_mm(x, head.codes, head.scales, self.weight_prefetch)
        else:
            y = _w8a8k_mm(x, head.codes, head.scales, head.offsets, head.scale_group, self.weight_prefetch)
        return y.view(*hidden.shape[:-1], head.out_features)
