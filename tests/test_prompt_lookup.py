"""Prompt lookup's n-gram index (speculant/drafters/prompt_lookup.py): the same continuation as the reference scan
(:func:`find_continuation`) at every length of a growing token list, the matched n-gram's size as its round
context, and sparse point-mass drafts under sampling."""

from __future__ import annotations

import random

import pytest
from helpers import tiny_model

from speculant import GenerationConfig, SamplingConfig, build_generator
from speculant.drafters.prompt_lookup import NgramIndex, find_continuation
from speculant.errors import SpeculantError


@pytest.mark.parametrize("max_ngram,min_ngram,vocab", [(3, 1, 5), (5, 2, 3), (1, 1, 4), (4, 4, 2)])
def test_index_matches_the_reference_scan_as_the_list_grows(max_ngram, min_ngram, vocab):
    rng = random.Random(max_ngram * 10 + vocab)
    tokens = [rng.randrange(vocab) for _ in range(2)]
    index = NgramIndex(max_ngram, min_ngram)
    found = 0
    for _ in range(200):
        for length in (1, 4):
            n, cont = index.match(tokens, length)
            assert cont == find_continuation(tokens, max_ngram, min_ngram, length)
            if cont:            # n is the longest size that matches, and no longer one does
                assert find_continuation(tokens, n, n, length) == cont
                assert n == max_ngram or find_continuation(tokens, max_ngram, n + 1, length) == []
                found += 1
            else:
                assert n == 0
        tokens.extend(rng.randrange(vocab) for _ in range(rng.randrange(1, 4)))
    assert found > 100


def test_index_starts_over_when_the_list_is_cut():
    index = NgramIndex(3, 1)
    tokens = [1, 2, 3, 1, 2, 3, 4, 1, 2]
    assert index.match(tokens, 2) == (2, [3, 4])
    tokens = [5, 6, 5]
    assert index.match(tokens, 2) == (1, [6, 5])


def test_round_context_is_the_matched_size_and_outputs_equal_ar():
    model = tiny_model(seed=3, scale=2.5, vocab=96, hidden=64, heads=4, kv_heads=2, inter=128)
    prompt = [3, 17, 42, 8, 25, 60, 1, 3, 17, 42, 8]
    gen = build_generator(model, method="prompt-lookup", num_speculations=4, max_ngram=4)
    state = type("S", (), {"tokens": prompt, "drafter_state": gen.drafter.begin(None)})()
    assert gen.drafter.round_context(state) == 4
    state.tokens = prompt + [99]
    assert gen.drafter.round_context(state) == 0
    ar = build_generator(model, method="ar")
    config = GenerationConfig(max_new_tokens=30)
    out = gen.generate(prompt, config)
    assert out.token_ids == ar.generate(prompt, config).token_ids
    # rounds counted per matched size (--json's rounds_by_context): only matches draft; the counts add up
    by = out.stats.to_dict()["rounds_by_context"]
    assert set(by) <= {"no match"} | {f"n-gram {n}" for n in range(1, 5)} and out.stats.drafted_tokens > 0
    assert by.get("no match", {"drafted_tokens": 0})["drafted_tokens"] == 0
    assert sum(v["drafted_tokens"] for v in by.values()) == out.stats.drafted_tokens
    assert sum(v["accepted_tokens"] for v in by.values()) == out.stats.accepted_tokens
    # sampled: the point masses are kept sparse ([1] over the token id); the law is tests/test_sampling_engine.py's
    sampled = gen.generate(prompt, GenerationConfig(max_new_tokens=30, sampling=SamplingConfig(temperature=1.0,
                                                                                               seed=5)))
    assert len(sampled.token_ids) == 30 and sampled.stats.drafted_tokens > 0


def test_bad_ngram_sizes_are_refused():
    with pytest.raises(SpeculantError, match="min_ngram=0"):
        build_generator(tiny_model(), method="prompt-lookup", min_ngram=0)
