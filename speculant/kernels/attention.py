"""Masked attention over a float32 static KV cache, each query row on its own (``attention.c``).

Greedy speculative decoding is exact only if a row of a verification block (or tree) gets the bits of the
one-token step at its position.  CPU attention kernels do not promise that in float32 (their blocking depends on
how many rows and masked keys share the call), which is why the runtime kept a float64 KV cache, and reading it
became the largest cost of a step at long contexts (SmolLM2, 900 tokens: 83 MB per step, more than the int4
weights).  This kernel gives each row a fixed sequence of operations over the keys it attends, listed in slot
order, so batch invariance holds by construction in float32 (half the cache bytes of float64).  The cache may
also be float16 (:data:`CACHE_DTYPES`): keys and values rounded to nearest even when stored (by the kernel or by
torch, the same bits) and read back exactly as float32, every sum in float32, half the bytes again.

:func:`attention` is ``torch.ops.speculant.attention``; it needs the kernels of :mod:`speculant.kernels.build`
(:func:`~speculant.kernels.build.available`), and the runtime falls back to float64 SDPA without them.
"""

from __future__ import annotations

import ctypes

import torch

from . import build


_KV_BYTES = {torch.float32: 4, torch.float16: 2}
CACHE_DTYPES = tuple(_KV_BYTES)
"""KV cache dtypes the kernel reads (float16: half the bytes; every sum still in float32)."""


def kv_bytes(dtype: torch.dtype) -> int:
    """Bytes per cache element the C entry points take for a cache of ``dtype`` (one of :data:`CACHE_DTYPES`).

    Raises:
        ValueError: another dtype (naming it and the allowed ones).
    """
    try:
        return _KV_BYTES[dtype]        # a dict lookup: called once per step (no torch call on the hot path)
    except KeyError:
        raise ValueError(f"KV cache dtype {dtype} is not one the attention kernel reads; allowed: float32, float16") from None


def _attention(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, mask: torch.Tensor,
               scale: float) -> torch.Tensor:
    lib = build._LIB or build.require("float32 batch-invariant attention")
    if values.dtype != keys.dtype:
        raise ValueError(f"keys {keys.dtype} and values {values.dtype}: a cache holds both in one dtype")
    _, h, t, d = q.shape
    hkv, smax = keys.shape[1], keys.shape[2]
    s = mask.shape[-1]
    qc = q.float().transpose(1, 2).contiguous()                                  # [1, T, H, D]
    m = mask.contiguous()
    out = torch.empty(1, t, h * d)
    if lib.spec_attention(qc.data_ptr(), keys.data_ptr(), values.data_ptr(), smax, m.data_ptr(), t, h, hkv, d, s,
                          scale, kv_bytes(keys.dtype), out.data_ptr()) != 0:
        raise MemoryError("speculant attention: cannot allocate its workspace")
    return out


_OPS = torch.library.Library("speculant", "FRAGMENT")
_OPS.define("attention(Tensor q, Tensor keys, Tensor values, Tensor mask, float scale) -> Tensor")
_OPS.impl("attention", _attention, "CPU")


@torch.library.register_fake("speculant::attention")
def _(q, keys, values, mask, scale):
    return q.new_empty(1, q.shape[2], q.shape[1] * q.shape[3])


def supports(head_dim: int, dtype: torch.dtype = torch.float32) -> bool:
    """Whether the kernel takes this head size (a multiple of 8, at most 256) and cache dtype (one of
    :data:`CACHE_DTYPES`), and runs here."""
    return dtype in CACHE_DTYPES and head_dim % 8 == 0 and head_dim <= 256 and build.available()


def attention(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, mask: torch.Tensor, scale: float) -> torch.Tensor:
    """Attention of ``q`` ``[1, H, T, D]`` over the first ``S`` slots of one layer's cache ``keys``/``values``
    ``[1, Hkv, S_max, D]`` (float32 or float16, contiguous), where ``mask`` ``[T, S]`` (bool) is True; ``H`` a multiple of
    ``Hkv`` (grouped-query attention).  Returns ``[1, T, H * D]`` float32.  Softmax of ``scale * q . k`` (Vaswani
    et al. 2017, Eq. 1), computed row by row in float32 over the attended slots in slot order.

    Raises:
        SpeculantError: the kernels cannot run here.
    """
    return torch.ops.speculant.attention(q, keys, values, mask, scale)


class RaggedPlan:
    """What one batched pass (:func:`speculant.runtime.ragged.ragged_run_layers`) tells the kernel about its
    sequences, prepared once and used at every layer: rows per sequence, first slot written, the caches' storage
    (:class:`~speculant.models.kv_cache.KVCache` ``keys``/``values``, batch 1, all in one of
    :data:`CACHE_DTYPES`) and the masks ``[rows[j], starts[j] + rows[j]]`` (bool).

    Raises:
        ValueError: caches of different or unsupported dtypes.
    """

    def __init__(self, rows: list[int], starts: list[int], caches: list, masks: list[torch.Tensor]):
        n = len(rows)
        i64, ptr = ctypes.c_int64 * n, ctypes.c_void_p * n
        self.n, self.rows = n, i64(*rows)
        self.masks = [m.contiguous() for m in masks]               # kept alive while the plan is used
        self.caches = caches
        dtypes = {c.dtype for c in caches}
        if len(dtypes) > 1:
            raise ValueError(f"a batched pass over KV caches of dtypes {sorted(map(str, dtypes))}; allowed: one dtype")
        self.kv_bytes = kv_bytes(dtypes.pop()) if dtypes else 4
        self.starts = i64(*starts)
        self.smax = i64(*(c.max_length for c in caches))
        self.keys = ptr(*(c.keys.data_ptr() for c in caches))
        self.values = ptr(*(c.values.data_ptr() for c in caches))
        self.layer_stride = i64(*(c.keys.stride(0) for c in caches))
        self.mask_ptrs = ptr(*(m.data_ptr() for m in self.masks))


def ragged_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, plan: RaggedPlan, layer: int,
                     scale: float) -> torch.Tensor:
    """Several sequences' blocks of one layer in one call (a batched round, :mod:`speculant.runtime.ragged`).

    ``q`` ``[1, H, R, D]`` and the new ``k``/``v`` ``[1, Hkv, R, D]`` hold the rows of every sequence of ``plan``
    in order (``R`` = the plan's rows summed); sequence ``j``'s new keys/values are written to slots
    ``starts[j] ..`` of layer ``layer`` of its cache, then its rows attend where its mask is True.  Each row gets
    exactly the bits :func:`attention` gives it (the same C function computes both).  Returns ``[1, R, H * D]``.

    Raises:
        SpeculantError: the kernels cannot run here.
        MemoryError: the workspace cannot be allocated.
    """
    lib = build._LIB or build.require("float32 batch-invariant attention")
    _, h, r, d = q.shape
    qc = q.float().transpose(1, 2).contiguous()
    kc, vc = k.float().transpose(1, 2).contiguous(), v.float().transpose(1, 2).contiguous()
    out = torch.empty(1, r, h * d)
    status = lib.spec_attention_ragged(plan.n, plan.rows, plan.starts, plan.smax, plan.keys, plan.values,
                                       plan.layer_stride, layer, plan.mask_ptrs, qc.data_ptr(), kc.data_ptr(),
                                       vc.data_ptr(), h, k.shape[1], d, scale, plan.kv_bytes, out.data_ptr())
    if status != 0:
        raise MemoryError("speculant attention: cannot allocate its workspace")
    return out
