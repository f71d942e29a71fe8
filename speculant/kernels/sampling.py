"""Python side of ``sampling.c``: a temperature softmax over vocabulary rows and inverse-CDF draws, each one C call.

A sampled decoding round reads a few vocabulary rows between two target forwards: the processed distribution of
each row the acceptance rule visits, a draw from it or from a residual distribution.  As torch operations these
are several passes and allocations per row, each slow right after a forward has streamed the weights through the
caches; here each is one call on the calling thread.  The runtime installs them under
:func:`speculant.sampling.processors.logits_to_probs` (temperature only),
:func:`~speculant.sampling.processors.sample_categorical` and :func:`speculant.verification.rules.sample_residual`
(the target's token of every sampled round, a chain node's residual); where the kernels cannot run
(:func:`available`), those keep their torch code.
"""

from __future__ import annotations

import torch

from . import build


def available() -> bool:
    """Whether the C sampling kernels run here (:func:`speculant.kernels.build.available`)."""
    return build.load() is not None


def usable(t: torch.Tensor) -> bool:
    """Whether the kernels can read ``t`` as it is: float32 on the CPU, no autograd, and the kernels available."""
    return t.dtype == torch.float32 and t.device.type == "cpu" and not t.requires_grad and available()


def softmax_rows(logits: torch.Tensor, temperature: float) -> torch.Tensor:
    """``softmax(logits / temperature)`` over the last dimension: float32 logits ``[..., V]`` (CPU) -> a new float32
    tensor of the same shape, rows summing to 1 (float64 sum; exp by a polynomial of relative error ~2e-7); a row
    of ``-inf`` gives NaNs, as ``torch.softmax`` does.

    Raises:
        ValueError: ``temperature`` is not positive.
    """
    if not temperature > 0:
        raise ValueError(f"temperature={temperature!r}: allowed: > 0")
    x = logits.contiguous()
    out = torch.empty_like(x)
    v = x.shape[-1]
    build.load().spec_softmax_rows(x.data_ptr(), x.numel() // v if v else 0, v, 1.0 / temperature, out.data_ptr())
    return out


def draw(p: torch.Tensor, u: float, q: torch.Tensor | None = None, ids: torch.Tensor | None = None) -> int:
    """One index of ``norm(max(0, p - q))`` (Leviathan et al. 2023, Alg. 1's residual), or of ``p`` when ``q`` is
    ``None``, by inverse CDF with the uniform ``u`` in ``[0, 1)``: index i when ``u * total`` falls in
    ``[c_{i-1}, c_i)`` of the float64 cumulative sums.

    Args:
        p: float32 ``[V]`` (CPU, need not be normalised).
        q: float32 ``[V]``, or ``[V']`` at the distinct token ids ``ids`` ``[V']`` (int64; zero elsewhere).
    Returns:
        an index of positive residual; where the residual is zero everywhere (``p <= q``: no rejection was
        possible) one of ``p``; ``V - 1`` for a ``p`` of zeros.
    """
    p = p.contiguous()
    v = p.shape[-1]
    lib = build.load()
    if q is None:
        return lib.spec_draw(p.data_ptr(), v, None, None, 0, u, None)
    q = q.contiguous()
    if ids is None:
        return lib.spec_draw(p.data_ptr(), v, q.data_ptr(), None, v, u, None)
    ids = ids.to(torch.int64).contiguous()
    scratch = torch.empty(v)
    return lib.spec_draw(p.data_ptr(), v, q.data_ptr(), ids.data_ptr(), ids.shape[0], u, scratch.data_ptr())

