"""DraftTree's tables (ancestor mask, depths, children) against a reference made from its parents, for chains whose
tables are written only when read or when a node branches; and a draft row's entry read without expanding it."""

import torch

from speculant.trees.tree import DraftTree


def reference(tree: DraftTree, prefix: int):
    """(ancestor mask [N+1, N+1], positions [N+1], children [N+1, C]) from ``tree.parents`` alone."""
    n = len(tree.tokens)
    anc = torch.zeros(n + 1, n + 1, dtype=torch.bool)
    anc[0, 0] = True
    depth = [0] * (n + 1)
    for i, p in enumerate(tree.parents):
        anc[i + 1] = anc[p + 1]
        anc[i + 1, i + 1] = True
        depth[i + 1] = depth[p + 1] + 1
    width = max((len(c) for c in tree.children), default=0) or 1
    kids = torch.full((n + 1, width), -1, dtype=torch.long)
    for e, cs in enumerate(tree.children):
        kids[e, :len(cs)] = torch.tensor(cs, dtype=torch.long)
    return anc, torch.tensor(depth) + prefix, kids


def check(tree: DraftTree, prefix: int = 7):
    anc, pos, kids = reference(tree, prefix)
    assert torch.equal(tree.block_positions(prefix), pos)
    assert torch.equal(tree.ancestor_mask(), anc)
    assert torch.equal(tree.children_table(), kids)
    assert torch.equal(tree.attention_mask(prefix), torch.cat([torch.ones(len(anc), prefix, dtype=torch.bool), anc], 1))


def test_a_chain_reads_its_tables_at_any_length():
    for length in (0, 1, 2, 5, 16, 17, 40):
        tree = DraftTree()
        for i in range(length):
            tree.add(i - 1, 100 + i)
        assert tree.is_chain
        check(tree)


def test_a_chain_that_branches_after_being_read_or_not():
    for read_first in (False, True):
        for length in (1, 3, 20):
            tree = DraftTree()
            for i in range(length):
                tree.add(i - 1, 100 + i)
            if read_first:
                check(tree)
            tree.add(length - 2, 7)                 # a sibling of the last node (or a second root child)
            tree.add(-1, 8)
            assert not tree.is_chain
            check(tree)
            tree.add(len(tree.tokens) - 1, 9)
            check(tree)


def test_a_chain_grown_after_a_read_keeps_its_tables():
    tree = DraftTree(capacity=2)
    for i in range(3):
        tree.add(i - 1, i)
    check(tree)
    for i in range(3, 9):                           # past the capacity, with tables already written
        tree.add(i - 1, i)
        check(tree)
    assert tree.is_chain


def test_draft_prob_equals_the_expanded_row():
    """``DraftTree.draft_prob(entry, token)`` is ``draft_row(entry)[token]`` for full rows, reduced rows (small ids
    searched, large ones mapped, the two kinds alternating as in ``eagle-lookup``), tokens outside the reduced
    vocabulary and entries with no row — and reading it expands nothing."""
    g = torch.Generator().manual_seed(0)
    vocab = 300
    large = torch.randperm(vocab, generator=g)[:40]
    for case in range(60):
        tree = DraftTree()
        kind = case % 3
        if kind == 0:
            q = torch.rand(vocab, generator=g)
            tree.set_draft_probs(-1, q / q.sum())
        else:
            ids = large if kind == 1 else torch.randperm(vocab, generator=g)[:3]
            q = torch.rand(ids.shape[0], generator=g)
            tree.set_draft_probs(-1, q / q.sum(), ids, vocab)
        tree.add(-1, 5)
        tokens = torch.randint(0, vocab, (20,), generator=g).tolist() + (ids.tolist() if kind else [])
        got = [float(tree.draft_prob(0, t)) for t in tokens] + [float(tree.draft_prob(1, 7))]
        assert kind == 0 or 0 in tree._draft_vocab                       # nothing expanded
        row = tree.draft_row(0)
        assert got == [float(row[t]) for t in tokens] + [0.0], case
