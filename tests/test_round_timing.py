"""Greedy rounds corrected by their own timing (speculant/engine/speculation.py, ``RoundTiming``), and the sizing kept
between rounds (``SequenceSpeculation``'s memo).

Checked here: the correction is what drafting rounds took beyond the table at the machine's pace of ``ar`` rounds,
per kind of draft figures, only after enough rounds, with a preempted round clipped; a drafter that drafts every round
is given an ``ar`` round to time; a drafter slower than its table stops drafting under greedy decoding (and drafts
every round without the correction: the test can fail), with ``ar``'s output; a sampled generation's output does not
depend on the timing; a kept sizing follows the acceptance and the correction.
"""

from __future__ import annotations

import time
from collections import deque

import pytest
from helpers import tiny_model

from speculant import GenerationConfig, SamplingConfig, build_generator
from speculant.engine.generator import SpeculativeGenerator
from speculant.engine.goodput import CostTable, DepthAcceptance, SequenceSpeculation
from speculant.engine.speculation import TIMING_REFERENCE, TIMING_ROUNDS, TIMING_WINDOW, RoundTiming
from speculant.engine.stats import GenerationStats
from speculant.trees.builders import ChainBuilder
from speculant.trees.tree import DraftTree

PROMPT = [3, 17, 42, 8, 25, 60, 1]
CHEAP = CostTable({1: 0.010, 2: 0.0102, 4: 0.0106, 8: 0.0114, 16: 0.013}, 0.0001)
"""Extra rows and draft calls nearly free: a drafter that is always right pays at any depth, by the table."""
SWITCHING = CostTable({1: 1.0, 2: 1.3, 4: 1.9, 8: 3.0, 16: 5.0}, 0.3)


def test_the_correction_is_what_drafting_rounds_took_beyond_the_table_at_the_machines_pace():
    t, step = RoundTiming(), 0.010
    for _ in range(20):                                  # the machine runs at half the table's speed
        t.observe(2 * step, step, False, step)
    t.observe(20 * step, step, False, step)              # a preempted ar round does not move the pace
    assert t.speed == pytest.approx(2.0)
    for i in range(TIMING_ROUNDS):
        assert t.correction(step) == 0.0                 # not before enough drafting rounds were timed
        t.observe(2 * (0.0125 + 0.003), 0.0125, True, step)       # 0.3 of a step beyond the table
    assert t.correction(step) == pytest.approx(0.003)
    assert t.correction(step, kind="other") == 0.0       # another kind's figures: its own rounds only
    for _ in range(3):
        t.observe(100.0, 0.0125, True, step)             # preempted drafting rounds: the median does not move
    assert t.correction(step) == pytest.approx(0.003)
    for _ in range(TIMING_ROUNDS + 4):                   # the rounds got dearer: the median follows
        t.observe(2 * (0.0125 + 0.001234), 0.0125, True, step)
    assert t.correction(step) == pytest.approx(0.0012)   # in steps of 1 % of a step: 0.0001 s here


def test_a_drafter_that_drafts_every_round_is_given_an_ar_round_to_time():
    t = RoundTiming()
    for _ in range(TIMING_REFERENCE - 1):
        t.observe(0.02, 0.0102, True, 0.01)
    assert not t.wants_reference and not t.excess       # no ar round timed yet: no excess either
    t.observe(0.02, 0.0102, True, 0.01)
    assert t.wants_reference
    t.observe(0.01, 0.01, False, 0.01)
    assert not t.wants_reference and t.speed == pytest.approx(1.0)


class SlowOracle:
    """Drafts ``ar``'s own next token (always accepted), sleeping ``delay`` seconds per draft: a drafter whose
    rounds cost far more than its cost table says."""

    def __new__(cls, prompt, output, delay):
        from speculant.drafters.base import Drafter

        class _Slow(Drafter):
            name = "slow-oracle"

            def draft(self, state, builder, generator, max_nodes, max_depth):
                tree, n = DraftTree(), len(state.tokens)
                parent = -1
                for tok in reference[n:n + min(max_depth, max_nodes)]:
                    parent = tree.add(parent, tok)
                if len(tree):
                    time.sleep(delay)
                return tree
        reference = list(prompt) + list(output)
        return _Slow()


@pytest.fixture(scope="module")
def model():
    return tiny_model(seed=3, scale=2.5, vocab=96, hidden=64, heads=4, kv_heads=2, inter=128)


def _run(gen, n, sampling=None):
    stats = GenerationStats()
    cfg = GenerationConfig(max_new_tokens=n, chat=False, sampling=sampling or SamplingConfig())
    return [t for block in gen.generate_blocks(PROMPT, cfg, stats) for t in block], stats


def test_a_drafter_slower_than_its_table_stops_drafting_under_greedy_decoding(model):
    n = 150
    ar, _ = _run(build_generator(model, method="ar"), n)
    untimed = SpeculativeGenerator(model, SlowOracle(PROMPT, ar, 0.01), ChainBuilder(1), costs=CHEAP)
    toks, stats = _run(untimed, n)
    assert toks == ar and stats.ar_rounds <= 1           # by its table it pays every round (the test can fail)
    timed = SpeculativeGenerator(model, SlowOracle(PROMPT, ar, 0.01), ChainBuilder(1), costs=CHEAP,
                                 round_timing=True)
    toks, stats = _run(timed, n)
    assert toks == ar
    # drafting rounds until an ar round was timed and TIMING_ROUNDS more (the generation's first is not timed), then
    # ar rounds (its 2 tokens for more than 3 steps) but for probes at the back-off's intervals (16 rounds and more:
    # by the table without the correction a depth-1 round could pay, so the correction is kept measured)
    learning = TIMING_REFERENCE + TIMING_ROUNDS + 3
    assert stats.speculated_rounds <= learning + (n - 2 * learning) // 16 + 1
    assert stats.ar_rounds >= n - 2 * learning - (n - 2 * learning) // 16 - 3
    kind = (CHEAP.first_draft_seconds, CHEAP.draft_seconds)       # the correction is kept per draft figures
    assert timed.round_timing.correction(CHEAP.forward_seconds[1], kind) >= 1.5 * CHEAP.forward_seconds[1]
    probes = timed.round_timing.counts[kind]
    again, stats = _run(timed, n)                        # the next greedy generation starts from the correction
    assert again == ar and 1 <= stats.speculated_rounds <= n // 16 + 1
    assert timed.round_timing.counts[kind] > probes      # its probes are timed too


def test_a_sampled_output_does_not_depend_on_the_timing(model):
    sampling = SamplingConfig(temperature=1.0, seed=11)
    plain = build_generator(model, costs=SWITCHING, method="early-exit", exit_layer=2, num_speculations=3)
    reference, _ = _run(plain, 60, sampling)
    timed = build_generator(model, costs=SWITCHING, method="early-exit", exit_layer=2, num_speculations=3)
    timed.round_timing = RoundTiming()
    timed.round_timing.speed, timed.round_timing.since_ar = 1.0, TIMING_REFERENCE
    kind = (None, 0.3)                                             # drafting would never pay, were it applied,
    t = timed.round_timing                                         # and a few timed probes do not move the median
    t.excess[kind] = deque([5.0] * TIMING_WINDOW, maxlen=TIMING_WINDOW)
    t.median[kind], t.counts[kind] = 5.0, TIMING_WINDOW
    greedy_plain, s_plain = _run(plain, 60)
    greedy_timed, s_timed = _run(timed, 60)
    assert greedy_timed == greedy_plain and s_timed.speculated_rounds < s_plain.speculated_rounds   # it applies
    assert _run(timed, 60, sampling)[0] == reference


def test_a_kept_sizing_follows_the_acceptance_and_the_correction():
    s = SequenceSpeculation(SWITCHING, acceptance=DepthAcceptance(prior=0.95))
    def nodes(d):
        return d
    s.at_context(0)
    deep = s.depth(8, nodes)
    assert deep > 1 and s.depth(8, nodes) == deep                 # kept: the same inputs, the same depth
    version = s.acceptance.version
    for _ in range(30):
        s.observe(deep, 0, deep, deep)
    assert s.acceptance.version > version
    assert s.depth(8, nodes) < deep                               # recomputed from the new acceptance
    s2 = SequenceSpeculation(SWITCHING, acceptance=DepthAcceptance(prior=0.95))
    s2.at_context(0)
    assert s2.depth(8, nodes) == deep
    s2.at_context(0, correction=10.0)                             # a drafting round 10 steps dearer
    assert s2.depth(8, nodes) == 0 and s2.costs.first_draft_seconds == pytest.approx(10.3)
    s2.at_context(0, correction=-1.0)                             # never below 0
    assert s2.costs.first_draft_seconds == 0.0


def test_an_empty_tree_needs_no_buffers():
    tree = DraftTree()
    assert tree._anc is None
    assert tree.block_positions(9).tolist() == [9]
    assert tree.attention_mask(4).tolist() == [[True] * 5]
    assert tree.children_table().tolist() == [[-1]]
    tree.add(-1, 5)
    assert tree.block_positions(9).tolist() == [9, 10]


def test_an_ar_round_in_a_run_of_them_reads_the_kept_sizing(monkeypatch):
    """The goodput of every depth is valued again only when the acceptance, the context step, the depth bound or the
    correction changed: counted on the policy's calls."""
    s = SequenceSpeculation(SWITCHING, acceptance=DepthAcceptance(prior=0.2))
    calls = []
    real = s.policy.draft_depth
    monkeypatch.setattr(s.policy, "draft_depth", lambda *a, **k: calls.append(1) or real(*a, **k))

    def nodes(d):
        return d
    s.at_context(0)
    assert s.depth(4, nodes) == 0
    first = len(calls)
    assert first >= 1
    for _ in range(5):
        s.depth(4, nodes)
    assert len(calls) == first                                     # kept
    s.depth(5, nodes)
    assert len(calls) > first                                      # another depth bound
    for change in (lambda: s.at_context(64), lambda: s.at_context(64, 0.05), lambda: s.observe(1, 0, 1, 1)):
        before = len(calls)
        change()
        s.depth(5, nodes)
        assert len(calls) > before                                 # a new context, correction or acceptance


def test_a_timed_round_is_valued_at_its_model_without_the_applied_correction():
    """``RoundSizer.observe`` then ``timed``: the excess is ``measured / speed - modeled`` with the round's model
    taken without the correction the sizing added (so a correction does not feed on itself), the clamp at 0 included."""
    from types import SimpleNamespace

    from speculant.engine.speculation import RoundSizer
    costs = CostTable({1: 0.010, 2: 0.012, 4: 0.016}, 0.002, 0.003)
    timing = RoundTiming()
    sizer = RoundSizer(costs, ChainBuilder(1), False, timing=timing)
    state = SimpleNamespace(tokens=list(range(50)), draft_stop=None)
    for _ in range(8):                                              # ar rounds at twice the table's time
        sizer.depth(state, 1)
        sizer.observe(0, 0, 0, 0)
        sizer.timed(0.020)
    assert timing.speed == pytest.approx(2.0)
    kind = (0.003, 0.002)
    for _ in range(TIMING_ROUNDS):                                  # depth-1 rounds: model 0.012 + 0.003
        sizer.depth(state, 1)
        sizer.observe(1, 1, 1, 1)
        sizer.timed(2 * (0.015 + 0.004))
    assert timing.median[kind] == pytest.approx(0.004)
    assert timing.correction(0.010, kind) == pytest.approx(0.004)
    sizer.depth(state, 1)                                           # now sized with the correction ...
    assert sizer.speculation.applied == pytest.approx(0.004)
    sizer.observe(1, 1, 1, 1)
    sizer.timed(2 * (0.015 + 0.004))                                # ... and valued without it: unchanged
    assert list(timing.excess[kind]) == pytest.approx([0.004] * (TIMING_ROUNDS + 1))
    timing.median[kind] = -0.008                                    # a correction below -first is clamped:
    sizer.depth(state, 1)                                           # applied -0.003, not -0.008
    assert sizer.speculation.applied == pytest.approx(-0.003)
    sizer.observe(1, 1, 1, 1)
    sizer.timed(2 * 0.012)                                          # the round took its forward alone
    assert timing.excess[kind][-1] == pytest.approx(-0.003)        # valued without the -0.003 applied
