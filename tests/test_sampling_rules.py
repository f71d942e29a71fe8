"""Exactness of the sampling acceptance rules with the production tree builders, 100 000 vectorised samples.

A first-order Markov target ``p(x | prev)`` and draft ``q(x | prev)`` over a
5-token vocabulary stand in for the networks.  Trees for 100 000 independent
samples are grown with the production builders (frontier rows of all samples
stacked; RSD-S through its batched ``expand_batch``) and verified with the
production :func:`recursive_rejection_sampling_batch`.  The joint law of the
first three emitted tokens must match the target's exact law (Pearson
chi-square, rejection threshold at false-alarm rate 1e-4 for the number of
cells), and deliberately broken rules must fail the same test.
"""

import itertools

import pytest
import torch
from stats_helpers import chi_square

from speculant.trees import ChainBuilder, ConstantBranchingBuilder, IIDTreeBuilder, StochasticBeamBuilder
from speculant.verification import rules

V = 5
N_SAMPLES = 100_000
N_TOKENS = 3
START = 2


def tables():
    g = torch.Generator().manual_seed(7)
    p = torch.softmax(torch.randn(V, V, generator=g) * 1.5, -1)
    q = torch.softmax(torch.randn(V, V, generator=g) * 1.5, -1)
    q[:, 0] = q[:, 0] * 0.05          # the draft nearly misses a token the target likes
    return p, q / q.sum(-1, keepdim=True)


P, Q = tables()


def exact_law() -> dict[tuple, float]:
    law = {}
    for seq in itertools.product(range(V), repeat=N_TOKENS):
        prob, prev = 1.0, START
        for x in seq:
            prob *= float(P[prev, x])
            prev = x
        law[seq] = prob
    return law


def grow_trees(builder, roots: torch.Tensor, generator):
    """Trees for ``B`` samples at once: tokens [B, N], children [B, N+1, C], draft q [B, N+1, V].

    Node ``i`` is block entry ``i + 1``; nodes are appended depth by depth, each
    parent's children contiguous and in sampling order, exactly as the drafters do.
    """
    b = roots.shape[0]
    rows = torch.arange(b)
    builder.reset()
    entry_tokens = [roots]
    width = builder.beam_width if isinstance(builder, StochasticBeamBuilder) else max(getattr(builder, "branching", [1]))
    children = torch.full((b, builder.budget() + 1, width), -1, dtype=torch.long)
    frontier = torch.zeros(b, 1, dtype=torch.long)                        # [B, F] block entries
    for depth in range(1, builder.max_depth + 1):
        q = Q[torch.stack(entry_tokens, 1).gather(1, frontier)]           # [B, F, V]
        if isinstance(builder, StochasticBeamBuilder):
            parents, toks = builder.expand_batch(q, False, generator)     # [B, W], grouped by parent
        else:
            f = frontier.shape[1]
            toks = torch.tensor(builder.expand(depth, q.reshape(b * f, V), False, generator)).reshape(b, -1)
            parents = torch.arange(f).repeat_interleave(toks.shape[1] // f).expand(b, -1)
        first = len(entry_tokens)
        slot = torch.zeros(b, dtype=torch.long)
        for j in range(toks.shape[1]):
            if j:
                slot = torch.where(parents[:, j] == parents[:, j - 1], slot + 1, 0)
            children[rows, frontier.gather(1, parents[:, j:j + 1])[:, 0], slot] = first + j - 1
            entry_tokens.append(toks[:, j])
        frontier = torch.arange(first, len(entry_tokens)).expand(b, -1)
    tok_table = torch.stack(entry_tokens, 1)                               # [B, N+1]
    return tok_table[:, 1:], children[:, :tok_table.shape[1]], Q[tok_table]


def sample_sequences(builder, without_replacement: bool, n: int, seed: int = 0) -> list[tuple]:
    g = torch.Generator().manual_seed(seed)
    seqs = torch.full((n, N_TOKENS + builder.max_depth + 1), -1, dtype=torch.long)
    length = torch.zeros(n, dtype=torch.long)
    while True:
        todo = (length < N_TOKENS).nonzero()[:, 0]
        if not todo.numel():
            break
        roots = torch.where(length[todo] > 0, seqs[todo, (length[todo] - 1).clamp_min(0)], START)
        tokens, children, q = grow_trees(builder, roots, g)
        block = torch.cat([roots[:, None], tokens], 1)
        path, token = rules.recursive_rejection_sampling_batch(tokens, children, q, P[block], g, without_replacement)
        n_acc = (path >= 0).sum(1)
        emitted = torch.cat([tokens.gather(1, path.clamp_min(0)), token[:, None]], 1)
        emitted.scatter_(1, n_acc[:, None], token[:, None])                 # the target's token right after the path
        pos = torch.arange(emitted.shape[1])
        keep = pos[None] <= n_acc[:, None]
        cols = (length[todo][:, None] + pos[None]).clamp_max(seqs.shape[1] - 1)
        r_idx = todo[:, None].expand_as(cols)
        seqs[r_idx[keep], cols[keep]] = emitted[keep]
        length[todo] += n_acc + 1
    return [tuple(r) for r in seqs[:, :N_TOKENS].tolist()]


CASES = {
    "chain": (lambda: ChainBuilder(3), True),
    "rsd-c": (lambda: ConstantBranchingBuilder([3, 2]), True),
    "rsd-s": (lambda: StochasticBeamBuilder(3, 2), True),
    "specinfer": (lambda: IIDTreeBuilder([3, 2]), False),
}


@pytest.mark.parametrize("name", CASES)
def test_rule_reproduces_target_law(name):
    make, wor = CASES[name]
    stat, threshold = chi_square(sample_sequences(make(), wor, N_SAMPLES), exact_law())
    assert stat < threshold, (name, stat, threshold)


def broken_residual(r, q):
    """Residual without renormalisation: later siblings are compared against too little mass."""
    res = torch.clamp_min(r - q, 0.0)
    return torch.where(res.sum(-1, keepdim=True) > 0, res, r)


def broken_remove_token(q, x):
    """Sibling removed from the proposal, proposal not renormalised."""
    return q.scatter(-1, x.unsqueeze(-1), 0.0)


def broken_no_residual(r, q):
    """Resample from the target itself after a rejection (forgets what the draft already covered)."""
    return r


@pytest.mark.parametrize("name,attr,broken", [
    ("rsd-c", "residual", broken_residual),
    ("rsd-s", "remove_token", broken_remove_token),
    ("chain", "residual", broken_no_residual),
    ("rsd-c", "remove_token", broken_remove_token),
])
def test_broken_rule_fails_the_same_test(monkeypatch, name, attr, broken):
    monkeypatch.setattr(rules, attr, broken)
    make, wor = CASES[name]
    stat, threshold = chi_square(sample_sequences(make(), wor, N_SAMPLES), exact_law())
    assert stat > threshold, (name, attr, stat, threshold)


def test_single_tree_wrapper_and_point_mass_draft():
    """The per-tree entry point the engine calls, with a one-hot (prompt-lookup) draft: law of one token."""
    from speculant.trees.tree import DraftTree
    g = torch.Generator().manual_seed(1)
    law = {(x,): float(P[START, x]) for x in range(V)}
    samples = []
    for _ in range(5_000):
        tree = DraftTree()
        tree.set_draft_probs(-1, torch.nn.functional.one_hot(torch.tensor(3), V).float())
        tree.add(-1, 3)
        path, tok = rules.recursive_rejection_sampling(tree, P[tree.block_tokens(START)], g)
        samples.append((tree.tokens[path[0]],) if path else (tok,))
    stat, threshold = chi_square(samples, law)
    assert stat < threshold


def test_sample_categorical_draws_the_law_and_never_a_zero_probability_token():
    from speculant.sampling.processors import sample_categorical
    probs = torch.tensor([[0.0, 0.5, 0.0, 0.2, 0.3, 0.0], [0.1, 0.0, 0.0, 0.0, 0.0, 0.9]])
    draws = sample_categorical(probs * 7.0, torch.Generator().manual_seed(0), 60_000)   # unnormalised is fine
    for row in range(2):
        samples = [(int(t),) for t in draws[row]]
        law = {(i,): float(p) for i, p in enumerate(probs[row]) if p > 0}
        stat, threshold = chi_square(samples, law)
        assert stat < threshold, (row, stat, threshold)
    # a broken sampler (one index off) fails the same test
    broken = [((int(t) + 1) % 6,) for t in draws[0]]
    with pytest.raises(AssertionError):
        stat, threshold = chi_square(broken, {(i,): float(p) for i, p in enumerate(probs[0]) if p > 0})
        assert stat < threshold


@pytest.mark.parametrize("scale", [0.3, 3.0, 12.0])
@pytest.mark.parametrize("top_p", [0.5, 0.9, 0.999])
def test_top_p_partial_sort_equals_the_full_sort(scale, top_p):
    """The nucleus found among the most likely candidates equals the full-sort nucleus (flat and peaked)."""
    from speculant.sampling import processors
    g = torch.Generator().manual_seed(1)
    probs = torch.softmax(torch.randn(3, 5000, generator=g) * scale, -1)
    fast = processors._top_p(probs, top_p)
    sorted_p, idx = torch.sort(probs, dim=-1, descending=True)
    cum = sorted_p.cumsum(-1)
    full = torch.zeros_like(probs).scatter_(-1, idx, sorted_p.masked_fill((cum - sorted_p) >= top_p, 0.0))
    full = full / full.sum(-1, keepdim=True)
    torch.testing.assert_close(fast, full, rtol=1e-6, atol=1e-7)
    assert torch.equal(fast > 0, full > 0)


@pytest.mark.parametrize("without_replacement", [True, False])
def test_the_one_tree_rule_draws_what_the_batch_rule_draws(without_replacement):
    """``recursive_rejection_sampling`` (a sequence's rounds) against ``recursive_rejection_sampling_batch`` at B = 1
    on random trees (up to 3 children a node, depth 3) with random draft and target rows, some zero: the same
    accepted path and emitted token from the same generator state, for tensor and callable targets."""
    from speculant.trees.tree import DraftTree
    rng = torch.Generator().manual_seed(7)
    outcomes = set()
    for case in range(400):
        tree = DraftTree()
        frontier = [-1]
        for _ in range(3):
            nxt = []
            for parent in frontier:
                k = int(torch.randint(0, 4, (1,), generator=rng))
                if not k:
                    continue
                q = torch.rand(V, generator=rng) * (torch.rand(V, generator=rng) > 0.3)
                q[int(torch.randint(0, V, (1,), generator=rng))] += 0.1
                q = q / q.sum()
                tree.set_draft_probs(parent, q)
                for x in torch.multinomial(q, min(k, int((q > 0).sum())), generator=rng).tolist():
                    nxt.append(tree.add(parent, x))
            frontier = nxt
        p = torch.rand(len(tree) + 1, V, generator=rng, dtype=torch.float64)
        p = p * (torch.rand(p.shape, generator=rng) > 0.2)
        p[:, 0] += 1e-3
        p = p / p.sum(-1, keepdim=True)
        vocab = tree.draft_vocab_size

        def q_row(entry):
            row = tree.draft_row(int(entry[0]))
            return row[None] if row is not None else torch.zeros(1, vocab or 1)

        for target in (p, lambda e: p[e]):
            batch_target = (lambda entry: p[int(entry[0])][None]) if callable(target) else p[None]
            path_b, token_b = rules.recursive_rejection_sampling_batch(
                torch.tensor([tree.tokens or [0]]), tree.children_table()[None], q_row, batch_target,
                torch.Generator().manual_seed(case), without_replacement)
            path, token = rules.recursive_rejection_sampling(tree, target, torch.Generator().manual_seed(case),
                                                             without_replacement)
            assert (path, token) == (path_b[0].tolist(), int(token_b[0])), case
            outcomes.add((len(path), len(tree) > 0))
    assert {(0, True), (1, True), (2, True)} <= outcomes, outcomes    # rejections and accepted depths both seen


def test_chain_accept_test_through_numpy_equals_torch():
    """The chain node's accept test on float32 rows (numpy float32 scalars) decides as the batch rule's 1-element
    torch operations do, ties ``u * q(x) == p(x)`` and ``q(x) = 0`` included; float64 rows keep torch's."""
    g = torch.Generator().manual_seed(3)
    for dtype in (torch.float32, torch.float64):
        for case in range(3000):
            u = torch.rand(1, generator=g)
            qx = torch.rand(1, generator=g) * (case % 7 != 0)
            r = torch.rand(5, generator=g, dtype=dtype)
            if case % 5 == 0:
                r[2] = (u * qx).to(dtype)[0]                                    # an exact tie
            want = bool((qx > 0) & (u * qx < r[2:3]))
            assert rules._accepts(u, qx.to(torch.float32), r, 2) == want, (dtype, case)
