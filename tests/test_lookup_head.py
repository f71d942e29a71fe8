"""``eagle-lookup`` (speculant/drafters/lookup_head.py): prompt lookup where an n-gram recurs, the draft head
elsewhere.  Greedy identity with ``ar`` is in tests/test_golden_ids.py (every weight format) and
tests/test_cost_policy.py (under switching costs); here: both kinds of rounds draft in one generation, each sized
by its own costs, and the sampled law stays the target's (chi-square), with a broken variant that fails it."""

from __future__ import annotations

import pytest
import torch
from helpers import on_fused_step, tiny_model
from stats_helpers import chi_square, exact_law
from test_cost_policy import LENGTH, RUNS, SAMPLING, SMALL_PROMPT, SWITCH_SMALL, run

from speculant import GenerationConfig, SamplingConfig, build_generator
from speculant.drafters import lookup_head
from speculant.drafters.lookup_head import LookupMixin
from speculant.engine.goodput import CostTable
from speculant.trees.tree import DraftTree

SMALL = dict(seed=5, scale=1.5, vocab=4, layers=2, hidden=32, heads=2, kv_heads=1, inter=64)


@pytest.fixture(scope="module")
def head_dir(tmp_path_factory):
    """A random draft head of the 4-token model, made on its float weights."""
    from speculant.drafters.draft_head import new_head, save_head
    path = tmp_path_factory.mktemp("head")
    torch.manual_seed(1)
    save_head(new_head(tiny_model(**SMALL), torch.arange(4)), path)
    return str(path)


@pytest.fixture(scope="module")
def small(head_dir):
    return on_fused_step(tiny_model(**SMALL))


@pytest.fixture(scope="module")
def law(small):
    return exact_law(small, SMALL_PROMPT, SamplingConfig(**SAMPLING), length=LENGTH)


def counted(gen):
    """Count the generator's round contexts: ``{"lookup": n, "head": n}``."""
    seen = {"lookup": 0, "head": 0}
    inner = gen.drafter.round_context

    def round_context(state):
        context = inner(state)
        seen["head" if context is None else "lookup"] += 1
        return context
    gen.drafter.round_context = round_context
    return seen


def sample(small, head_dir, min_ngram=2):
    gen = build_generator(small, costs=SWITCH_SMALL, method="eagle-lookup", num_speculations=2, draft_head=head_dir,
                          min_ngram=min_ngram)
    seen = counted(gen)
    outs, forwards = [], 0
    for seed in range(RUNS):
        toks, stats = run(gen, SMALL_PROMPT, LENGTH, SamplingConfig(seed=seed, **SAMPLING))
        forwards += stats.draft_forwards
        outs.append(tuple(toks))
    assert seen["lookup"] > RUNS // 10 and forwards > RUNS // 25, (seen, forwards)     # both kinds drafted
    return outs


@pytest.mark.parametrize("min_ngram", [2, 1])
def test_sampled_law_is_the_targets(small, head_dir, law, min_ngram):
    stat, threshold = chi_square(sample(small, head_dir, min_ngram), law)
    assert stat < threshold, (stat, threshold)


def test_a_copy_recorded_with_the_wrong_point_mass_fails(small, head_dir, law, monkeypatch):
    """Recording each copied token's point mass on another token (so q(x) = 0: always accepted) biases the law
    toward copying; the same test catches it."""
    def wrong(state, cont):
        tree, parent = DraftTree(), -1
        for tok in cont:
            tree.set_draft_probs(parent, torch.ones(1), torch.tensor([(tok + 1) % 4]), 4)
            parent = tree.add(parent, tok)
        return tree
    monkeypatch.setattr(lookup_head, "continuation_tree", wrong)
    stat, threshold = chi_square(sample(small, head_dir, min_ngram=1), law)
    assert stat > threshold, (stat, threshold)


def test_lookup_rounds_are_sized_by_their_own_costs(small, head_dir):
    gen = build_generator(small, costs=CostTable({1: 1.0, 2: 1.1, 3: 1.2}, 5.0), method="eagle-lookup",
                          num_speculations=2, draft_head=head_dir)
    assert isinstance(gen.drafter, LookupMixin) and gen.drafter.name == "eagle-lookup"
    seen = counted(gen)
    prompt = [1, 2, 3, 0, 1, 2, 3, 0, 1, 2]
    ar = build_generator(small, method="ar").generate(prompt, GenerationConfig(max_new_tokens=24)).token_ids
    toks, stats = run(gen, prompt, 24)
    assert toks == ar
    # a head draft call costs 5 target steps: it never pays, so only the lookup rounds (cost 0 a call) draft
    assert stats.draft_forwards == 0 and stats.drafted_tokens > 0 and seen["lookup"] > 0
    # the stats count both kinds of rounds apart (--json's rounds_by_context): the head's drafted nothing here
    by = stats.rounds_by_context
    assert by["head"]["drafted_tokens"] == 0 and by["head"]["rounds"] == seen["head"]
    lookups = [v for k, v in by.items() if k.startswith("lookup n-gram ")]
    assert sum(v["rounds"] for v in lookups) == seen["lookup"]
    assert sum(v["drafted_tokens"] for v in lookups) == stats.drafted_tokens
    assert sum(v["accepted_tokens"] for v in lookups) == stats.accepted_tokens
    assert sum(v["speculated_rounds"] for v in by.values()) == stats.speculated_rounds


def test_head_rounds_are_costed_by_the_head_alone(small, head_dir, monkeypatch):
    """The head's rounds cost the plain head drafter's calibration (``eagle``'s, shared), not one of the mixed
    drafter (which times mostly copies: a head round looked free and drafted nearly every round); copying rounds
    cost prompt lookup's."""
    from speculant.engine import methods
    asked = []

    def cost_table(model, drafter, builder, signature, sampled=False):
        asked.append((type(drafter), signature, sampled))
        return CostTable({1: 1.0, 2: 1.1, 3: 1.2}, 0.5)
    monkeypatch.setattr(methods, "cost_table", cost_table)
    monkeypatch.setattr(methods, "lookup_costs", lambda model, spec: lambda sampled: (0.0, 0.0))
    gen = build_generator(small, method="eagle-lookup", num_speculations=2, draft_head=head_dir, speculation="cost")
    gen.costs_for(SamplingConfig(temperature=1.0))
    head = type(gen.drafter.head_drafter)
    assert not issubclass(head, LookupMixin) and isinstance(gen.drafter, head)
    assert asked == [(head, f"eagle,draft_head={head_dir}", False), (head, f"eagle,draft_head={head_dir}", True)]
