"""Cost-aware speculation for one sequence (``--speculation cost``, speculant/engine/speculation.py): each round drafts
the depth, zero included, that maximizes expected tokens per second; a zero-draft round is an ``ar`` round.

Checked here: drafts that never pay give only ``ar`` rounds and ``ar``'s output; an always-right cheap drafter drafts
its full depth every round, a never-right one stops; greedy outputs stay token-identical to ``ar`` for every method
while the depth switches; the sampled law stays the target's while the depth switches (chi-square, with a broken
variant that fails it); the round counters.
"""

from __future__ import annotations

import json
import math
import time

import pytest
import torch
from helpers import on_fused_step, tiny_model
from stats_helpers import chi_square, exact_law
from test_golden_ids import SPECS as GOLDEN_SPECS

from speculant import GenerationConfig, SamplingConfig, build_generator
from speculant.drafters import base
from speculant.drafters.base import Drafter
from speculant.engine.generator import SpeculativeGenerator
from speculant.engine.goodput import CostTable
from speculant.engine.methods import MethodSpec, drafter_signature
from speculant.engine.speculation import forward_seconds, nodes_at_depth
from speculant.engine.stats import GenerationStats
from speculant.errors import SpeculantError
from speculant.trees.builders import ChainBuilder, ConstantBranchingBuilder, StochasticBeamBuilder
from speculant.trees.tree import DraftTree

PROMPT = [3, 17, 42, 8, 25, 60, 1]
NEVER_PAYS = CostTable({1: 0.010, 2: 0.0105, 4: 0.0115, 8: 0.0135, 16: 0.0175}, 0.010)
"""A draft call costs a whole target step: no depth pays even if every drafted token were accepted."""
SWITCHING = CostTable({1: 1.0, 2: 1.3, 4: 1.9, 8: 3.0, 16: 5.0}, 0.3)
"""Drafting pays only while the acceptance is high: the depth moves with it."""
SPECS = {name: spec for name, spec in GOLDEN_SPECS.items() if name != "ar"}
"""Every drafting method of the golden-ids test (the same settings)."""


@pytest.fixture(scope="module")
def model():
    return tiny_model(seed=3, scale=2.5, vocab=96, hidden=64, heads=4, kv_heads=2, inter=128)


@pytest.fixture(scope="module")
def head_dir(model, tmp_path_factory):
    from speculant.drafters.draft_head import new_head, save_head
    path = tmp_path_factory.mktemp("head")
    torch.manual_seed(0)
    save_head(new_head(model, torch.arange(0, 96, 2)), path)
    return str(path)


def _spec(name, head_dir):
    return {k: (head_dir if v == "HEAD" else v) for k, v in SPECS[name].items()}


def run(gen, prompt=PROMPT, n=40, sampling=None):
    stats = GenerationStats()
    cfg = GenerationConfig(max_new_tokens=n, chat=False, sampling=sampling or SamplingConfig())
    toks = [t for block in gen.generate_blocks(prompt, cfg, stats) for t in block]
    return toks, stats


@pytest.fixture(scope="module")
def ar_ids(model):
    return run(build_generator(model, method="ar"))[0]


# ------------------------------------------------------------------ (a) drafts that never pay
@pytest.mark.parametrize("name", ["early-exit", "prompt-lookup", "rsd-c", "eagle"])
def test_drafting_that_never_pays_gives_only_ar_rounds(model, ar_ids, head_dir, name):
    toks, stats = run(build_generator(model, costs=NEVER_PAYS, **_spec(name, head_dir)))
    assert toks == ar_ids
    assert stats.speculated_rounds == 0 and stats.ar_rounds == stats.rounds == len(toks) - 1
    assert stats.drafted_tokens == 0 and stats.draft_forwards == 0
    # the same drafter with `always` does draft (the test can fail)
    _, always = run(build_generator(model, speculation="always", **_spec(name, head_dir)))
    assert always.speculated_rounds > 0

@pytest.mark.parametrize("name", ["early-exit", "rsd-s"])
def test_an_ar_round_of_self_speculation_is_one_forward_from_layer_0(model, ar_ids, head_dir, name, monkeypatch):
    """A round without drafts runs the target's layers in one call from layer 0, as ``ar`` does, not layers < E and
    then the rest (the drafting route, two calls a round)."""
    from speculant.runtime.executor import Executor
    calls = []
    real = Executor.run

    def counted(self, blocks, end=None):
        calls.append([b.start_layer for b in blocks])
        return real(self, blocks, end)

    monkeypatch.setattr(Executor, "run", counted)
    toks, stats = run(build_generator(model, costs=NEVER_PAYS, **_spec(name, head_dir)))
    assert toks == ar_ids and stats.ar_rounds == stats.rounds
    assert calls[1:] == [[0]] * stats.rounds                     # the prompt, then one call per round
    calls.clear()                                                # drafting rounds do split (the check can fail)
    run(build_generator(model, speculation="always", **_spec(name, head_dir)))
    assert any(start != [0] for start in calls[1:])



# ------------------------------------------------------------------ (b) an always-right / never-right drafter
class OracleDrafter(Drafter):
    """Drafts the next tokens of a known output: ``ar``'s own (always right), or each one shifted (never right)."""

    name = "oracle"

    def __init__(self, prompt, output, wrong=False, vocab=96, wrong_calls=0):
        self.reference, self.wrong, self.vocab = list(prompt) + list(output), wrong, vocab
        self.wrong_calls = wrong_calls               # the first calls draft wrong tokens, the later ones right

    def draft(self, state, builder, generator, max_nodes, max_depth):
        tree, n = DraftTree(), len(state.tokens)
        wrong, self.wrong_calls = self.wrong or self.wrong_calls > 0, self.wrong_calls - 1
        parent = -1
        for tok in self.reference[n:n + min(max_depth, max_nodes)]:
            parent = tree.add(parent, (tok + 1) % self.vocab if wrong else tok)
        return tree


CHEAP = CostTable({1: 0.010, 2: 0.0102, 4: 0.0106, 8: 0.0114, 16: 0.013}, 0.0001)
"""Extra rows and draft calls nearly free: a drafter that is right should draft its full depth."""


def test_always_right_cheap_drafter_drafts_the_full_depth(model, ar_ids):
    k = 4
    gen = SpeculativeGenerator(model, OracleDrafter(PROMPT, ar_ids), ChainBuilder(k), costs=CHEAP)
    toks, stats = run(gen)
    assert toks == ar_ids
    assert stats.ar_rounds == 0
    # every round drafted: the first one depth 1 (no acceptance known yet), the others min(K, tokens still to emit - 1)
    assert stats.drafted_tokens == stats.accepted_tokens == len(toks) - 1 - stats.rounds
    assert stats.drafted_at_depth[0] == stats.rounds
    assert stats.drafted_at_depth[k - 1] == stats.rounds - 1 - (1 if (len(toks) - 3) % (k + 1) else 0)


def test_never_right_drafter_stops_drafting(model):
    ar60 = run(build_generator(model, method="ar"), n=60)[0]
    gen = SpeculativeGenerator(model, OracleDrafter(PROMPT, ar60, wrong=True), ChainBuilder(4), costs=SWITCHING)
    toks, stats = run(gen, n=60)
    assert toks == ar60
    assert stats.accepted_tokens == 0
    # a few rounds learn that the drafts fail, then only an exploring round each 16 ar rounds drafts
    assert stats.speculated_rounds <= 6 and stats.ar_rounds >= stats.rounds - 6
    _, always = run(SpeculativeGenerator(model, OracleDrafter(PROMPT, ar60, wrong=True), ChainBuilder(4)), n=60)
    assert always.ar_rounds <= 1                # the last token alone (no room for a draft)


# ------------------------------------------------------------------ (c) greedy identity, every method
@pytest.mark.parametrize("name", SPECS)
def test_greedy_identity_with_ar_under_cost(model, ar_ids, head_dir, name):
    for costs in (SWITCHING, CHEAP, NEVER_PAYS):
        toks, stats = run(build_generator(model, costs=costs, **_spec(name, head_dir)))
        assert toks == ar_ids, (name, costs)
        assert stats.speculated_rounds + stats.ar_rounds == stats.rounds


def test_depth_switches_under_the_switching_costs(model, head_dir):
    """The identity test above is not vacuous: rounds with and without drafts in one generation."""
    _, stats = run(build_generator(model, costs=SWITCHING, **SPECS["early-exit"]))
    assert stats.speculated_rounds > 0 and stats.ar_rounds > 0


# ------------------------------------------------------------------ (d) sampling exactness
RUNS = 5_000
SMALL_PROMPT = [1, 2, 3, 1, 2]
SAMPLING = dict(temperature=1.3, top_k=3)
LENGTH = 4
SWITCH_SMALL = CostTable({1: 1.0, 2: 1.3, 3: 1.6, 4: 1.9}, 0.6)
"""On the 4-token vocabulary: full depth 2 while every draft was accepted, 1 after a rejection at depth 2, none after
one at depth 1 (running acceptance per depth, smoothing 0.2); the confidence rule cuts some depth-2 drafts."""
SWITCH_TREE = CostTable({1: 1.0, 3: 1.3, 5: 1.6}, 0.6)
"""The same for an RSD-S tree of 2 beams (2 nodes per depth)."""
CONFIDENT = CostTable({1: 1.0, 2: 1.45, 3: 1.9}, 0.1)
"""The depth-1 draft is dropped when its top draft probability is under ~0.41 (the confidence rule)."""


@pytest.fixture(scope="module")
def small():
    """On the fused step where our kernels build (:func:`helpers.on_fused_step`)."""
    return on_fused_step(tiny_model(seed=5, scale=1.5, vocab=4, layers=2, hidden=32, heads=2, kv_heads=1, inter=64))


@pytest.fixture(scope="module")
def law(small):
    return exact_law(small, SMALL_PROMPT, SamplingConfig(**SAMPLING), length=LENGTH)


def sample(model, spec, costs, runs=RUNS):
    gen = build_generator(model, costs=costs, **spec)
    outs, rounds = [], {"speculated": 0, "ar": 0}
    for seed in range(runs):
        toks, stats = run(gen, SMALL_PROMPT, LENGTH, SamplingConfig(seed=seed, **SAMPLING))
        rounds["speculated"] += stats.speculated_rounds
        rounds["ar"] += stats.ar_rounds
        outs.append(tuple(toks))
    assert rounds["speculated"] > 0 and rounds["ar"] > 0, rounds      # the depth did switch
    return outs


EXACT = {
    "early-exit": (dict(method="early-exit", exit_layer=1, num_speculations=2), SWITCH_SMALL),
    "rsd-s": (dict(method="rsd-s", exit_layer=1, beam_width=2, draft_length=2), SWITCH_TREE),
    "early-exit-confident": (dict(method="early-exit", exit_layer=1, num_speculations=2), CONFIDENT),
}


@pytest.mark.parametrize("name", EXACT)
def test_sampled_law_is_the_targets_while_the_depth_switches(small, law, name):
    stat, threshold = chi_square(sample(small, *EXACT[name]), law)
    assert stat < threshold, (name, stat, threshold)


def test_broken_confidence_rule_fails(small, law, monkeypatch):
    """Dropping a depth for the probability of the token just *sampled* there (instead of the top token's) biases the
    draft law; the same test catches it."""
    monkeypatch.setattr(base, "depth_confidence", lambda confidence, frontier, q, kids: max(
        (confidence[node] * float(row[t]) for node, row, toks in zip(frontier, q, kids) for t in toks), default=0.0))
    stat, threshold = chi_square(sample(small, *EXACT["early-exit-confident"]), law)
    assert stat > threshold, (stat, threshold)


# ------------------------------------------------------------------ (e) counters, options, cost sources
def test_round_counters(model, ar_ids):
    toks, stats = run(build_generator(model, costs=SWITCHING, **SPECS["early-exit"]))
    d = stats.to_dict()
    assert d["speculated_rounds"] == stats.speculated_rounds and d["ar_rounds"] == stats.ar_rounds
    assert stats.speculated_rounds == stats.drafted_at_depth[0]      # a round that drafted reached depth 1
    assert stats.rounds == stats.target_forwards - 1 == len(toks) - 1 - stats.accepted_tokens
    json.dumps(d)
    _, ar = run(build_generator(model, method="ar"))
    assert ar.speculated_rounds == 0 and ar.ar_rounds == ar.rounds


def test_speculation_option_is_checked(model):
    with pytest.raises(SpeculantError) as e:
        MethodSpec(method="early-exit", speculation="sometimes")
    assert "\n" not in str(e.value) and "sometimes" in str(e.value) and "cost, always" in str(e.value)
    assert build_generator(model, speculation="always", **SPECS["early-exit"]).costs is None
    # a model without a tune has no measured costs: `cost` then drafts as `always` does
    assert build_generator(model, **SPECS["early-exit"]).costs is None
    assert MethodSpec(method="eagle").speculation == "cost"
    assert drafter_signature(MethodSpec(method="early-exit", exit_layer=2)) != drafter_signature(
        MethodSpec(method="early-exit", exit_layer=3))


def test_sampled_generations_are_sized_by_the_sampled_costs(model):
    """Greedy generations use ``costs``; sampled ones the sampled table, measured once (acceptance at a
    temperature costs more per draft than a greedy match)."""
    made = []

    def sampled():
        made.append(1)
        return NEVER_PAYS
    gen = SpeculativeGenerator(model, base.Drafter(), ChainBuilder(3), costs=SWITCHING, sampled_costs=sampled)
    assert gen.costs_for(SamplingConfig()) is SWITCHING and not made
    assert gen.costs_for(SamplingConfig(temperature=1.0)) is NEVER_PAYS
    assert gen.costs_for(SamplingConfig(temperature=0.5)) is NEVER_PAYS and made == [1]
    assert SpeculativeGenerator(model, base.Drafter(), ChainBuilder(3), costs=SWITCHING).costs_for(
        SamplingConfig(temperature=1.0)) is SWITCHING


def test_cli_and_bench_take_the_option():
    from speculant.bench.specs import parse_methods
    from speculant.cli import build_parser
    args = build_parser().parse_args(["generate", "x", "--method", "eagle", "--speculation", "always"])
    from speculant.arguments import method_spec_from_args
    assert method_spec_from_args(args).speculation == "always"
    assert method_spec_from_args(build_parser().parse_args(["generate", "x", "--method", "eagle"])).speculation == "cost"
    a, b = parse_methods("eagle:K=4,spec=always,eagle:K=4")
    assert a.spec.speculation == "always" and b.spec.speculation == "cost"
    assert parse_methods("eagle", speculation="always")[0].spec.speculation == "always"
    with pytest.raises(SpeculantError):
        parse_methods("eagle:spec=never")


def test_cost_sources():
    class Tune:
        forward_ms = {"1": 10.0, "2": 11.0}
        fp32_route = "linear"

        def row(self, fmt, route=None):
            return {"ms": {"1": 8.0, "16": 20.0}}

    class Model:
        tune, weights = Tune(), "w4a8"
    assert forward_seconds(Model()) == {1: 0.010, 2: 0.011}
    Model.tune.forward_ms = {}
    assert forward_seconds(Model()) == {1: 0.008, 16: 0.020}
    Model.tune.forward_ms = {"1": 10.0, "2": 30.0, "3": 12.0}            # a spike from another process's work
    assert forward_seconds(Model()) == {1: 0.010, 2: 0.012, 3: 0.012}
    Model.tune = None
    assert forward_seconds(Model()) is None
    assert [nodes_at_depth(ChainBuilder(4))(d) for d in range(5)] == [0, 1, 2, 3, 4]
    assert [nodes_at_depth(ConstantBranchingBuilder("3,2,1"))(d) for d in range(4)] == [0, 3, 9, 15]
    assert nodes_at_depth(StochasticBeamBuilder(3, 4))(2) == 6


def test_generate_json_reports_rounds_end_to_end(capsys, tmp_path):
    """The CLI path with a tune: the loaded model's measured costs (the tuner's table), the drafter's cost measured
    once and kept with the tune, rounds reported in --json, outputs as ar's."""
    from speculant.cli import main
    from speculant.models.loading import save_hf_dir
    from speculant.runtime.loader import load_model
    directory = save_hf_dir(tiny_model(seed=11, scale=2.5, vocab=64, layers=4, eos=63), tmp_path / "tiny_hf")
    out = {}
    for name, extra in {"ar": [], "cost": ["--method", "early-exit", "--exit-layer", "2"],
                        "always": ["--method", "early-exit", "--exit-layer", "2", "--speculation", "always"]}.items():
        assert main(["generate", "t1 t2 t3 t4", "--model", str(directory), "--raw", "--json", "--max-new-tokens", "16",
                     *extra]) == 0
        out[name] = json.loads(capsys.readouterr().out)
    for name, d in out.items():
        s = d["stats"]
        assert d["token_ids"] == out["ar"]["token_ids"], name
        assert s["speculated_rounds"] + s["ar_rounds"] == s["rounds"], name
    assert out["ar"]["stats"]["speculated_rounds"] == 0
    assert out["always"]["stats"]["ar_rounds"] <= 1 < out["always"]["stats"]["speculated_rounds"]
    tune = load_model(str(directory), weights="fp32", compile=False).tune
    assert "early-exit,exit_layer=2" in tune.draft_ms and tune.draft_ms["early-exit,exit_layer=2"] > 0
    assert tune.draft_ms["early-exit,exit_layer=2 first"] > 0             # a round's first call, measured apart
    assert "early-exit,exit_layer=2 sampled" not in tune.draft_ms         # measured at the first sampled generation
    assert main(["generate", "t1 t2 t3 t4", "--model", str(directory), "--raw", "--json", "--max-new-tokens", "8",
                 "--method", "early-exit", "--exit-layer", "2", "--temperature", "1"]) == 0
    capsys.readouterr()
    tune = load_model(str(directory), weights="fp32", compile=False).tune
    assert tune.draft_ms["early-exit,exit_layer=2 sampled"] > 0
    assert forward_seconds(load_model(str(directory), weights="fp32", compile=False)) is not None


def _probe_gaps(s, chain, accepted, rounds=1200):
    """Rounds of ``s`` with every probe's draft accepted as ``accepted(k)`` says for the k-th probe: the rounds
    without drafts before each probe, and after each probe the back-off's interval and :meth:`probe_interval`."""
    gaps, due, without = [], [], 0
    for _ in range(rounds):
        d = s.depth(4, chain)
        if d:
            assert d == 1 and s._probing
            gaps.append(without)
            without = 0
            s.observe(1, accepted(len(gaps) - 1), 1, 1)
            due.append((s.interval, s.probe_interval(chain)))
        else:
            without += 1
            s.observe(0, 0)                                        # an ar round: its time in the ledger
    return gaps, due


def test_exploring_probes_at_depth_one_and_backs_off():
    """While drafting does not pay, a probe round drafts depth 1 only, as every 16th round, then (each probe
    rejected) every 32nd, 64th, ... (at most every 256th), each interval scaled by what a probe is expected to lose
    at the running acceptance (near 0 here: most of it); once accepted probes' acceptance makes drafting pay,
    rounds draft by choice again and the interval is 16."""
    from speculant.engine.goodput import SequenceSpeculation
    s = SequenceSpeculation(SWITCHING, loss_budget=0.5)           # (the loss budget apart: tested below)
    chain = lambda d: d                                            # noqa: E731  (a chain: d nodes at depth d)
    assert s.depth(4, chain) == 1                                  # the first round: depth 1, nothing known yet
    assert SequenceSpeculation(NEVER_PAYS).depth(4, chain) == 0    # ... where some depth could pay
    for _ in range(10):                                            # learn that the first depth fails
        s.observe(s.depth(4, chain) or 4, 0)
    gaps, due = _probe_gaps(s, chain, lambda k: 0)
    assert [interval for interval, _ in due[:5]] == [32, 64, 128, 256, 256], due
    assert gaps[1:6] == [scaled - 1 for _, scaled in due[:5]], (gaps, due)   # rounds without drafts between probes
    assert all(0.85 * interval <= scaled <= interval for interval, scaled in due), due
    drafted = []
    for _ in range(2000):                                          # the drafts start being accepted
        d = s.depth(4, chain)
        if d:
            drafted.append(d)
            s.observe(d, d)
    assert drafted[:3] == [1] * 3 and max(drafted) > 1 and len(drafted) > 100 and s.interval == 16   # drafting resumes


def test_probes_accepted_too_seldom_to_pay_back_off_too():
    """Every other probe accepted (the running acceptance never reaches the 0.6 that depth 1 needs under SWITCHING):
    the probes back off as if all were rejected (accepted ones used to keep the interval: a drafter right 30 % of
    the time probed every 16 rounds for good), each interval scaled down by what a probe near the break-even is
    expected to lose (a fraction of a rejected one's)."""
    from speculant.engine.goodput import SequenceSpeculation
    s = SequenceSpeculation(SWITCHING, loss_budget=0.5)           # (the loss budget apart: tested below)
    chain = lambda d: d                                            # noqa: E731
    for _ in range(10):                                            # learn that the first depth fails
        s.observe(s.depth(4, chain) or 4, 0)
    gaps, due = _probe_gaps(s, chain, lambda k: k % 2, rounds=3000)
    assert s.acceptance.alpha(1) < 0.6
    assert [interval for interval, _ in due[:5]] == [32, 64, 128, 256, 256], due
    assert gaps[1:6] == [scaled - 1 for _, scaled in due[:5]], (gaps, due)
    assert all(scaled < 0.9 * interval for interval, scaled in due[4:]), due


def test_a_probe_near_the_break_even_comes_sooner():
    """The probe interval scales with the probe's expected loss ``cost(2) + c_1 - (1 + alpha_1) cost(1)`` over a
    rejected probe's: under SWITCHING (0.6 to lose, 1.0 a token) at alpha_1 = 0.5 one sixth of the back-off's
    interval, at 0 all of it, never below one round."""
    from speculant.engine.goodput import DepthAcceptance, SequenceSpeculation
    chain = lambda d: d                                            # noqa: E731
    for alpha, want in ((0.0, 16), (0.5, 3), (0.59, 1), (0.9, 1)):
        s = SequenceSpeculation(SWITCHING)
        s.acceptance = DepthAcceptance(prior=alpha)
        assert s.probe_interval(chain) == want, (alpha, s.probe_interval(chain))
BREAK_EVEN_20 = CostTable({1: 1.0, 2: 1.05, 4: 1.15, 8: 1.35, 16: 1.75}, 0.15)
"""A depth-1 round pays from an acceptance of 0.2 (``cost(2) + c_1 = 1.2`` target steps), as a draft head's does."""


def _history_of_forty_percent():
    """A generator's history: 20 depth-1 observations, two of every five accepted (its estimate 9/21 with the prior
    of certainty)."""
    from speculant.engine.goodput import DepthAcceptance
    history = DepthAcceptance(0.02)
    for k in range(20):
        history.observe_at(1, k % 5 in (0, 3))
    return history


def _depth_one_rounds(pattern, rounds, explores=True):
    """Rounds of at most depth 1 under BREAK_EVEN_20 whose ``k``-th draft is accepted when ``pattern(k)``, from
    :func:`_history_of_forty_percent`: the drafts made and the share of the rounds' time they saved (the cost
    table's)."""
    from speculant.engine.goodput import DepthAcceptance, SequenceSpeculation
    s = SequenceSpeculation(BREAK_EVEN_20, acceptance=DepthAcceptance.from_history(_history_of_forty_percent(), 8))
    if not explores:
        s.explores = lambda *a, **k: False
    drafted = 0
    for _ in range(rounds):
        if s.depth(1, lambda d: d):
            s.observe(1, int(pattern(drafted)), 1, 1)
            drafted += 1
        else:
            s.observe(0, 0)
    return drafted, s.ledger.saved / s.ledger.spent


def test_a_drafter_rejected_at_first_keeps_drafting_while_one_acceptance_would_make_it_pay():
    """Twelve drafts rejected, then two of every five accepted (a draft head's first rounds of an answer are accepted
    less), from a history of 0.43: the estimate after the twelve (0.17) is below the break-even (0.2), but one
    accepted draft would lift the slow mean past it, so the rounds keep drafting (the knowledge gradient) and save
    what drafting every round saves; without that rule, the rounds stop there and their probes, rejected, drafted
    half as often and saved less than half as much.  A drafter
    accepted one time in ten stops nonetheless (one acceptance no longer lifts its slow mean past 0.2), at a small
    loss (under 1 % of the time)."""
    forty = lambda k: k >= 12 and k % 5 in (0, 3)                   # noqa: E731
    drafted, saved = _depth_one_rounds(forty, 200)
    assert drafted == 200 and saved > 0.12
    drafted_before, saved_before = _depth_one_rounds(forty, 200, explores=False)
    assert drafted_before < 150 and saved_before < saved - 0.05      # the premise: the rule was needed
    drafted, saved = _depth_one_rounds(lambda k: k % 10 == 9, 1000)
    assert drafted < 60 and saved > -0.01


def test_exploring_weighs_the_rounds_left():
    """The same state explores with many tokens left and not with one (the information pays over the rounds left),
    and not before the estimate has 8 observations (a few from the uninformed prior are no belief to explore on)."""
    from speculant.engine.goodput import DepthAcceptance, SequenceSpeculation
    s = SequenceSpeculation(BREAK_EVEN_20, acceptance=DepthAcceptance.from_history(_history_of_forty_percent(), 8))
    for _ in range(12):
        s.acceptance.observe_at(1, False)
    assert s._depth(1, lambda d: d, s.acceptance) == 0
    assert s.explores(lambda d: d, horizon=100) and not s.explores(lambda d: d, horizon=1)
    s.interval = 64
    assert s.depth(1, lambda d: d, horizon=100) == 1 and not s._probing
    assert s.interval == 64                                    # exploring leaves the probes' back-off as it was
    fresh = SequenceSpeculation(BREAK_EVEN_20)
    assert not fresh.explores(lambda d: d)                                  # nothing observed: the first round's rule
    for _ in range(5):
        fresh.acceptance.observe_at(1, False)
    assert fresh.acceptance.alpha(1) < 0.2 < fresh.acceptance.slow_after(1, True)
    assert not fresh.explores(lambda d: d, horizon=100)                     # 6 observations, the prior's included


def test_a_history_of_forty_percent_rides_out_five_rejections():
    """A generation's estimate from earlier generations' (0.4, counted as 8 observations): five rejections leave 0.25
    at depth 1, above BREAK_EVEN_20's 0.2 (from the uninformed prior they leave 1/6); rounds are sized from it at
    once (no first-round draft on certainty).  A history of fewer observations weighs as many as it has (its prior
    not counted)."""
    from speculant.engine.goodput import DepthAcceptance, SequenceSpeculation
    history = _history_of_forty_percent()
    for k in range(9):
        history.observe_at(2, k % 3 == 0)
    start = DepthAcceptance.from_history(history, 8)
    assert start.alphas == history.alphas and start.counts == [8, 8]
    once = DepthAcceptance(0.02)
    once.observe_at(1, False)
    assert DepthAcceptance.from_history(once, 8).counts == [1]
    for _ in range(5):
        start.observe_at(1, False)
    assert start.alpha(1) == pytest.approx(history.alpha(1) * 8 / 13)
    s = SequenceSpeculation(BREAK_EVEN_20, acceptance=DepthAcceptance.from_history(DepthAcceptance(prior=0.05), 8))
    assert s.depth(1, lambda d: d) == 0                        # a history that does not pay: no first-round draft


def test_a_greedy_generation_starts_from_the_acceptance_of_the_earlier_ones(model):
    """The generator keeps each round context's long-run acceptance over its greedy generations; the next greedy
    generation starts from it: a drafter that is never right drafts only its probes the second time (not the first
    rounds that learnt it), and outputs stay ``ar``'s."""
    ar60 = run(build_generator(model, method="ar"), n=60)[0]
    gen = SpeculativeGenerator(model, OracleDrafter(PROMPT, ar60, wrong=True), ChainBuilder(4), costs=SWITCHING)
    toks, first = run(gen, n=60)
    assert toks == ar60 and set(gen.acceptance_history) == {None}
    assert gen.acceptance_history[None].alpha(1) < 0.5
    toks, second = run(gen, n=60)
    assert toks == ar60 and second.speculated_rounds < first.speculated_rounds, (first, second)


def test_sampled_generations_neither_use_nor_change_the_history(model):
    """A seeded sampled output must not depend on what the generator ran before (a round without drafts draws its
    random numbers in another order): sampled generations start from the uninformed prior and leave the greedy
    generations' history as it was."""
    gen = build_generator(model, costs=SWITCHING, **SPECS["early-exit"])
    sampling = SamplingConfig(temperature=1.0, seed=11)
    before = run(gen, sampling=sampling)[0]
    assert gen.acceptance_history == {}
    run(gen)
    run(gen)
    kept = {c: (a.fast, a.slow, a.counts) for c, a in gen.acceptance_history.items()}
    assert kept
    assert run(gen, sampling=sampling)[0] == before
    assert {c: (a.fast, a.slow, a.counts) for c, a in gen.acceptance_history.items()} == kept


def _losing_run(loss_budget, rounds=1000):
    """A drafter whose drafts are never accepted under SWITCHING costs: returns the policy after ``rounds`` rounds,
    the number of probes, and the loss [s] once the first rounds (which draft on the prior) stopped drafting."""
    from speculant.engine.goodput import SequenceSpeculation
    s = SequenceSpeculation(SWITCHING, loss_budget=loss_budget)
    chain = lambda d: d                                            # noqa: E731
    probes, settled = 0, None
    for _ in range(rounds):
        d = s.depth(4, chain)
        probes += s._probing
        if not d and settled is None:
            settled = -s.ledger.saved
        s.observe(d, 0, d, d)
    return s, probes, settled


def test_the_loss_budget_bounds_what_failing_probes_lose():
    """Valued from the cost table, the probes of a drafter that is never accepted lose at most ``loss_budget`` (0.2 %) of the
    rounds' time (plus the one probe that crossed the bound) beyond what its first rounds lost; with the bound lifted
    the same drafter probes more and loses more (the check can fail)."""
    s, probes, settled = _losing_run(0.002)
    probe_loss = SWITCHING.forward_seconds[2] + SWITCHING.draft_seconds - SWITCHING.forward_seconds[1]
    assert probes > 0 and -s.ledger.saved > settled                       # it probed, and lost
    assert -s.ledger.saved <= settled + 0.002 * s.ledger.spent + probe_loss, (s.ledger.saved, s.ledger.spent, settled)
    loose, loose_probes, _ = _losing_run(0.99)
    assert loose_probes > probes and -loose.ledger.saved > settled + 0.002 * loose.ledger.spent + probe_loss


def test_a_paying_drafter_is_not_held_back_by_the_budget(model, ar_ids):
    """The budget gates probes only, not the rounds the acceptance estimate chooses to draft: a drafter whose first
    draft is rejected (time lost before anything was saved) and that is right afterwards keeps drafting every round
    (a budget on every round would stop it after that first loss); an always-right one drafts from its first round."""
    gen = SpeculativeGenerator(model, OracleDrafter(PROMPT, ar_ids), ChainBuilder(4), costs=CHEAP)
    toks, stats = run(gen)
    assert toks == ar_ids and stats.ar_rounds == 0
    late = SpeculativeGenerator(model, OracleDrafter(PROMPT, ar_ids, wrong_calls=1), ChainBuilder(4), costs=CHEAP)
    toks, stats = run(late)
    assert toks == ar_ids and stats.accepted_at_depth[0] == stats.drafted_at_depth[0] - 1      # one rejection
    assert stats.ar_rounds == 0 and stats.speculated_rounds == stats.rounds


def test_an_unobserved_depth_takes_the_deepest_observed_estimate():
    from speculant.engine.goodput import DepthAcceptance
    a = DepthAcceptance(smoothing=0.5, prior=1.0)
    assert a.alpha(1) == a.alpha(3) == 1.0
    a.observe(4, 0)                                               # depth 1 rejected: depths 2.. never reached
    assert a.alpha(1) == 0.5 and a.alpha(2) == a.alpha(4) == 0.5
    a.observe(4, 1)                                               # depth 1 accepted, depth 2 rejected
    assert a.alpha(1) == 0.75 and a.alpha(2) == 0.375 and a.alpha(3) == 0.375   # depth 2 started from depth 1's


def test_the_prior_counts_as_one_observation_until_the_exponential_weight_takes_over():
    """The n-th observation of a depth weighs max(1 / (n + 1), smoothing): a rejection after a prior of certainty
    halves it (the exponential mean alone left 0.8, and an early-exit draft kept drafting by choice), and from the
    fourth observation on (weight 1/5 = 0.2) the mean is the exponential one."""
    from speculant.engine.goodput import DepthAcceptance
    a = DepthAcceptance(smoothing=0.2, prior=1.0)
    a.observe(1, 0)
    assert a.alpha(1) == 0.5
    a.observe(1, 0)
    assert abs(a.alpha(1) - 1 / 3) < 1e-12                      # the mean of the prior and two rejections
    for _ in range(2):
        a.observe(1, 1)
    assert abs(a.alpha(1) - 0.6) < 1e-12                        # (1 + 0 + 0 + 1 + 1) / 5
    before = a.alpha(1)
    a.observe(1, 0)
    assert abs(a.fast[0] - 0.8 * before) < 1e-12                # weight 0.2 from here on
    assert abs(a.slow[0] - 5 / 6 * before) < 1e-12              # the slow mean: 1 / 6 until 1 / 20 > 0.05
    assert a.alpha(1) == a.slow[0] and a.alphas == [a.slow[0]]  # the larger
    assert DepthAcceptance(smoothing=0.2, prior=0.3).alpha(2) == 0.3


def test_the_estimate_rides_out_runs_of_rejections_and_follows_a_recovery():
    """Accepted 40 % of the time in runs (4 accepted, 6 rejected): the fast mean falls below 0.25 in each run of
    rejections, the estimate (the larger of the fast and the slow mean) stays above 0.3; after 1000 rejections, five
    acceptances lift the estimate above 0.6 (the fast mean) while the slow one is still below 0.3."""
    from speculant.engine.goodput import DepthAcceptance
    a, fast, estimate = DepthAcceptance(), [], []
    for i in range(1000):
        a.observe_at(1, i % 10 < 4)
        if i >= 200:
            fast.append(a.fast[0])
            estimate.append(a.alpha(1))
    assert min(fast) < 0.25 and min(estimate) > 0.3, (min(fast), min(estimate))
    for _ in range(1000):
        a.observe_at(1, False)
    for _ in range(5):
        a.observe_at(1, True)
    assert a.alpha(1) > 0.6 and a.slow[0] < 0.3


def test_a_costly_first_draft_call_is_charged_once_per_round():
    """A round's drafting costs ``c_1 + (d - 1) c``: with a costly first call (an EAGLE head's catch-up) depth 1
    alone does not pay where depth 3 does, which one cost per call could not express."""
    from speculant.engine.goodput import DepthAcceptance, GoodputPolicy
    table = CostTable({1: 1.0, 2: 1.1, 4: 1.3}, 0.05, first_draft_seconds=0.5)
    assert table.drafting_seconds(0) == 0.0 and table.drafting_seconds(3) == pytest.approx(0.6)
    assert CostTable({1: 1.0}, 0.05).drafting_seconds(3) == pytest.approx(0.15)
    policy = GoodputPolicy(table.forward_seconds, warmup=0)
    sure = DepthAcceptance(prior=0.6)
    chain = lambda d: d                                            # noqa: E731
    assert policy.draft_depth(1, sure, 1, chain, 0.05, first_draft_seconds=0.5) == 0
    assert policy.draft_depth(1, sure, 3, chain, 0.05, first_draft_seconds=0.5) == 3
    assert policy.draft_depth(1, sure, 1, chain, 0.05) == 1       # one cost per call: depth 1 pays
    with pytest.raises(SpeculantError) as e:
        CostTable({1: 1.0}, 0.05, first_draft_seconds=-1.0)
    assert "first_draft_seconds=-1.0" in str(e.value)


def test_a_depth_that_cannot_pay_is_refused_before_its_draft_call(model, ar_ids, monkeypatch):
    """The confidence rule's ``refuses`` is asked before a depth's draft call with the best path confidence so far:
    greedy outputs are unchanged and fewer draft calls are made than when each depth is first drafted and then
    judged."""
    from speculant.engine.goodput import SequenceSpeculation
    spec = dict(method="early-exit", exit_layer=2, num_speculations=4)
    toks, stats = run(build_generator(model, costs=SWITCHING, **spec))
    real = SequenceSpeculation.stop_rule

    def judged_after(self, nodes_at_depth):
        rule = real(self, nodes_at_depth)
        del rule.refuses
        return rule
    monkeypatch.setattr(SequenceSpeculation, "stop_rule", judged_after)
    late_toks, late = run(build_generator(model, costs=SWITCHING, **spec))
    assert toks == late_toks == ar_ids
    assert stats.draft_forwards < late.draft_forwards, (stats.draft_forwards, late.draft_forwards)


# ------------------------------------------------------------------ round contexts: acceptance kept per context
class ContextDrafter(OracleDrafter):
    """Right in every other round (context 0), wrong in the others (context 1), and says which through its round
    context."""

    def round_context(self, state):
        self.context = self.rounds_seen % 2
        self.rounds_seen += 1
        return self.context

    def draft(self, state, builder, generator, max_nodes, max_depth):
        self.wrong = self.context == 1
        self.rounds[self.context] += 1
        self.drafted[self.context] += bool(max_depth)
        return super().draft(state, builder, generator, max_nodes, max_depth)


def test_each_round_context_keeps_its_own_acceptance(model):
    ar80 = run(build_generator(model, method="ar"), n=80)[0]
    drafter = ContextDrafter(PROMPT, ar80)
    drafter.rounds, drafter.drafted, drafter.rounds_seen = [0, 0], [0, 0], 0
    toks, stats = run(SpeculativeGenerator(model, drafter, ChainBuilder(1), costs=SWITCHING), n=80)
    assert toks == ar80
    even, odd = drafter.drafted[0] / drafter.rounds[0], drafter.drafted[1] / drafter.rounds[1]
    assert drafter.rounds[1] >= 20
    assert even == 1.0                            # the right context drafts every round
    assert odd <= 0.25                            # the wrong one stops after a few, then only probes
    assert Drafter.round_context(drafter, None) is None     # the base class: one context


def test_round_contexts_share_one_loss_budget():
    """The loss budget is the generation's, not each context's: once failing probes in some contexts spent it, no
    context probes, and a context never seen before does not draft its first round either."""
    from types import SimpleNamespace

    from speculant.engine.speculation import RoundSizer
    sizer = RoundSizer(SWITCHING, ChainBuilder(4), confidence=False)
    state = SimpleNamespace(draft_stop=None, tokens=[0] * 100)
    for r in range(400):                               # contexts 0..3 in turn, every draft rejected
        d = sizer.depth(state, 4, r % 4)
        sizer.observe(d, 0, d, d)
    assert len(sizer.contexts) == 5 and all(s.ledger is sizer.ledger for s in sizer.contexts.values())  # + None
    assert not sizer.speculation.within_budget()
    assert sizer.depth(state, 4, "new") == 0


def test_a_new_round_context_starts_from_the_generations_pooled_acceptance():
    """A context met after others starts from the acceptance at depth 1 pooled over the generation's contexts so
    far, not from certainty: after most drafts of other contexts were rejected, a new context would not draft by
    choice, where one that started from certainty would."""
    from types import SimpleNamespace

    from speculant.engine.goodput import DepthAcceptance
    from speculant.engine.speculation import RoundSizer
    sizer = RoundSizer(SWITCHING, ChainBuilder(4), confidence=False)
    state = SimpleNamespace(draft_stop=None, tokens=[0] * 100)
    assert sizer.contexts[None].acceptance.alpha(1) == 1.0              # nothing seen yet: certainty
    want = DepthAcceptance()
    for r in range(12):                                # contexts 0, 1 in turn: first drafts accepted, then rejected
        d = sizer.depth(state, 4, r % 2)
        accepted = d if r < 2 else 0
        sizer.observe(d, accepted, d, d)
        if d:
            want.observe(1, accepted)
    assert 0.0 < sizer.pooled.alpha(1) == want.alpha(1) < 0.5
    sizer.depth(state, 4, "new")
    new = sizer.speculation
    assert new.acceptance.alpha(1) == want.alpha(1)                     # the new context's prior
    # what it would draft by choice from that prior: nothing; from certainty (the first context's prior): a depth
    assert new._depth(4, sizer.nodes, new.acceptance) == 0
    assert new._depth(4, sizer.nodes, DepthAcceptance()) > 0


def test_calibration_rounds_draft_the_depths_in_turn(model):
    """The calibration's generation (``timed_rounds``): its rounds draft no depth, one and the builder's in turn, each
    as asked unless nothing is left to draft; a round's draft calls are its depths for this chain."""
    from speculant.engine.methods import _drafter
    from speculant.engine.speculation import timed_rounds
    drafter = _drafter(MethodSpec(method="early-exit", exit_layer=1), model)
    rounds = timed_rounds(model, drafter, ChainBuilder(4), (0, 1, 4), PROMPT, 40, SamplingConfig())
    assert len(rounds) >= 12 and all(seconds > 0 for seconds, _, _ in rounds)
    assert [nodes for _, nodes, _ in rounds[0::3]] == [0] * len(rounds[0::3])
    assert {nodes for _, nodes, _ in rounds[1::3]} == {1}
    deep = [nodes for _, nodes, _ in rounds[2::3]]
    assert set(deep[:-2]) == {4} and set(deep[-2:]) <= {1, 2, 3, 4}     # the last ones cut by max_new_tokens
    assert all(nodes == calls for _, nodes, calls in rounds)


def test_draft_figures_reproduce_the_calibration_rounds(model, monkeypatch):
    """``measure_draft_seconds`` on fixed round times (no timing): with forward(1) = 1, turns of an ``ar`` round of 2
    (its overhead too), a depth-1 round of 3 (one node) and a depth-4 round of 5 (four nodes, four calls) must come
    back as ``forward(1 + n) + drafting`` = 1.5 and 2.5 forward units: first = 1.5 - forward(2), further =
    (2.5 - forward(5) - first) / 3 (ratios within a turn: a turn twice as slow says the same; the tenth of the
    turns on each side left out: one outlier among 11 changes nothing); a turn whose round drafted less than asked
    is left out; figures below zero are 0; nothing drafted gives (0, 0)."""
    from speculant.engine import speculation
    from speculant.engine.methods import _drafter
    forward = {1: 1.0, 2: 1.1, 5: 1.4}
    turns = [[(2.0, 0, 0), (3.0, 1, 1), (5.0, 4, 4)]] * 9 + [[(4.0, 0, 0), (6.0, 1, 1), (10.0, 4, 4)],
                                                         [(2.0, 0, 0), (9.0, 1, 1), (5.0, 4, 4)],
                                                         [(2.0, 0, 0), (2.0, 0, 0), (9.0, 4, 4)]]
    monkeypatch.setattr(speculation, "timed_rounds", lambda *a: [r for t in turns for r in t])
    drafter = _drafter(MethodSpec(method="early-exit", exit_layer=1), model)

    def figures():
        return speculation.measure_draft_seconds(model, drafter, ChainBuilder(4), forward=forward, repeats=1)
    first, further = figures()
    assert first == pytest.approx(1.5 - 1.1)
    assert further == pytest.approx((2.5 - 1.4 - 0.4) / 3)
    turns[:] = [[(2.0, 0, 0), (3.0, 1, 1), (2.0, 4, 4)]] * 3                 # a deep round cheaper than its rows
    assert figures() == (pytest.approx(0.4), 0.0)
    turns[:] = [[(2.0, 0, 0), (2.0, 0, 0), (2.0, 0, 0)]]                     # nothing drafted
    assert figures() is None


def test_a_warm_up_past_its_deadline_still_leaves_the_timed_generations(model, monkeypatch):
    """The calibration's warm-up is cut at a quarter of the budget; running past that deadline must not end the
    calibration (it did: on a machine where the target step is 3.8 ms, early exit's greedy warm-up overran its 0.5 s,
    no turn was timed and early exit never drafted, greedy)."""
    from speculant.engine import speculation
    from speculant.engine.methods import _drafter
    calls = []

    def rounds(model, drafter, builder, depths, prompt, tokens, sampling, deadline):
        calls.append(tokens)
        if len(calls) == 1:                                   # the warm-up ends past its deadline
            while time.perf_counter() < deadline:
                pass
        return [(2.0, 0, 0), (3.0, 1, 1), (5.0, 4, 4)]
    monkeypatch.setattr(speculation, "timed_rounds", rounds)
    drafter = _drafter(MethodSpec(method="early-exit", exit_layer=1), model)
    turns = speculation.calibration_turns(model, drafter, ChainBuilder(4), (0, 1, 4), PROMPT, 40, 2, 0.2,
                                          SamplingConfig())
    assert calls == [10, 40, 40] and len(turns) == 2


def test_a_calibration_that_timed_nothing_is_not_kept_and_never_looks_free(model, monkeypatch):
    """No turn drafted as asked (a loaded machine's budget ran out): the figure is not kept in the tune (measured
    again next time), a sampled figure falls back to the greedy one, and a greedy one to a target step per draft
    call (drafting never pays), never to ``(0, 0)`` (every draft free)."""
    from types import SimpleNamespace

    from speculant.engine import speculation
    tune = SimpleNamespace(draft_ms={"x": 0.5, "x first": 0.75})
    fake = SimpleNamespace(tune=tune)
    monkeypatch.setattr(speculation, "measure_draft_seconds", lambda *a, **k: None)
    monkeypatch.setattr(speculation, "forward_seconds", lambda m: {1: 0.002, 2: 0.0021})
    assert speculation.draft_seconds(fake, None, None, "x", sampled=True) == (0.00075, 0.0005)
    assert speculation.draft_seconds(fake, None, None, "y", sampled=True) == (0.002, 0.002)
    assert speculation.draft_seconds(fake, None, None, "y") == (0.002, 0.002)
    assert set(tune.draft_ms) == {"x", "x first"}


# ------------------------------------------------------------------ (d) shadow chains of free drafts
def test_a_shadow_chain_observes_its_matched_prefix_as_the_tokens_arrive():
    """A chain known without drafting (prompt lookup's copy) in a round that drafted nothing is checked against the
    tokens then emitted, one position at a time as they arrive: its matched prefix's positions are accepted
    observations of their depths, the first mismatch a rejected one, and nothing past it is observed; depth 1 is
    pooled too (a new context's prior); a drafting round forgets the pending chain, and one chain is pending at a
    time."""
    from speculant.engine.goodput import DepthAcceptance
    from speculant.engine.speculation import RoundSizer
    sizer = RoundSizer(SWITCHING, ChainBuilder(4), confidence=False)
    tokens = list(range(10))
    sizer.shadow("c", [20, 21, 22, 23], len(tokens))
    sizer.shadow("c", [99], len(tokens))                      # one at a time: the pending one stays
    tokens.append(20)
    sizer.resolve_shadow(tokens)                              # depth 1 reached: accepted
    acceptance = sizer.contexts["c"].acceptance
    assert sizer.pending_shadow is not None and acceptance.counts == [2]
    tokens += [21, 7, 23]
    sizer.resolve_shadow(tokens)                              # depth 2 accepted, depth 3 rejected, depth 4 unseen
    want = DepthAcceptance(prior=acceptance.prior)
    want.observe(4, 2)
    assert acceptance.alphas == want.alphas and acceptance.counts == want.counts
    assert sizer.pending_shadow is None and sizer.pooled.counts == [2] and sizer.pooled.alphas == [1.0]
    sizer.resolve_shadow(tokens + [0])                        # nothing pending: nothing more observed
    assert acceptance.counts == want.counts
    sizer.shadow(None, [1, 2], len(tokens))
    sizer.drop_shadow()
    sizer.resolve_shadow(tokens + [1, 2])
    assert sizer.contexts[None].acceptance.counts == []


class FreeOracleDrafter(OracleDrafter):
    """An :class:`OracleDrafter` whose chain is free to know (as prompt lookup's copy is)."""

    name = "free-oracle"

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.blind = 0                                # rounds drafted before any chain was checked

    def free_draft(self, state, context, max_depth):
        n = len(state.tokens)
        return [(t + 1) % self.vocab if self.wrong else t for t in self.reference[n:n + max_depth]]

    def draft(self, state, builder, generator, max_nodes, max_depth):
        tree = super().draft(state, builder, generator, max_nodes, max_depth)
        self.blind += bool(len(tree)) and not self.checked(state)
        return tree

    def checked(self, state):
        return any(s.acceptance.alphas for s in self.sizer.contexts.values())


def _free_run(model, reference, wrong, costs):
    drafter = FreeOracleDrafter(PROMPT, reference, wrong=wrong)
    gen = SpeculativeGenerator(model, drafter, ChainBuilder(4), costs=costs)
    make = gen.round_sizer

    def sizer(*args, **kwargs):
        drafter.sizer = make(*args, **kwargs)
        return drafter.sizer
    gen.round_sizer = sizer
    toks, stats = run(gen, n=60)
    return drafter, toks, stats


def test_a_free_drafter_never_drafts_blind_and_one_never_right_never_drafts(model):
    """A free chain is learnt from its shadow, so no round drafts before one was checked (no first-round draft on
    the prior): a never-right free drafter drafts no round at all (a model's drafter probes), an always-right one
    drafts from its second round on; outputs are ``ar``'s either way."""
    ar60 = run(build_generator(model, method="ar"), n=60)[0]
    wrong, toks, stats = _free_run(model, ar60, True, SWITCHING)
    assert toks == ar60 and stats.speculated_rounds == 0 and stats.ar_rounds == stats.rounds
    assert any(s.acceptance.alphas and s.acceptance.alpha(1) < 0.05 for s in wrong.sizer.contexts.values())
    right, toks, stats = _free_run(model, ar60, False, CHEAP)
    assert toks == ar60 and right.blind == 0
    assert stats.ar_rounds == 1 and stats.speculated_rounds == stats.rounds - 1
    assert stats.accepted_tokens == stats.drafted_tokens


def test_losses_of_rounds_drafted_by_choice_do_not_stop_the_probes():
    """The loss budget counts the probes' losses: rounds that drafted by choice on the prior and lost (the first
    ones) leave the generation's value far below the budget, yet the first probe comes after the back-off's 16
    rounds (counting those losses, it came after hundreds: a head stopped probing for the rest of a generation)."""
    from speculant.engine.goodput import SequenceSpeculation
    s = SequenceSpeculation(SWITCHING)
    chain = lambda d: d                                            # noqa: E731
    d = s.depth(4, chain)
    while d:                                                       # drafted by choice (and first), all rejected
        assert not s._probing
        s.observe(d, 0, d, d)
        d = s.depth(4, chain)
    s.observe(0, 0)
    without = 1
    while not s.depth(4, chain):
        without += 1
        s.observe(0, 0)
    assert s._probing and without <= 16, without
    assert s.ledger.saved + s.loss_budget * s.ledger.spent < 0.0      # what all the rounds lost: over the budget


def test_costs_grow_with_the_context_beyond_the_tables():
    """``CostTable.at``: each forward figure plus its growth per cached token beyond the table's context, each draft
    call plus the drafter's; at or below the table's context (and without growth) the table itself; bad growth
    figures are refused naming the value."""
    table = CostTable({1: 1.0, 2: 1.1}, 0.2, 0.3, context=256, forward_growth={1: 0.001, 2: 0.002},
                      draft_growth=0.0005)
    assert table.at(256) is table and table.at(100) is table
    at = table.at(1256)
    assert at.forward_seconds == {1: pytest.approx(2.0), 2: pytest.approx(3.1)}
    assert (at.draft_seconds, at.first_draft_seconds) == (pytest.approx(0.7), pytest.approx(0.8))
    assert at.context == 1256 and at.forward_growth is None and at.at(5000) is at
    flat = CostTable({1: 1.0}, 0.2)
    assert flat.at(10_000) is flat
    for bad in ({1: -0.1, 2: 0.1}, {1: 0.1, 3: 0.1}, {1: 0.1}, {1: "x", 2: 0.1}, {1: None, 2: 0.1},
                {1: math.inf, 2: 0.1}, {1: True, 2: 0.1}):
        with pytest.raises(SpeculantError) as e:
            CostTable({1: 1.0, 2: 1.1}, 0.2, forward_growth=bad)
        assert f"forward_growth={bad!r}" in str(e.value)
    for bad in (-1.0, math.inf, "1"):
        with pytest.raises(SpeculantError) as e:
            CostTable({1: 1.0}, 0.2, draft_growth=bad)
        assert f"draft_growth={bad!r}" in str(e.value)


def test_an_acceptance_prior_that_is_not_one_is_refused(model):
    """``acceptance_prior`` must be a callable returning ``None`` or ``{context: DepthAcceptance}``: a dict given
    in its place is refused at construction, a callable returning something else at the first generation asking."""
    with pytest.raises(SpeculantError) as e:
        SpeculativeGenerator(model, OracleDrafter(PROMPT, []), ChainBuilder(2), costs=SWITCHING, acceptance_prior={})
    assert "acceptance_prior={}" in str(e.value)
    gen = SpeculativeGenerator(model, OracleDrafter(PROMPT, []), ChainBuilder(2), costs=SWITCHING,
                               acceptance_prior=lambda sampled: {None: 0.4})
    with pytest.raises(SpeculantError) as e:
        run(gen)
    assert "acceptance_prior(False) returned {None: 0.4}" in str(e.value)


def test_growth_per_cached_token_from_the_tunes_second_table():
    """``forward_growth``: the slope between the tune's tables (256 and 1024 cached tokens), at least 0 and never
    less at more rows; ``None`` without the second table."""
    from speculant.engine.speculation import forward_growth

    class Tune:
        forward_ms = {"1": 4.0, "2": 4.2, "4": 5.0}
        forward_context_ms = {"1024": {"1": 5.536, "2": 4.0, "4": 7.304}}

    class Model:
        tune, config = Tune(), type("C", (), {"context_length": 8192})()
    context, growth = forward_growth(Model(), forward_seconds(Model()))
    assert context == 256
    # T = 2 came out below its 256-token figure (noise): its slope is not below T = 1's
    assert growth == {1: pytest.approx(0.002e-3), 2: pytest.approx(0.002e-3), 4: pytest.approx(0.003e-3)}
    Model.tune.forward_context_ms = {"1024": {"1": 3.0, "2": 4.2, "4": 5.0}}       # faster after more tokens: noise
    assert forward_growth(Model(), forward_seconds(Model())) == (256, {1: 0.0, 2: 0.0, 4: 0.0})
    Model.tune.forward_context_ms = {}
    assert forward_growth(Model(), forward_seconds(Model())) is None


def test_drafting_that_pays_after_a_short_context_stops_after_a_long_one():
    """A drafter accepted 40 % of the time pays at the table's context, where two rows cost 1.05 steps, and not after
    3000 cached tokens, where the rows' attention makes them cost 1.4: the rounds are sized at the sequence's context
    (``RoundSizer`` reads ``len(state.tokens)``), and the time a round is valued at follows it."""
    from types import SimpleNamespace

    from speculant.engine.speculation import RoundSizer
    costs = CostTable({1: 1.0e-3, 2: 1.05e-3}, 0.1e-3, context=256,
                      forward_growth={1: 0.5e-6, 2: 1.0e-6}, draft_growth=0.0)
    sizer = RoundSizer(costs, ChainBuilder(1), False, history={None: _history_of_forty_percent()})
    short = SimpleNamespace(draft_stop=None, tokens=[0] * 300)
    long = SimpleNamespace(draft_stop=None, tokens=[0] * 3000)
    assert sizer.depth(short, 1) == 1
    assert sizer.speculation.costs.forward_seconds[1] == pytest.approx(1.0e-3 + 0.5e-6 * 32)   # 288 = 256 + 32
    assert sizer.depth(long, 1) == 0
    assert sizer.speculation.costs.forward_seconds[2] == pytest.approx(1.05e-3 + 1.0e-6 * (2976 - 256))


def test_draft_calls_grow_by_the_drafters_share_of_the_cache(model, head_dir):
    """A draft call reads the KV cache of the layers it runs: early exit at ``E`` of ``L`` layers ``E / L`` of the
    target's, a draft head its one layer's, a truncated draft model its layers', prompt lookup none, and a copying
    round of ``eagle-lookup`` none (its table's draft growth set to 0); the head's rounds keep the head's."""
    from types import SimpleNamespace

    from speculant.drafters.early_exit import EarlyExitDrafter
    from speculant.drafters.prompt_lookup import PromptLookupDrafter
    L = model.config.num_hidden_layers
    assert EarlyExitDrafter(L, 1).cache_share(model.config) == pytest.approx(1 / L)
    assert PromptLookupDrafter().cache_share(model.config) == 0.0
    assert build_generator(model, **_spec("eagle", head_dir)).drafter.cache_share(model.config) == pytest.approx(1 / L)
    assert build_generator(model, **SPECS["draft-model"]).drafter.cache_share(model.config) == pytest.approx(1 / L)
    mixed = build_generator(model, **_spec("eagle-lookup", head_dir)).drafter
    assert mixed.cache_share(model.config) == pytest.approx(1 / L)
    mixed.lookup_seconds = {True: (0.001, 0.0005)}
    table = CostTable({1: 1.0, 2: 1.1}, 0.2, 0.3, 256, {1: 0.001, 2: 0.002}, draft_growth=0.0004)
    state = SimpleNamespace(sampling=SamplingConfig())
    assert mixed.round_costs(state, ("lookup", 2), table).draft_growth == 0.0
    assert mixed.round_costs(state, None, table) is table


def _builtin_reference(model, monkeypatch, text="the cat sat on the mat"):
    """The prior's prompts replaced by one, its ids and ``ar``'s 64 tokens after them (what an oracle drafts)."""
    from speculant.engine import speculation
    from speculant.engine.prompts import encode_prompt
    monkeypatch.setattr(speculation, "PRIOR_PROMPTS", (text,))
    ids = encode_prompt(model.tokenizer, text)
    return ids, run(build_generator(model, method="ar"), prompt=ids, n=64)[0]


def test_the_acceptance_prior_counts_what_every_round_drafting_accepts(model, monkeypatch):
    """``measure_acceptance`` drafts every round as deep as the builder allows on its fixed prompts and keeps the
    acceptance per depth: a drafter always right is at 1 at every depth, one never right at ``1 / (rounds + 1)``
    (the plain mean from the prior of certainty, as a history's first observations weigh)."""
    from speculant.engine.speculation import measure_acceptance
    ids, out = _builtin_reference(model, monkeypatch)
    right = measure_acceptance(model, OracleDrafter(ids, out), ChainBuilder(3))
    assert set(right) == {None} and right[None].alphas == [1.0, 1.0, 1.0]
    wrong = measure_acceptance(model, OracleDrafter(ids, out, wrong=True), ChainBuilder(3))[None]
    rounds = wrong.counts[0] - 1
    assert rounds >= 60 and wrong.alphas == [pytest.approx(1 / (rounds + 1))]


def test_the_acceptance_prior_is_measured_once_and_kept_with_the_tune(model, monkeypatch):
    """``acceptance_prior``: measured at the first call and kept in the tune (saved), greedy and sampled apart; later
    calls read it (round contexts that are tuples come back as tuples from JSON); no prior without a tune."""
    import copy as copy_module
    from types import SimpleNamespace

    from speculant.engine import speculation
    from speculant.runtime import tune as tune_module
    ids, out = _builtin_reference(model, monkeypatch)
    saved = []
    monkeypatch.setattr(tune_module, "save", lambda t: saved.append(json.dumps(t.acceptance)))
    m = copy_module.copy(model)
    m.tune = SimpleNamespace(acceptance={})
    assert speculation.acceptance_prior(model, OracleDrafter(ids, out), ChainBuilder(2), "oracle") is None
    prior = speculation.acceptance_prior(m, OracleDrafter(ids, out), ChainBuilder(2), "oracle")
    assert prior[None].alphas == [1.0, 1.0] and set(m.tune.acceptance) == {"oracle"} and len(saved) == 1
    monkeypatch.setattr(speculation, "measure_acceptance", lambda *a, **k: pytest.fail("measured again"))
    again = speculation.acceptance_prior(m, OracleDrafter(ids, out), ChainBuilder(2), "oracle")
    assert again[None].alphas == [1.0, 1.0] and again[None].counts == prior[None].counts
    assert speculation.tree_shape(ConstantBranchingBuilder("2,1")) == ",b=2x1"       # a tree's shape is in its key
    assert speculation.tree_shape(StochasticBeamBuilder(2, 3)) == ",W=2"
    m.tune.acceptance["oracle sampled"] = json.loads(json.dumps([[("lookup", 2), [0.5], [3]]]))
    sampled = speculation.acceptance_prior(m, OracleDrafter(ids, out), ChainBuilder(2), "oracle", sampled=True)
    assert list(sampled) == [("lookup", 2)] and sampled[("lookup", 2)].alpha(1) == 0.5


def test_rounds_start_from_the_acceptance_prior_and_sampled_ones_leave_it(model):
    """A generator given an acceptance prior: its first greedy generation starts from the greedy prior (a drafter
    never right, with a prior that does not pay, drafts fewer rounds than from certainty; outputs are ``ar``'s),
    and its history is seeded from it; a sampled generation starts from a copy of the sampled prior, so a seeded
    output is the same before and after other generations and the prior is left as it was.  The prior is asked for
    once per kind."""
    import copy

    from speculant.engine.goodput import DepthAcceptance
    ar60 = run(build_generator(model, method="ar"), n=60)[0]
    low = DepthAcceptance(0.02, prior=0.05)
    low.observe_at(1, False)
    asked = []

    def prior(sampled):
        asked.append(sampled)
        return {None: copy.deepcopy(low)}
    plain = SpeculativeGenerator(model, OracleDrafter(PROMPT, ar60, wrong=True), ChainBuilder(4), costs=SWITCHING)
    gen = SpeculativeGenerator(model, OracleDrafter(PROMPT, ar60, wrong=True), ChainBuilder(4), costs=SWITCHING,
                               acceptance_prior=prior)
    toks, with_prior = run(gen, n=60)
    assert toks == ar60 and with_prior.speculated_rounds < run(plain, n=60)[1].speculated_rounds
    assert gen.acceptance_history[None].counts[0] > 2                       # seeded from the prior, then updated
    early = build_generator(model, **SPECS["early-exit"])
    gen = SpeculativeGenerator(model, early.drafter, early.builder, costs=SWITCHING, acceptance_prior=prior)
    sampling = SamplingConfig(temperature=1.0, seed=11)
    first = run(gen, sampling=sampling)[0]
    run(gen, sampling=SamplingConfig(temperature=1.0, seed=3))
    run(gen)
    assert run(gen, sampling=sampling)[0] == first
    assert gen._priors[True][None].counts == low.counts and asked == [False, True, False]   # once per kind


def test_one_off_measurements_are_not_in_a_generations_time(model, monkeypatch):
    """The sampled cost table and the acceptance prior, measured at the first generation that needs them, are
    measured before its clock starts: its ``seconds`` do not include them."""
    def slow_prior(sampled):
        time.sleep(0.3)
        return None

    def slow_costs():
        time.sleep(0.3)
        return SWITCHING
    early = build_generator(model, **SPECS["early-exit"])
    gen = SpeculativeGenerator(model, early.drafter, early.builder, costs=SWITCHING, sampled_costs=slow_costs,
                               acceptance_prior=slow_prior)
    start = time.perf_counter()
    stats = run(gen, n=4, sampling=SamplingConfig(temperature=1.0, seed=1))[1]
    assert time.perf_counter() - start >= 0.6 > stats.seconds      # 0.6 s measured, none of it counted
