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

    Attributes:
        tokens: drafted token ids, ``N`` ints.
        parents: parent of each node, ``N`` ints; -1 is the root.
        depths: depth of each node (root children have depth 1), ``N`` ints.
        children: ``N + 1`` lists; entry ``0`` the root's children, entry ``i+1`` node i's.
        draft_probs: ``{block index: q [V]}``, the draft distribution each expanded
            node's children were sampled from (block index 0 = root).  Empty under greedy decoding.
    """

    def __init__(self):
        self.tokens: list[int] = []
        self.parents: list[int] = []
        self.depths: list[int] = []
        self.children: list[list[int]] = [[]]
        self.draft_probs: dict[int, torch.Tensor] = {}

    def __len__(self) -> int:
        return len(self.tokens)

    @property
    def is_chain(self) -> bool:
        """True when every node's parent is the node before it (causal mask suffices)."""
        return all(p == i - 1 for i, p in enumerate(self.parents))

    @property
    def max_depth(self) -> int:
        return max(self.depths, default=0)

    def add(self, parent: int, token: int) -> int:
        """Append a child of ``parent`` (-1 = root); returns the new node index."""
        idx = len(self.tokens)
        self.tokens.append(int(token))
        self.parents.append(parent)
        self.depths.append(1 if parent < 0 else self.depths[parent] + 1)
        self.children[parent + 1].append(idx)
        self.children.append([])
        return idx

    def set_draft_probs(self, node: int, q: torch.Tensor) -> None:
        """Record the draft distribution ``q`` ``[V]`` of ``node`` (-1 = root)."""
        self.draft_probs[node + 1] = q

    def block_tokens(self, root_token: int) -> torch.Tensor:
        """Ids ``[N + 1]`` of the verification block: root then the drafted nodes."""
        return torch.tensor([root_token] + self.tokens, dtype=torch.long)

    def block_positions(self, prefix_length: int) -> torch.Tensor:
        """RoPE positions ``[N + 1]``: ``prefix_length + depth`` (root depth 0)."""
        return torch.tensor([0] + self.depths, dtype=torch.long) + prefix_length

    def ancestor_mask(self) -> torch.Tensor:
        """Bool ``[N + 1, N + 1]``: entry (i, j) is True when block entry j is i itself or an ancestor of i."""
        n = len(self.tokens) + 1
        m = torch.zeros(n, n, dtype=torch.bool)
        m[:, 0] = True
        for i, p in enumerate(self.parents):
            row = i + 1
            if p >= 0:
                m[row] = m[p + 1]
            m[row, row] = True
        return m

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
        """Children of every block entry in sampling order, ``[N + 1, C]`` int64, -1 padded."""
        width = max((len(c) for c in self.children), default=0)
        table = torch.full((len(self.children), max(width, 1)), -1, dtype=torch.long)
        for entry, kids in enumerate(self.children):
            if kids:
                table[entry, :len(kids)] = torch.tensor(kids)
        return table

    def path_to(self, node: int) -> list[int]:
        """Node indices from the root's child down to ``node`` (inclusive)."""
        path = []
        while node >= 0:
            path.append(node)
            node = self.parents[node]
        return path[::-1]
