"""The C row kernels of a sampled round (``speculant/kernels/sampling.c``): a temperature softmax and inverse-CDF
draws from a row or from speculative sampling's residual, against their torch definitions.

* the softmax equals ``torch.softmax(logits / T)`` within float32 rounding of the exponent's argument (rows of any
  length, ``-inf`` entries);
* a draw with uniform ``u`` is the index a float64 cumulative sum gives (``searchsorted(cumsum(r), u * total)``)
  for the residual ``r = max(0, p - q)`` with ``q`` absent, dense or sparse over unsorted token ids, on a grid of
  uniforms, across blocks (long rows with empty blocks) — so the law is the residual's;
* never a token of zero residual, even for ``u`` just below 1; ``p == q`` draws from ``p``; a zero row gives V - 1;
* installed under the sampling package, :func:`sample_categorical` still draws the law (chi-square), and one index
  off fails the same test.
"""

import pytest
import torch
from stats_helpers import chi_square

from speculant.kernels import sampling as kernels
from speculant.sampling import processors
from speculant.verification import rules

pytestmark = pytest.mark.skipif(not kernels.available(), reason="the C kernels do not build here")


def reference_draw(p: torch.Tensor, u: float, q: torch.Tensor | None = None) -> int:
    """The float64 inverse CDF of ``max(0, p - q)`` (``p`` where that is zero everywhere)."""
    r = p.double() if q is None else torch.clamp_min(p.double() - q.double(), 0.0)
    if not float(r.sum()) > 0:
        r = p.double()
    c = r.cumsum(0)
    return min(int(torch.searchsorted(c, torch.tensor([u * float(c[-1])], dtype=torch.float64), right=True)),
               p.shape[0] - 1)


@pytest.mark.parametrize("v", [1, 7, 8, 13, 256, 1000, 49152])
@pytest.mark.parametrize("temperature", [0.3, 1.0, 2.5])
def test_softmax_equals_torch(v, temperature):
    g = torch.Generator().manual_seed(v)
    logits = torch.randn(3, v, generator=g) * 4
    if v > 2:
        logits[0, 1] = float("-inf")
    got = kernels.softmax_rows(logits, temperature)
    want = torch.softmax(logits / temperature, -1)
    # both round the exponent's argument (l - max) / T to float32 in another order: up to |x| * 2^-24 relative
    # (x down to -87, where exp underflows), i.e. ~5e-6
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-12)
    assert got.shape == logits.shape and (got[0, 1] == 0 if v > 2 else True)
    forbidden = torch.full((1, v), float("-inf"))                       # every token forbidden: NaNs, as torch's
    assert torch.isnan(kernels.softmax_rows(forbidden, temperature)).all()


def rows(v: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A target row ``p`` and a draft row ``q`` of length ``v`` with zero entries and empty 256-entry blocks."""
    g = torch.Generator().manual_seed(seed)
    p = torch.rand(v, generator=g) * (torch.rand(v, generator=g) > 0.3)
    q = torch.rand(v, generator=g) * (torch.rand(v, generator=g) > 0.5)
    if v > 1200:
        p[256:1024] = 0.0                                  # whole blocks without mass
    p[v // 2] += 0.5
    return p / p.sum(), q / q.sum()


@pytest.mark.parametrize("v", [5, 300, 3000])
def test_draws_equal_the_float64_inverse_cdf(v):
    p, q = rows(v, v)
    ids = torch.randperm(v, generator=torch.Generator().manual_seed(1))[: max(1, v // 3)]   # unsorted token ids
    q_sparse = q[ids] / q[ids].sum()
    q_full = torch.zeros(v).index_copy_(0, ids, q_sparse)
    for k in range(2000):
        u = (k + 0.5) / 2000
        assert kernels.draw(p, u) == reference_draw(p, u), (k, "p")
        assert kernels.draw(p, u, q) == reference_draw(p, u, q), (k, "dense q")
        assert kernels.draw(p, u, q_sparse, ids) == reference_draw(p, u, q_full), (k, "sparse q")


def test_draw_edges():
    p, q = rows(3000, 5)
    below_one = 1.0 - 2.0 ** -53
    for q_row in (None, q):
        token = kernels.draw(p, below_one, q_row)
        r = p if q_row is None else torch.clamp_min(p - q_row, 0.0)
        assert r[token] > 0 and token == int(torch.nonzero(r)[-1])       # the last token with mass, not past it
    assert kernels.draw(p, 0.0) == int(torch.nonzero(p)[0])
    assert kernels.draw(p, 0.37, p.clone()) == reference_draw(p, 0.37)   # p == q: p itself
    assert kernels.draw(torch.zeros(600), 0.5) == 599


def test_installed_sample_categorical_draws_the_law():
    """The installed kernels under :func:`sample_categorical` (as the runtime installs them): the law of each row
    (one of them with empty blocks), and a sampler that moves each draw to another token with mass fails it."""
    before = processors._ROW_KERNELS
    processors.install_row_kernels(kernels)
    try:
        probs = torch.zeros(2, 600)
        probs[0, [1, 3, 4]] = torch.tensor([0.5, 0.2, 0.3])
        probs[1, [0, 599]] = torch.tensor([0.1, 0.9])
        draws = processors.sample_categorical(probs * 7.0, torch.Generator().manual_seed(0), 20_000)
        single = processors.sample_categorical(probs[0], torch.Generator().manual_seed(0))
        residual = rules.sample_residual(probs[0], probs[0] * 0.5, None, torch.Generator().manual_seed(0))
    finally:
        processors.install_row_kernels(before)
    assert draws.shape == (2, 20_000) and single.shape == (1,) and residual in (1, 3, 4)
    for row in range(2):
        law = {(i,): float(p) for i, p in enumerate(probs[row]) if p > 0}
        stat, threshold = chi_square([(int(t),) for t in draws[row]], law)
        assert stat < threshold, (row, stat, threshold)
    law = {(i,): float(p) for i, p in enumerate(probs[0]) if p > 0}
    misplaced = {1: 3, 3: 4, 4: 1}                                  # each draw moved to the next token with mass
    stat, threshold = chi_square([(misplaced[int(t)],) for t in draws[0]], law)
    assert stat > threshold
