"""The tree builders' samplers without full-vocabulary passes draw the laws of the full-vocabulary ones.

* successive sampling without replacement = Gumbel-Top-k: the ordered sample is Plackett-Luce;
* stochastic beam search with top-down truncated Gumbels: after two depths its W beams, ordered by
  score, are a Plackett-Luce sample of the 2-token sequences (Kool et al. 2019, Sec. 4);
each against its exact law (chi-square, false-alarm rate 1e-4), and a broken variant fails the same test.
DraftTree's incrementally grown masks equal the ones rebuilt from the parents.
"""

import itertools

import torch
from stats_helpers import chi_square

from speculant.sampling import gumbel
from speculant.trees import StochasticBeamBuilder
from speculant.trees.tree import DraftTree


def plackett_luce(probs: list[float], k: int) -> dict[tuple, float]:
    law = {}
    for seq in itertools.permutations([i for i, p in enumerate(probs) if p > 0], k):
        prob, left = 1.0, 1.0
        for x in seq:
            prob *= probs[x] / left
            left -= probs[x]
        law[seq] = prob
    return law


PROBS = [0.05, 0.0, 0.4, 0.2, 0.3, 0.05]


def test_sample_without_replacement_is_plackett_luce():
    n = 60_000
    probs = torch.tensor(PROBS).expand(n, -1).contiguous()
    toks, left = gumbel.sample_without_replacement(probs, 3, torch.Generator().manual_seed(4))
    assert toks.shape == (n, 3) and torch.allclose(left[:, 0], torch.ones(n, dtype=torch.float64))
    stat, threshold = chi_square([tuple(r) for r in toks.tolist()], plackett_luce(PROBS, 3))
    assert stat < threshold, (stat, threshold)


def test_with_replacement_is_not_plackett_luce():
    """The same test catches i.i.d. draws renamed into distinct tokens (a broken sampler)."""
    n = 60_000
    g = torch.Generator().manual_seed(0)
    draws = torch.multinomial(torch.tensor(PROBS), 3 * n, replacement=True, generator=g).view(n, 3).tolist()
    samples = [tuple(r) for r in draws if len(set(r)) == 3]
    stat, threshold = chi_square(samples, plackett_luce(PROBS, 3))
    assert stat > threshold


def test_sharpened_draws_fail_the_same_test(monkeypatch):
    """A broken successive sampler whose draws follow the squared weights (a temperature slip) is caught."""
    draw = gumbel.inverse_cdf_draw
    monkeypatch.setattr(gumbel, "inverse_cdf_draw", lambda w, u: draw(w * w, u))
    n = 60_000
    toks, _ = gumbel.sample_without_replacement(torch.tensor(PROBS).expand(n, -1).contiguous(), 3,
                                                torch.Generator().manual_seed(4))
    stat, threshold = chi_square([tuple(r) for r in toks.tolist()], plackett_luce(PROBS, 3))
    assert stat > threshold


def test_support_rules():
    """k' = fewest positive tokens (as gumbel_top_k); with pad, -1 once a row has none left."""
    probs = torch.tensor([[0.5, 0.5, 0.0, 0.0], [0.2, 0.3, 0.1, 0.4]])
    toks, _ = gumbel.sample_without_replacement(probs, 3, None)
    assert toks.shape == (2, 2) and set(toks[0].tolist()) == {0, 1}
    toks, left = gumbel.sample_without_replacement(probs, 3, None, pad=True)
    assert toks.shape == (2, 3) and toks[0, 2] == -1 and left[0, 2] == 0 and len(set(toks[1].tolist())) == 3


V = 3
DRAFT = torch.tensor([[0.6, 0.3, 0.1], [0.2, 0.5, 0.3], [0.45, 0.45, 0.1]])


def beam_law() -> dict[tuple, float]:
    seq_probs = {(a, b): float(DRAFT[0, a] * DRAFT[a, b]) for a in range(V) for b in range(V)}
    names = list(seq_probs)
    law = plackett_luce([seq_probs[s] for s in names], 2)
    return {tuple(names[i] for i in k): p for k, p in law.items()}


def beam_samples(n: int, seed: int) -> list[tuple]:
    g = torch.Generator().manual_seed(seed)
    builder = StochasticBeamBuilder(beam_width=2, draft_length=2)
    builder.reset()
    parents1, tok1 = builder.expand_batch(DRAFT[0].expand(n, 1, V), False, g)
    parents2, tok2 = builder.expand_batch(DRAFT[tok1], False, g)
    order = torch.argsort(builder._score, dim=1, descending=True)
    first = tok1.gather(1, parents2.gather(1, order))
    second = tok2.gather(1, order)
    return [((a, b), (c, d)) for (a, c), (b, d) in zip(first.tolist(), second.tolist())]


def test_stochastic_beam_search_samples_sequences_without_replacement():
    stat, threshold = chi_square(beam_samples(60_000, 1), beam_law())
    assert stat < threshold, (stat, threshold)


def test_untruncated_beam_scores_fail_the_same_test(monkeypatch):
    """Children scored by plain Gumbels of the mass left, not truncated at the previous score."""
    def untruncated(location, bound, generator):
        u = torch.rand(location.shape, generator=generator, dtype=torch.float64).clamp_min(1e-300)
        return location - torch.log(-torch.log(u))
    import speculant.trees.builders as builders
    monkeypatch.setattr(builders, "truncated_gumbel_below", untruncated)
    stat, threshold = chi_square(beam_samples(60_000, 1), beam_law())
    assert stat > threshold, (stat, threshold)


def test_greedy_beam_search_keeps_the_best_sequences():
    builder = StochasticBeamBuilder(beam_width=2, draft_length=2)
    builder.reset()
    _, tok1 = builder.expand_batch(DRAFT[0].expand(1, 1, V), True, None)
    parents2, tok2 = builder.expand_batch(DRAFT[tok1], True, None)
    got = {(int(tok1[0, p]), int(t)) for p, t in zip(parents2[0], tok2[0])}
    seq = sorted(((float(DRAFT[0, a] * DRAFT[a, b]), (a, b)) for a in range(V) for b in range(V)), reverse=True)
    best_first = {s for _, s in seq[:2]}
    # beam search keeps the best 2 of the children of the 2 best first tokens
    kept = sorted(((float(DRAFT[0, a] * DRAFT[a, b]), (a, b)) for a in (0, 1) for b in range(V)), reverse=True)
    assert got == {s for _, s in kept[:2]} and got == best_first


def test_incremental_masks_equal_the_rebuilt_ones():
    tree = DraftTree()
    g = torch.Generator().manual_seed(0)
    for i in range(40):
        parent = int(torch.randint(-1, i, (1,), generator=g)) if i else -1
        tree.add(parent, i)
        n = len(tree) + 1
        want = torch.zeros(n, n, dtype=torch.bool)
        want[:, 0] = True
        for node, par in enumerate(tree.parents):
            if par >= 0:
                want[node + 1] = want[par + 1]
            want[node + 1, node + 1] = True
        assert torch.equal(tree.ancestor_mask(), want)
        assert tree.block_positions(7).tolist() == [7] + [7 + d for d in tree.depths]
        assert tree.is_chain == all(p == j - 1 for j, p in enumerate(tree.parents))
    table = tree.children_table()
    for entry, kids in enumerate(tree.children):
        assert table[entry][:len(kids)].tolist() == kids and (table[entry][len(kids):] == -1).all()

