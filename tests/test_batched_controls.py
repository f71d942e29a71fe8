"""Issue 27 in the batched path (the server's): sequences with different controls in one batch each give what the
one-sequence generator gives with the same config (tokens and logprobs bit for bit), under speculative methods; and
``start_n`` gives ``generate_n``'s samples."""

from __future__ import annotations

import pytest
from helpers import tiny_model

from speculant import GenerationConfig, SamplingConfig, build_generator
from speculant.engine.batch import BatchedGenerator
from speculant.models.loading import save_hf_dir
from speculant.runtime.loader import load_model

PROMPTS = [[1, 2, 3, 1, 2, 3, 1, 2], [5, 6, 7, 5, 6], [9, 9, 9, 4]]
SPECS = {"ar": dict(method="ar"), "draft-model": dict(method="draft-model", draft_model="truncated:1",
                                                     num_speculations=3, speculation="always"),
         "prompt-lookup": dict(method="prompt-lookup", num_speculations=3, max_ngram=2,
                                         speculation="always")}


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    tiny = tiny_model(seed=11, scale=2.5, vocab=64, layers=2, ctx=256)
    return load_model(str(save_hf_dir(tiny, tmp_path_factory.mktemp("batched_controls"))), weights="int8",
                      compile=False)


def configs():
    return [GenerationConfig(16, SamplingConfig(frequency_penalty=1.5, presence_penalty=0.5, logit_bias={7: 2.0}),
                             logprobs=2, chat=False),
            GenerationConfig(16, SamplingConfig(temperature=1.0, seed=3, repetition_penalty=1.5, min_p=0.05),
                             logprobs=0, min_tokens=4, stop_token_ids=(11,), chat=False),
            GenerationConfig(16, SamplingConfig(), logprobs=1, chat=False)]


def drive(batched, seqs) -> list[list[int]]:
    outs = [list(s.last_block) for s in seqs]
    while running := [i for i, s in enumerate(seqs) if s.finished is None]:
        batched.step([seqs[i] for i in running])
        for i in running:
            outs[i] += seqs[i].last_block
    return outs


@pytest.mark.parametrize("name", list(SPECS))
def test_mixed_controls_in_one_batch_equal_each_alone(model, name):
    gen = build_generator(model, **SPECS[name])
    batched = BatchedGenerator(model, gen.drafter, gen.builder)
    seqs = batched.start_many(list(zip(PROMPTS, configs())))
    outs = drive(batched, seqs)
    drafted = 0
    for prompt, cfg, seq, out in zip(PROMPTS, configs(), seqs, outs):
        alone = gen.generate(prompt, cfg)
        assert out == alone.token_ids
        assert [(t.token_id, t.logprob, t.top) for t in seq.logprobs] == \
            [(t.token_id, t.logprob, t.top) for t in alone.logprobs]
        drafted += seq.stats.drafted_tokens
    assert name == "ar" or drafted > 0
    plain = build_generator(model, method="ar").generate(PROMPTS[0], GenerationConfig(16, chat=False))
    assert outs[0] != plain.token_ids                       # the penalties did something


def test_start_n_gives_generate_n(model):
    gen = build_generator(model, **SPECS["draft-model"])
    cfg = GenerationConfig(12, SamplingConfig(temperature=1.0, seed=8, frequency_penalty=0.5), chat=False)
    batched = BatchedGenerator(model, gen.drafter, gen.builder)
    outs = drive(batched, batched.start_n(PROMPTS[0], cfg, 4))
    assert outs == [r.token_ids for r in gen.generate_n(PROMPTS[0], cfg, 4)]
    assert len({tuple(o) for o in outs}) > 1
