"""Float32 projections for decoding-sized batches, with the kernel route chosen by measurement.

Speculative decoding pays off only if verifying ``K+1`` tokens costs about as much as decoding one
(Leviathan et al. 2023, Sec. 3: the target is memory-bound, so the extra rows are nearly free).  On a
CPU that premise depends on the BLAS call: on some machines MKL's ``sgemm`` for ``x [M, I] @ W[O, I]^T``
with a small ``M`` (2..16 rows) packs the whole weight every call and costs 2-2.5x the one-row
product, while ``(W @ x^T)^T`` streams the weight once; on some, a single row runs faster as a
two-column product (``weight @ [x, 0]``).  Which is faster (and which keeps a row's result bit-identical
whatever else is in the batch) differs from one CPU to the next, so nothing here is fixed:
every :class:`DecodeLinear` starts on plain ``F.linear`` (:data:`DEFAULT_ROUTES`), :mod:`speculant.runtime.tune`
measures the routes on the machine at hand, and the executor that runs a model sets the chosen :class:`Routes` on its
projections (no process-wide state: two models in one process may take different routes).

:class:`DecodeLinear` is an ``nn.Linear`` (same parameters and state-dict keys, trainable, LoRA-able)
that takes the tuned route outside autograd.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

SMALL_BATCH_MAX_ROWS = 16
"""Largest number of rows (tokens in a forward, batch included) the ``transposed`` route takes."""


@dataclass(frozen=True)
class Routes:
    """How float32 projections run (chosen by :mod:`speculant.runtime.tune`, set per model by its executor).

    Attributes:
        one_row: ``"linear"`` (``F.linear``) or ``"pad2"`` (a two-column ``mm``).
        small_batch: ``"linear"`` or ``"transposed"`` (``(W @ x^T)^T`` for 2..max_rows rows).
        max_rows: row limit of the ``transposed`` route.
    """

    one_row: str = "linear"
    small_batch: str = "linear"
    max_rows: int = SMALL_BATCH_MAX_ROWS


DEFAULT_ROUTES = Routes()
"""Plain ``F.linear`` for every row count: a projection's route until a runtime sets another."""


def _plain(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> bool:
    needs_grad = x.requires_grad or weight.requires_grad or (bias is not None and bias.requires_grad)
    return x.device.type != "cpu" or (torch.is_grad_enabled() and needs_grad)


def small_batch_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
                       routes: Routes | None = None) -> torch.Tensor:
    """``F.linear(x, weight, bias)`` by the route in ``routes`` (default :data:`DEFAULT_ROUTES`).

    Args:
        x: ``[..., I]``.
        weight: ``[O, I]``; bias: ``[O]`` or ``None``.
    Returns:
        ``[..., O]``, equal to ``F.linear`` up to float rounding (summation order differs).
    Autograd and non-CPU tensors always take ``F.linear``.
    """
    r = routes or DEFAULT_ROUTES
    features = x.shape[-1]
    rows = x.numel() // features if features else 0
    if rows == 0 or _plain(x, weight, bias):
        return F.linear(x, weight, bias)
    if rows == 1 and r.one_row == "pad2":
        pair = x.new_zeros(2, features)
        pair[0] = x.reshape(features)
        out = torch.mm(weight, pair.t())[:, 0].contiguous()
    elif 2 <= rows <= r.max_rows and r.small_batch == "transposed":
        out = torch.mm(weight, x.reshape(rows, features).t()).t().contiguous()
    else:
        return F.linear(x, weight, bias)
    if bias is not None:
        out += bias
    return out.view(*x.shape[:-1], weight.shape[0])


class DecodeLinear(nn.Linear):
    """``nn.Linear`` whose forward uses :func:`small_batch_linear` (decoding-sized batches, CPU) by its ``routes``
    (:data:`DEFAULT_ROUTES` unless the executor running the model set the routes tuned for this machine)."""

    routes: Routes = DEFAULT_ROUTES

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return small_batch_linear(x, self.weight, self.bias, self.routes)
