"""Issue 27: penalties, logit bias, min-p, a grammar and logprobs are exact under every method.

The law of the first three emitted tokens under the controls is computed from the target alone (one forward
per prefix, the penalties written out from their definitions here), and the engine's samples are tested
against it (chi-square, as tests/test_sampling_engine.py); a variant that processes every verified row for the
committed prefix only (ignoring the drafted path) must fail the same test.
"""

import itertools

import pytest
import torch
from helpers import on_fused_step, tiny_model
from stats_helpers import chi_square

from speculant import GenerationConfig, SamplingConfig, build_generator
from speculant.engine import controlled
from speculant.engine.stats import GenerationStats
from speculant.sampling.processors import logits_to_probs
from speculant.runtime.executor import executor_of

RUNS = 2_000
PROMPT = [1, 2, 3, 1, 2]
CONTROLS = dict(temperature=1.3, top_k=3, min_p=0.05, repetition_penalty=1.8, frequency_penalty=1.5,
                presence_penalty=1.0, logit_bias={0: 1.0})
METHODS = {
    "early-exit": dict(method="early-exit", exit_layer=1, num_speculations=2),
    "draft-model": dict(method="draft-model", draft_model="truncated:1", num_speculations=3),
    "prompt-lookup": dict(method="prompt-lookup", num_speculations=2, max_ngram=2),
    "rsd-c": dict(method="rsd-c", exit_layer=1, branching="2,2"),
    "rsd-s": dict(method="rsd-s", exit_layer=1, beam_width=3, draft_length=2),
    "specinfer": dict(method="specinfer", draft_model="truncated:1", branching="2,2"),
}


@pytest.fixture(scope="module")
def model():
    """On the fused step where our kernels build (:func:`helpers.on_fused_step`); the reference law runs the same
    weights through the model's torch forward."""
    return on_fused_step(tiny_model(seed=5, scale=1.5, vocab=4, layers=2, hidden=32, heads=2, kv_heads=1, inter=64))


def reference_logits(logits, prompt, generated, cfg: SamplingConfig):
    """The controls from their definitions (OpenAI's penalties, HF's repetition penalty), one row."""
    out = logits.float().clone()
    for tok, b in (cfg.logit_bias or {}).items():
        out[tok] += b
    for tok in set(prompt) | set(generated):
        out[tok] = out[tok] / cfg.repetition_penalty if out[tok] > 0 else out[tok] * cfg.repetition_penalty
    for tok in set(generated):
        out[tok] -= cfg.frequency_penalty * generated.count(tok) + cfg.presence_penalty
    return out


def controlled_law(model, prompt, cfg, length=3):
    vocab = model.config.vocab_size
    law = {}
    with torch.no_grad():
        for seq in itertools.product(range(vocab), repeat=length):
            prob = 1.0
            for i in range(length):
                logits = model.decoder(torch.tensor([prompt + list(seq[:i])]))[0, -1]
                prob *= float(logits_to_probs(reference_logits(logits, prompt, list(seq[:i]), cfg), cfg)[seq[i]])
            law[seq] = prob
    return law


def sample(model, spec, runs=RUNS, **controls):
    gen = build_generator(model, **spec)
    outs, drafted = [], 0
    for seed in range(runs):
        cfg = GenerationConfig(max_new_tokens=3, sampling=SamplingConfig(seed=seed, **controls))
        stats = GenerationStats()
        outs.append(tuple(t for block in gen.generate_blocks(PROMPT, cfg, stats) for t in block))
        drafted += stats.drafted_tokens
    assert drafted > 0
    return outs


@pytest.fixture(scope="module")
def law(model):
    return controlled_law(model, PROMPT, SamplingConfig(**CONTROLS))


def test_reference_matches_plain_sampling_without_controls(model):
    """The reference is the plain law when every control is off (premise of the test below)."""
    cfg = SamplingConfig(temperature=1.3)
    logits = model.decoder(torch.tensor([PROMPT]))[0, -1]
    assert torch.equal(reference_logits(logits, PROMPT, [1, 1], cfg), logits.float())


@pytest.mark.parametrize("name", ["ar", *METHODS])
def test_emitted_law_with_controls_equals_target_law(model, law, name):
    spec = METHODS.get(name, dict(method="ar"))
    if name == "ar":
        gen = build_generator(model, method="ar")
        outs = [tuple(gen.generate(PROMPT, GenerationConfig(max_new_tokens=3, chat=False,
                                                             sampling=SamplingConfig(seed=s, **CONTROLS))).token_ids)
                for s in range(RUNS)]
    else:
        outs = sample(model, spec, **CONTROLS)
    stat, threshold = chi_square(outs, law)
    assert stat < threshold, (name, stat, threshold)


def test_penalty_from_committed_prefix_only_fails(model, law, monkeypatch):
    """Processing each verified row for the committed prefix only (the drafted path ignored) is caught."""
    monkeypatch.setattr(controlled, "entry_path", lambda tree, entry: ())
    stat, threshold = chi_square(sample(model, METHODS["early-exit"], **CONTROLS), law)
    assert stat > threshold, (stat, threshold)


GREEDY = dict(temperature=0.0, repetition_penalty=1.3, frequency_penalty=0.7, presence_penalty=0.4,
              logit_bias={4: 1.5, 7: -3.0})
GREEDY_METHODS = {"ar": dict(method="ar"), **METHODS,
                  "eagle-like-chain": dict(method="early-exit", exit_layer=1, num_speculations=4),
                  "rsd-c-wide": dict(method="rsd-c", exit_layer=1, branching="3,2,1")}


@pytest.fixture(scope="module")
def model16():
    return tiny_model(seed=3, scale=1.5, vocab=16, layers=2, hidden=32, heads=2, kv_heads=1, inter=64)


@pytest.fixture(scope="module")
def fused16():
    """model16 in ``w4a8``: every forward runs the fused step, whose rows are batch-invariant, so verification
    rows carry the one-token step's bits (the premise of bitwise logprobs)."""
    from speculant.kernels import build
    from speculant.runtime.formats import apply_weight_format
    if not build.available():
        pytest.skip(f"kernels: {build.unavailable_reason()}")
    m = tiny_model(seed=3, scale=1.5, vocab=16, layers=2, hidden=32, heads=2, kv_heads=1, inter=64)
    apply_weight_format(m.decoder, "w4a8")
    executor_of(m).fused_prompt_tokens = 64
    assert executor_of(m).fused_layers() is not None
    return m


def test_greedy_with_controls_identical_to_ar(model16):
    """fp32 tiny model (rows not batch-invariant to the last bit): tokens identical, logprobs within 1e-5."""
    prompt = [1, 2, 3, 1, 2, 3, 1, 2]
    cfg = GenerationConfig(max_new_tokens=24, sampling=SamplingConfig(**GREEDY), logprobs=3, min_tokens=4)
    ref = build_generator(model16, method="ar").generate(prompt, cfg)
    plain = build_generator(model16, method="ar").generate(prompt, GenerationConfig(max_new_tokens=24))
    assert ref.token_ids != plain.token_ids            # the controls change the output (premise)
    for name, spec in GREEDY_METHODS.items():
        out = build_generator(model16, **spec).generate(prompt, cfg)
        assert out.token_ids == ref.token_ids, name
        assert max(abs(a.logprob - b.logprob) for a, b in zip(out.logprobs, ref.logprobs)) < 1e-5, name


def test_greedy_with_controls_identical_to_ar_and_logprobs_bitwise(fused16):
    model16 = fused16
    prompt = [1, 2, 3, 1, 2, 3, 1, 2]
    cfg = GenerationConfig(max_new_tokens=24, sampling=SamplingConfig(**GREEDY), logprobs=3, min_tokens=4)
    ref = build_generator(model16, method="ar").generate(prompt, cfg)
    plain = build_generator(model16, method="ar").generate(prompt, GenerationConfig(max_new_tokens=24))
    assert ref.token_ids != plain.token_ids            # the controls change the output (premise)
    assert len(ref.logprobs) == len(ref.token_ids)
    for name, spec in GREEDY_METHODS.items():
        out = build_generator(model16, **spec).generate(prompt, cfg)
        assert out.token_ids == ref.token_ids, name
        assert [(lp.token_id, lp.logprob, lp.top) for lp in out.logprobs] == \
               [(lp.token_id, lp.logprob, lp.top) for lp in ref.logprobs], name


def test_logprobs_are_the_raw_distribution(model16):
    prompt = [1, 2, 3]
    out = build_generator(model16, method="ar").generate(prompt, GenerationConfig(max_new_tokens=1, logprobs=2))
    logp = torch.log_softmax(model16.decoder(torch.tensor([prompt]))[0, -1].float(), -1)
    lp = out.logprobs[0]
    assert lp.token_id == out.token_ids[0] == int(logp.argmax())
    assert abs(lp.logprob - float(logp.max())) < 1e-5
    assert [t for t, _ in lp.top] == torch.topk(logp, 2).indices.tolist()
    assert "logprobs" in out.to_dict()


def test_generate_n_shares_prefill_and_sample_zero_is_generate(model16):
    gen = build_generator(model16, method="early-exit", exit_layer=1, num_speculations=3)
    cfg = GenerationConfig(max_new_tokens=10, sampling=SamplingConfig(temperature=1.0, seed=11,
                                                                      presence_penalty=0.5))
    outs = gen.generate_n([1, 2, 3, 1, 2], cfg, 4)
    assert len(outs) == 4
    assert outs[0].token_ids == gen.generate([1, 2, 3, 1, 2], cfg).token_ids
    import dataclasses
    third = dataclasses.replace(cfg, sampling=dataclasses.replace(cfg.sampling, seed=13))
    assert outs[2].token_ids == gen.generate([1, 2, 3, 1, 2], third).token_ids
    assert len({tuple(o.token_ids) for o in outs}) > 1


def test_stop_token_ids_min_tokens_ignore_eos(model16):
    gen = build_generator(model16, method="prompt-lookup", num_speculations=3)
    prompt = [1, 2, 3, 1, 2, 3, 1, 2]
    free = gen.generate(prompt, GenerationConfig(max_new_tokens=16))
    stop = free.token_ids[2]
    cut = gen.generate(prompt, GenerationConfig(max_new_tokens=16, stop_token_ids=[stop]))
    assert cut.token_ids == free.token_ids[:free.token_ids.index(stop) + 1] and cut.stop_reason == "stop"
    late = gen.generate(prompt, GenerationConfig(max_new_tokens=16, stop_token_ids=[stop], min_tokens=8))
    assert stop not in late.token_ids[:8]
    ar = build_generator(model16, method="ar").generate(
        prompt, GenerationConfig(max_new_tokens=16, stop_token_ids=[stop], min_tokens=8))
    assert late.token_ids == ar.token_ids


@pytest.mark.parametrize("bad", [dict(repetition_penalty=0.0), dict(frequency_penalty=2.5),
                                 dict(presence_penalty=float("nan")), dict(min_p=1.5),
                                 dict(logit_bias={1: 101}), dict(logit_bias={"x": 1}), dict(seed=10 ** 30)])
def test_bad_sampling_values_are_one_line_errors(bad):
    from speculant import SpeculantError
    with pytest.raises(SpeculantError) as e:
        SamplingConfig(**bad)
    assert "\n" not in str(e.value) and "allowed" in str(e.value)


@pytest.mark.parametrize("bad", [dict(logprobs=21), dict(logprobs=-1), dict(min_tokens=200),
                                 dict(stop_token_ids=[-1]), dict(ignore_eos="yes")])
def test_bad_generation_values_are_one_line_errors(bad):
    from speculant import SpeculantError
    with pytest.raises(SpeculantError) as e:
        GenerationConfig(max_new_tokens=100, **bad)
    assert "\n" not in str(e.value) and "allowed" in str(e.value)


def test_out_of_vocabulary_bias_is_refused(model16):
    from speculant import SpeculantError
    with pytest.raises(SpeculantError, match="logit_bias token id 99"):
        build_generator(model16, method="ar").generate([1, 2], GenerationConfig(
            max_new_tokens=2, sampling=SamplingConfig(logit_bias={99: 1.0})))


def test_stop_string_cut_uncounts_accepted_tokens():
    stats = GenerationStats()
    stats.record_round(8, 8, 8)
    stats.cut_last_round(4)
    assert stats.accepted_tokens == 4 and stats.accepted_at_depth == [1, 1, 1, 1, 0, 0, 0, 0]
