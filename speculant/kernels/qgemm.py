"""Weight-quantized products on int8 activations (W4A8 / W8A8), built from ``qgemm.c`` on the machine at hand.

Why a kernel of our own (the last resort, measured): on a 2-core AMD EPYC with AVX2 and no AVX-512
(2026-12-01), torch's ``_weight_int4pack_mm_for_cpu`` took 13.6 ms for one row through all of SmolLM2's
projections (53 MB of int4 codes; a float32 sum streams ~24 GB/s there) and ``_weight_int8pack_mm`` 15.5 ms;
on an AVX-512 EPYC the same int4 pass took 4.8 ms.  torch's CPU kernels dequantize every weight to float
and multiply in float, which AVX2 cannot do at memory speed; ``torch._int_mm`` on CPU is a reference loop
(0.9 ms for one 576 x 3072 row).  llama.cpp instead quantizes the activations to int8 per block of 32
(Q8_1) and takes integer dot products of the blocks (``vpmaddubsw``), which this kernel does too
(``benchmarks/qgemm_cost.py`` compares them shape by shape).

The C source is built once per machine (:mod:`speculant.kernels.build`).  The products are torch custom
operators (``torch.ops.speculant.w4a8_mm`` / ``w8a8_mm``), so compiled
decoding steps call them like any other extern kernel.

:func:`~speculant.kernels.build.available` says whether it can run here; the formats that need it are left out
of the tuner's measurement otherwise.
"""

from __future__ import annotations

import torch

from . import build
from .build import available, unavailable_reason  # noqa: F401  (re-exported)

BLOCK = 32
"""Weights (and activations) per quantization block: GGUF's Q4_0/Q4_1/Q8_0 and llama.cpp's Q8_1."""


def require():
    """The kernel library.

    Raises:
        SpeculantError: it cannot run here ("the w4a8 weight format needs ...; allowed here: ...").
    """
    return build.require("the w4a8 weight format", "fp32, bf16, int8, int4")


def quantize_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Activations ``x`` ``[M, K]`` float32 (K a multiple of 32) -> ``(xq [M, K] int8, xd [M, K/32], xs [M, K/32])``
    with ``x ~ xq * xd`` per block of 32 and ``xs = xd * sum(xq)`` (llama.cpp's Q8_1; round to nearest even)."""
    lib = require()
    x = x.contiguous()
    m, k = x.shape
    xq = torch.empty(m, k, dtype=torch.int8)
    xd = torch.empty(m, k // BLOCK)
    xs = torch.empty(m, k // BLOCK)
    lib.spec_quantize_rows(x.data_ptr(), m, k, xq.data_ptr(), xd.data_ptr(), xs.data_ptr())
    return xq, xd, xs


def _product(entry: str, x: torch.Tensor, codes: torch.Tensor, *weight_tensors: torch.Tensor,
             prefetch: int = 0) -> torch.Tensor:
    """``y [M, N]`` of the C entry point ``entry(x, M, K, codes, *weight_tensors, N, y, prefetch)`` on float32 rows
    ``x``; ``prefetch``: how many bytes ahead the product prefetches its codes (0: none; never changes ``y``).

    Raises:
        SpeculantError: the kernel cannot run here.
        MemoryError: the quantized-activation workspace cannot be allocated.
    """
    x = x.contiguous()
    y = torch.empty(x.shape[0], codes.shape[0])
    status = getattr(build.for_rows(x.shape[0]) or require(), entry)(x.data_ptr(), x.shape[0], x.shape[1], codes.data_ptr(),
                                                     *(0 if t is None else t.data_ptr() for t in weight_tensors),
                                                     codes.shape[0],
                                                     y.data_ptr(), prefetch)
    if status != 0:
        raise MemoryError("speculant qgemm: cannot allocate the quantized-activation workspace")
    return y


def _w4a8_mm(x: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor, offsets: torch.Tensor | None,
             prefetch: int = 0) -> torch.Tensor:
    """``x`` ``[M, K]`` float32 times the transpose of the 4-bit weight ``[N, K]`` -> ``[M, N]`` float32
    (``torch.ops.speculant.w4a8_mm``).

    The weight is ``w[n, k] = scales[n, g] * q[n, k] + offsets[n, g]`` (``g = k // 32``, ``q`` in 0..15), packed
    in ``codes`` ``[N, K/2]`` uint8 as GGUF does (byte j of a block: code j in the low nibble, code j+16 in the
    high one); ``scales``/``offsets`` ``[N, K/32]`` float16 (GGUF's Q4_0/Q4_1 values; ``offsets`` ``None``: Q4_0's
    ``-8 * scales``, computed in float32, exact), or float32 (Q4_K's
    super-block scales folded exactly into per-32 values; ``qgemm.c``'s K layouts), or Q4_K as stored (``scales``
    ``[N, 2K/32]`` int8: each block's 6-bit scale ``sc`` and min ``m``; ``offsets`` ``[N, 2K/256]`` float32: each
    super-block's ``d`` and ``-dmin``; ``w = (d * sc) * q + (-dmin * m)``, ``qgemm.c``'s ``SK_Q4K``: the float32
    layout's bits); the rows of all three interleaved by groups of 8 outputs (the layout in ``qgemm.c``'s header;
    :class:`~speculant.runtime.formats.W4A8Linear` makes it).
    ``x`` is quantized per block of 32 to int8 first (:func:`quantize_rows`).  ``prefetch``: bytes ahead that the
    product prefetches its codes (0: none; a multiple of 64; measured per machine by the tuner; never changes the
    result).

    Raises:
        SpeculantError: the kernel cannot run here.
        MemoryError: the quantized-activation workspace cannot be allocated.
    """
    entry = {torch.float32: "spec_w4a8k_f32", torch.int8: "spec_w4a8q4k_f32"}.get(scales.dtype, "spec_w4a8_f32")
    if offsets is None and entry != "spec_w4a8_f32":
        raise ValueError(f"w4a8_mm: {scales.dtype} scales need offsets")
    return _product(entry, x, codes, scales, offsets, prefetch=prefetch)


def _w8a8k_mm(x: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor, offsets: torch.Tensor | None, group: int,
              prefetch: int = 0) -> torch.Tensor:
    """``x`` ``[M, K]`` float32 times the transpose of the 8-bit weight ``w[n, k] = scales[n, k // group] * codes[n, k]
    (+ offsets[n, k // 32])`` -> ``[M, N]`` float32 (``torch.ops.speculant.w8a8k_mm``): GGUF's Q5_0, Q5_1, Q5_K
    (``group`` 32) and Q6_K (``group`` 16) with their scales folded exactly into float32 (``codes`` ``[N, K]`` int8,
    ``scales`` ``[N, K/group]`` and ``offsets`` ``[N, K/32]`` float32 or None; rows interleaved by groups of 8 outputs,
    ``qgemm.c``'s K layouts; :class:`~speculant.runtime.formats.W8A8Linear` makes them), on int8 activations
    (:func:`quantize_rows`); ``prefetch`` as for :func:`_w4a8_mm`.

    Raises:
        SpeculantError: the kernel cannot run here.
        ValueError: ``group`` is not 16 or 32.
        MemoryError: the quantized-activation workspace cannot be allocated.
    """
    if group not in (16, 32):
        raise ValueError(f"w8a8k_mm: group {group!r}; allowed: 16, 32")
    x = x.contiguous()
    y = torch.empty(x.shape[0], codes.shape[0])
    status = (build.for_rows(x.shape[0]) or require()).spec_w8a8k_f32(
        x.data_ptr(), x.shape[0], x.shape[1], codes.data_ptr(), scales.data_ptr(),
        0 if offsets is None else offsets.data_ptr(), group, codes.shape[0], y.data_ptr(), prefetch)
    if status != 0:
        raise MemoryError("speculant qgemm: cannot allocate the quantized-activation workspace")
    return y


def _w6a8k_mm(x: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor, supers: torch.Tensor,
              prefetch: int = 0) -> torch.Tensor:
    """``x`` ``[M, K]`` float32 times the transpose of GGUF's Q6_K weight in 6 bits, ``w[n, k] = (supers[n, k // 256] *
    scales[n, k // 16]) * q[n, k]`` -> ``[M, N]`` float32 (``torch.ops.speculant.w6a8k_mm``): ``codes``
    ``[N, K * 3 / 4]`` uint8 (``q + 32`` in 0..63 as low nibbles and high bit pairs), ``scales`` ``[N, K / 16]``
    int8, ``supers`` ``[N, K / 256]`` float32, rows interleaved by groups of 8 outputs (``qgemm.c``'s 6-bit layout;
    :class:`~speculant.runtime.formats.W6A8Linear` makes them); the bits of :func:`_w8a8k_mm` with ``group`` 16 on
    the same codes and the scales ``supers * scales``; ``prefetch`` as for :func:`_w4a8_mm`.

    Raises:
        SpeculantError: the kernel cannot run here.
        MemoryError: the quantized-activation workspace cannot be allocated.
    """
    return _product("spec_w6a8k_f32", x, codes, scales, supers, prefetch=prefetch)


def _w5a8_mm(x: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor, prefetch: int = 0) -> torch.Tensor:
    """``x`` ``[M, K]`` float32 times the transpose of GGUF's Q5_0 weight in 5 bits, ``w[n, k] = scales[n, k // 32] *
    q[n, k]`` -> ``[M, N]`` float32 (``torch.ops.speculant.w5a8_mm``): ``codes`` ``[N, K * 5 / 8]`` uint8 (``q + 16`` in
    0..31 as low nibbles and high bits), ``scales`` ``[N, K / 32]`` float16 (the file's ``d``), rows interleaved by
    groups of 8 outputs (``qgemm.c``'s 5-bit layout; :class:`~speculant.runtime.formats.W5A8Linear` makes them); the
    bits of :func:`_w8a8_mm` on the same codes and scales; ``prefetch`` as for :func:`_w4a8_mm`.

    Raises:
        SpeculantError: the kernel cannot run here.
        MemoryError: the quantized-activation workspace cannot be allocated.
    """
    return _product("spec_w5a8_f32", x, codes, scales, prefetch=prefetch)


def _w8a8_mm(x: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor, prefetch: int = 0) -> torch.Tensor:
    """``x`` ``[M, K]`` float32 times the transpose of the 8-bit weight ``w[n, k] = scales[n, k // 32] * codes[n, k]``
    (``codes`` ``[N, K]`` int8, ``scales`` ``[N, K/32]`` float16; GGUF's Q8_0; rows interleaved by groups of 8
    outputs as for :func:`_w4a8_mm`, :class:`~speculant.runtime.formats.W8A8Linear`) -> ``[M, N]`` float32, on int8
    activations (:func:`quantize_rows`; ``torch.ops.speculant.w8a8_mm``); ``prefetch`` as for :func:`_w4a8_mm`.

    Raises:
        SpeculantError: the kernel cannot run here.
        MemoryError: the quantized-activation workspace cannot be allocated.
    """
    return _product("spec_w8a8_f32", x, codes, scales, prefetch=prefetch)


# Registered with the dispatcher directly (torch.library.custom_op's Python wrapper cost ~20 us a call, as
# much as a projection's kernel); the fake (meta) versions give compiled graphs the output shape.
_OPS = torch.library.Library("speculant", "FRAGMENT")
_OPS.define("w4a8_mm(Tensor x, Tensor codes, Tensor scales, Tensor? offsets, int prefetch=0) -> Tensor")
_OPS.define("w8a8_mm(Tensor x, Tensor codes, Tensor scales, int prefetch=0) -> Tensor")
_OPS.impl("w4a8_mm", _w4a8_mm, "CPU")
_OPS.define("w8a8k_mm(Tensor x, Tensor codes, Tensor scales, Tensor? offsets, int group, int prefetch=0) -> Tensor")
_OPS.impl("w8a8_mm", _w8a8_mm, "CPU")
_OPS.impl("w8a8k_mm", _w8a8k_mm, "CPU")
_OPS.define("w6a8k_mm(Tensor x, Tensor codes, Tensor scales, Tensor supers, int prefetch=0) -> Tensor")
_OPS.impl("w6a8k_mm", _w6a8k_mm, "CPU")
_OPS.define("w5a8_mm(Tensor x, Tensor codes, Tensor scales, int prefetch=0) -> Tensor")
_OPS.impl("w5a8_mm", _w5a8_mm, "CPU")


@torch.library.register_fake("speculant::w4a8_mm")
def _(x, codes, scales, offsets, prefetch=0):
    return x.new_empty(x.shape[0], codes.shape[0])


@torch.library.register_fake("speculant::w8a8_mm")
def _(x, codes, scales, prefetch=0):
    return x.new_empty(x.shape[0], codes.shape[0])


@torch.library.register_fake("speculant::w8a8k_mm")
def _(x, codes, scales, offsets, group, prefetch=0):
    return x.new_empty(x.shape[0], codes.shape[0])


@torch.library.register_fake("speculant::w6a8k_mm")
def _(x, codes, scales, supers, prefetch=0):
    return x.new_empty(x.shape[0], codes.shape[0])


@torch.library.register_fake("speculant::w5a8_mm")
def _(x, codes, scales, prefetch=0):
    return x.new_empty(x.shape[0], codes.shape[0])
