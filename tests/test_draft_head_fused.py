"""The EAGLE draft head's forward as one C call (speculant/kernels/draft_head_step.py, ``spec_draft_head``) against
the torch head: features and draft logits for single rows, chains, tree frontiers under masks; incremental equal
to from scratch; greedy decoding with the fused head token-identical to ``ar``; the torch fallback."""

from __future__ import annotations

import copy

import pytest
import torch
from helpers import on_fused_step, tiny_model
from test_draft_head import random_head

from speculant import GenerationConfig, SamplingConfig, build_generator
from speculant.drafters.draft_head import DraftHead, fused_head_why_not, save_head
from speculant.kernels import build
from speculant.kernels.draft_head_step import FusedDraftHead

pytestmark = pytest.mark.skipif(not build.available(), reason=f"kernels: {build.unavailable_reason()}")
V, D = 64, 64
TOL = dict(atol=1e-4, rtol=1e-4)      # the torch head's RMSNorm and RoPE round differently from the C code


@pytest.fixture(scope="module")
def model():
    return on_fused_step(tiny_model(seed=5, scale=1.5, vocab=V, layers=2, hidden=D, heads=2, kv_heads=1, inter=128))


def packed_head(m, feature="post-norm", vocab_ids=torch.arange(0, V, 2), fmt="w8a8", seed=1) -> DraftHead:
    return random_head(m, vocab_ids, feature, seed).pack(fmt)


def both(head, *args, **kw):
    """``head.step`` fused and through torch (each on its own copy of the cache)."""
    cache, rest = args[4], args[5:]
    copy = head.new_cache(cache.max_length)
    copy.keys.copy_(cache.keys)
    copy.values.copy_(cache.values)
    fused = head.step(*args[:4], cache, *rest, **kw)
    head.use_fused = False
    try:
        ref = head.step(*args[:4], copy, *rest, **kw)
    finally:
        head.use_fused = True
    return fused, ref


@pytest.mark.parametrize("feature", ["post-norm", "pre-norm"])
def test_fused_head_equals_the_torch_head(model, feature):
    """A prompt's catch-up (causal), one row, a chain of rows after it, a tree frontier under its mask: the fused
    head's predicted features and draft-vocabulary logits equal the torch head's within rounding."""
    head = packed_head(model, feature)
    assert head.fused(torch.float32) is not None, fused_head_why_not(head, torch.float32)
    g = torch.Generator().manual_seed(0)
    cache = head.new_cache(64)
    n = 9
    feats, toks = torch.randn(n, D, generator=g), torch.randint(0, V, (n,), generator=g)
    (f1, l1), (f2, l2) = both(head, feats, toks, torch.arange(n), None, cache, 0)
    assert l1.shape == (n, V // 2) and f1.shape == (n, D)
    torch.testing.assert_close(f1, f2, **TOL)
    torch.testing.assert_close(l1, l2, **TOL)
    (f1, l1), (f2, l2) = both(head, feats[:1], toks[:1], torch.tensor([n]), None, cache, n)       # one row
    torch.testing.assert_close(f1, f2, **TOL)
    torch.testing.assert_close(l1, l2, **TOL)
    (f1, l1), (f2, l2) = both(head, feats[:3], toks[:3], torch.arange(n, n + 3), None, cache, n)   # a chain
    torch.testing.assert_close(l1, l2, **TOL)
    mask = torch.ones(4, n + 4, dtype=torch.bool)              # a frontier of 4 siblings: each sees itself only
    mask[:, n:] = torch.eye(4, dtype=torch.bool)
    (f1, l1), (f2, l2) = both(head, feats[:4], toks[:4], torch.full((4,), n), mask, cache, n)
    torch.testing.assert_close(f1, f2, **TOL)
    torch.testing.assert_close(l1, l2, **TOL)
    assert not torch.equal(l1[0], l1[1])                       # the rows really differ (tokens, features)


def test_rows_are_independent_and_incremental_equals_from_scratch(model):
    """Bitwise, as the fused step's rows: a catch-up in two calls equals one call, a frontier row alone equals the
    row among others, and ``logit_rows`` gives the last rows' logits of the full call."""
    head = packed_head(model, "pre-norm")
    g = torch.Generator().manual_seed(1)
    n = 12
    feats, toks = torch.randn(n, D, generator=g), torch.randint(0, V, (n,), generator=g)
    a, b = head.new_cache(32), head.new_cache(32)
    fa, la = head.step(feats, toks, torch.arange(n), None, a, 0)
    head.step(feats[:5], toks[:5], torch.arange(5), None, b, 0)
    fb, lb = head.step(feats[5:], toks[5:], torch.arange(5, n), None, b, 5, 2)
    assert torch.equal(fa[5:], fb) and torch.equal(la[-2:], lb) and lb.shape == (2, V // 2)
    assert torch.equal(a.keys[:, :, :, :n], b.keys[:, :, :, :n])
    mask = torch.ones(3, n + 3, dtype=torch.bool)
    mask[:, n:] = torch.eye(3, dtype=torch.bool)
    fr, lr = head.step(feats[:3], toks[:3], torch.full((3,), n), mask, a, n)
    for i in range(3):
        one = torch.ones(1, n + 1, dtype=torch.bool)
        f1, l1 = head.step(feats[i:i + 1], toks[i:i + 1], torch.tensor([n]), one, b, n)
        assert torch.equal(f1, fr[i:i + 1]) and torch.equal(l1, lr[i:i + 1])


def test_fallback_and_errors(model):
    """Float or int8 heads run the torch modules (no fused head, a reason given); bad tokens, positions and cache
    overflows are errors naming the values."""
    assert packed_head(model, fmt="fp32").fused(torch.float32) is None
    assert "not w4a8/w8a8" in fused_head_why_not(packed_head(model, fmt="int8"), torch.float32)
    head = packed_head(model)
    fused = head.fused(torch.float32)
    assert isinstance(fused, FusedDraftHead) and head.fused(torch.float32) is fused      # built once
    head.use_fused = False
    assert head.fused(torch.float32) is None
    head.use_fused = True
    copied = copy.deepcopy(head)                 # the copy builds its own (the pointers are this head's)
    assert copied.fused(torch.float32) not in (None, fused)
    cache = head.new_cache(4)
    x = torch.zeros(1, D)
    with pytest.raises(IndexError, match="tokens"):
        fused.forward(x, torch.tensor([V]), torch.tensor([0]), cache, 0)
    with pytest.raises(IndexError, match="positions"):
        fused.forward(x, torch.tensor([0]), torch.tensor([10 ** 6]), cache, 0)
    with pytest.raises(ValueError, match="max_length=4"):
        fused.forward(x, torch.tensor([0]), torch.tensor([0]), cache, 4)


@pytest.mark.parametrize("spec", [dict(method="eagle", num_speculations=4), dict(method="rsd-c", branching="3,2,1"),
                                  dict(method="specinfer", branching="2,2")], ids=["eagle", "rsd-c", "specinfer"])
@pytest.mark.parametrize("controls", [False, True], ids=["plain", "penalties"])
def test_greedy_with_the_fused_head_matches_ar_and_the_torch_head(model, spec, controls, tmp_path, monkeypatch):
    """Greedy decoding with a w8a8 head on the fused route, with and without per-position controls (penalties and
    logit bias: the full-vocabulary route of the draft distribution): token-identical to ``ar``; each draft's logits
    equal the torch head's within rounding (the same trees drafted)."""
    import speculant.drafters.draft_head as draft_head
    monkeypatch.setattr(draft_head, "head_weight_format", lambda m, head: "w8a8")
    save_head(packed_head(model, "pre-norm", fmt="fp32", seed=4), tmp_path / "h")
    sampling = SamplingConfig(temperature=0.0, repetition_penalty=1.3, logit_bias={4: 1.5, 7: -3.0}) if controls \
        else SamplingConfig()
    prompt, cfg = [3, 17, 42, 8, 25, 60, 1, 33, 12], GenerationConfig(max_new_tokens=30, sampling=sampling)
    ar = build_generator(model, method="ar").generate(prompt, cfg).token_ids
    runs = []
    for use_fused in (True, False):
        gen = build_generator(model, draft_head=str(tmp_path / "h"), speculation="always", **spec)
        gen.drafter.head.use_fused = use_fused
        seen, inner = [], gen.drafter.draft_vocab_logits

        def spy(state, tree, first_entry, depth, inner=inner, seen=seen):
            out = inner(state, tree, first_entry, depth)
            seen.append((list(state.tokens), list(tree.tokens), out.clone()))
            return out

        gen.drafter.draft_vocab_logits = spy
        out = gen.generate(prompt, cfg)
        assert out.token_ids == ar and out.stats.drafted_tokens > 0
        assert (gen.drafter.head.fused(torch.float32) is not None) == use_fused
        runs.append(seen)
    assert len(runs[0]) == len(runs[1]) > 10
    for (tok1, tree1, l1), (tok2, tree2, l2) in zip(*runs):
        assert (tok1, tree1) == (tok2, tree2)
        torch.testing.assert_close(l1, l2, **TOL)



def test_the_route_is_timed_once_per_machine_kept_and_applied(model, monkeypatch):
    """The tune step of the head's route (:func:`weights.tune_head_route`): both routes timed once per head shape
    (real timings: both positive, ``use_fused`` restored by the measurement), the torch modules chosen only when
    faster by more than the noise, the choice kept in the tune and read back without timing; no tune: fused kept."""
    from speculant.drafters import weights
    from speculant.runtime import tune
    head = packed_head(model)
    ms = weights.measure_head_routes(head, lambda: None, repeats=2)
    assert set(ms) == {"fused", "torch"} and min(ms.values()) > 0 and head.use_fused
    assert weights.tune_head_route(model, head) is True                         # a model built in memory: no tune
    tuned = copy.copy(model)
    tuned.tune = tune.TuneResult(key=tune.tune_key(model.decoder.config, 1), weights="w4a8", fp32_route="linear",
                                 threads=1)
    monkeypatch.setattr(tune, "save", lambda result: None)
    for torch_ms, want in ((0.97, True), (0.9, False)):                          # within the noise, then a clear win
        tuned.tune.drafter_weights.clear()
        monkeypatch.setattr(weights, "measure_head_routes", lambda h, evict, t=torch_ms: {"fused": 1.0, "torch": t})
        assert weights.tune_head_route(tuned, head) is want and head.use_fused is want
    (entry,) = tuned.tune.drafter_weights.values()
    assert entry == {"fused": False, "ms": {"fused": 1.0, "torch": 0.9}}
    monkeypatch.setattr(weights, "measure_head_routes", lambda *a: pytest.fail("timed again"))
    head.use_fused = True
    assert weights.tune_head_route(tuned, head) is False                       # the kept choice, not timed again
