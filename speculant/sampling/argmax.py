"""The argmax of a vocabulary's logits, as ``torch.argmax`` gives it, in less time.

``torch.argmax`` over a row of logits is not vectorized on the CPU, and a greedy verification pays it per row it
reads.  numpy's ``argmax`` over the same memory (no copy) is SIMD code run on the calling thread (BENCHMARKS.md BE
has the times; a two-level argmax in torch, block maxima first, was faster alone but slower inside decoding: its
reductions wake torch's thread pool between our kernels' parallel regions).  The same index whatever the values:
the first of tied maxima, the first NaN where there is one (both libraries document the first; ``tests/test_argmax.py`` holds
them equal on planted ties, NaNs, infinities and lengths).  Dtypes numpy lacks (bfloat16) go to ``torch.argmax``.
"""

from __future__ import annotations

import torch

_NUMPY_DTYPES = (torch.float32, torch.float64, torch.float16)


def _torch_only(logits: torch.Tensor) -> bool:
    """Whether numpy cannot read ``logits`` as they are (another device or dtype, a lazily negated view)."""
    return logits.dtype not in _NUMPY_DTYPES or logits.device.type != "cpu" or logits.is_neg()


def first_argmax(logits: torch.Tensor) -> int:
    """``int(torch.argmax(logits))`` of one row ``[V]`` on the CPU (any float dtype)."""
    if _torch_only(logits):
        return int(logits.argmax())
    return int(logits.detach().numpy().argmax())


def rows_argmax(logits: torch.Tensor) -> torch.Tensor:
    """``torch.argmax(logits, -1)`` of rows ``[R, V]`` on the CPU -> ``[R]`` (int64; other shapes: torch's)."""
    if _torch_only(logits) or logits.dim() != 2:
        return logits.argmax(-1)
    return torch.from_numpy(logits.detach().numpy().argmax(-1).astype("int64", copy=False))
