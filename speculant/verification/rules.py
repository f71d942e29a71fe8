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

from typing import Callable

import torch

from ..sampling.processors import row_kernels, sample_categorical
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
    """Residual distribution ``norm(max(0, r - q))`` over the last dim (Leviathan et al. 2023, Alg. 1).

    Rows where ``r == q`` (no rejection possible) keep ``r``.  Shapes ``[..., V]``.
    """
    res = torch.clamp_min(r - q, 0.0)
    total = res.sum(-1, keepdim=True)
    return torch.where(total > 0, res / total.clamp_min(1e-30), r)


def remove_token(q: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """``q`` ``[..., V]`` with token ``x`` ``[...]`` removed and renormalised: the next sibling's proposal.

    A row left with no mass becomes all zeros (no later sibling can then be accepted).
    """
    q = q.scatter(-1, x.unsqueeze(-1), 0.0)
    return q / q.sum(-1, keepdim=True).clamp_min(1e-30)


def sample_residual(p: torch.Tensor, q: torch.Tensor | None, vocab_ids: torch.Tensor | None,
                    generator: torch.Generator | None) -> int:
    """One token of the residual distribution ``norm(max(0, p - q))`` (Leviathan et al. 2023, Alg. 1; ``p`` where
    it is zero everywhere, as :func:`residual`), or of ``p`` when ``q`` is ``None``, with one float64 uniform of
    ``generator`` (as :func:`~speculant.sampling.processors.sample_categorical`).

    Args:
        p: the target's distribution ``[V]`` (need not be normalised).
        q: the draft distribution ``[V]``, or ``[V']`` over the token ids ``vocab_ids`` ``[V']`` (zero elsewhere).
    Returns:
        the token id.  Rows the installed row kernels take are one call, with no ``[V]`` residual written
        (:func:`~speculant.sampling.processors.install_row_kernels`); others :func:`residual` then the draw.
    """
    kernels = row_kernels(p)
    if kernels is not None and (q is None or row_kernels(q) is not None):
        u = float(torch.rand(1, generator=generator, dtype=torch.float64))
        return kernels.draw(p, u, q, vocab_ids)
    if q is not None:
        if vocab_ids is not None:
            q = q.new_zeros(p.shape[-1]).index_copy_(0, vocab_ids, q)
        p = residual(p[None], q[None])[0]
    return int(sample_categorical(p, generator)[0])


RowSource = torch.Tensor | Callable[[torch.Tensor], torch.Tensor]


def recursive_rejection_sampling_batch(tokens: torch.Tensor, children: torch.Tensor, q: RowSource,
                                       p: RowSource, generator: torch.Generator | None = None,
                                       without_replacement: bool = True):
    """Recursive rejection sampling over a batch of B independent draft trees.

    At a node with target ``r_1 = p`` and children ``x_1..x_m`` in sampling order:
    child j is accepted with probability ``min(1, r_j(x_j) / Q_j(x_j))``; on
    rejection ``r_{j+1} = norm(max(0, r_j - Q_j))``.  With ``without_replacement``
    (RSD, Jeon et al. 2024, Alg. 2) ``Q_1 = q`` and ``Q_{j+1}`` is ``Q_j`` with ``x_j``
    removed and renormalised; otherwise (SpecInfer, Miao et al. 2024, Alg. 2)
    ``Q_j = q``.  When every child is rejected the token is drawn from the last
    residual; after an accepted leaf, a bonus token is drawn from the target.
    A chain with ``q`` the draft distribution is Leviathan et al.'s Alg. 1; with
    ``q = one_hot(x)`` (prompt lookup) x is accepted with probability ``p(x)``.

    Args:
        tokens: drafted tokens ``[B, N]`` (node i = block entry i + 1).
        children: ``[B, N + 1, C]`` node indices of each block entry's children in
            sampling order, -1 padded.
        q: draft distributions ``[B, N + 1, V]`` each entry's children were sampled from, or a callable
            mapping block entries ``[B]`` (int64) to their rows ``[B, V]``.
        p: target distributions ``[B, N + 1, V]``, or such a callable: then only the rows the rule
            visits (one per accepted depth) are ever computed.
        generator: source of every uniform and categorical draw.
    Returns:
        ``path`` ``[B, D]`` accepted node indices from the root down (-1 padded) and
        ``token`` ``[B]``, the token the target emits after the path.
    """
    b = tokens.shape[0]
    rows = torch.arange(b)
    entry = torch.zeros(b, dtype=torch.long)
    active = torch.ones(b, dtype=torch.bool)
    token = torch.full((b,), -1, dtype=torch.long)
    path = []
    while True:
        r = p(entry) if callable(p) else p[rows, entry]
        big_q = q(entry) if callable(q) else q[rows, entry]
        kids = children[rows, entry]
        accepted = torch.full((b,), -1, dtype=torch.long)
        trying = active
        for j in range(kids.shape[1]):
            child = kids[:, j]
            trying = trying & (child >= 0)
            if not bool(trying.any()):
                break
            x = tokens[rows, child.clamp_min(0)]
            qx = big_q.gather(1, x[:, None])[:, 0]
            rx = r.gather(1, x[:, None])[:, 0]
            u = torch.rand(b, generator=generator)
            ok = trying & (qx > 0) & (u * qx < rx)
            accepted = torch.where(ok, child, accepted)
            trying = trying & ~ok
            if not bool(trying.any()):          # every row accepted a child: no residual is needed (same draws)
                break
            r = torch.where(trying[:, None], residual(r, big_q), r)
            if without_replacement and j + 1 < kids.shape[1]:   # a next sibling's proposal (none after the last)
                big_q = torch.where(trying[:, None], remove_token(big_q, x), big_q)
        done = active & (accepted < 0)
        if bool(done.any()):
            token[done] = sample_categorical(r[done], generator)[:, 0]
        active = active & (accepted >= 0)
        if not bool(active.any()):
            break
        path.append(accepted)
        entry = torch.where(active, accepted + 1, entry)
    path_t = torch.stack(path, 1) if path else torch.empty(b, 0, dtype=torch.long)
    return path_t, token


def _accepts(u: torch.Tensor, qx: torch.Tensor, r: torch.Tensor, x: int) -> bool:
    """``q(x) > 0 and u * q(x) < r(x)`` for 1-element ``u`` and ``qx`` and a row ``r`` ``[V]``, in the batch rule's
    dtypes; float32 CPU tensors through numpy float32 scalars (the same IEEE operations, without four small torch
    calls)."""
    if u.dtype == qx.dtype == r.dtype == torch.float32 and r.device.type == "cpu" and not r.requires_grad:
        qv = qx.numpy()[0]
        return bool(qv > 0 and u.numpy()[0] * qv < r.numpy()[x])
    return bool((qx > 0) & (u * qx < r[x:x + 1]))


def recursive_rejection_sampling(tree: DraftTree, p: torch.Tensor | Callable[[int], torch.Tensor],
                                 generator: torch.Generator | None,
                                 without_replacement: bool = True) -> tuple[list[int], int]:
    """:func:`recursive_rejection_sampling_batch` for one tree: the same rule, the same random draws and the same
    float operations on the rows it visits, without the batch's masks and full-vocabulary selects (a
    sequence's rounds take this one; ``tests/test_sampling_rules.py`` holds the two equal).  A node with one child
    (a chain's) reads ``q(x)`` without expanding a reduced draft row, and on a rejection draws from the residual
    at once (:func:`sample_residual`: in one call of the installed row kernels where they take the rows, the
    same law with another float rounding).

    Args:
        p: the target's processed distributions ``[N + 1, V]``, or a callable mapping a block entry to
            its row ``[V]``; the callable is called only for the entries the rule visits (the root and
            each accepted node), so a large tree never needs ``[N + 1, V]`` probabilities.
    Returns (accepted node indices, emitted token).
    """
    vocab = tree.draft_vocab_size
    entry, path = 0, []
    while True:
        kids = tree.children[entry]
        if len(kids) <= 1:                      # a leaf or a chain's node: no sibling proposal, no [V] draft row
            r = p(entry) if callable(p) else p[entry]
            if not kids:
                return path, sample_residual(r, None, None, generator)
            x = tree.tokens[kids[0]]
            if _accepts(torch.rand(1, generator=generator), tree.draft_prob(entry, x), r, x):
                path.append(kids[0])
                entry = kids[0] + 1
                continue
            return path, sample_residual(r, *tree.draft_entry(entry), generator)
        r = (p(entry) if callable(p) else p[entry])[None]                  # [1, V]: the batch rule's row
        big_q = tree.draft_row(entry)
        big_q = big_q[None] if big_q is not None else torch.zeros(1, vocab or 1)
        accepted = -1
        for j, child in enumerate(kids):
            x = tree.tokens[child]
            qx, rx = big_q[0, x:x + 1], r[0, x:x + 1]                       # 1-d: the batch rule's dtypes
            u = torch.rand(1, generator=generator)
            if bool((qx > 0) & (u * qx < rx)):
                accepted = child
                break
            r = residual(r, big_q)
            if without_replacement and j + 1 < len(kids):
                big_q = remove_token(big_q, torch.tensor([x]))
        if accepted < 0:
            return path, int(sample_categorical(r, generator)[0, 0])
        path.append(accepted)
        entry = accepted + 1
