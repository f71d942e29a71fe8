"""Weight formats of the projections: how ``y = x W^T (+ b)`` is stored and computed.

======== ========================================================= ==============================
format   weights                                                   kernel
======== ========================================================= ==============================
fp32     float32 (dequantized GGUF), :class:`~speculant.models.   ``F.linear`` / ``(W x^T)^T`` (route tuned)
         linear.DecodeLinear`` (trainable)
bf16     bfloat16                                                  ``F.linear`` in bfloat16 (oneDNN)
int8     int8 per output channel, symmetric, bfloat16 scales       ``aten._weight_int8pack_mm``
int4     int4 per group of 32, asymmetric (GGUF Q4_0/Q4_1 codes     ``aten._weight_int4pack_mm_for_cpu``
         as stored; other weights quantized like Q4_1),
         bfloat16 scales and offsets
w4a8     the same 4-bit codes with float16 scales and offsets (as    ``speculant.w4a8_mm`` (our AVX2 /
         the GGUF stores them; rows interleaved by 8 for the         VNNI kernel, :mod:`speculant.kernels.
         kernel); activations quantized to int8 per block of 32      qgemm`)
         (llama.cpp's Q4 x Q8_1 dot product)
======== ========================================================= ==============================

Weight-only quantization: activations stay float32 between projections; the bf16/int8/int4 kernels
read them rounded to bfloat16 and return bfloat16, which is converted back to float32.  The LM head of
``int4`` is ``int8`` (GGUF stores it as Q8_0, for which torch has no group-wise kernel).  ``w4a8`` is not
weight-only: each projection quantizes its input rows to int8 per block of 32 and returns float32, as
llama.cpp's CPU backend does; its LM head is ``w8a8`` (the GGUF's own Q8_0 codes, same activations).  A GGUF's
projections of other types run as stored (:func:`block_linear`): Q4_K in ``w4a8`` with its integer sub-block scales
and mins (:class:`W4A8KLinear`), Q8_0, Q5_1 and Q5_K in ``w8a8`` (float32 scales per 32 where the type needs them),
Q5_0 in its own 5 bits (:class:`W5A8Linear`), Q6_K in its own 6 bits with its integer sub-block scales
(:class:`W6A8Linear`), a fused projection whose tensors differ in type as a :class:`StackedLinear`.  A projection
whose shape a kernel cannot take (int4 needs ``O % 16 == 0`` and ``I % 32 == 0``; w4a8 needs ``I % 32 == 0``) falls
back to the next format in ``w4a8 -> int8``, ``int4 -> int8 -> bf16``.
With every projection in ``w4a8``/``w8a8``, a forward over the KV cache runs all its decoder layers as one call into
our kernels (:mod:`speculant.kernels.decode_step`) instead of torch's per-operation (or compiled) path.

Every kernel here computes each output row from its own input row only; whether that holds *bit for bit*
for 1..N rows on the machine at hand (batch invariance, which greedy exactness of speculative decoding
rests on) is measured by :mod:`speculant.runtime.tune`, not assumed.
"""

from __future__ import annotations

from dataclasses import replace

import torch
import torch.nn.functional as F
from torch import nn

from ..errors import SpeculantError
from ..kernels import qgemm          # registers torch.ops.speculant.w4a8_mm / w8a8_mm (built on first use)
from ..models.gguf_codes import GroupQuantized

FORMATS = ("fp32", "bf16", "int8", "int4", "w4a8")
"""Weight formats, most exact first."""
INT4_GROUP = 32
HEAD_FORMATS = {"int4": "int8", "w4a8": "w8a8"}
"""The LM head's format where it differs from the projections' (``w8a8`` exists for LM heads only)."""
KERNEL_FORMATS = ("w4a8",)
"""Formats that run our own kernel (:mod:`speculant.kernels.qgemm`), available where it builds."""

DRAFTER_FORMATS = ("fp32", "int8", "w8a8")
"""Weight formats a drafter's own projections are timed in (``w8a8``: Q8_0 codes on int8 activations, where our
kernels run; :func:`speculant.runtime.tune.measure_drafter_weights`)."""


def head_format(fmt: str) -> str:
    """The format of the LM head of a model whose projections are in ``fmt``."""
    return HEAD_FORMATS.get(fmt, fmt)


def format_available(fmt: str) -> bool:
    """Whether format ``fmt``'s kernel runs on this machine (torch's always do; ours needs AVX2 and a C compiler)."""
    if fmt in KERNEL_FORMATS:
        return qgemm.available()
    return True


def check_format(name: str) -> str:
    """Return ``name`` if it is a weight format (:data:`FORMATS`); raise :class:`SpeculantError` otherwise."""
    if name not in FORMATS:
        raise SpeculantError(f"weights={name!r} is not a weight format; allowed: {', '.join(FORMATS)} or auto")
    return name


class PackedLinear(nn.Module):
    """A frozen projection in a weight format: ``[..., I]`` float32 -> ``[..., O]`` float32.

    Subclasses store the weight and implement :meth:`matmul` on 2-D inputs ``[M, I]``.
    ``nbytes`` is the size of the stored weight (bytes), what a decoding step reads.
    """

    format = "fp32"

    def __init__(self, in_features: int, out_features: int, bias: torch.Tensor | None):
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.register_buffer("bias", None if bias is None else bias.detach().float().clone())

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def dequantized_weight(self) -> torch.Tensor:
        """The float32 weight ``[O, I]`` the kernel multiplies by (scales rounded as stored)."""
        raise NotImplementedError

    _ROW_BUFFERS: tuple[str, ...] = ()      # buffers whose first dimension is the output row

    def select_rows(self, index: torch.Tensor) -> "PackedLinear":
        """The projection restricted to output rows ``index`` ``[O']`` (same format, no copy of other rows):
        a reduced-vocabulary LM head for a draft head.

        Raises:
            SpeculantError: the format's packed layout cannot be sliced by rows (int4).
        """
        if not self._ROW_BUFFERS:
            raise SpeculantError(f"{self.format} weights cannot be sliced by output rows")
        buffers = {name: getattr(self, name)[index].contiguous() for name in self._ROW_BUFFERS}
        if self.bias is not None:
            buffers["bias"] = self.bias[index]
        return type(self).empty(self.in_features, int(index.numel()), buffers)

    @classmethod
    def empty(cls, in_features: int, out_features: int, buffers: dict[str, torch.Tensor]) -> "PackedLinear":
        """An instance whose buffers are ``buffers`` (e.g. meta tensors to be replaced by ``load_state_dict(assign=True)``)."""
        mod = cls.__new__(cls)
        PackedLinear.__init__(mod, in_features, out_features, buffers.get("bias"))
        for name, tensor in buffers.items():
            if name != "bias":
                mod.register_buffer(name, tensor)
        return mod

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.matmul(x.reshape(-1, self.in_features)).float()
        if self.bias is not None:
            y = y + self.bias
        return y.view(*x.shape[:-1], self.out_features)

    @property
    def nbytes(self) -> int:
        return sum(b.nbytes for name, b in self.named_buffers() if name != "bias")

    def extra_repr(self) -> str:
        return f"{self.in_features} -> {self.out_features}, format={self.format}"


class Bf16Linear(PackedLinear):
    format = "bf16"
    _ROW_BUFFERS = ("weight",)

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None):
        super().__init__(weight.shape[1], weight.shape[0], bias)
        self.register_buffer("weight", weight.detach().to(torch.bfloat16).contiguous())

    def matmul(self, x):
        return F.linear(x.to(torch.bfloat16), self.weight)

    def dequantized_weight(self):
        return self.weight.float()


class Int8Linear(PackedLinear):
    """Symmetric per-output-channel int8: ``W[o] = scale[o] * q[o]``, ``q`` in -127..127."""

    format = "int8"
    _ROW_BUFFERS = ("qweight", "scales")

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None):
        super().__init__(weight.shape[1], weight.shape[0], bias)
        o, i = weight.shape
        q, scale = torch.empty(o, i, dtype=torch.int8), torch.empty(o)
        for rows in _row_chunks(o, i):          # row by row: float temporaries of a chunk only (an LM head is 113 MB)
            w = weight.detach()[rows].float()
            scale[rows] = (w.abs().amax(dim=1) / 127.0).clamp_min(1e-12)
            q[rows] = torch.round(w / scale[rows, None]).clamp(-127, 127).to(torch.int8)
        self.register_buffer("qweight", q)
        self.register_buffer("scales", scale.to(torch.bfloat16))

    def matmul(self, x):
        return torch.ops.aten._weight_int8pack_mm(x.to(torch.bfloat16), self.qweight, self.scales)

    def dequantized_weight(self):
        return self.qweight.float() * self.scales.float()[:, None]


class Int4Linear(PackedLinear):
    """Group-wise asymmetric int4: ``W[o, i] = scale[o, g] * q[o, i] + offset[o, g]``, ``q`` in 0..15, ``g = i // 32``.

    torch's kernel reads ``(q - 8) * s + z``, so ``z = offset + 8 * scale``.
    """

    format = "int4"

    def __init__(self, codes: GroupQuantized, bias: torch.Tensor | None = None):
        o, i = codes.shape
        super().__init__(i, o, bias)
        if codes.bits != 4 or codes.group != INT4_GROUP:
            raise SpeculantError(f"int4 format takes 4-bit codes in groups of {INT4_GROUP}, got {codes.bits}-bit "
                                 f"groups of {codes.group}")
        packed, scales_and_zeros = _int4_scales_and_zeros(codes)
        self.register_buffer("qweight", packed)
        self.register_buffer("scales_and_zeros", scales_and_zeros)

    def matmul(self, x):
        return torch.ops.aten._weight_int4pack_mm_for_cpu(x.to(torch.bfloat16), self.qweight, INT4_GROUP,
                                                          self.scales_and_zeros)

    @staticmethod
    def kernel_weight(codes: GroupQuantized) -> torch.Tensor:
        """The float32 weight ``[O, I]`` the int4 kernel multiplies by for ``codes``: ``(q - 8) * s + z`` with
        ``s`` and ``z = offset + 8 s`` rounded to bfloat16 (the packed layout itself is opaque)."""
        _, s_z = _int4_scales_and_zeros(codes)
        o, i = codes.shape
        s, z = s_z[..., 0].t().float(), s_z[..., 1].t().float()            # [O, I / 32]
        w = (codes.codes.float().view(o, -1, INT4_GROUP) - 8.0) * s[..., None] + z[..., None]
        return w.view(o, i)


LANES = 8
"""Outputs per interleaved group of the ``w4a8``/``w8a8`` layout (one 32-bit lane each of a 256-bit vector)."""


PACK_ROWS = 1024
"""Outputs a block projection's codes are converted and interleaved at a time (a multiple of :data:`LANES`)."""


def _interleave(x: torch.Tensor, blocks: int, inverse: bool = False) -> torch.Tensor:
    """Rows ``[O, blocks * W * B]`` (each block ``W`` words of ``B`` elements; ``x`` shaped ``[O, blocks, W, B]``) in the
    kernels' layout: per group of :data:`LANES` rows and block, word ``w`` of every row of the group, row after row
    (``[O / 8, blocks, W, 8, B]``); the last ``O % 8`` rows as they are.  ``inverse``: back to row by row."""
    o, _, w, b = x.shape
    t = o // LANES * LANES
    head = x[:t].view(t // LANES, LANES, blocks, w, b) if not inverse else x[:t].view(t // LANES, blocks, w, LANES, b)
    head = head.permute(0, 2, 3, 1, 4) if not inverse else head.permute(0, 3, 1, 2, 4)
    return torch.cat([head.reshape(t, blocks, w, b), x[t:]]).reshape(o, -1).contiguous()


class _BlockLinear(PackedLinear):
    """GGUF-style blocks of 32 on int8 activations, interleaved by groups of :data:`LANES` outputs for our kernel
    (:mod:`speculant.kernels.qgemm`'s layout); subclasses say how a block's codes split into 32-bit words.

    ``prefetch``: how many bytes ahead the kernel prefetches the codes (0: none; never changes a result); the
    executor that runs the model sets it to the distance tuned for this machine
    (:meth:`speculant.runtime.executor.Executor.configure`)."""

    _WORDS = 0           # 32-bit words of codes per block and output
    prefetch = 0

    def _store(self, codes, scale: torch.Tensor, offset: torch.Tensor | None,
               dtype: torch.dtype = torch.float16) -> None:
        """``codes(rows)``: the codes of the output ``rows`` (a slice) as ``[n, G, block bytes]``; ``scale``
        ``[O, G * per_block]`` (``per_block`` scales per block of 32: 1, or 2 for groups of 16), ``offset`` ``[O, G]``
        or None, scales and offsets stored in ``dtype``.  The codes are converted and interleaved
        :data:`PACK_ROWS` outputs at a time (the interleaving is within groups of :data:`LANES` outputs, so the
        result is the whole matrix's): a 128k-token LM head's temporaries stay a few MiB, not ~3 copies of it."""
        o, g = self.out_features, self.in_features // INT4_GROUP
        packed = None
        for start in range(0, o, PACK_ROWS):
            end = min(o, start + PACK_ROWS)
            part = _interleave(codes(slice(start, end)).contiguous().view(end - start, g, self._WORDS, 4), g)
            if packed is None:
                packed = torch.empty((o, part.shape[1]), dtype=part.dtype)
            packed[start:end] = part
        self.register_buffer("codes", packed)
        for name, v in (("scales", scale), ("offsets", offset)):
            if v is not None:
                self.register_buffer(name, _interleave(v.to(dtype).view(o, g, -1, 1), g))

    def _rows(self, name: str, words: int) -> torch.Tensor:
        """Buffer ``name`` row by row ``[O, G, words * B]``."""
        v = getattr(self, name)
        o, g = self.out_features, self.in_features // INT4_GROUP
        return _interleave(v.view(o, g, words, -1), g, inverse=True).view(o, g, -1)

    @property
    def scale_group(self) -> int:
        """Inputs per scale: 32, or 16 (Q6_K)."""
        return self.in_features // self.scales.shape[1]

    def group_quantized(self) -> GroupQuantized:
        """The stored weight as group-wise codes ``[O, I]`` (scales and offsets as stored, in float32)."""
        raise NotImplementedError

    def dequantized_weight(self):
        return self.group_quantized().dequantize()

    def select_rows(self, index: torch.Tensor) -> "PackedLinear":
        """The projection restricted to output rows ``index`` (regrouped: the interleaved layout is not row-sliceable).
        Its rows get the bits the full projection gives them (the kernel computes each output alike)."""
        bias = None if self.bias is None else self.bias[index]
        return type(self)(self.group_quantized().rows(index), bias)


class W4A8Linear(_BlockLinear):
    """4-bit codes in blocks of 32 on int8 activations: ``W[o, i] = scales[o, g] * q[o, i] + offsets[o, g]``,
    ``q`` in 0..15 packed two per byte as in GGUF, ``scales``/``offsets`` float16 (a GGUF's Q4_0/Q4_1 values exactly;
    others are rounded to float16; no ``offsets`` where they are ``-8 * scales``, Q4_0's: the kernel computes them,
    0.56 bytes a weight instead of 0.63) or float32 (codes whose ``scale_dtype`` is float32: Q4_K's super-block scales
    folded exactly per sub-block of 32), the rows of ``codes`` ``[O, I/2]``, ``scales``, ``offsets`` ``[O, I/32]``
    interleaved by groups of 8 outputs (:mod:`speculant.kernels.qgemm`'s layout; :meth:`group_quantized` undoes it).
    The input is quantized per row and block of 32 to int8 (llama.cpp's Q8_1) inside the kernel."""

    format = "w4a8"
    _WORDS = 4           # 16 bytes: byte j = code j | code j + 16 << 4

    def __init__(self, gq: GroupQuantized, bias: torch.Tensor | None = None):
        o, i = gq.shape
        super().__init__(i, o, bias)
        if gq.bits != 4 or gq.group != INT4_GROUP:
            raise SpeculantError(f"w4a8 takes 4-bit codes in groups of {INT4_GROUP}, got {gq.bits}-bit groups of {gq.group}")
        offset = gq.offset if gq.offset is not None else torch.zeros_like(gq.scale)
        if gq.scale_dtype == torch.float16 and torch.equal(offset, -8.0 * gq.scale):
            offset = None                          # Q4_0: the kernel computes -8 d
        self._store(lambda rows: self.block_bytes(gq.codes[rows], i), gq.scale, offset,
                    torch.float32 if gq.scale_dtype == torch.float32 else torch.float16)

    @staticmethod
    def block_bytes(codes: torch.Tensor, in_features: int) -> torch.Tensor:
        """Codes ``[n, I]`` (0..15) -> GGUF's block bytes ``[n, I / 32, 16]``: byte ``j`` = code ``j`` | code
        ``j + 16`` << 4."""
        c = codes.to(torch.uint8).view(-1, in_features // INT4_GROUP, INT4_GROUP)
        return c[..., :16] | (c[..., 16:] << 4)

    @staticmethod
    def codes_of(blocks: torch.Tensor, out_features: int, in_features: int) -> torch.Tensor:
        """The inverse of :meth:`block_bytes` on rows ``[O, I / 32, 16]``: codes ``[O, I]``."""
        return torch.cat([blocks & 0x0F, blocks >> 4], -1).reshape(out_features, in_features)

    def matmul(self, x):
        return torch.ops.speculant.w4a8_mm(x.float(), self.codes, self.scales, getattr(self, "offsets", None),
                                           self.prefetch)

    def group_quantized(self):
        o, i = self.out_features, self.in_features
        scale = self._rows("scales", 1).view(o, -1).float()
        offset = -8.0 * scale if getattr(self, "offsets", None) is None else self._rows("offsets", 1).view(o, -1).float()
        return GroupQuantized(self.codes_of(self._rows("codes", self._WORDS), o, i), scale, offset, 4, INT4_GROUP,
                              self.scales.dtype)


class W4A8KLinear(_BlockLinear):
    """GGUF's Q4_K as stored, on int8 activations: ``W[o, i] = (d[o, s] * sc[o, g]) * q[o, i] + (-dmin[o, s]) *
    m[o, g]`` (``g = i // 32``, ``s = i // 256``), ``q`` in 0..15 packed as :class:`W4A8Linear`'s, ``sc``, ``m`` the
    file's 6-bit sub-block scales and mins (int8), ``d``, ``dmin`` its fp16 super-block scale and min (float32).  Both
    products are exact in float32, so the product is :class:`W4A8Linear`'s with the folded float32 scales bit for bit,
    from 0.59 bytes a weight instead of 0.75 (:mod:`speculant.kernels.qgemm`'s ``SK_Q4K`` layout,
    ``torch.ops.speculant.w4a8_mm`` on int8 scales):

    * ``codes`` ``[O, I / 2]`` as :class:`W4A8Linear`'s;
    * ``scales`` ``[O, 2 I / 32]`` int8: per block ``sc`` then ``m``; ``supers`` ``[O, 2 I / 256]`` float32: per
      super-block ``d`` then ``-dmin``; both interleaved by groups of 8 outputs like the codes (per group and block:
      the 8 outputs' ``sc``, then their ``m``).

    Raises:
        SpeculantError: codes that are not Q4_K's with their super-block scales and mins (:func:`block_linear` then
            takes :class:`W4A8Linear`).
    """

    format = "w4a8"
    _WORDS = 4

    def __init__(self, gq: GroupQuantized, bias: torch.Tensor | None = None):
        o, i = gq.shape
        super().__init__(i, o, bias)
        factors = _q4k_scales_mins(gq)
        if factors is None:
            raise SpeculantError("w4a8 with Q4_K scales takes Q4_K codes (4-bit codes, scales and offsets per 32 that are "
                                 "an fp16 super-block scale and min per 256 times 6-bit integers)")
        g, s = i // INT4_GROUP, i // Q6K_SUPER
        self._store(lambda rows: W4A8Linear.block_bytes(gq.codes[rows], i), None, None)
        self.register_buffer("scales", _interleave(torch.stack(factors, -1).view(o, g, 2, 1), g))
        supers = torch.stack([gq.super_scale.float(), -gq.super_min.float()], -1)
        self.register_buffer("supers", _interleave(supers.view(o, s, 2, 1), s))

    @property
    def scale_group(self) -> int:
        return INT4_GROUP

    def matmul(self, x):
        return torch.ops.speculant.w4a8_mm(x.float(), self.codes, self.scales, self.supers, self.prefetch)

    def group_quantized(self):
        o, i = self.out_features, self.in_features
        g, s = i // INT4_GROUP, i // Q6K_SUPER
        sc, m = _interleave(self.scales.view(o, g, 2, 1), g, inverse=True).view(o, g, 2).float().unbind(-1)
        d, nm = _interleave(self.supers.view(o, s, 2, 1), s, inverse=True).view(o, s, 2).unbind(-1)
        per = Q6K_SUPER // INT4_GROUP
        return GroupQuantized(W4A8Linear.codes_of(self._rows("codes", self._WORDS), o, i),
                              d.repeat_interleave(per, 1) * sc, nm.repeat_interleave(per, 1) * m, 4, INT4_GROUP,
                              torch.float32, "Q4_K", d.contiguous(), (-nm).contiguous())


class W8A8Linear(_BlockLinear):
    """8-bit codes in blocks of 32 on int8 activations: ``W[o, i] = scales[o, i // group] * codes[o, i]
    (+ offsets[o, i // 32])``, rows interleaved by groups of 8 outputs as in :class:`W4A8Linear`:

    * GGUF's Q8_0 and Q5_0 (codes ``q - 16``): ``scales`` float16 per 32, a GGUF's values exactly, no offsets
      (the LM head of ``w4a8``, and its Q8_0/Q5_0 projections);
    * Q5_1 (codes 0..31, fp16 scale and offset), Q5_K (codes 0..31; float32 scales and offsets per 32, the
      super-block folded exactly) and Q6_K (codes ``q - 32``; float32 scales per 16, no offsets): ``scales`` (and
      ``offsets``) float32, :mod:`speculant.kernels.qgemm`'s K layouts (``torch.ops.speculant.w8a8k_mm``)."""

    format = "w8a8"
    _WORDS = 8           # 32 codes

    def __init__(self, gq: GroupQuantized, bias: torch.Tensor | None = None):
        o, i = gq.shape
        super().__init__(i, o, bias)
        if gq.bits != 8 or gq.group not in (16, INT4_GROUP) or (gq.offset is not None and gq.group != INT4_GROUP):
            raise SpeculantError(f"w8a8 takes 8-bit codes with scales per 16 or {INT4_GROUP} inputs (offsets per "
                                 f"{INT4_GROUP}), got {gq.bits}-bit groups of {gq.group}")
        fp16 = gq.group == INT4_GROUP and gq.offset is None and gq.scale_dtype == torch.float16
        self._store(lambda rows: gq.codes[rows].to(torch.int8).view(-1, i // INT4_GROUP, INT4_GROUP), gq.scale, gq.offset,
                    torch.float16 if fp16 else torch.float32)

    def matmul(self, x):
        if self.scales.dtype == torch.float16:
            return torch.ops.speculant.w8a8_mm(x.float(), self.codes, self.scales, self.prefetch)
        return torch.ops.speculant.w8a8k_mm(x.float(), self.codes, self.scales, getattr(self, "offsets", None),
                                            self.scale_group, self.prefetch)

    def group_quantized(self):
        o, i = self.out_features, self.in_features
        offsets = getattr(self, "offsets", None)
        return GroupQuantized(self._rows("codes", self._WORDS).reshape(o, i),
                              self._rows("scales", INT4_GROUP // self.scale_group).reshape(o, -1).float(),
                              None if offsets is None else self._rows("offsets", 1).reshape(o, -1).float(),
                              8, self.scale_group, self.scales.dtype)


Q6K_SUPER = 256
"""Inputs per Q6_K super-block (one fp16 scale ``d``)."""


def _integer_factors(values: torch.Tensor, supers: torch.Tensor | None) -> torch.Tensor | None:
    """int8 ``k`` ``[O, S]`` with ``values == supers[:, j // (S / U)] * k`` exactly in float32 (``values`` ``[O, S]``,
    ``supers`` ``[O, U]``, ``U`` dividing ``S``; ``k`` 0 where the super-block value is 0), or ``None`` where they do
    not factor so (or ``supers`` is ``None`` or misshapen)."""
    o, n = values.shape
    if supers is None or supers.dim() != 2 or supers.shape[0] != o or not supers.shape[1] or n % supers.shape[1]:
        return None
    d = supers.float().repeat_interleave(n // supers.shape[1], dim=1)
    k = torch.where(d != 0, values / torch.where(d != 0, d, torch.ones_like(d)), torch.zeros_like(d)).round()
    if k.numel() and (k.min() < -128 or k.max() > 127):
        return None
    return k.to(torch.int8) if torch.equal(d * k, values) else None


def _q6k_sub_scales(gq: GroupQuantized) -> torch.Tensor | None:
    """Q6_K's int8 sub-block scales ``sc_j`` ``[O, I / 16]`` with ``scale == super_scale * sc_j`` exactly (float32),
    or ``None`` where ``gq`` is not such a weight (no super-block scales, or scales that do not factor so)."""
    if gq.bits != 8 or gq.group != 16 or gq.offset is not None or gq.shape[1] % Q6K_SUPER:
        return None
    if gq.super_scale is None or tuple(gq.super_scale.shape) != (gq.shape[0], gq.shape[1] // Q6K_SUPER):
        return None
    return _integer_factors(gq.scale, gq.super_scale)


def _q4k_scales_mins(gq: GroupQuantized) -> tuple[torch.Tensor, torch.Tensor] | None:
    """Q4_K's int8 sub-block scales ``sc_j`` and mins ``m_j`` ``[O, I / 32]`` with ``scale == d * sc_j`` and
    ``offset == -dmin * m_j`` exactly (float32; ``d``, ``dmin``: ``super_scale``, ``super_min``), or ``None`` where
    ``gq`` is not such a weight."""
    if gq.bits != 4 or gq.group != INT4_GROUP or gq.offset is None or gq.super_min is None:
        return None
    o, i = gq.shape
    if i % Q6K_SUPER or gq.super_scale is None or tuple(gq.super_scale.shape) != (o, i // Q6K_SUPER):
        return None
    sc, m = _integer_factors(gq.scale, gq.super_scale), _integer_factors(gq.offset, -gq.super_min.float())
    return None if sc is None or m is None else (sc, m)


class W6A8Linear(_BlockLinear):
    """GGUF's Q6_K as stored, 6 bits a weight, on int8 activations: ``W[o, i] = (d[o, i // 256] * sc[o, i // 16]) *
    q[o, i]``, ``q`` in -32..31 (the file's 6-bit code minus 32), ``sc`` int8 (the file's sub-block scales), ``d``
    float32 (its fp16 super-block scale); ``d * sc`` is exact in float32, so the products are
    :class:`W8A8Linear`'s on the same codes bit for bit, from 0.82 bytes a weight instead of 1.25
    (:mod:`speculant.kernels.qgemm`'s 6-bit layout, ``torch.ops.speculant.w6a8k_mm``):

    * ``codes`` ``[O, I * 3 / 4]`` uint8: per group of 8 outputs and block of 32 inputs, the 8-bit layout's 256 bytes
      (:class:`W8A8Linear`: 32-byte words ``c`` = 0..7, each 4 codes of each output) as ``q + 32``: 128 bytes of low
      nibbles (word ``c`` in the low nibbles of bytes ``32c ..``, word ``c + 4`` in their high ones, ``c`` < 4), then
      64 bytes of high bit pairs (bits ``2k, 2k + 1`` of byte ``32h + j``: those of word ``4h + k``'s byte ``j``); the
      last ``O % 8`` outputs row by row, per block 16 bytes of nibbles (code ``j`` low, ``j + 16`` high) and 8 of
      high pairs (bits ``2k, 2k + 1`` of byte ``j``: code ``j + 8k``'s);
    * ``scales`` ``[O, I / 16]`` int8 and ``supers`` ``[O, I / 256]`` float32, interleaved by groups of 8 outputs
      like :class:`W8A8Linear`'s float32 scales.

    Raises:
        SpeculantError: codes that are not Q6_K's with their super-block scales (:func:`block_linear` then takes
            :class:`W8A8Linear`).
    """

    format = "w8a8"
    _WORDS = 6           # 24 bytes per block and output

    def __init__(self, gq: GroupQuantized, bias: torch.Tensor | None = None):
        o, i = gq.shape
        super().__init__(i, o, bias)
        sc = _q6k_sub_scales(gq)
        if sc is None:
            raise SpeculantError("w6a8 takes Q6_K codes (8-bit codes in -32..31, scales per 16 that are an fp16 "
                                 "super-block scale per 256 times int8 sub-block scales)")
        g = i // INT4_GROUP
        t = o // LANES * LANES
        packed = torch.empty((o, g * 24), dtype=torch.uint8)
        for start in range(0, o, PACK_ROWS):          # PACK_ROWS is a multiple of LANES: groups never split
            end = min(o, start + PACK_ROWS)
            packed[start:end] = _pack6(gq.codes[start:end], max(0, min(end, t) - start))
        self.register_buffer("codes", packed)
        self.register_buffer("scales", _interleave(sc.view(o, g, 2, 1), g))
        self.register_buffer("supers", _interleave(gq.super_scale.float().view(o, i // Q6K_SUPER, 1, 1),
                                                   i // Q6K_SUPER))

    @property
    def scale_group(self) -> int:
        return 16

    def matmul(self, x):
        return torch.ops.speculant.w6a8k_mm(x.float(), self.codes, self.scales, self.supers, self.prefetch)

    def group_quantized(self):
        o, i = self.out_features, self.in_features
        g = i // INT4_GROUP
        sc = _interleave(self.scales.view(o, g, 2, 1), g, inverse=True).view(o, -1).float()
        d = _interleave(self.supers.view(o, i // Q6K_SUPER, 1, 1), i // Q6K_SUPER, inverse=True).view(o, -1)
        t = o // LANES * LANES
        codes = torch.cat([_unpack6(self.codes[:t], t), _unpack6(self.codes[t:], 0)]).view(o, i)
        return GroupQuantized(codes, d.repeat_interleave(Q6K_SUPER // 16, dim=1) * sc, None, 8, 16, torch.float32,
                              "Q6_K", d.clone())


def _pack6(codes: torch.Tensor, grouped: int) -> torch.Tensor:
    """Codes ``[n, I]`` int8 (-32..31) -> :class:`W6A8Linear`'s ``codes`` rows ``[n, I * 3 / 4]``: the first
    ``grouped`` rows (a multiple of 8) interleaved by groups of 8, the rest row by row."""
    n, i = codes.shape
    g = i // INT4_GROUP
    u = (codes.to(torch.int16) + 32).to(torch.uint8)
    grouped_rows = torch.empty((0, g * 24), dtype=torch.uint8)
    if grouped:
        head = _interleave(u[:grouped].contiguous().view(grouped, g, 8, 4), g).view(grouped // LANES, g, 8, 32)
        lo, hi = head & 0x0F, head >> 4
        nib = lo[:, :, :4] | (lo[:, :, 4:] << 4)                                    # [n/8, g, 4, 32]
        pairs = torch.stack([sum(hi[:, :, 4 * h + k] << (2 * k) for k in range(4)) for h in range(2)], 2)
        grouped_rows = torch.cat([nib, pairs], 2).reshape(grouped, g * 24)
    tail = u[grouped:].view(n - grouped, g, 32)
    tlo, thi = tail & 0x0F, tail >> 4
    tnib = tlo[..., :16] | (tlo[..., 16:] << 4)
    tpairs = sum(thi[..., 8 * k:8 * k + 8] << (2 * k) for k in range(4))
    tail_rows = torch.cat([tnib, tpairs], -1).reshape(n - grouped, g * 24)
    return torch.cat([grouped_rows, tail_rows])


def _unpack6(packed: torch.Tensor, grouped: int) -> torch.Tensor:
    """The inverse of :func:`_pack6` for rows that are all grouped (``grouped == len(packed)``) or all row by row
    (``grouped == 0``): codes ``[n, I]`` int8."""
    n = packed.shape[0]
    g = packed.shape[1] // 24
    if grouped:
        b = packed.view(n // LANES, g, 6, 32)
        nib, pairs = b[:, :, :4], b[:, :, 4:]
        lo = torch.cat([nib & 0x0F, nib >> 4], 2)                                   # [n/8, g, 8, 32]
        hi = torch.stack([(pairs[:, :, h] >> (2 * k)) & 3 for h in range(2) for k in range(4)], 2)
        u = (lo | (hi << 4)).reshape(n, g, 8, 4)
        u = _interleave(u, g, inverse=True).view(n, g * 32)
    else:
        b = packed.view(n, g, 24)
        nib, pairs = b[..., :16], b[..., 16:]
        lo = torch.cat([nib & 0x0F, nib >> 4], -1)
        hi = torch.cat([(pairs >> (2 * k)) & 3 for k in range(4)], -1)
        u = (lo | (hi << 4)).view(n, g * 32)
    return (u.to(torch.int16) - 32).to(torch.int8)


def _q5_codes(gq: GroupQuantized) -> bool:
    """Whether ``gq`` is Q5_0-like: 8-bit codes in -16..15 with an fp16 scale per 32 and no offsets (what
    :class:`W5A8Linear` stores in 5 bits)."""
    if gq.bits != 8 or gq.group != INT4_GROUP or gq.offset is not None or gq.scale_dtype != torch.float16:
        return False
    return not gq.codes.numel() or (int(gq.codes.min()) >= -16 and int(gq.codes.max()) <= 15)


class W5A8Linear(_BlockLinear):
    """GGUF's Q5_0 as stored, 5 bits a weight, on int8 activations: ``W[o, i] = scales[o, i // 32] * q[o, i]``,
    ``q`` in -16..15 (the file's 5-bit code minus 16), ``scales`` float16 (the file's ``d``); the products are
    :class:`W8A8Linear`'s on the same codes bit for bit, from 0.69 bytes a weight instead of 1.06
    (:mod:`speculant.kernels.qgemm`'s 5-bit layout, ``torch.ops.speculant.w5a8_mm``):

    * ``codes`` ``[O, I * 5 / 8]`` uint8: per group of 8 outputs and block of 32 inputs, the 8-bit layout's 256 bytes
      (:class:`W8A8Linear`: 32-byte words ``c`` = 0..7, each 4 codes of each output) as ``q + 16``: 128 bytes of low
      nibbles (word ``c`` in the low nibbles of bytes ``32c ..``, word ``c + 4`` in their high ones, ``c`` < 4), then
      32 bytes of high bits (bit ``c`` of byte ``128 + j``: word ``c``'s byte ``j``'s); the last ``O % 8`` outputs
      row by row, per block 16 bytes of nibbles (code ``j`` low, ``j + 16`` high) and 4 of high bits (bit ``i % 8``
      of byte ``i / 8``: code ``i``'s, GGUF's order);
    * ``scales`` ``[O, I / 32]`` float16, interleaved by groups of 8 outputs like :class:`W8A8Linear`'s.

    Raises:
        SpeculantError: codes that are not Q5_0-like (:func:`block_linear` then takes :class:`W8A8Linear`).
    """

    format = "w8a8"

    def __init__(self, gq: GroupQuantized, bias: torch.Tensor | None = None):
        o, i = gq.shape
        super().__init__(i, o, bias)
        if not _q5_codes(gq):
            raise SpeculantError("w5a8 takes Q5_0 codes (8-bit codes in -16..15, an fp16 scale per 32, no offsets)")
        g = i // INT4_GROUP
        t = o // LANES * LANES
        packed = torch.empty((o, g * 20), dtype=torch.uint8)
        for start in range(0, o, PACK_ROWS):          # PACK_ROWS is a multiple of LANES: groups never split
            end = min(o, start + PACK_ROWS)
            packed[start:end] = _pack5(gq.codes[start:end], max(0, min(end, t) - start))
        self.register_buffer("codes", packed)
        self.register_buffer("scales", _interleave(gq.scale.half().view(o, g, 1, 1), g))

    def matmul(self, x):
        return torch.ops.speculant.w5a8_mm(x.float(), self.codes, self.scales, self.prefetch)

    def group_quantized(self):
        o, i = self.out_features, self.in_features
        t = o // LANES * LANES
        codes = torch.cat([_unpack5(self.codes[:t], t), _unpack5(self.codes[t:], 0)]).view(o, i)
        return GroupQuantized(codes, self._rows("scales", 1).view(o, -1).float(), None, 8, INT4_GROUP, torch.float16)


def _pack5(codes: torch.Tensor, grouped: int) -> torch.Tensor:
    """Codes ``[n, I]`` int8 (-16..15) -> :class:`W5A8Linear`'s ``codes`` rows ``[n, I * 5 / 8]``: the first
    ``grouped`` rows (a multiple of 8) interleaved by groups of 8, the rest row by row."""
    n, i = codes.shape
    g = i // INT4_GROUP
    u = (codes.to(torch.int16) + 16).to(torch.uint8)
    grouped_rows = torch.empty((0, g * 20), dtype=torch.uint8)
    if grouped:
        head = _interleave(u[:grouped].contiguous().view(grouped, g, 8, 4), g).view(grouped // LANES, g, 8, 32)
        lo, hi = head & 0x0F, head >> 4
        nib = (lo[:, :, :4] | (lo[:, :, 4:] << 4)).reshape(grouped // LANES, g, 128)
        bits = sum(hi[:, :, c] << c for c in range(8))                              # [n/8, g, 32]
        grouped_rows = torch.cat([nib, bits], 2).reshape(grouped, g * 20)
    tail = u[grouped:].view(n - grouped, g, 32)
    tlo, thi = tail & 0x0F, (tail >> 4).view(n - grouped, g, 4, 8)
    tnib = tlo[..., :16] | (tlo[..., 16:] << 4)
    tbits = sum(thi[..., k] << k for k in range(8))                                 # [n, g, 4]
    tail_rows = torch.cat([tnib, tbits], -1).reshape(n - grouped, g * 20)
    return torch.cat([grouped_rows, tail_rows])


def _unpack5(packed: torch.Tensor, grouped: int) -> torch.Tensor:
    """The inverse of :func:`_pack5` for rows that are all grouped (``grouped == len(packed)``) or all row by row
    (``grouped == 0``): codes ``[n, I]`` int8."""
    n = packed.shape[0]
    g = packed.shape[1] // 20
    if grouped:
        b = packed.view(n // LANES, g, 160)
        nib, bits = b[:, :, :128].view(n // LANES, g, 4, 32), b[:, :, 128:]
        lo = torch.cat([nib & 0x0F, nib >> 4], 2)                                   # [n/8, g, 8, 32]
        hi = torch.stack([(bits >> c) & 1 for c in range(8)], 2)
        u = (lo | (hi << 4)).reshape(n, g, 8, 4)
        u = _interleave(u, g, inverse=True).view(n, g * 32)
    else:
        b = packed.view(n, g, 20)
        nib, bits = b[..., :16], b[..., 16:]
        lo = torch.cat([nib & 0x0F, nib >> 4], -1)
        hi = torch.stack([(bits >> k) & 1 for k in range(8)], -1).reshape(n, g, 32)
        u = (lo | (hi << 4)).view(n, g * 32)
    return (u.to(torch.int16) - 16).to(torch.int8)


def block_linear(gq: GroupQuantized, bias: torch.Tensor | None = None) -> "_BlockLinear":
    """The projection of GGUF codes ``gq`` as stored on our kernels: Q4_K's with their super-block scales and mins
    :class:`W4A8KLinear`, other 4-bit codes :class:`W4A8Linear`, Q6_K's with their super-block scales
    :class:`W6A8Linear`, Q5_0's :class:`W5A8Linear`, other 8-bit ones :class:`W8A8Linear` (each in the layout of its
    scales; no requantization).

    Raises:
        SpeculantError: codes no layout takes (groups other than 16 or 32).
    """
    if gq.bits == 4:
        return (W4A8KLinear if _q4k_scales_mins(gq) is not None else W4A8Linear)(gq, bias)
    if _q6k_sub_scales(gq) is not None:
        return W6A8Linear(gq, bias)
    return (W5A8Linear if _q5_codes(gq) else W8A8Linear)(gq, bias)


class StackedLinear(PackedLinear):
    """A fused projection (q|k|v, gate|up) whose GGUF tensors are stored in different block types (a Q4_K_M file's
    Q4_K q, k and Q6_K v): its output columns are its parts' (:class:`W4A8Linear` / :class:`W8A8Linear`, each in
    its own type's layout) in order, then ``bias``.  The fused step runs the parts on the same int8 activations
    (``decode_step.c``'s stacked projections)."""

    format = "w4a8"

    def __init__(self, parts: list[PackedLinear], bias: torch.Tensor | None = None):
        super().__init__(parts[0].in_features, sum(p.out_features for p in parts), bias)
        if any(p.in_features != self.in_features or p.bias is not None for p in parts):
            raise SpeculantError("a stacked projection's parts take the same inputs and have no bias")
        self.parts = nn.ModuleList(parts)

    @classmethod
    def empty(cls, in_features, out_features, buffers):
        mod = cls.__new__(cls)
        PackedLinear.__init__(mod, in_features, out_features, buffers.get("bias"))
        mod.parts = nn.ModuleList()              # filled by the loader, part by part
        return mod

    def matmul(self, x):
        return torch.cat([p.matmul(x) for p in self.parts], -1)

    def dequantized_weight(self):
        return torch.cat([p.dequantized_weight() for p in self.parts])


PACKED_CLASSES = {cls.__name__: cls for cls in (Bf16Linear, Int8Linear, Int4Linear, W4A8Linear, W4A8KLinear,
                                                W8A8Linear, W6A8Linear, W5A8Linear, StackedLinear)}


def _int4_scales_and_zeros(codes: GroupQuantized) -> tuple[torch.Tensor, torch.Tensor]:
    """(torch's packed int4 weight, ``scales_and_zeros`` ``[I / 32, O, 2]`` bfloat16) for ``codes``."""
    packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(codes.codes.to(torch.int32).contiguous(), 1)
    offset = codes.offset if codes.offset is not None else torch.zeros_like(codes.scale)
    zero = offset + 8.0 * codes.scale
    return packed, torch.stack([codes.scale, zero], -1).transpose(0, 1).contiguous().to(torch.bfloat16)


def select_rows(projection: nn.Module, index: torch.Tensor) -> nn.Module:
    """Output rows ``index`` of a projection in any format (a float ``nn.Linear`` gives a float
    :class:`~speculant.models.linear.DecodeLinear`): the reduced-vocabulary LM head of a draft head.

    Raises:
        SpeculantError: an int4 projection (its packed layout is not row-sliceable).
    """
    if isinstance(projection, PackedLinear):
        return projection.select_rows(index)
    from ..models.linear import DecodeLinear
    rows = DecodeLinear(projection.in_features, int(index.numel()), bias=projection.bias is not None,
                        device="meta")
    rows.weight = nn.Parameter(projection.weight.detach()[index].contiguous(), requires_grad=False)
    if projection.bias is not None:
        rows.bias = nn.Parameter(projection.bias.detach()[index].contiguous(), requires_grad=False)
    return rows


def lm_head_rows_weight(decoder, index: torch.Tensor | None = None) -> torch.Tensor:
    """Float32 rows ``index`` (all when ``None``) ``[V', D]`` of ``decoder``'s LM head as its kernel uses them
    (dequantized for an int8/bf16 head): for heads that reuse the frozen LM head at another precision."""
    head = decoder.lm_head_proj
    if isinstance(head, PackedLinear):
        head = head if index is None else head.select_rows(index)
        return head.dequantized_weight()
    w = head.weight.detach()
    return w if index is None else w[index]


def _row_chunks(rows: int, cols: int, elements: int = 1 << 21) -> list[slice]:
    """Slices of ``rows`` rows of ``cols`` elements, ~``elements`` per slice: quantizing a large weight a chunk at a
    time (every step is per row or per group, so the result is the same bits) keeps its float temporaries small."""
    step = max(1, elements // max(cols, 1))
    return [slice(r, min(r + step, rows)) for r in range(0, rows, step)]


def int4_fits(out_features: int, in_features: int) -> bool:
    """Whether torch's int4 kernel takes an ``[O, I]`` weight."""
    return out_features % 16 == 0 and in_features % INT4_GROUP == 0


def quantize_q4(weight: torch.Tensor) -> GroupQuantized:
    """Float weight ``[O, I]`` -> 4-bit group-wise codes by llama.cpp's reference Q4_1 quantizer
    (``quantize_row_q4_1_ref``, as the ``gguf`` package implements it, which makes the codes: per block of 32,
    ``d = (max - min) / 15``, ``q = trunc((w - min) / d + 0.5)``, then ``d`` and ``min`` rounded to float16 as a
    GGUF stores them), so a projection quantized here has the bytes ``gguf.quants.quantize(w, Q4_1)`` writes."""
    return _reference_quantized(weight, "Q4_1")


def quantize_q8(weight: torch.Tensor) -> GroupQuantized:
    """Float weight ``[O, I]`` -> symmetric 8-bit codes per group of 32 by llama.cpp's reference Q8_0 quantizer
    (``quantize_row_q8_0_ref`` through the ``gguf`` package, bit for bit: ``d = max|w| / 127``,
    ``q = roundf(w / d)`` half away from zero, ``d`` stored in float16)."""
    return _reference_quantized(weight, "Q8_0")


def _reference_quantized(weight: torch.Tensor, kind: str) -> GroupQuantized:
    """``weight`` ``[O, I]`` quantized by ``gguf.quants.quantize`` to ``kind`` in row chunks, read back as codes."""
    from gguf import GGMLQuantizationType
    from gguf.quants import quantize

    from ..models.gguf_codes import decode_blocks
    o, i = weight.shape
    parts = []
    for rows in _row_chunks(o, i):
        w = weight.detach()[rows].float().contiguous().numpy()
        parts.append(decode_blocks(kind, quantize(w, GGMLQuantizationType[kind]).reshape(w.shape[0], -1)))
    out = parts[0] if len(parts) == 1 else GroupQuantized(
        torch.cat([p.codes for p in parts]), torch.cat([p.scale for p in parts]),
        None if parts[0].offset is None else torch.cat([p.offset for p in parts]), parts[0].bits)
    return replace(out, kind=None)                     # made here: packed as torch-made codes always were


def pack_linear(fmt: str, weight: torch.Tensor, bias: torch.Tensor | None = None,
                codes: GroupQuantized | list[GroupQuantized] | None = None) -> PackedLinear:
    """The projection ``weight`` ``[O, I]`` (float) in format ``fmt`` (not ``fp32``: float32 projections stay
    :class:`~speculant.models.linear.DecodeLinear`, an ``nn.Linear`` that training and LoRA can use).

    ``codes``: the GGUF's own group-wise codes of the same weight (or a list of them: a fused projection whose
    tensors differ in type; torch's formats quantize such a projection from ``weight``, as before); ``int4`` packs
    4-bit codes as they are (no requantization), ``w4a8``/``w8a8`` take the
    codes of every type :mod:`~speculant.models.gguf_codes` reads as stored, whichever of the two is asked
    (:func:`block_linear`: a Q8_0 projection of a ``w4a8`` model runs in ``w8a8``, a Q4_K LM head in ``w4a8``).
    Shapes a kernel cannot take fall back ``int4 -> int8 -> bf16``.

    Raises:
        SpeculantError: unknown format.
    """
    if fmt != "w8a8":
        check_format(fmt)
    o, i = weight.shape
    if isinstance(codes, list) and fmt not in ("w4a8", "w8a8"):
        codes = None                 # torch's formats take one layout per projection: quantized from the float weight
    if fmt in ("w4a8", "w8a8"):
        if i % INT4_GROUP == 0:
            qgemm.require()
            if isinstance(codes, list):                  # parts stored in different types: each as stored
                return StackedLinear([block_linear(c) for c in codes], bias)
            if codes is not None and codes.kind is not None:
                return block_linear(codes, bias)         # a GGUF's codes of any type, as stored
            if fmt == "w8a8":
                ok = codes is not None and codes.bits == 8 and codes.group == INT4_GROUP and codes.offset is None
                return W8A8Linear(codes if ok else quantize_q8(weight), bias)
            if codes is None or codes.bits != 4 or codes.group != INT4_GROUP:
                codes = quantize_q4(weight)
            return W4A8Linear(codes, bias)
        fmt = "int8"
    if fmt == "int4":
        if int4_fits(o, i):
            if codes is None or codes.bits != 4 or codes.group != INT4_GROUP:
                codes = quantize_q4(weight)
            return Int4Linear(codes, bias)
        fmt = "int8"
    if fmt == "int8":
        return Int8Linear(weight, bias)
    if fmt == "bf16":
        return Bf16Linear(weight, bias)
    raise SpeculantError("fp32 projections are not packed; keep the model's DecodeLinear")


PROJECTIONS = ("self_attn.qkv_proj", "self_attn.o_proj", "mlp.gate_up_proj", "mlp.down_proj")


def apply_weight_format(decoder, fmt: str, codes: dict[str, GroupQuantized] | None = None) -> None:
    """Put every projection of ``decoder`` (a :class:`~speculant.models.llama.LlamaDecoder`) in format ``fmt``, in place.

    The float32 projection weights are dropped (the token embedding stays float32: it is a lookup);
    ``codes`` (from :func:`~speculant.models.gguf_codes.read_group_quantized`) lets ``int4`` and ``w4a8`` use
    the GGUF's own 4-bit codes (and ``w4a8``'s LM head its Q8_0 codes).  The LM head of ``int4`` is ``int8``,
    that of ``w4a8`` is ``w8a8`` (see the module docstring).
    ``decoder.weight_format`` records ``fmt``.

    Raises:
        SpeculantError: unknown format, or a decoder already in another format.
    """
    check_format(fmt)
    current = getattr(decoder, "weight_format", "fp32")
    if current != "fp32":
        raise SpeculantError(f"the model's weights are already in format {current!r}; load it again for {fmt!r}")
    if fmt == "fp32":
        return
    for i, layer in enumerate(decoder.layers):
        pack_projections(layer, fmt, layer_codes(codes, i))
    pack_head(decoder, fmt, codes)


def layer_codes(codes, i: int) -> dict:
    """The GGUF codes of decoder layer ``i``'s :data:`PROJECTIONS` (by projection name; ``None`` where absent) out
    of a model's ``codes`` (:func:`apply_weight_format`; ``None``: none)."""
    return {name: (codes or {}).get(f"layers.{i}.{name}") for name in PROJECTIONS}


def block_linear_by_rows(rows: int, decode, bias: torch.Tensor | None = None) -> "_BlockLinear | None":
    """:func:`block_linear` of a tensor's ``rows`` rows of codes, decoded and packed :data:`PACK_ROWS` rows at a
    time (``decode(start, end)``: the :class:`GroupQuantized` of rows ``[start, end)``, e.g.
    :meth:`~speculant.models.gguf_codes.GGUFCodes.row_slices`) and copied into the whole's buffers: one slice's codes
    held at a time beside the packed result, not the whole tensor's (a 262k-token LM head's, BENCHMARKS.md BC).
    The same buffers as packing the whole (the kernels' interleaving stays within groups of :data:`LANES` rows, and
    :data:`PACK_ROWS` is a multiple of it).  ``None`` where the slices do not all pack into one class with buffers of
    the same row shapes (a K-quant's scales that factor exactly in some rows only): then pack the whole."""
    whole, cls, in_features = {}, None, None
    for start in range(0, rows, PACK_ROWS):
        end = min(rows, start + PACK_ROWS)
        part = block_linear(decode(start, end))
        buffers = dict(part.named_buffers(recurse=False))
        if cls is None:
            cls, in_features = type(part), part.in_features
            whole = {k: torch.empty((rows, *v.shape[1:]), dtype=v.dtype) for k, v in buffers.items()}
        if type(part) is not cls or set(buffers) != set(whole) or any(
                v.shape[1:] != whole[k].shape[1:] or v.dtype != whole[k].dtype or v.shape[0] != end - start
                for k, v in buffers.items()):
            return None
        for k, v in buffers.items():
            whole[k][start:end] = v
        del part, buffers
    if bias is not None:
        whole["bias"] = bias
    return cls.empty(in_features, rows, whole)


def pack_head(decoder, fmt: str, codes=None) -> None:
    """Put ``decoder``'s LM head in the head format of ``fmt`` (:func:`head_format`; ``codes``: as
    :func:`apply_weight_format`'s) and record ``fmt`` as ``decoder.weight_format``: the last step of packing a
    model whose layers are packed (:func:`pack_projections`).  A head that is one tensor of a GGUF file in its row
    order is decoded and packed a slice of rows at a time (:func:`block_linear_by_rows`)."""
    head, packed = decoder.lm_head_proj, None
    sliced = None
    if (head_format(fmt) in ("w4a8", "w8a8") and head.in_features % INT4_GROUP == 0
            and hasattr(codes, "row_slices") and "lm_head_proj" in codes):
        sliced = codes.row_slices("lm_head_proj")
    if sliced is not None and sliced[0] == head.out_features:
        qgemm.require()
        packed = block_linear_by_rows(*sliced, head.bias)
    decoder.lm_head_proj = packed if packed is not None else pack_linear(
        head_format(fmt), head.weight, head.bias, (codes or {}).get("lm_head_proj"))
    decoder.weight_format = fmt


def pack_projections(layer, fmt: str, codes: dict[str, GroupQuantized | None] | None = None) -> None:
    """Put the :data:`PROJECTIONS` of one decoder layer in format ``fmt`` (:func:`pack_linear`), in place;
    ``codes``: the GGUF's own codes per projection name, where known."""
    for name in PROJECTIONS:
        parent_name, attr = name.split(".")
        parent = getattr(layer, parent_name)
        lin = getattr(parent, attr)
        setattr(parent, attr, pack_linear(fmt, lin.weight, lin.bias, (codes or {}).get(name)))


def weight_bytes(module: nn.Module) -> int:
    """Weight bytes of ``module`` [bytes]: its parameters plus the packed buffers of its
    :class:`PackedLinear` projections (whose weights are buffers, not parameters; a stack's counted in its parts)."""
    params = sum(p.numel() * p.element_size() for p in module.parameters())
    return params + sum(m.nbytes for m in module.modules()
                        if isinstance(m, PackedLinear) and not isinstance(m, StackedLinear))
