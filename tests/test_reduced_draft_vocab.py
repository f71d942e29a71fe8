"""Drafting over a reduced draft vocabulary (an exit adapter's ``V'`` tokens) through the real engine.

The drafter hands ``(logits [F, V'], vocab_ids [V'])``; the tree builders sample columns of ``V'``, mapped to token
ids after, and the tree keeps ``q [V']`` until the acceptance rule reads a row (:meth:`DraftTree.draft_row`).
Sampling: the joint law of 3 emitted tokens equals the target's (chi-square, as tests/test_sampling_engine.py), and
a draft row expanded onto the wrong token ids fails the same test.  Greedy: the output equals ``ar``'s.
"""

import pytest
import torch
from helpers import on_fused_step, tiny_model
from stats_helpers import chi_square, exact_law

from speculant import GenerationConfig, SamplingConfig, build_generator
from speculant.drafters.base import full_vocab_logits
from speculant.drafters.early_exit import EarlyExitDrafter
from speculant.trees.tree import DraftTree

RUNS = 1_500
PROMPT = [1, 2, 3, 1, 2]
SAMPLING = dict(temperature=1.3, top_k=3)
VOCAB = 4
IDS = [3, 0, 2]                     # unsorted; token 1 is never drafted


class ReducedHead:
    """An exit head over ``IDS`` only: the shared final norm and LM head's rows, scaled (a draft unlike the target)."""

    def __init__(self, decoder):
        self.decoder = decoder
        self.ids = torch.tensor(IDS)

    def reduced(self, h):
        return self.decoder.lm_head(self.decoder.final_norm(h))[..., self.ids].float() * 0.6, self.ids

    def __call__(self, h):
        return full_vocab_logits(*self.reduced(h), VOCAB)


@pytest.fixture(scope="module")
def model():
    return on_fused_step(tiny_model(seed=5, scale=1.5, vocab=VOCAB, layers=2, hidden=32, heads=2, kv_heads=1,
                                    inter=64))


def generator(model, **spec):
    gen = build_generator(model, exit_layer=1, **spec)
    gen.drafter = EarlyExitDrafter(model.decoder.num_layers, 1, ReducedHead(model.decoder))
    return gen


SPECS = {"rsd-c": dict(method="rsd-c", branching="2,2"),
         "rsd-s": dict(method="rsd-s", beam_width=2, draft_length=2),
         "specinfer": dict(method="specinfer", branching="2,1")}


def sample(gen, runs=RUNS):
    outs = []
    for seed in range(runs):
        cfg = GenerationConfig(max_new_tokens=3, sampling=SamplingConfig(seed=seed, **SAMPLING))
        res = gen.generate(PROMPT, cfg)
        assert res.stats.drafted_tokens > 0
        outs.append(tuple(res.token_ids))
    return outs


@pytest.fixture(scope="module")
def law(model):
    return exact_law(model, PROMPT, SamplingConfig(**SAMPLING))


@pytest.mark.parametrize("name", ["rsd-c", "rsd-s"])
def test_reduced_vocabulary_emits_the_target_law(model, law, name):
    stat, threshold = chi_square(sample(generator(model, **SPECS[name])), law)
    assert stat < threshold, (name, stat, threshold)


def test_draft_rows_on_the_wrong_tokens_fail(model, law, monkeypatch):
    """The acceptance rule reading q on the first V' token ids instead of ``vocab_ids`` is caught."""
    def misplaced(self, entry):
        q = self.draft_probs.get(entry)
        if q is not None and entry in self._draft_vocab:
            q = torch.cat([q, q.new_zeros(VOCAB - q.shape[-1])])
        return q
    monkeypatch.setattr(DraftTree, "draft_row", misplaced)
    stat, threshold = chi_square(sample(generator(model, **SPECS["rsd-c"])), law)
    assert stat > threshold, (stat, threshold)


@pytest.mark.parametrize("name", list(SPECS))
def test_greedy_reduced_vocabulary_equals_ar(model, name):
    cfg = GenerationConfig(max_new_tokens=24)
    prompt = [1, 2, 3, 0, 0, 2]
    want = build_generator(model, method="ar").generate(prompt, cfg).token_ids
    gen = generator(model, **SPECS[name])
    res = gen.generate(prompt, cfg)
    assert res.token_ids == want and res.stats.drafted_tokens > 0
