"""Sampling without replacement with Gumbel perturbations.

* Gumbel-Top-k (Vieira 2014; Kool et al. 2019, Sec. 2): the k largest of
  ``log q + G`` (G i.i.d. standard Gumbel) are k draws from ``q`` without
  replacement, in their sampling order.
* Truncated Gumbel (Kool et al. 2019, Eq. 7 / Appendix B): used by stochastic
  beam search to make the children's perturbed scores have maximum equal to
  the parent's.
"""

from __future__ import annotations

import torch


def gumbel_like(x: torch.Tensor, generator: torch.Generator | None) -> torch.Tensor:
    """Standard Gumbel noise with the shape of ``x`` (fp32)."""
    u = torch.rand(x.shape, generator=generator, dtype=torch.float32, device=x.device)
    return -torch.log((-torch.log(u.clamp_min(1e-20))).clamp_min(1e-20))


def gumbel_top_k(probs: torch.Tensor, k: int, generator: torch.Generator | None) -> torch.Tensor:
    """``k`` token ids ``[..., k']`` sampled from ``probs`` ``[..., V]`` without replacement, in sampling order.

    ``k' = min(k, number of tokens with positive probability)`` (a batch uses the
    smallest such count over rows).
    """
    scores = torch.log(probs) + gumbel_like(probs, generator)
    k = min(k, int((probs > 0).sum(-1).min()))
    return torch.topk(scores, k, dim=-1).indices


def truncated_gumbel(scores: torch.Tensor, bound: torch.Tensor) -> torch.Tensor:
    """Shift perturbed scores ``[..., V]`` so their max equals ``bound`` ``[..., 1]`` (Kool et al. 2019, Eq. 23).

    ``G~ = -log(exp(-T) - exp(-Z) + exp(-G))`` with ``Z = max G``, computed in the
    numerically stable form of the reference implementation.
    """
    z = scores.amax(-1, keepdim=True)
    v = bound - scores + torch.log1p(-torch.exp(scores - z))
    return bound - torch.clamp_min(v, 0) - torch.log1p(torch.exp(-v.abs()))
