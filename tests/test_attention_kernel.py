"""Our float32 attention kernel (speculant/kernels/attention.c): the softmax it computes, and rows that get the
same bits whatever else shares the call, including tree layouts."""

import pytest
import torch
import torch.nn.functional as F

from speculant.kernels import attention as kernel
from speculant.kernels import build

pytestmark = pytest.mark.skipif(not build.available(), reason=f"kernels: {build.unavailable_reason()}")


def _cache(hkv=2, smax=40, d=16, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(1, hkv, smax, d, generator=g) * 2, torch.randn(1, hkv, smax, d, generator=g)


def test_matches_float64_sdpa():
    keys, values = _cache()
    g = torch.Generator().manual_seed(1)
    q = torch.randn(1, 6, 5, 16, generator=g) * 3
    mask = torch.rand(5, 33, generator=g) < 0.6
    mask[:, 0] = True                                           # every row attends at least one slot
    got = kernel.attention(q, keys, values, mask, 0.25)
    want = F.scaled_dot_product_attention(q.double(), keys[:, :, :33].double(), values[:, :, :33].double(),
                                          attn_mask=mask, scale=0.25, enable_gqa=True)
    want = want.transpose(1, 2).reshape(1, 5, -1)
    assert got.shape == (1, 5, 96) and got.dtype == torch.float32
    assert float((got.double() - want).abs().max()) < 2e-6 * float(want.abs().max())


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_a_block_row_gets_the_bits_of_its_one_token_step(dtype):
    """Row j of a chain block (later slots masked) equals the one-token step that sees slots 0..n+j only, over a
    float32 or a float16 cache."""
    keys, values = (c.to(dtype) for c in _cache(smax=64))
    g = torch.Generator().manual_seed(2)
    n, t = 30, 7
    q = torch.randn(1, 4, t, 16, generator=g)
    causal = torch.arange(n + t)[None, :] <= torch.arange(t)[:, None] + n
    block = kernel.attention(q, keys, values, causal, 0.25)
    for j in range(t):
        step = kernel.attention(q[:, :, j:j + 1], keys, values, torch.ones(1, n + j + 1, dtype=torch.bool), 0.25)
        assert torch.equal(block[:, j], step[:, 0]), j


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_a_one_token_step_split_over_threads_gets_the_bits_of_a_block_row(dtype):
    """One key/value head (Gemma 3 270M's 4 query heads on 1): a one-token step is fewer units than threads, so its
    heads are split over the threads; each head gets the bits of the same row computed whole (1 thread) and of a
    block row (more units than threads: not split)."""
    keys, values = (c.to(dtype) for c in _cache(hkv=1, smax=64, d=16, seed=5))
    g = torch.Generator().manual_seed(6)
    n, t = 30, 4
    q = torch.randn(1, 4, t, 16, generator=g)
    causal = torch.arange(n + t)[None, :] <= torch.arange(t)[:, None] + n
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        block = kernel.attention(q, keys, values, causal, 0.25)
        steps = {}
        for threads in (2, 1):
            torch.set_num_threads(threads)
            steps[threads] = [kernel.attention(q[:, :, j:j + 1], keys, values,
                                               torch.ones(1, n + j + 1, dtype=torch.bool), 0.25) for j in range(t)]
    finally:
        torch.set_num_threads(before)
    for j in range(t):
        assert torch.equal(steps[2][j], steps[1][j]) and torch.equal(block[:, j], steps[2][j][:, 0]), j


def test_a_tree_row_gets_the_bits_of_the_contiguous_path():
    """A tree node whose ancestors sit at scattered slots (siblings masked between) equals the same keys laid out
    contiguously, as they are after the accepted path is committed."""
    keys, values = _cache(smax=64, seed=3)
    g = torch.Generator().manual_seed(4)
    n = 20
    q = torch.randn(1, 4, 1, 16, generator=g)
    scattered = torch.zeros(1, n + 9, dtype=torch.bool)
    scattered[0, :n] = True
    path = [n + 1, n + 4, n + 8]                                  # the node's ancestors and itself
    scattered[0, path] = True
    tree = kernel.attention(q, keys, values, scattered, 0.25)
    k2, v2 = keys.clone(), values.clone()
    k2[:, :, n:n + 3], v2[:, :, n:n + 3] = keys[:, :, path], values[:, :, path]
    contiguous = kernel.attention(q, k2, v2, torch.ones(1, n + 3, dtype=torch.bool), 0.25)
    assert torch.equal(tree, contiguous)


def test_supports():
    assert kernel.supports(64) and not kernel.supports(60) and not kernel.supports(64, torch.float64)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_ragged_call_writes_each_cache_and_gives_each_row_its_own_bits(dtype):
    """A batched round's one call over several sequences (own caches, block sizes, masks) equals each sequence's
    own KV write + attention, at the layer asked for.  A float16 cache gets the new keys/values rounded exactly as
    torch rounds them (nearest even; ties, tiny values and overflow included), so a cache written by the fused
    step and one written by the torch layer step hold the same bits for the same values."""
    from speculant.models.kv_cache import KVCache
    g = torch.Generator().manual_seed(5)
    specs = [(12, 3), (30, 1), (7, 5)]                          # (cache position, rows) per sequence
    caches = [KVCache(3, 2, 16, 48 + 8 * j, dtype=dtype) for j in range(3)]
    for c in caches:
        c.keys.copy_(torch.randn(c.keys.shape, generator=g))
        c.values.copy_(torch.randn(c.values.shape, generator=g))
    solo = [(c.keys.clone(), c.values.clone()) for c in caches]
    rows = [t for _, t in specs]
    q = torch.randn(1, 4, sum(rows), 16, generator=g)
    k_new = torch.randn(1, 2, sum(rows), 16, generator=g) * torch.tensor([1.0, 1e-5, 3e4, 7e4]).repeat(4)
    v_new = (torch.randn(1, 2, sum(rows), 16, generator=g).half().float()      # float16 values + half an ulp or so:
             + torch.rand(1, 2, sum(rows), 16, generator=g).half().float() * 2 ** -11)      # rounding ties
    masks = []
    for start, t in specs:
        m = torch.rand(t, start + t, generator=g) < 0.7
        m[:, 0] = True
        masks.append(m)
    plan = kernel.RaggedPlan(rows, [s for s, _ in specs], caches, masks)
    out = kernel.ragged_attention(q, k_new, v_new, plan, 1, 0.25)
    first = 0
    for j, (start, t) in enumerate(specs):
        k, v = solo[j]
        k[1, :, :, start:start + t], v[1, :, :, start:start + t] = k_new[:, :, first:first + t], v_new[:, :, first:first + t]
        assert torch.equal(caches[j].keys, k) and torch.equal(caches[j].values, v)   # layer 1 written, 0 and 2 not
        alone = kernel.attention(q[:, :, first:first + t], k[1], v[1], masks[j], 0.25)
        assert torch.equal(out[:, first:first + t], alone), j
        first += t
