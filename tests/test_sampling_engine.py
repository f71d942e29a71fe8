"""End-to-end sampling exactness: every drafter through the real engine on a tiny-vocabulary Llama.

5 000 seeded generations of 3 tokens per method (each generation is a full
engine call: prefill, drafting, one target verification, cache commit); the
acceptance rules themselves are checked with 100 000 samples in
test_sampling_rules.py.  The first token comes from
prefill, tokens 2-3 from the first speculative round, so the joint law of the
three tokens checks the drafter + acceptance rule + cache commit.  The exact
law is computed by running the target on every prefix.  Logits processing
(temperature 1.3, top-k 3 of 4) is applied to draft and target alike.
"""


import pytest
from helpers import tiny_model
from stats_helpers import chi_square, exact_law

from speculant import GenerationConfig, SamplingConfig, build_generator
from speculant.engine.stats import GenerationStats
from speculant.verification import rules
from speculant.runtime.executor import executor_of

RUNS = 5_000
PROMPT = [1, 2, 3, 1, 2]           # repeats, so prompt lookup finds n-gram drafts
SAMPLING = dict(temperature=1.3, top_k=3)


@pytest.fixture(scope="module")
def model():
    return tiny_model(seed=5, scale=1.5, vocab=4, layers=2, hidden=32, heads=2, kv_heads=1, inter=64)


@pytest.fixture(scope="module")
def law(model):
    return exact_law(model, PROMPT, SamplingConfig(**SAMPLING))


def sample(model, spec, runs=RUNS):
    gen = build_generator(model, **spec)
    outs, drafted = [], 0
    for seed in range(runs):
        cfg = GenerationConfig(max_new_tokens=3, sampling=SamplingConfig(seed=seed, **SAMPLING))
        stats = GenerationStats()
        toks = [t for block in gen.generate_blocks(PROMPT, cfg, stats) for t in block]
        drafted += stats.drafted_tokens
        outs.append(tuple(toks))
    assert drafted > 0
    return outs


METHODS = {
    "early-exit": dict(method="early-exit", exit_layer=1, num_speculations=2),
    "early-exit-adaptive": dict(method="early-exit", exit_layer=1, num_speculations="auto"),
    "draft-model": dict(method="draft-model", draft_model="truncated:1", num_speculations=3),
    "prompt-lookup": dict(method="prompt-lookup", num_speculations=2, max_ngram=2),
    "rsd-c": dict(method="rsd-c", exit_layer=1, branching="2,2"),
    "rsd-s": dict(method="rsd-s", exit_layer=1, beam_width=3, draft_length=2),
    "specinfer": dict(method="specinfer", draft_model="truncated:1", branching="2,2"),
}


@pytest.mark.parametrize("name", METHODS)
def test_emitted_law_equals_target_law(model, law, name):
    stat, threshold = chi_square(sample(model, METHODS[name]), law)
    assert stat < threshold, (name, stat, threshold)


def test_broken_rule_fails(model, law, monkeypatch):
    """Resampling from the target after a rejection (ignoring the residual) is caught by the same test."""
    monkeypatch.setattr(rules, "residual", lambda r, q: r)
    stat, threshold = chi_square(sample(model, METHODS["early-exit"]), law)
    assert stat > threshold, (stat, threshold)


@pytest.fixture(scope="module")
def fused_model():
    """The same tiny model in ``w4a8``: its cached forwards run the fused step (speculant/kernels/decode_step.c)."""
    from speculant.kernels import build
    from speculant.runtime.formats import apply_weight_format
    if not build.available():
        pytest.skip(f"kernels: {build.unavailable_reason()}")
    m = tiny_model(seed=5, scale=1.5, vocab=4, layers=2, hidden=32, heads=2, kv_heads=1, inter=64)
    apply_weight_format(m.decoder, "w4a8")
    executor_of(m).fused_prompt_tokens = 64          # the prompt's forward through the fused step as well
    assert executor_of(m).fused_layers() is not None
    return m


@pytest.mark.parametrize("name", ["early-exit", "rsd-s"])
def test_fused_step_emits_the_target_law(fused_model, name):
    """A chain resuming at its exit layer and a tree, drafted and verified through the fused step, against the law
    of the same w4a8 target."""
    stat, threshold = chi_square(sample(fused_model, METHODS[name]), exact_law(fused_model, PROMPT,
                                                                                 SamplingConfig(**SAMPLING)))
    assert stat < threshold, (name, stat, threshold)
