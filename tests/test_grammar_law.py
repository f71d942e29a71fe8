"""Issue 27: a tiny grammar's distribution under speculation.  With the regex ``[ab]{3}`` on a byte-level tiny model
the law of the three emitted tokens is the target's distribution masked to ``a``/``b`` at each position
(renormalised), computed here from the target alone; the engine's samples under a drafting method must follow it
(chi-square), and every sample matches the regex."""

from __future__ import annotations

import itertools

import pytest
import torch
from helpers import byte_tokenizer, on_fused_step, tiny_model
from stats_helpers import chi_square

from speculant import GenerationConfig, SamplingConfig, build_generator
from speculant.models.loading import LoadedModel
from speculant.sampling.grammar import compile_grammar

RUNS = 1_200


@pytest.fixture(scope="module")
def model():
    tok = byte_tokenizer()
    tiny = tiny_model(seed=2, scale=1.0, vocab=len(tok), layers=2, hidden=32, heads=2, kv_heads=1, inter=64,
                      eos=tok.eos_token_id)
    return on_fused_step(LoadedModel("tiny", tiny.decoder, tok, None))


@pytest.mark.parametrize("spec", [dict(method="draft-model", draft_model="truncated:1", num_speculations=2),
                                  dict(method="rsd-c", exit_layer=1, branching="2,2")], ids=["chain", "tree"])
def test_grammar_law_under_speculation(model, spec):
    tok = model.tokenizer
    a, b = tok.convert_tokens_to_ids("a"), tok.convert_tokens_to_ids("b")
    prompt = tok.encode("ab ba ab")
    grammar = compile_grammar("regex", "[ab]{3}", tok, vocab_size=model.config.vocab_size,
                              eos_token_ids=model.eos_token_ids)
    law = {}
    with torch.no_grad():
        for seq in itertools.product((a, b), repeat=3):
            p = 1.0
            for i in range(3):
                probs = torch.softmax(model.decoder(torch.tensor([prompt + list(seq[:i])]))[0, -1].float(), -1)
                p *= float(probs[seq[i]] / (probs[a] + probs[b]))
            law[seq] = p
    gen = build_generator(model, **spec)
    outs, drafted = [], 0
    for seed in range(RUNS):
        r = gen.generate(prompt, GenerationConfig(3, SamplingConfig(temperature=1.0, seed=seed), grammar=grammar))
        outs.append(tuple(r.token_ids))
        drafted += r.stats.drafted_tokens
    assert drafted > 0 and all(set(o) <= {a, b} for o in outs)
    stat, threshold = chi_square(outs, law)
    assert stat < threshold, (stat, threshold)
