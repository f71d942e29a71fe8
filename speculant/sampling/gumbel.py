"""Sampling without replacement with Gumbel perturbations.

* Successive sampling without replacement (:func:`sample_without_replacement`) and top-down truncated
  Gumbels (:func:`truncated_gumbel_below`): the same laws as the two below, with one cumulative sum per draw
  instead of per-token logarithms and random numbers; the tree builders use these.
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


def inverse_cdf_draw(weights: torch.Tensor, u: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """One categorical draw per row of ``weights`` ``[R, V]`` (>= 0, need not be normalised) from uniforms ``u``
    ``[R]`` in [0, 1): the token whose interval of the float64 cumulative sum holds ``u * total`` (a token of weight
    0 has an empty interval).  Returns ``(tokens [R], total [R] float64)``; a row of total 0 gives token ``V - 1``."""
    cum = weights.cumsum(-1, dtype=torch.float64)
    total = cum[:, -1].clamp_min(0.0)
    t = torch.minimum(u * total, total * (1 - 1e-12))
    return torch.searchsorted(cum, t[:, None], right=True)[:, 0].clamp_max(weights.shape[-1] - 1), total


def sample_without_replacement(probs: torch.Tensor, k: int, generator: torch.Generator | None,
                               pad: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """``k`` tokens drawn from each row of ``probs`` ``[R, V]`` without replacement, in sampling order.

    Successive sampling: draw j is a categorical draw from the tokens not drawn yet, in proportion to
    ``probs``; the ordered sample has the law of Gumbel-Top-k (Plackett-Luce; Kool et al. 2019, Sec. 2),
    for any support.  Each draw is an inverse CDF over a float64 cumulative sum of the row with the tokens
    drawn so far set to 0 (a drawn or zero-probability token has an empty interval, so it is never drawn):
    per draw one cumulative sum and a few ``[R]`` operations, no logarithm or random number per token.

    Returns:
        ``tokens`` ``[R, k']`` int64 and ``remaining`` ``[R, k']`` float64, the mass left before each
        draw; ``k' = min(k, fewest positive-probability tokens of any row)`` (the rule of :func:`gumbel_top_k`),
        or with ``pad`` ``k' = min(k, most positive-probability tokens of any row)`` and token -1 (mass 0)
        once a row has none left.
    """
    r, v = probs.shape
    positive = (probs > 0).sum(-1)
    k = min(k, int(positive.max() if pad else positive.min()))
    if k <= 0:
        return torch.empty(r, 0, dtype=torch.long), torch.empty(r, 0, dtype=torch.float64)
    left = probs.clone()
    u = torch.rand(r, k, generator=generator, dtype=torch.float64)
    tokens, remaining = [], []
    for j in range(k):
        x, total = inverse_cdf_draw(left, u[:, j])
        if j + 1 < k:
            left.scatter_(1, x[:, None], 0.0)
        tokens.append(torch.where(total > 0, x, -1))
        remaining.append(total)
    return torch.stack(tokens, 1), torch.stack(remaining, 1)


def truncated_gumbel_below(location: torch.Tensor, bound: torch.Tensor,
                           generator: torch.Generator | None) -> torch.Tensor:
    """A Gumbel(``location``) draw conditioned to be at most ``bound`` (same shapes; float64).

    Inverse CDF: ``g = location - log(exp(location - bound) + E)`` with ``E ~ Exp(1)``.  With the
    Gumbel-max property it samples stochastic beam search's children top-down (Kool et al. 2019,
    Sec. 3 and Appendix B): below a parent of score T the best child scores T, and the next best,
    given the previous score s, is the maximum of the remaining children's Gumbels, a Gumbel at
    ``log(mass left)`` truncated at s.  ``location = -inf`` gives ``-inf``.
    """
    e = -torch.log(torch.rand(location.shape, generator=generator, dtype=torch.float64).clamp_min(1e-300))
    return location - torch.logaddexp(location - bound, torch.log(e))
