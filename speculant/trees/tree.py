"""DraftTree: the flattened token tree one target forward verifies.

Node 0 of the *verification block* is the root: the last emitted token, not yet
in the target's KV cache.  Drafted nodes ``i = 0..N-1`` become block entries
``i + 1``; they are stored breadth-first (depth-major), each parent's children
contiguous and in their sampling order, which is the order recursive rejection
sampling visits them (Jeon et al. 2024, Alg. 2).  A chain (ordinary speculative
decoding) is a tree with one child per node; autoregressive decoding is a tree
with no drafted node.
"""

from __future__ import annotations

import torch


class DraftTree:
    """A growing tree of drafted tokens.

    The ancestor mask, the depths (RoPE positions), the children table and whether the tree is a chain are
    kept up to date by :meth:`add` (one row each per node, in buffers that double when full), so the
    drafters' per-depth masks and the verification's tables are slices, not rebuilt from the parents.  A chain
    (every node the child of the one before) writes no table until one is asked for or a node branches: its
    tables are then written at once from its length (a chain's verification reads none of them).

    Attributes:
        tokens: drafted token ids, ``N`` ints.
        parents: parent of each node, ``N`` ints; -1 is the root.
        depths: depth of each node (root children have depth 1), ``N`` ints.
        children: ``N + 1`` lists; entry ``0`` the root's children, entry ``i+1`` node i's.
        draft_probs: ``{block index: q}``, the draft distribution each expanded node's children were sampled
            from (block index 0 = root): ``[V]``, or ``[V']`` over a reduced draft vocabulary (then
            :meth:`draft_row` gives the ``[V]`` row).  Empty under greedy decoding.
    """

    def __init__(self, capacity: int = 16):
        self.tokens: list[int] = []
        self.parents: list[int] = []
        self.depths: list[int] = []
        self.children: list[list[int]] = [[]]
        self.draft_probs: dict[int, torch.Tensor] = {}
        self._draft_vocab: dict[int, tuple[torch.Tensor, int]] = {}            # entry -> (vocab_ids [V'], V)
        self._chain = True
        self._width = 1                                                          # most children of an entry
        self._capacity = capacity
        self._anc = self._depth = self._kids = None          # made when first needed (a chain's may never be)
        self._written = 0                                    # nodes whose rows the tables hold

    def _buffers(self) -> None:
        """The tables for every node added so far (a tree that stays empty, or a chain whose tables nobody reads,
        needs none: an ``ar`` round or a chain round of a speculative generator pays no tensor writes for them).
        The nodes a chain added without tables get their rows here in one write each."""
        if self._anc is None:
            cap = max(self._capacity, len(self.tokens)) + 1
            self._anc = torch.zeros(cap, cap, dtype=torch.bool)         # [entry, entry] ancestor-or-self
            self._anc[0, 0] = True
            self._depth = torch.zeros(cap, dtype=torch.long)            # [entry] depth
            self._kids = torch.full((cap, 1), -1, dtype=torch.long)     # [entry, C] children table
        n = len(self.tokens)
        if self._written < n:                      # a chain's nodes: entry i + 1 is node i, child of entry i
            lo, hi = self._written + 1, n + 1
            self._anc[lo:hi, :hi] = torch.ones(hi, hi, dtype=torch.bool).tril()[lo:hi]
            self._depth[lo:hi] = torch.arange(lo, hi)
            self._kids[lo - 1:hi - 1, 0] = torch.arange(lo - 1, hi - 1)
            self._written = n

    def __len__(self) -> int:
        return len(self.tokens)

    @property
    def is_chain(self) -> bool:
        """True when every node's parent is the node before it (causal mask suffices)."""
        return self._chain

    @property
    def max_depth(self) -> int:
        return max(self.depths, default=0)

    def _grow(self, entries: int, width: int) -> None:
        """Buffers for at least ``entries`` block entries and ``width`` children per entry."""
        self._buffers()
        cap = self._anc.shape[0]
        if entries > cap:
            new = max(entries, 2 * cap)
            anc = torch.zeros(new, new, dtype=torch.bool)
            anc[:cap, :cap] = self._anc
            self._anc = anc
            self._depth = torch.cat([self._depth, self._depth.new_zeros(new - cap)])
            self._kids = torch.cat([self._kids, self._kids.new_full((new - cap, self._kids.shape[1]), -1)])
        if width > self._kids.shape[1]:
            extra = max(width, 2 * self._kids.shape[1]) - self._kids.shape[1]
            self._kids = torch.cat([self._kids, self._kids.new_full((self._kids.shape[0], extra), -1)], 1)

    def add(self, parent: int, token: int) -> int:
        """Append a child of ``parent`` (-1 = root); returns the new node index."""
        idx = len(self.tokens)
        depth = 1 if parent < 0 else self.depths[parent] + 1
        siblings = self.children[parent + 1]
        if self._chain and parent == idx - 1 and self._anc is None:     # still a chain, no table asked for
            self.tokens.append(int(token))
            self.parents.append(parent)
            self.depths.append(depth)
            siblings.append(idx)
            self.children.append([])
            return idx
        self._grow(idx + 2, len(siblings) + 1)          # writes the rows of the chain's nodes before this one
        self.tokens.append(int(token))
        self.parents.append(parent)
        self.depths.append(depth)
        self._kids[parent + 1, len(siblings)] = idx
        siblings.append(idx)
        self._width = max(self._width, len(siblings))
        self.children.append([])
        self._chain = self._chain and parent == idx - 1
        row = idx + 1
        self._anc[row] = self._anc[parent + 1]
        self._anc[row, row] = True
        self._depth[row] = depth
        self._written = len(self.tokens)
        return idx

    def set_draft_probs(self, node: int, q: torch.Tensor, vocab_ids: torch.Tensor | None = None,
                        vocab_size: int | None = None) -> None:
        """Record the draft distribution of ``node`` (-1 = root): ``q`` ``[V]``, or ``q`` ``[V']`` over the token ids
        ``vocab_ids`` ``[V']`` of a vocabulary of ``vocab_size`` tokens (zero outside them), expanded to ``[V]`` only
        when :meth:`draft_row` reads it (the acceptance rules read the root's and the accepted nodes' rows only)."""
        self.draft_probs[node + 1] = q
        if vocab_ids is not None:
            self._draft_vocab[node + 1] = (vocab_ids, int(vocab_size))

    def draft_row(self, entry: int) -> torch.Tensor | None:
        """Draft distribution ``[V]`` block entry ``entry``'s children were sampled from (``None``: not recorded)."""
        q = self.draft_probs.get(entry)
        sparse = self._draft_vocab.pop(entry, None)
        if q is not None and sparse is not None:
            ids, vocab = sparse
            q = q.new_zeros(vocab).index_copy_(0, ids, q)
            self.draft_probs[entry] = q
        return q

    def draft_entry(self, entry: int) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """The draft distribution block entry ``entry``'s children were sampled from, as recorded, without expanding
        it: ``(q [V], None)``, ``(q [V'], vocab_ids [V'])`` (zero outside ``vocab_ids``), or ``(None, None)``."""
        q = self.draft_probs.get(entry)
        sparse = self._draft_vocab.get(entry)
        return q, (sparse[0] if sparse is not None and q is not None else None)

    def draft_prob(self, entry: int, token: int) -> torch.Tensor:
        """``q(token)`` in block entry ``entry``'s draft distribution, a 1-element tensor of ``q``'s dtype (0 where
        nothing is recorded or ``token`` is outside a reduced vocabulary): :meth:`draft_row` ``[token]`` without
        expanding a reduced row (its column through a token -> column map kept for the last large ``vocab_ids``)."""
        q, ids = self.draft_entry(entry)
        if q is None:
            return torch.zeros(1)
        if ids is None:
            return q[token:token + 1]
        if ids.shape[0] <= _SCANNED:                    # a point mass (prompt lookup's [1] over its token), say
            listed = ids.tolist()
            col = listed.index(token) if token in listed else None
        else:
            col = _columns(ids).get(token)
        return q[col:col + 1] if col is not None else q.new_zeros(1)

    @property
    def draft_vocab_size(self) -> int | None:
        """``V`` of the recorded draft distributions (``None`` when none is recorded)."""
        if not self.draft_probs:
            return None
        entry, q = next(iter(self.draft_probs.items()))
        return self._draft_vocab[entry][1] if entry in self._draft_vocab else q.shape[-1]

    def block_tokens(self, root_token: int) -> torch.Tensor:
        """Ids ``[N + 1]`` of the verification block: root then the drafted nodes."""
        return torch.tensor([root_token] + self.tokens, dtype=torch.long)

    def block_positions(self, prefix_length: int) -> torch.Tensor:
        """RoPE positions ``[N + 1]``: ``prefix_length + depth`` (root depth 0)."""
        if self._anc is None:                               # empty, or a chain: the depths are 0 .. N
            return torch.arange(prefix_length, prefix_length + len(self.tokens) + 1)
        return self._depth[:len(self.tokens) + 1] + prefix_length

    def ancestor_mask(self) -> torch.Tensor:
        """Bool ``[N + 1, N + 1]``: entry (i, j) is True when block entry j is i itself or an ancestor of i.
        A view of the tree's own buffer: read it, do not write to it."""
        self._buffers()
        n = len(self.tokens) + 1
        return self._anc[:n, :n]

    def attention_mask(self, prefix_length: int, rows: slice | None = None) -> torch.Tensor:
        """Tree attention mask ``[R, prefix_length + N + 1]`` for block rows ``rows`` (default: all).

        Each entry sees the committed prefix, its ancestors and itself (SpecInfer,
        Miao et al. 2024, Sec. 4.2).
        """
        anc = self.ancestor_mask()
        if rows is not None:
            anc = anc[rows]
        return torch.cat([torch.ones(anc.shape[0], prefix_length, dtype=torch.bool), anc], dim=1)

    def children_table(self) -> torch.Tensor:
        """Children of every block entry in sampling order, ``[N + 1, C]`` int64, -1 padded (a view)."""
        self._buffers()
        return self._kids[:len(self.children), :self._width]

    def path_to(self, node: int) -> list[int]:
        """Node indices from the root's child down to ``node`` (inclusive)."""
        path = []
        while node >= 0:
            path.append(node)
            node = self.parents[node]
        return path[::-1]


_SCANNED = 16
"""Reduced vocabularies up to this many ids are searched in a list, not mapped: a drafter that makes a new small one
per node (prompt lookup) does not evict the map of a head's one large one (``eagle-lookup`` alternates them)."""
_COLUMNS: tuple[torch.Tensor, dict[int, int]] | None = None


def _columns(ids: torch.Tensor) -> dict[int, int]:
    """Token id -> column of ``ids`` ``[V']`` (a drafter passes the same tensor every round: kept for the last one)."""
    global _COLUMNS
    kept = _COLUMNS                     # read once: another thread may replace it with another vocabulary's map
    if kept is None or kept[0] is not ids:
        kept = _COLUMNS = (ids, {t: c for c, t in enumerate(ids.tolist())})
    return kept[1]
