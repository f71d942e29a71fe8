"""End-to-end sampling exactness: every drafter through the real engine on a tiny-vocabulary Llama.

5 000 seeded generations of 3 tokens per method (each generation is a full
engine call: prefill, drafting, one target verification, cache commit); the
acceptance rules themselves are checked with 100 000 samples in
test_sampling_rules.py.  The first token comes from
prefill, tokens 2-3 from the first speculative round, so the joint law of the
three tokens checks the drafter + acceptance rule + cache commit.  The exact
law is computed by running the target on every prefix.  Logits processing
(temperature 1.3, top-k 3 of 4) is applied to draft and target alike.
Every method runs on the fused C step (the tiny model in w4a8, the route real models decode on); a chain and a tree
also run on the torch step.
"""


import pytest
from helpers import on_fused_step, tiny_model
from stats_helpers import chi_square, exact_law

from speculant import GenerationConfig, SamplingConfig, build_generator
from speculant.engine.stats import GenerationStats
from speculant.verification import rules

RUNS = 5_000
PROMPT = [1, 2, 3, 1, 2]           # repeats, so prompt lookup finds n-gram drafts
SAMPLING = dict(temperature=1.3, top_k=3)


def tiny():
    return tiny_model(seed=5, scale=1.5, vocab=4, layers=2, hidden=32, heads=2, kv_heads=1, inter=64)


@pytest.fixture(scope="module")
def model():
    """The tiny model on the fused step where our kernels build (:func:`helpers.on_fused_step`);
    :func:`test_torch_step_emits_the_target_law` holds the torch step to the same law."""
    return on_fused_step(tiny())


@pytest.fixture(scope="module")
def law(model):
    """The law of the model's own weights (w4a8 where it runs the fused step)."""
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
    """Resampling from the target after a rejection (ignoring the residual) is caught by the same test: in the
    rule for trees (:func:`rules.residual`) and for a chain's nodes (:func:`rules.sample_residual`, the C kernels'
    draw where they run)."""
    monkeypatch.setattr(rules, "residual", lambda r, q: r)
    target_only = rules.sample_residual
    monkeypatch.setattr(rules, "sample_residual", lambda p, q, ids, g: target_only(p, None, None, g))
    stat, threshold = chi_square(sample(model, METHODS["early-exit"]), law)
    assert stat > threshold, (stat, threshold)


@pytest.fixture(scope="module")
def torch_model():
    """The same tiny model in float32: its forwards run the torch step (speculant/runtime/steps.py)."""
    return tiny()


@pytest.mark.parametrize("name", ["early-exit", "rsd-s"])
def test_torch_step_emits_the_target_law(torch_model, name):
    """A chain resuming at its exit layer and a tree, drafted and verified through the torch step, against the law
    of the same float32 target."""
    stat, threshold = chi_square(sample(torch_model, METHODS[name]), exact_law(torch_model, PROMPT,
                                                                                 SamplingConfig(**SAMPLING)))
    assert stat < threshold, (name, stat, threshold)
