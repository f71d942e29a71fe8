"""Exactness of the sampling acceptance rules with the production tree builders.

A first-order Markov target ``p(x | prev)`` and draft ``q(x | prev)`` over a
5-token vocabulary stand in for the networks, so 100 000 samples are cheap;
builders and rules are the production code.  The joint law of the first
three emitted tokens must match the target's exact law (chi-square, 1e-4
false-alarm threshold from the sample count), and deliberately broken rules
must fail the same test with the same sample count.
"""

import itertools

import pytest
import torch
from stats_helpers import chi_square

from speculant.trees import ChainBuilder, ConstantBranchingBuilder, IIDTreeBuilder, StochasticBeamBuilder
from speculant.trees.tree import DraftTree
from speculant.verification import rules

V = 5
N_SAMPLES = 100_000
N_TOKENS = 2


def tables():
    g = torch.Generator().manual_seed(7)
    p = torch.softmax(torch.randn(V, V, generator=g) * 1.5, -1)
    q = torch.softmax(torch.randn(V, V, generator=g) * 1.5, -1)
    q[:, 0] = q[:, 0] * 0.05          # the draft nearly misses a token the target likes
    q = q / q.sum(-1, keepdim=True)
    return p, q


P, Q = tables()
START = 2


def exact_law() -> dict[tuple, float]:
    law = {}
    for seq in itertools.product(range(V), repeat=N_TOKENS):
        prob, prev = 1.0, START
        for x in seq:
            prob *= float(P[prev, x])
            prev = x
        law[seq] = prob
    return law


def draft_tree(builder, root: int, generator) -> DraftTree:
    """Grow a tree depth by depth with the builder, as the drafters do."""
    tree, frontier = DraftTree(), [-1]
    builder.reset()
    for depth in range(1, builder.max_depth + 1):
        toks = [root if f < 0 else tree.tokens[f] for f in frontier]
        q = Q[toks]
        for f, row in zip(frontier, q):
            tree.set_draft_probs(f, row)
        kids = builder.expand(depth, q, False, generator)
        new = [tree.add(f, t) for f, ts in zip(frontier, kids) for t in ts]
        if not new:
            break
        frontier = new
    return tree


def sample_sequences(builder, without_replacement: bool, n: int, seed: int = 0) -> list[tuple]:
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        seq = []
        while len(seq) < N_TOKENS:
            root = seq[-1] if seq else START
            tree = draft_tree(builder, root, g)
            p = P[tree.block_tokens(root)]
            path, tok = rules.recursive_rejection_sampling(tree, p, g, without_replacement)
            seq.extend([tree.tokens[i] for i in path] + [tok])
        out.append(tuple(seq[:N_TOKENS]))
    return out


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
    return torch.clamp_min(r - q, 0.0)


def broken_remove_token(q, x):
    """Sibling removed from the proposal but the proposal not renormalised."""
    q = q.clone()
    q[x] = 0.0
    return q


def broken_no_residual(r, q):
    """Resample from the target itself after a rejection (forgets what the draft already covered)."""
    return r


@pytest.mark.parametrize("name,attr,broken", [
    ("rsd-c", "residual", broken_residual),
    ("rsd-c", "remove_token", broken_remove_token),
    ("chain", "residual", broken_no_residual),
])
def test_broken_rule_fails_the_same_test(monkeypatch, name, attr, broken):
    monkeypatch.setattr(rules, attr, broken)
    make, wor = CASES[name]
    stat, threshold = chi_square(sample_sequences(make(), wor, N_SAMPLES), exact_law())
    assert stat > threshold, (name, attr, stat, threshold)


def test_point_mass_draft_is_exact():
    """Prompt-lookup style one-hot drafts: accept with p(x), else sample p without x."""
    g = torch.Generator().manual_seed(1)
    law = {(x,): float(P[START, x]) for x in range(V)}
    samples = []
    for _ in range(20_000):
        tree = DraftTree()
        tree.set_draft_probs(-1, torch.nn.functional.one_hot(torch.tensor(3), V).float())
        tree.add(-1, 3)
        path, tok = rules.recursive_rejection_sampling(tree, P[tree.block_tokens(START)], g)
        samples.append((tree.tokens[path[0]],) if path else (tok,))
    stat, threshold = chi_square(samples, law)
    assert stat < threshold
