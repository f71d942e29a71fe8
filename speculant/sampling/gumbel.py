"""Sampling without replacement with Gumbel perturbations.

* Successive sampling without replacement (:func:`sample_without_replacement`) and top-down truncated
  Gumbels (:func:`truncated_gumbel_below`): the same laws as the two below, with one reduction over the
  vocabulary instead of per-token logarithms and random numbers; the tree builders use these.
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


BLOCK = 256
"""Tokens per block of the two-level inverse CDF of :func:`sample_without_replacement`."""


def sample_without_replacement(probs: torch.Tensor, k: int, generator: torch.Generator | None,
                               block: int = BLOCK, pad: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """``k`` tokens drawn from each row of ``probs`` ``[R, V]`` without replacement, in sampling order.

    Successive sampling: draw j is a categorical draw from the tokens not drawn yet, in proportion to
    ``probs``; the ordered sample has the law of Gumbel-Top-k (Plackett-Luce; Kool et al. 2019, Sec. 2),
    for any support.  Each draw is a two-level inverse CDF: the row's block masses (one reduction over
    the vocabulary per call, the only full-vocabulary pass), then the tokens of the chosen block; a drawn
    token's block mass is recomputed from its block without it.  Masses are float64.

    Returns:
        ``tokens`` ``[R, k']`` int64 and ``remaining`` ``[R, k']`` float64, the mass left before each
        draw; ``k' = min(k, fewest positive-probability tokens of any row)`` (the rule of :func:`gumbel_top_k`),
        or with ``pad`` ``k' = min(k, most positive-probability tokens of any row)`` and token -1 (mass 0)
        once a row has none left.
    """
    r, v = probs.shape
    nb = -(-v // block)
    padded = probs if nb * block == v else torch.nn.functional.pad(probs, (0, nb * block - v))
    blocks = padded.view(r, nb, block)
    mass = blocks.sum(-1, dtype=torch.float64)                               # [R, nb]
    rows = torch.arange(r)
    tokens, remaining = [], []
    for _ in range(k):
        total = mass.sum(-1)
        live = total > 0
        if not bool(live.any() if pad else live.all()):
            break
        cum = mass.cumsum(-1)
        t = torch.rand(r, generator=generator, dtype=torch.float64) * total
        b = torch.searchsorted(cum, torch.minimum(t, cum[:, -1] * (1 - 1e-12))[:, None], right=True)[:, 0]
        b = b.clamp_max(nb - 1)
        within = blocks[rows, b].double()                                    # [R, block]
        for prev in tokens:                                                  # drawn tokens of this block: gone
            same = (prev // block) == b
            within[rows[same], prev[same] % block] = 0.0
        offset = (t - (cum[rows, b] - mass[rows, b])).clamp_min(0.0)
        cw = within.cumsum(-1)
        i = torch.searchsorted(cw, torch.minimum(offset, cw[:, -1] * (1 - 1e-12))[:, None], right=True)[:, 0]
        i = i.clamp_max(block - 1)
        within[rows, i] = 0.0
        mass[rows, b] = within.sum(-1)
        tokens.append(torch.where(live, b * block + i, -1))
        remaining.append(total.clamp_min(0.0))
    if not tokens:
        return torch.empty(r, 0, dtype=torch.long), torch.empty(r, 0, dtype=torch.float64)
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
