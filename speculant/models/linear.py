"""Projections for decoding-sized batches: the one kernel choice speculative decoding depends on.

Speculative decoding pays off only if verifying ``K+1`` tokens costs about as much
as decoding one (Leviathan et al. 2023, Sec. 3: the target is memory-bound, so
the extra rows are free).  On CPU that premise depends on the BLAS call: MKL's
``sgemm`` for ``x [M, I] @ W[O, I]^T`` with a small ``M`` (2..16 rows) packs the
whole weight every call and ran at 1.9-2.5x the cost of the one-row ``sgemv``
(measured on SmolLM2-135M, BENCHMARKS.md "Small-batch projections").  Computing
the same product as ``(W @ x^T)^T`` makes the weight the streamed left operand and
costs about one ``sgemv`` for up to ~8 rows.  With more than one thread, MKL's one-row
``sgemv`` also used only part of the machine: the same product over two columns (the row plus a
zero column) was ~30% faster, so single rows are padded to two.

:class:`DecodeLinear` is an ``nn.Linear`` (same parameters and state-dict keys)
that takes that route for ``2 <= rows <= max_rows`` outside autograd.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

SMALL_BATCH_MAX_ROWS = 16
"""Largest number of rows (tokens in a forward, batch included) that uses ``(W @ x^T)^T``."""
PAD_SINGLE_ROW = True
"""With more than one torch thread, run one-row products as a two-column ``mm`` (see above)."""


def _plain(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> bool:
    needs_grad = x.requires_grad or weight.requires_grad or (bias is not None and bias.requires_grad)
    return x.device.type != "cpu" or (torch.is_grad_enabled() and needs_grad)


def small_batch_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
                       max_rows: int | None = None) -> torch.Tensor:
    """``F.linear(x, weight, bias)`` with the weight as the streamed left operand for decoding-sized inputs.

    Rows ``2..max_rows`` run as ``(weight @ x^T)^T``; one row runs as ``weight @ [x, 0]`` (two columns)
    when torch uses more than one thread and :data:`PAD_SINGLE_ROW` is set; anything else (more rows,
    autograd, non-CPU tensors) is ``F.linear``.

    Args:
        x: ``[..., I]``.
        weight: ``[O, I]``; bias: ``[O]`` or ``None``.
        max_rows: row limit for the transposed route (default :data:`SMALL_BATCH_MAX_ROWS`; 1 turns
            both special routes off).
    Returns:
        ``[..., O]``, equal to ``F.linear`` up to float rounding (summation order differs).
    """
    features = x.shape[-1]
    rows = x.numel() // features if features else 0
    limit = SMALL_BATCH_MAX_ROWS if max_rows is None else max_rows
    if limit < 2 or rows == 0 or rows > limit or _plain(x, weight, bias):
        return F.linear(x, weight, bias)
    if rows == 1:
        if not (PAD_SINGLE_ROW and torch.get_num_threads() > 1):
            return F.linear(x, weight, bias)
        pair = x.new_zeros(2, features)
        pair[0] = x.reshape(features)
        out = torch.mm(weight, pair.t())[:, 0].contiguous()
    else:
        out = torch.mm(weight, x.reshape(rows, features).t()).t().contiguous()
    if bias is not None:
        out += bias
    return out.view(*x.shape[:-1], weight.shape[0])


class DecodeLinear(nn.Linear):
    """``nn.Linear`` whose forward uses :func:`small_batch_linear` (decoding-sized batches, CPU)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return small_batch_linear(x, self.weight, self.bias)
