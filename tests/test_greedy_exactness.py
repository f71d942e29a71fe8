"""Greedy speculative decoding is token-identical to autoregressive decoding, for every method."""

import pytest
from helpers import tiny_model

from speculant import GenerationConfig, build_generator
from speculant.engine.stats import GenerationStats

PROMPTS = {
    "varied": [3, 17, 42, 8, 25, 60, 1, 33, 12],
    "one-token": [5],
    "repetitive": [7, 8, 9, 10] * 6,
}

CHAIN_METHODS = [
    dict(method="early-exit", exit_layer=2),
    dict(method="early-exit", exit_layer=1),
    dict(method="draft-model", draft_model="truncated:2"),
    dict(method="prompt-lookup", max_ngram=3),
]
TREE_METHODS = [
    dict(method="rsd-c", exit_layer=2, branching="3,2,1"),
    dict(method="rsd-c", draft_model="truncated:1", branching="2,2,2,2"),
    dict(method="rsd-s", exit_layer=2, beam_width=3, draft_length=4),
    dict(method="rsd-s", draft_model="truncated:3", beam_width=4, draft_length=3),
    dict(method="specinfer", exit_layer=3, branching="2,2"),
    dict(method="early-exit", exit_layer=2, num_speculations="auto"),
]


@pytest.fixture(scope="module")
def model():
    # scale 2.5 gives peaked but not degenerate distributions: outputs vary and drafts are often right
    return tiny_model(seed=11, scale=2.5, vocab=64, layers=4)


def run(model, prompt, max_new=40, **kw):
    gen = build_generator(model, **kw)
    stats = GenerationStats()
    out = [t for block in gen.generate_blocks(prompt, GenerationConfig(max_new_tokens=max_new), stats) for t in block]
    return out, stats


@pytest.mark.parametrize("prompt", PROMPTS)
@pytest.mark.parametrize("k", range(1, 9))
@pytest.mark.parametrize("spec", CHAIN_METHODS, ids=lambda s: "-".join(map(str, s.values())))
def test_chain_methods_match_ar(model, spec, k, prompt):
    ar, _ = run(model, PROMPTS[prompt], method="ar")
    out, stats = run(model, PROMPTS[prompt], num_speculations=k, **spec)
    assert out == ar
    assert stats.new_tokens == len(out) == 40
    assert stats.accepted_tokens <= stats.drafted_tokens


@pytest.mark.parametrize("prompt", PROMPTS)
@pytest.mark.parametrize("spec", TREE_METHODS, ids=lambda s: "-".join(map(str, s.values())))
def test_tree_methods_match_ar(model, spec, prompt):
    ar, _ = run(model, PROMPTS[prompt], method="ar")
    out, stats = run(model, PROMPTS[prompt], **spec)
    assert out == ar
    assert stats.drafted_tokens > 0


def test_outputs_are_not_trivial(model):
    """Guard against a degenerate test model: AR output varies and drafts get accepted sometimes."""
    ar, _ = run(model, PROMPTS["varied"], method="ar")
    assert len(set(ar)) >= 5
    _, stats = run(model, PROMPTS["varied"], method="early-exit", exit_layer=3, num_speculations=4)
    assert 0 < stats.accepted_tokens < stats.drafted_tokens


@pytest.mark.parametrize("spec", CHAIN_METHODS + TREE_METHODS[:3], ids=lambda s: "-".join(map(str, s.values())))
def test_eos_mid_block_stops_exactly(spec):
    """With EOS = a token AR emits at step s, every method stops at exactly step s and counts it right."""
    base = tiny_model(seed=11, scale=2.5, vocab=64, layers=4)
    ar, _ = run(base, PROMPTS["varied"], method="ar")
    step = next(i for i in range(6, len(ar)) if ar[i] not in ar[:i])   # first occurrence, mid-stream
    eos_model = tiny_model(seed=11, scale=2.5, vocab=64, layers=4, eos=ar[step])
    ar_eos, _ = run(eos_model, PROMPTS["varied"], method="ar")
    assert ar_eos == ar[:step + 1]
    k = {} if spec["method"] in ("rsd-c", "rsd-s", "specinfer") else {"num_speculations": 6}  # trees have no K
    out, stats = run(eos_model, PROMPTS["varied"], **k, **spec)
    assert out == ar_eos
    assert stats.new_tokens == len(out)


@pytest.mark.parametrize("max_new", [1, 2, 3, 7])
def test_max_new_tokens_never_exceeded(model, max_new):
    for spec in (dict(method="early-exit", exit_layer=3, num_speculations=8),
                 dict(method="rsd-c", exit_layer=3, branching="2,2,2,2,2")):
        out, stats = run(model, PROMPTS["repetitive"], max_new=max_new, **spec)
        ar, _ = run(model, PROMPTS["repetitive"], max_new=max_new, method="ar")
        assert out == ar and len(out) == max_new == stats.new_tokens


@pytest.mark.parametrize("spec", [dict(method="early-exit", exit_layer=2, num_speculations=4),
                                  dict(method="rsd-s", exit_layer=2, beam_width=3, draft_length=3),
                                  dict(method="rsd-c", exit_layer=1, branching="3,2")])
def test_early_exit_each_layer_processes_each_token_once(model, spec):
    """Shared KV + exit-query cache: every layer processed exactly the prompt and each verified block entry once."""
    prompt = PROMPTS["varied"]
    out, stats = run(model, prompt, **spec)
    assert out == run(model, prompt, method="ar")[0]
    expected = len(prompt) + stats.rounds + stats.drafted_tokens    # prefill + (root + nodes) per round
    assert stats.layer_token_evaluations == [expected] * model.config.num_hidden_layers


def test_cache_never_overflows_near_context_end():
    small = tiny_model(seed=11, scale=2.5, vocab=64, layers=4, ctx=40)
    prompt = PROMPTS["varied"] * 3                                    # 27 tokens of a 40-token context
    ar, _ = run(small, prompt, max_new=100, method="ar")
    out, _ = run(small, prompt, max_new=100, method="rsd-c", exit_layer=2, branching="4,4,4")
    assert out == ar and len(ar) == 40 - len(prompt)
