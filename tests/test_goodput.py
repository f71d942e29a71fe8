"""Speculation by goodput (speculant/engine/goodput.py): the cost table, the decision, and that a round without
drafts changes no greedy output while sampled sequences keep drafting."""

import pytest
import torch
from helpers import tiny_model

from speculant import GenerationConfig, SamplingConfig
from speculant.engine.batch import BatchedGenerator
from speculant.engine.goodput import GoodputPolicy
from speculant.engine.methods import MethodSpec, build_generator
from speculant.errors import SpeculantError


def test_cost_is_the_table_linear_in_between_and_beyond():
    p = GoodputPolicy({1: 1.0, 2: 1.2, 4: 2.0})
    assert p.cost(1) == 1.0 and p.cost(0.5) == 1.0
    assert p.cost(3) == pytest.approx(1.6) and p.cost(8) == pytest.approx(3.6)
    assert GoodputPolicy({4: 2.0}).cost(8) == pytest.approx(4.0)


def test_it_drafts_when_the_expected_tokens_per_second_are_higher():
    # one row 10 ms, four rows 12 ms, 32 rows 80 ms: at one sequence a 4-row block pays, at eight it does not
    p = GoodputPolicy({1: 0.010, 4: 0.012, 8: 0.020, 32: 0.080}, warmup=1, explore_every=1000)
    assert p.drafting(8) == 8                                # nothing observed yet: it drafts (and learns)
    p.observe(sequences=8, rows=32, emitted=16, draft_seconds=0.0)        # tau 2, r 4
    assert p.tokens_per_sequence == 2.0 and p.rows_per_sequence == 4.0
    assert p.drafting(1) == 1                                # 2 * 10 ms > 12 ms
    assert p.drafting(8) == 0                                # 2 * 20 ms < 80 ms
    p.observe(sequences=1, rows=4, emitted=4, draft_seconds=0.0)           # the means move by `smoothing`
    assert p.tokens_per_sequence == pytest.approx(2.2)
    assert (p.rounds_drafted, p.rounds_skipped) == (2, 1)
    # a round's own overhead (5 ms per sequence beyond its forward) favours fewer, longer rounds
    p.observe_period(sequences=8, rows=8, seconds=0.020 + 0.040, draft_seconds=0.0)
    assert p.overhead_seconds_per_sequence == pytest.approx(0.1 * 0.005)
    for _ in range(100):
        p.observe_period(8, 8, 0.060, 0.0)
    assert p.overhead_seconds_per_sequence == pytest.approx(0.005, rel=1e-3)
    assert p.pays(8)                                         # 2.2 * (20 + 40) ms > 80 + 40 ms
    expensive = GoodputPolicy({1: 0.010, 4: 0.012}, warmup=3, explore_every=4)
    for _ in range(3):
        assert expensive.drafting(4) == 4                    # the warm-up drafts whatever it sees
        expensive.observe(4, 16, 8, draft_seconds=0.060)     # drafting costs more than it brings
    # then three rounds without drafts, and one in which one sequence drafts, to keep the means current
    assert [expensive.drafting(4) for _ in range(8)] == [0, 0, 0, 1] * 2


@pytest.mark.parametrize("bad", [{}, {0: 1.0}, {2: 0.0}])
def test_bad_tables_and_smoothing_are_refused(bad):
    with pytest.raises(SpeculantError, match="forward_seconds"):
        GoodputPolicy(bad)
    with pytest.raises(SpeculantError, match="smoothing=0"):
        GoodputPolicy({1: 1.0}, smoothing=0)
    with pytest.raises(SpeculantError, match="explore_every=0"):
        GoodputPolicy({1: 1.0}, explore_every=0)


def test_measured_on_the_model():
    m = tiny_model(seed=3, vocab=64, layers=2)
    p = GoodputPolicy.measure(m.decoder, 6, context=8, repeats=1)
    assert [r for r, _ in p.table] == [1, 2, 4, 6] and all(s > 0 for _, s in p.table)
    with pytest.raises(SpeculantError, match="max_rows=0"):
        GoodputPolicy.measure(m.decoder, 0)


def test_rounds_without_drafts_keep_greedy_outputs_and_sampled_ones_draft():
    m = tiny_model(seed=5, scale=2.0, vocab=64, layers=4)
    gen = build_generator(m, MethodSpec(method="early-exit", exit_layer=2, num_speculations=3))
    never = GoodputPolicy({1: 1.0, 64: 1000.0}, warmup=0, explore_every=1000)
    never.observe(1, 4, 1, 0.0)                               # tau 1 with 4 rows: never pays
    greedy, sampled = GenerationConfig(max_new_tokens=12), GenerationConfig(
        max_new_tokens=12, sampling=SamplingConfig(temperature=1.0, seed=4))
    prompts = [[3, 1, 4, 1, 5], [9, 2, 6]]
    out = {}
    for name, policy in (("always", None), ("never", never)):
        bg = BatchedGenerator(m, gen.drafter, gen.builder, policy=policy)
        with torch.inference_mode():
            seqs = bg.start_many([(prompts[0], greedy), (prompts[1], sampled)])
            while any(s.finished is None for s in seqs):
                bg.step([s for s in seqs if s.finished is None])
        out[name] = seqs
    assert out["never"][0].state.tokens == out["always"][0].state.tokens
    assert out["never"][0].stats.drafted_tokens == 0 < out["always"][0].stats.drafted_tokens
    assert out["never"][1].state.tokens == out["always"][1].state.tokens   # sampled: drafted as before
    assert out["never"][1].stats.drafted_tokens == out["always"][1].stats.drafted_tokens > 0
    assert never.rounds_skipped > 0 and never.rounds_drafted == 0


def test_exploring_rounds_let_one_sequence_draft_in_turn():
    m = tiny_model(seed=5, scale=2.0, vocab=64, layers=4)
    gen = build_generator(m, MethodSpec(method="early-exit", exit_layer=2, num_speculations=3))
    explore = GoodputPolicy({1: 1.0, 64: 1000.0}, warmup=0, explore_every=2)
    explore.observe(1, 4, 1, 0.0)
    cfg = GenerationConfig(max_new_tokens=12)
    prompts = [[3, 1, 4, 1, 5], [9, 2, 6], [7, 7, 1]]
    runs = {}
    for name, policy in (("always", None), ("explore", explore)):
        bg = BatchedGenerator(m, gen.drafter, gen.builder, policy=policy)
        with torch.inference_mode():
            seqs = bg.start_many([(p, cfg) for p in prompts])
            for _ in range(6):                         # 6 rounds: every other one explores, with one sequence
                bg.step(seqs)
        runs[name] = seqs
    for a, b in zip(runs["explore"], runs["always"]):        # the same tokens (fewer of them after 6 rounds)
        a, b = a.state.tokens, b.state.tokens
        assert a == b[:len(a)] or b == a[:len(b)]
    assert explore.rounds_drafted == 3 and explore.rounds_skipped == 3
    # each sequence drafted in exactly one of the three exploring rounds
    assert all(s.stats.drafted_tokens > 0 for s in runs["explore"])
    assert sum(s.stats.drafted_tokens for s in runs["explore"]) < sum(s.stats.drafted_tokens for s in runs["always"])
