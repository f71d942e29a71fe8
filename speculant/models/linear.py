"""Projections for decoding-sized batches: the one kernel choice speculative decoding depends on.

Speculative decoding pays off only if verifying ``K+1`` tokens costs about as much
as decoding one (Leviathan et al. 2023, Sec. 3: the target is memory-bound, so
the extra rows are free).  On CPU that premise depends on the BLAS call: MKL's
``sgemm`` for ``x [M, I] @ W[O, I]^T`` with a small ``M`` (2..16 rows) packs the
whole weight every call and ran at 1.9-2.5x the cost of the one-row ``sgemv``
(measured on SmolLM2-135M, BENCHMARKS.md "Small-batch projections").  Computing
the same product as ``(W @ x^T)^T`` makes the weight the streamed left operand and
costs about one ``sgemv`` for up to ~8 rows.

:class:`DecodeLinear` is an ``nn.Linear`` (same parameters and state-dict keys)
that takes that route for ``2 <= rows <= max_rows`` outside autograd.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

SMALL_BATCH_MAX_ROWS = 16
MIN_ROWS = 2
"""Largest number of rows (tokens in a forward, batch included) that uses ``(W @ x^T)^T``."""


def small_batch_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
                       max_rows: int | None = None) -> torch.Tensor:
    """``F.linear(x, weight, bias)`` computed as ``(weight @ x^T)^T`` when ``x`` has 2..``max_rows`` rows.

    Args:
        x: ``[..., I]``.
        weight: ``[O, I]``; bias: ``[O]`` or ``None``.
        max_rows: row limit for the transposed route (default :data:`SMALL_BATCH_MAX_ROWS`).
    Returns:
        ``[..., O]``, equal to ``F.linear`` up to float rounding (summation order differs).
    """
    rows = x.numel() // x.shape[-1] if x.shape[-1] else 0
    limit = SMALL_BATCH_MAX_ROWS if max_rows is None else max_rows
    if rows < MIN_ROWS or rows > limit or x.device.type != "cpu" or (torch.is_grad_enabled() and
                                                               (x.requires_grad or weight.requires_grad)):
        return F.linear(x, weight, bias)
    out = torch.mm(weight, x.reshape(rows, x.shape[-1]).t()).t().contiguous()
    if bias is not None:
        out += bias
    return out.view(*x.shape[:-1], weight.shape[0])


class DecodeLinear(nn.Linear):
    """``nn.Linear`` whose forward uses :func:`small_batch_linear` (decoding-sized batches, CPU)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return small_batch_linear(x, self.weight, self.bias)
