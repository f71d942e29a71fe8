"""Acceptance rules: which drafted nodes the target keeps, and the one token it adds.

All rules are pure functions of the tree, the target's processed distributions
``p`` ``[N + 1, V]`` (row i = the distribution *after* block entry i; row 0 after
the root) and, for sampling, the draft distributions stored in the tree.  They
return ``(path, token)``: drafted node indices accepted from the root down, and
the token the target emits after them (a correction or a bonus token).

Sources:
    * greedy: exact match with the target's argmax (Stern et al. 2018, blockwise decoding).
    * chain speculative sampling: Leviathan et al. 2023, Alg. 1; Chen et al. 2023, Alg. 2.
    * recursive rejection sampling, siblings sampled without replacement: Jeon et al.
      2024 (RSD), Alg. 2 / Eq. 3-4.
    * i.i.d. siblings (multi-round speculative sampling): Miao et al. 2024 (SpecInfer), Alg. 2.
    A chain is a tree with one child per node, where all three sampling rules
    reduce to Leviathan et al.'s rule; a point-mass draft (prompt lookup) is
    ``q = one_hot(x)``: accept with probability p(x), else sample ``p`` with ``x`` removed.
"""

from __future__ import annotations

import torch

from ..trees.tree import DraftTree


def greedy_accept(tree: DraftTree, target_argmax: list[int]) -> tuple[list[int], int]:
    """Follow the child equal to the target's argmax at each node.

    Args:
        target_argmax: ``N + 1`` token ids, the target's argmax after each block entry.
    Returns:
        (accepted node indices, the target's next token).
    """
    path: list[int] = []
    entry = 0
    while True:
        want = target_argmax[entry]
        nxt = next((c for c in tree.children[entry] if tree.tokens[c] == want), None)
        if nxt is None:
            return path, want
        path.append(nxt)
        entry = nxt + 1


def residual(r: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """Residual distribution ``norm(max(0, r - q))`` (Leviathan et al. 2023, Alg. 1).

    When ``r == q`` no rejection can happen; ``r`` is then returned unchanged.
    """
    res = torch.clamp_min(r - q, 0.0)
    total = res.sum()
    return res / total if total > 0 else r


def remove_token(q: torch.Tensor, x: int) -> torch.Tensor | None:
    """``q`` with token ``x`` removed and renormalised (the next sibling's proposal); ``None`` if nothing is left."""
    q = q.clone()
    q[x] = 0.0
    s = q.sum()
    return q / s if s > 0 else None


def recursive_rejection_sampling(tree: DraftTree, p: torch.Tensor, generator: torch.Generator | None,
                                 without_replacement: bool = True) -> tuple[list[int], int]:
    """Recursive rejection sampling over a draft tree.

    At a node with target ``r_1 = p`` and children ``x_1..x_m`` in sampling order:
    child j is accepted with probability ``min(1, r_j(x_j) / Q_j(x_j))``; on
    rejection ``r_{j+1} = norm(max(0, r_j - Q_j))``.  With ``without_replacement``
    (RSD) ``Q_1 = q`` and ``Q_{j+1}`` is ``Q_j`` with ``x_j`` removed and renormalised;
    otherwise (SpecInfer, i.i.d. siblings) ``Q_j = q``.  When every child is
    rejected the token is drawn from the last residual; after an accepted leaf,
    a bonus token is drawn from the target.

    Args:
        p: target distributions ``[N + 1, V]``.
        generator: source of every uniform and categorical draw.
    Returns:
        (accepted node indices, emitted token).
    """
    path: list[int] = []
    entry = 0
    while True:
        r = p[entry]
        kids = tree.children[entry]
        accepted = None
        if kids:
            big_q = tree.draft_probs[entry]
            for c in kids:
                x = tree.tokens[c]
                qx, rx = float(big_q[x]), float(r[x])
                u = float(torch.rand((), generator=generator))
                if qx > 0 and u * qx < rx:
                    accepted = c
                    break
                r = residual(r, big_q)
                if without_replacement:
                    big_q = remove_token(big_q, x)
                    if big_q is None:
                        break
        if accepted is None:
            return path, int(torch.multinomial(r, 1, generator=generator))
        path.append(accepted)
        entry = accepted + 1

