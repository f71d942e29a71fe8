"""A draft head's LM-head rows in 4 bits (``DraftHead.pack_lm_rows``) and the tune step that chooses them
(``weights.tune_head_lm_rows``): what the rows compute, greedy identity with ``ar``, the paired accuracy the tune
compares, and the choice kept per machine."""

from __future__ import annotations

import copy

import pytest
import torch
from helpers import on_fused_step, tiny_model
from test_draft_head import random_head

from speculant import GenerationConfig, build_generator
from speculant.drafters import weights
from speculant.drafters.draft_head import save_head
from speculant.errors import SpeculantError
from speculant.kernels import build
from speculant.runtime import tune
from speculant.runtime.formats import pack_linear

pytestmark = pytest.mark.skipif(not build.available(), reason=f"kernels: {build.unavailable_reason()}")
V, D = 64, 64


@pytest.fixture(scope="module")
def model():
    return on_fused_step(tiny_model(seed=5, scale=1.5, vocab=V, layers=2, hidden=D, heads=2, kv_heads=1, inter=128))


def head_of(m, seed=1):
    return random_head(m, torch.arange(0, V, 2), "post-norm", seed).pack("w8a8")


def test_the_rows_are_the_target_rows_requantized_and_switch_back(model):
    head = head_of(model)
    target = head._lm_head_rows[0]
    x = torch.randn(5, D, generator=torch.Generator().manual_seed(0))
    head.pack_lm_rows("w4a8")
    assert head.lm_rows_format == "w4a8"
    want = pack_linear("w4a8", target.dequantized_weight())(x)
    assert torch.equal(head._lm_head_rows[0](x), want)              # Q4_1 of the rows the target reads
    assert (want - target(x)).abs().max() < 0.25 * target(x).abs().max()   # close to them, not equal
    assert head.fused(torch.float32) is not None                    # still one C call
    head.pack_lm_rows("target")
    assert head._lm_head_rows[0] is target and head.lm_rows_format == "target"
    with pytest.raises(SpeculantError, match="'w2'.*allowed: target, w4a8"):
        head.pack_lm_rows("w2")


@pytest.mark.parametrize("spec", [dict(method="eagle", num_speculations=3), dict(method="rsd-c", branching="2,2")],
                         ids=["eagle", "rsd-c"])
def test_greedy_with_4_bit_rows_matches_ar(model, spec, tmp_path, monkeypatch):
    import speculant.drafters.draft_head as draft_head
    monkeypatch.setattr(draft_head, "head_weight_format", lambda m, head: "w8a8")
    save_head(random_head(model, torch.arange(0, V, 2), "post-norm", 4), tmp_path / "h")
    prompt, cfg = [3, 17, 42, 8, 25, 60, 1, 33, 12], GenerationConfig(max_new_tokens=30)
    ar = build_generator(model, method="ar").generate(prompt, cfg).token_ids
    gen = build_generator(model, draft_head=str(tmp_path / "h"), speculation="always", **spec)
    gen.drafter.head.pack_lm_rows("w4a8")
    assert gen.drafter.cost_signature == ",lm_rows=w4a8"
    out = gen.generate(prompt, cfg)
    assert out.token_ids == ar and out.stats.drafted_tokens > 0


def test_the_accuracy_is_the_heads_teacher_forced_top1_per_format(model):
    """Against the torch head run row by row over the same features: the count of generated tokens it drafts."""
    head = head_of(model, seed=2)
    g = torch.Generator().manual_seed(1)
    seqs = [(torch.randint(V, (12,), generator=g), torch.randn(12, D, generator=g), 5) for _ in range(3)]
    got = weights.head_lm_rows_accuracy(head, seqs)
    assert head.lm_rows_format == "target"                          # left as it was
    for fmt in ("target", "w4a8"):
        head.pack_lm_rows(fmt)
        hits = total = 0
        with torch.inference_mode():
            for ids, feats, n0 in seqs:
                rows = len(ids) - 2
                out = head(feats[None, :rows], ids[None, 1:rows + 1], torch.arange(rows))[0]
                drafted = head.vocab_ids[head.logits(out).argmax(-1)]
                for i in range(rows):
                    if i + 2 >= n0:
                        total += 1
                        hits += int(drafted[i] == ids[i + 2])
        assert got[fmt] == pytest.approx(hits / total, abs=1.5 / total)   # the fused and torch routes round apart
    head.pack_lm_rows("target")


def test_the_choice_needs_speed_and_accuracy_and_is_kept(model, monkeypatch):
    head = head_of(model)
    assert weights.tune_head_lm_rows(model, head) == "target"            # a model built in memory: no tune
    tuned = copy.copy(model)
    tuned.tune = tune.TuneResult(key=tune.tune_key(model.decoder.config, 1), weights="w4a8", fp32_route="linear",
                                 threads=1)
    monkeypatch.setattr(tune, "save", lambda result: None)
    monkeypatch.setattr(weights, "measure_head_lm_rows", lambda *a: pytest.fail("timed without prompts"))
    assert weights.tune_head_lm_rows(tuned, head) == "target" and not tuned.tune.drafter_weights   # nothing kept
    monkeypatch.setattr(weights, "greedy_features", lambda m, h, p: [])
    assert weights.tune_head_lm_rows(tuned, head, list) == "target" and not tuned.tune.drafter_weights  # no prompts
    monkeypatch.setattr(weights, "greedy_features", lambda m, h, p: [(torch.arange(4), torch.zeros(4, D), 2)])
    cases = [((1.0, 0.7), (0.50, 0.495), "w4a8"),      # faster, within the tolerance
             ((1.0, 0.7), (0.50, 0.48), "target"),     # faster, but drafts worse
             ((1.0, 0.97), (0.50, 0.50), "target")]    # within the timing noise
    for (t_ms, w_ms), (t_acc, w_acc), want in cases:
        tuned.tune.drafter_weights.clear()
        monkeypatch.setattr(weights, "measure_head_lm_rows", lambda h, evict, a=t_ms, b=w_ms: {"target": a, "w4a8": b})
        monkeypatch.setattr(weights, "head_lm_rows_accuracy", lambda h, s, a=t_acc, b=w_acc: {"target": a, "w4a8": b})
        assert weights.tune_head_lm_rows(tuned, head, list) == want == head.lm_rows_format
    head.pack_lm_rows("target")
    tuned.tune.drafter_weights.clear()
    monkeypatch.setattr(weights, "measure_head_lm_rows", lambda h, evict: {"target": 1.0, "w4a8": 0.6})
    monkeypatch.setattr(weights, "head_lm_rows_accuracy", lambda h, s: {"target": 0.5, "w4a8": 0.5})
    assert weights.tune_head_lm_rows(tuned, head, list) == "w4a8"
    (entry,) = tuned.tune.drafter_weights.values()
    assert entry == {"format": "w4a8", "ms": {"target": 1.0, "w4a8": 0.6}, "top1": {"target": 0.5, "w4a8": 0.5}}
    monkeypatch.setattr(weights, "measure_head_lm_rows", lambda *a: pytest.fail("timed again"))
    head.pack_lm_rows("target")
    assert weights.tune_head_lm_rows(tuned, head) == "w4a8"                 # the kept choice, applied


def test_real_timings_of_both_formats(model):
    head = head_of(model)
    ms = weights.measure_head_lm_rows(head, lambda: None, repeats=2)
    assert set(ms) == {"target", "w4a8"} and min(ms.values()) > 0 and head.lm_rows_format == "target"
