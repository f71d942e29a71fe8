"""A generation depends on its prompt, config and seed only (issue 13, sections 1, 2 and the stats of 6).

* State across calls: the same call gives the same output whatever the generator did before, for every
  method, drafter and tree builder.
* Torch state: the caller's torch mode between streamed pieces is its own; generations on one model
  interleaved in any order each give what they give alone (tokens, text and stats; these models have no cost
  table: with one, a greedy generation's rounds follow its generator's acceptance history, never its tokens).
"""

import random

import pytest
import torch
from helpers import tiny_model

from speculant import GenerationConfig, SamplingConfig, build_generator
from speculant.drafters.draft_model import DraftModelDrafter
from speculant.engine.generator import SpeculativeGenerator
from speculant.engine.stats import GenerationStats
from speculant.trees.builders import ChainBuilder

# every drafter (none, early exit, draft model, prompt lookup) x every builder (chain, adaptive chain,
# RSD-C, RSD-S, SpecInfer i.i.d.)
ALL_METHODS = {
    "ar": dict(method="ar"),
    "early-exit": dict(method="early-exit", exit_layer=2, num_speculations=3),
    "early-exit-auto": dict(method="early-exit", exit_layer=2, num_speculations="auto"),
    "early-exit-auto-default-E": dict(method="early-exit", num_speculations="auto"),
    "draft-model": dict(method="draft-model", draft_model="truncated:2", num_speculations=3),
    "draft-model-auto": dict(method="draft-model", draft_model="truncated:1", num_speculations="auto"),
    "prompt-lookup": dict(method="prompt-lookup", num_speculations=3),
    "rsd-c": dict(method="rsd-c", exit_layer=2, branching="2,2"),
    "rsd-c-draft": dict(method="rsd-c", draft_model="truncated:1", branching="2,1,2"),
    "rsd-s": dict(method="rsd-s", exit_layer=1, beam_width=3, draft_length=3),
    "rsd-s-draft": dict(method="rsd-s", draft_model="truncated:2", beam_width=2, draft_length=3),
    "specinfer": dict(method="specinfer", exit_layer=2, branching="2,2"),
    "specinfer-draft": dict(method="specinfer", draft_model="truncated:1", branching="3,1"),
}
PROMPT = [3, 17, 42, 8, 3, 17]
OTHER_PROMPT = [9, 9, 1, 50, 2]


@pytest.fixture(scope="module")
def model():
    return tiny_model(seed=11, scale=1.5, vocab=64, layers=4)


def config(seed, temperature=1.0, max_new=40):
    return GenerationConfig(max_new_tokens=max_new, sampling=SamplingConfig(temperature=temperature, seed=seed))


@pytest.mark.parametrize("temperature", [0.0, 1.0])
@pytest.mark.parametrize("name", ALL_METHODS)
def test_same_call_same_output_whatever_ran_before(model, name, temperature):
    """The issue's case (early-exit, num_speculations='auto', T=1, seed 123, three calls) for every method,
    with another prompt and seed run in between, against a fresh generator."""
    gen = build_generator(model, **ALL_METHODS[name])
    first = gen.generate(PROMPT, config(123, temperature)).token_ids
    assert gen.generate(PROMPT, config(123, temperature)).token_ids == first
    gen.generate(OTHER_PROMPT, config(7, temperature, max_new=25))
    assert gen.generate(PROMPT, config(123, temperature)).token_ids == first
    assert build_generator(model, **ALL_METHODS[name]).generate(PROMPT, config(123, temperature)).token_ids == first


def test_adaptive_threshold_restarts_each_call(model):
    """ChainBuilder(adaptive=True): the threshold moves during a call and starts from its initial value
    in the next one; the generator's builder is never changed."""
    gen = build_generator(model, **ALL_METHODS["early-exit-auto"])
    builder = gen.builder
    assert isinstance(builder, ChainBuilder) and builder.adaptive
    seen = []
    real_observe = ChainBuilder.observe

    def observe(self, accepted, depth):
        real_observe(self, accepted, depth)
        seen.append((self, self.current_threshold))       # the object itself: its id stays unique while kept
    ChainBuilder.observe = observe
    try:
        gen.generate(PROMPT, config(123))
        gen.generate(PROMPT, config(123))
    finally:
        ChainBuilder.observe = real_observe
    assert len({t for _, t in seen}) > 1                  # it did adapt
    assert builder.current_threshold == builder.threshold == 0.4
    copies = {id(b): b for b, _ in seen}
    assert id(builder) not in copies and len(copies) == 2      # one fresh copy per call


# ---------------------------------------------------------------- torch state and interleaving
def test_stream_leaves_the_callers_torch_state_alone(model):
    for name in ("ar", "early-exit", "draft-model", "rsd-s-draft"):
        gen = build_generator(model, **ALL_METHODS[name])
        w = torch.ones(3, requires_grad=True)
        pieces = 0
        for _piece in gen.stream(PROMPT, config(1, max_new=12)):
            assert not torch.is_inference_mode_enabled() and torch.is_grad_enabled()
            (w * 2.0).sum().backward()                       # a backward pass in the loop body works
            pieces += 1
            if pieces == 3:
                break
        assert not torch.is_inference_mode_enabled()       # after break, before the stream is collected
        assert w.grad is not None and float(w.grad[0]) == 2.0 * pieces


def test_issue_case_two_streams_on_one_model(model):
    """Start stream A (4 tokens) and B (30 tokens), one piece of each, finish A, then resume B."""
    a, b = build_generator(model, method="ar"), build_generator(model, method="ar")
    alone = build_generator(model, method="ar").generate([1, 2, 3], GenerationConfig(max_new_tokens=30)).text
    sa = a.stream([4, 5, 6], GenerationConfig(max_new_tokens=4))
    sb = b.stream([1, 2, 3], GenerationConfig(max_new_tokens=30))
    next(sa)
    pieces_b = [next(sb)]
    list(sa)
    pieces_b += list(sb)
    assert "".join(pieces_b) == alone


def _blocks(gen, prompt, cfg):
    stats = GenerationStats()
    return gen.generate_blocks(prompt, cfg, stats), stats


def _comparable(stats):
    d = stats.to_dict()
    for k in ("seconds", "tokens_per_second", "time_to_first_token_s", "draft_seconds", "first_draft_seconds",
              "accept_seconds"):
        d.pop(k)
    return d


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_interleaved_generations_each_give_what_they_give_alone(model, temperature):
    """Every method, two generators per method plus a second stream of one of them (same generator), all on
    one model, advanced one block at a time in a random order: tokens and stats equal each run alone."""
    runs = []
    for i, (name, spec) in enumerate(ALL_METHODS.items()):
        gen = build_generator(model, **spec)
        runs.append((gen, PROMPT, config(100 + i, temperature, max_new=20)))
        runs.append((gen, OTHER_PROMPT, config(200 + i, temperature, max_new=15)))
        runs.append((build_generator(model, **spec), [5, 6, 7, 5, 6], config(300 + i, temperature, max_new=18)))
    alone = []
    for gen, prompt, cfg in runs:
        it, stats = _blocks(gen, prompt, cfg)
        alone.append(([t for b in it for t in b], _comparable(stats)))
    live = [(_blocks(gen, prompt, cfg), []) for gen, prompt, cfg in runs]
    order = random.Random(temperature).sample(range(len(live)), len(live))
    while order:
        i = order[random.Random(len(order)).randrange(len(order))]
        (it, _stats), out = live[i]
        block = next(it, None)
        if block is None:
            order.remove(i)
        else:
            out.extend(block)
    for ((_, stats), out), (want, want_stats), run in zip(live, alone, runs):
        assert out == want, run[2]
        assert _comparable(stats) == want_stats


@pytest.mark.parametrize("name", ["rsd-s", "rsd-s-draft", "draft-model-auto"])
def test_interleaved_text_streams_of_one_generator(model, name):
    """Three streams of one generator: one piece of each, the first one to the end, then the others in turn."""
    gen = build_generator(model, **ALL_METHODS[name])
    runs = ((PROMPT, 1), (OTHER_PROMPT, 2), (PROMPT, 3))
    want = [gen.generate(p, config(s)).text for p, s in runs]
    streams = [gen.stream(p, config(s)) for p, s in runs]
    texts = [next(s) for s in streams]
    texts[0] += "".join(streams[0])
    active = [1, 2]
    step = 0
    while active:
        i = active[step % len(active)]
        step += 1
        piece = next(streams[i], None)
        if piece is None:
            active.remove(i)
        else:
            texts[i] += piece
    assert texts == want


# ---------------------------------------------------------------- stats and results
def test_accepted_tokens_stop_at_an_eos_inside_the_block():
    """A drafter that is always right (the target itself) and an EOS in the middle of an accepted block:
    only the emitted drafted tokens count as accepted."""
    base = tiny_model(seed=11, scale=2.5, vocab=64, layers=4)
    ar = build_generator(base, method="ar").generate(PROMPT, GenerationConfig(max_new_tokens=12)).token_ids
    step = next(i for i in range(2, len(ar)) if ar[i] not in ar[:i])
    model = tiny_model(seed=11, scale=2.5, vocab=64, layers=4, eos=ar[step])
    gen = SpeculativeGenerator(model, DraftModelDrafter(model.decoder), ChainBuilder(8))
    res = gen.generate(PROMPT, GenerationConfig(max_new_tokens=40))
    assert res.token_ids == ar[:step + 1] and res.stop_reason == "eos"
    s = res.stats
    assert s.rounds == 1 and s.drafted_tokens == 8
    assert s.accepted_tokens == step == s.new_tokens - 1          # not the 8 accepted by the rule
    assert s.accepted_at_depth == [1] * step + [0] * (8 - step)


def test_last_result_of_an_abandoned_stream(model):
    gen = build_generator(model, method="early-exit", exit_layer=2)
    gen.generate(PROMPT, config(1))
    full = build_generator(model, method="early-exit", exit_layer=2).generate(OTHER_PROMPT, config(2))
    stream = gen.stream(OTHER_PROMPT, config(2))
    first = next(stream)
    assert gen.last_result is None                     # not the previous call's result
    stream.close()
    part = gen.last_result
    assert part.stop_reason == "abandoned"
    assert part.token_ids == full.token_ids[:len(part.token_ids)] and part.text.startswith(first)
    assert part.stats.new_tokens == len(part.token_ids)
