"""Sequence-level acceptance: block verification (chains) and traversal verification (trees).

Token-level verification (:mod:`.rules`) accepts each drafted token against its own ratio
``min(1, p(x) / q(x))``.  These rules accept a drafted *sequence* by the running weight

    ``w_0 = 1``,  ``w_i = min(1, w_{i-1} p_{i-1}(x_i) / q_{i-1}(x_i))``      (Sun et al. 2025, Alg. 2, line 4)

so a token the draft under-proposes can make up for an earlier over-proposed one.  When the
continuations below a node with weight ``w`` and scaled target ``r = w p`` (a sub-probability of
mass ``w``) are rejected, the node itself is still kept with the mass of the *sequence residual*

    ``r' = max(r - q, 0) / sum(max(q - r, 0))``                                    (:func:`sequence_residual`)

and the token after it is drawn from ``norm(r')``.  On a chain ``mass(r')`` is Sun et al.'s ``h_i``
(Alg. 2, line 5: ``sum max(w p - q, 0) / (sum max(w p - q, 0) + 1 - w)``, the same number since
``sum max(q - r, 0) = sum max(r - q, 0) + 1 - w``) and ``norm(r')`` their residual ``p_res``.

Sources:
    * block verification: Sun, Mendlovic, Leviathan, Aharoni, Beirami, Ro, Suresh, "Block Verification
      Accelerates Speculative Decoding", ICLR 2025, Algorithm 2.  It emits the target's law and accepts
      at least as many tokens in expectation as token-level verification (their Theorem 2).
    * traversal verification: Weng et al., "Traversal Verification for Speculative Tree Decoding",
      NeurIPS 2025: the tree is visited leaf to root (post-order: a node's first child's subtree, then
      its next sibling's, then the node itself), each node accepted with its sequence-level probability;
      a rejected node is deleted and its parent's target replaced by the sequence residual (and, for
      siblings drawn without replacement, its proposal by ``q`` with the token removed, as in RSD).
      On a chain it is block verification.

Exactness of traversal verification needs each node's subtree to be drafted from its own token only
(given it, independent of its siblings' subtrees): chains, RSD-C and SpecInfer's i.i.d. trees.  The
stochastic beam search of RSD-S couples sibling subtrees (survivors compete for the W beams), so a
rejected subtree would carry information about its siblings' tokens; :func:`check_traversal_tree`
refuses it.

Same conventions as :mod:`.rules`: node i is block entry i + 1, ``p`` row i is the target's processed
distribution after block entry i, ``q`` row i the draft distribution block entry i's children were drawn from.
"""

from __future__ import annotations

from typing import Callable

import torch

from ..errors import SpeculantError
from ..sampling.processors import sample_categorical
from ..trees.tree import DraftTree
from . import rules

RowSource = torch.Tensor | Callable[[torch.Tensor], torch.Tensor]
VERIFICATIONS = ("token", "block", "traversal")


def sequence_residual(r: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """Scaled target left after every continuation through ``q`` was rejected, ``[..., V]``.

    ``r`` is a sub-probability (the weight times the target's distribution), ``q`` the normalised proposal.
    Returns ``max(r - q, 0) / sum(max(q - r, 0))``: its mass is the probability to keep the node (Sun et
    al. 2025, Alg. 2, ``h_i``), its normalisation the law of the token after it (``p_res``).  Rows with
    ``q <= r`` everywhere (no rejection is possible there) keep ``r``.
    """
    over = torch.clamp_min(r - q, 0.0)
    under = torch.clamp_min(q - r, 0.0).sum(-1, keepdim=True)
    return torch.where(under > 0, over / under.clamp_min(1e-30), r)


def _rows(source: RowSource, entries: torch.Tensor, rows: torch.Tensor | None = None) -> torch.Tensor:
    """Rows ``[R, V]`` of ``source`` (``[B, N + 1, V]``, or a callable for one tree) at block entries
    ``entries`` ``[R]`` of trees ``rows`` (default: all)."""
    if callable(source):
        return source(entries)
    return source[torch.arange(entries.shape[0]) if rows is None else rows, entries]


def chain_lengths(children: torch.Tensor) -> torch.Tensor:
    """Drafted length ``[B]`` of chains given as children tables ``[B, N + 1, C]``.

    Raises:
        SpeculantError: a tree that is not a chain (a node with two children, or nodes off the chain).
    """
    b, entries, _ = children.shape
    first = children[:, :, 0]
    has = first >= 0
    length = has.long().cumprod(1).sum(1)                                   # consecutive entries with a child
    expected = torch.arange(entries).expand(b, -1)
    on_chain = torch.arange(entries)[None] < length[:, None]
    bad = (children[:, :, 1:] >= 0).any() if children.shape[2] > 1 else torch.tensor(False)
    bad = bad | (has & ~on_chain).any() | ((first != expected) & on_chain).any()
    if bool(bad):
        raise SpeculantError("verification='block' needs a chain (one child per node); allowed for trees: "
                             "verification='traversal' or 'token'")
    return length


def block_verification_batch(tokens: torch.Tensor, children: torch.Tensor, q: RowSource, p: RowSource,
                             generator: torch.Generator | None = None):
    """Block verification of B drafted chains (Sun et al. 2025, Algorithm 2).

    With weights ``w_i`` (module docstring), ``h_i = mass(sequence_residual(w_i p_i, q_i))`` for
    ``i < L`` and ``h_L = w_L``: draw ``eta_i ~ U(0, 1)``, accept the longest prefix ``tau`` with
    ``eta_tau < h_tau`` (0 if none), then draw the next token from ``norm(sequence_residual(w_tau p_tau,
    q_tau))``, or from ``p_L`` when ``tau = L`` (a bonus token).

    Args:
        tokens: drafted tokens ``[B, N]``.
        children: ``[B, N + 1, C]`` children tables of chains (entry i's child is node i), -1 padded;
            chain ``b`` has ``L_b <= N`` nodes.
        q: draft distributions ``[B, N + 1, V]``, or (one tree, ``B = 1``) a callable mapping block entries
            ``[1]`` (int64) to rows ``[1, V]``.
        p: target distributions, the same way.
        generator: source of every uniform and categorical draw.
    Returns:
        ``path`` ``[B, N]`` accepted node indices (-1 padded) and ``token`` ``[B]``, the token after them.
    Raises:
        SpeculantError: a tree that is not a chain.
    """
    b, n = tokens.shape
    length = chain_lengths(children)
    weight = torch.ones(b)
    h = torch.zeros(b, n + 1)
    residuals = []
    r = _rows(p, torch.zeros(b, dtype=torch.long))
    for i in range(n + 1):
        big_q = _rows(q, torch.full((b,), i, dtype=torch.long)) if i < n else torch.zeros_like(r)
        res = sequence_residual(weight[:, None] * r, big_q)
        residuals.append(torch.where((i < length)[:, None], res, r))
        h[:, i] = torch.where(i < length, res.sum(-1).clamp_max(1.0), weight)
        if i == n:
            break
        x = tokens[:, i]
        qx = big_q.gather(1, x[:, None])[:, 0]
        rx = r.gather(1, x[:, None])[:, 0]
        weight = torch.where(qx > 0, torch.clamp_max(weight * rx / qx.clamp_min(1e-30), 1.0), 0.0)
        weight = torch.where(i < length, weight, 0.0)
        r = _rows(p, torch.full((b,), i + 1, dtype=torch.long))
    eta = torch.rand(b, n, generator=generator)
    idx = torch.arange(1, n + 1)
    ok = (eta < h[:, 1:]) & (idx[None] <= length[:, None])
    tau = torch.where(ok, idx[None], 0).amax(1)                              # longest accepted prefix
    last = torch.stack(residuals, 1)[torch.arange(b), tau]
    token = sample_categorical(last, generator)[:, 0]
    path = torch.where(torch.arange(n)[None] < tau[:, None], torch.arange(n)[None], -1)
    return path, token


def _push(state: dict, rows: torch.Tensor, child: torch.Tensor, weight: torch.Tensor, q: RowSource, p: RowSource):
    """Enter ``child`` (node ids ``[R]``) of the current node of ``rows`` with its sequence weight."""
    level = state["level"][rows] + 1
    entry = child + 1
    state["r"][rows, level] = weight[:, None] * _rows(p, entry, rows)
    state["q"][rows, level] = _rows(q, entry, rows)
    state["entry"][rows, level] = entry
    state["next"][rows, level] = 0
    state["level"][rows] = level


def _reject(state: dict, rows: torch.Tensor, level: torch.Tensor, x: torch.Tensor, without_replacement: bool):
    """Child token ``x`` ``[R]`` of the node at ``level`` of ``rows`` was rejected: sequence residual, next sibling."""
    r, big_q = state["r"][rows, level], state["q"][rows, level]
    state["r"][rows, level] = sequence_residual(r, big_q)
    if without_replacement:
        state["q"][rows, level] = rules.remove_token(big_q, x)
    state["next"][rows, level] += 1
    state["level"][rows] = level


def traversal_verification_batch(tokens: torch.Tensor, children: torch.Tensor, q: RowSource, p: RowSource,
                                 generator: torch.Generator | None = None, without_replacement: bool = True):
    """Traversal verification of B draft trees (Weng et al. 2025), post-order from the first leaf.

    Each tree keeps a stack root -> current node with, per level, the scaled target ``r`` (a
    sub-probability), the proposal ``Q`` of the next child and the index of that child.  At a node
    with children left, the next child ``c`` (token ``x``) is entered with weight ``min(1, r(x) / Q(x))``
    and ``r_c = weight * p_c``.  At a node with none left, draw ``u ~ U(0, 1)``: if ``u < mass(r)``
    the path root -> node is accepted and the next token drawn from ``norm(r)``; otherwise the node is
    deleted: its parent's ``r`` becomes ``sequence_residual(r, Q)`` and ``Q`` loses ``x`` (renormalised)
    when siblings were drawn ``without_replacement`` (RSD), else stays (SpecInfer's i.i.d. siblings).
    The root's mass is 1, so it is always kept.  A child entered with weight 0 is deleted at once.

    Args: as :func:`block_verification_batch` (``children`` any tree in the layout of
        :class:`~speculant.trees.tree.DraftTree`: each parent's children in sampling order).
    Returns:
        ``path`` ``[B, N]`` accepted node indices from the root down (-1 padded) and ``token`` ``[B]``.
    """
    b, n = tokens.shape
    rows_all = torch.arange(b)
    r0 = _rows(p, torch.zeros(b, dtype=torch.long))
    q0 = _rows(q, torch.zeros(b, dtype=torch.long))
    v = r0.shape[-1]
    state = {"r": torch.zeros(b, n + 2, v), "q": torch.zeros(b, n + 2, v),
             "entry": torch.zeros(b, n + 2, dtype=torch.long), "next": torch.zeros(b, n + 2, dtype=torch.long),
             "level": torch.zeros(b, dtype=torch.long)}
    state["r"][:, 0], state["q"][:, 0] = r0, q0
    active = torch.ones(b, dtype=torch.bool)
    token = torch.full((b,), -1, dtype=torch.long)
    path = torch.full((b, n), -1, dtype=torch.long)
    width = children.shape[2]
    while bool(active.any()):
        level = state["level"]
        entry = state["entry"][rows_all, level]
        j = state["next"][rows_all, level]
        child = torch.where(j < width, children[rows_all, entry, j.clamp_max(width - 1)], -1)
        x = tokens[rows_all, child.clamp_min(0)]
        r, big_q = state["r"][rows_all, level], state["q"][rows_all, level]
        qx, rx = big_q.gather(1, x[:, None])[:, 0], r.gather(1, x[:, None])[:, 0]
        weight = torch.where(qx > 0, torch.clamp_max(rx / qx.clamp_min(1e-30), 1.0), 0.0)
        u = torch.rand(b, generator=generator)
        exhausted = active & (child < 0)
        keep = exhausted & ((u < r.sum(-1)) | (level == 0))
        enter = active & (child >= 0) & (weight > 0)
        if bool(keep.any()):
            rows = keep.nonzero()[:, 0]
            token[rows] = sample_categorical(r[rows], generator)[:, 0]
            ids = state["entry"][rows, 1:n + 1] - 1
            path[rows] = torch.where(torch.arange(n)[None] < level[rows, None], ids, -1)
            active = active & ~keep
        if bool(enter.any()):
            _push(state, enter.nonzero()[:, 0], child[enter], weight[enter], q, p)
        skip = active & (child >= 0) & ~(weight > 0)                        # entered with weight 0: deleted
        if bool(skip.any()):
            rows = skip.nonzero()[:, 0]
            _reject(state, rows, level[rows], x[rows], without_replacement)
        drop = exhausted & ~keep                                            # a deleted leaf: back to its parent
        if bool(drop.any()):
            rows = drop.nonzero()[:, 0]
            lv = level[rows]
            node = state["entry"][rows, lv] - 1
            _reject(state, rows, lv - 1, tokens[rows, node], without_replacement)
    return path, token


def _single(fn, tree: DraftTree, p, generator, **kw) -> tuple[list[int], int]:
    """Run a batch rule on one :class:`DraftTree` (rows by callables, as :func:`rules.recursive_rejection_sampling`)."""
    vocab = tree.draft_vocab_size or 1

    def q_row(entry: torch.Tensor) -> torch.Tensor:
        row = tree.draft_row(int(entry[0]))
        return row[None] if row is not None else torch.zeros(1, vocab)

    p_rows = (lambda entry: p(int(entry[0]))[None]) if callable(p) else p[None]
    path, token = fn(torch.tensor([tree.tokens or [0]]), tree.children_table()[None], q_row, p_rows, generator, **kw)
    return [i for i in path[0].tolist() if i >= 0], int(token[0])


def block_verification(tree: DraftTree, p: torch.Tensor | Callable[[int], torch.Tensor],
                       generator: torch.Generator | None) -> tuple[list[int], int]:
    """:func:`block_verification_batch` for one chain; ``p`` ``[N + 1, V]`` or a callable entry -> ``[V]``
    (called for every entry of the chain).  Returns (accepted node indices, emitted token).

    Raises:
        SpeculantError: ``tree`` is not a chain.
    """
    if not tree.tokens:
        return rules.recursive_rejection_sampling(tree, p, generator)
    return _single(block_verification_batch, tree, p, generator)


def traversal_verification(tree: DraftTree, p: torch.Tensor | Callable[[int], torch.Tensor],
                           generator: torch.Generator | None,
                           without_replacement: bool = True) -> tuple[list[int], int]:
    """:func:`traversal_verification_batch` for one tree; ``p`` as :func:`block_verification`.
    Returns (accepted node indices, emitted token)."""
    if not tree.tokens:
        return rules.recursive_rejection_sampling(tree, p, generator)
    return _single(traversal_verification_batch, tree, p, generator, without_replacement=without_replacement)


def check_verification(verification: str, method: str, tree_methods=(), coupled_tree_methods=(),
                       undrafted_methods=("ar",)) -> str:
    """``verification`` checked against ``method``; returns it.

    Raises:
        SpeculantError: an unknown name; ``block``/``traversal`` with a method that drafts nothing
            (``undrafted_methods``); ``block`` with a tree method (block verification is for chains);
            ``traversal`` with a method whose sibling subtrees are drafted jointly (``coupled_tree_methods``,
            e.g. RSD-S's stochastic beam search), where it would not emit the target's law.
    """
    if verification not in VERIFICATIONS:
        raise SpeculantError(f"verification={verification!r} is unknown; allowed: {', '.join(VERIFICATIONS)}")
    if verification != "token" and method in undrafted_methods:
        raise SpeculantError(f"verification={verification!r} is not used by method={method!r} (it drafts nothing); "
                             "allowed: 'token'")
    if verification == "block" and method in tree_methods:
        raise SpeculantError(f"verification='block' needs a chain, method={method!r} drafts a tree; allowed: "
                             "'traversal' or 'token'")
    if verification == "traversal" and method in coupled_tree_methods:
        raise SpeculantError(f"verification='traversal' is not exact for method={method!r} (its beam search "
                             "drafts sibling subtrees jointly); allowed: 'token'")
    return verification


def sampling_accept(tree: DraftTree, p: torch.Tensor | Callable[[int], torch.Tensor],
                    generator: torch.Generator | None, without_replacement: bool,
                    verification: str = "token") -> tuple[list[int], int]:
    """Acceptance under sampling by ``verification``: ``token`` (recursive rejection sampling,
    :func:`rules.recursive_rejection_sampling`), ``block`` or ``traversal``.
    Returns (accepted node indices, emitted token).

    Raises:
        SpeculantError: an unknown ``verification``; ``block`` on a tree that is not a chain.
    """
    if verification == "token":
        return rules.recursive_rejection_sampling(tree, p, generator, without_replacement)
    if verification == "block":
        return block_verification(tree, p, generator)
    if verification == "traversal":
        return traversal_verification(tree, p, generator, without_replacement)
    raise SpeculantError(f"verification={verification!r} is unknown; allowed: {', '.join(VERIFICATIONS)}")
