"""Batched speculative decoding (engine level): the ragged forward, continuous batching, exactness per sequence."""

from __future__ import annotations

import copy
from dataclasses import dataclass, field

import pytest
import torch
from helpers import prefilled_caches, tiny_model

from speculant import GenerationConfig, SamplingConfig, build_generator
from speculant.drafters.base import DecodingState, DrafterCapabilities
from speculant.drafters.draft_model import DraftModelDrafter
from speculant.drafters.early_exit import EarlyExitDrafter
from speculant.drafters.prompt_lookup import PromptLookupDrafter
from speculant.engine.generator import SpeculativeGenerator
from speculant.engine.batch import BatchedGenerator
from speculant.engine.methods import MethodSpec
from speculant.runtime.blocks import Block
from speculant.runtime.ragged import ragged_run_layers
from speculant.runtime import tune
from speculant.runtime.formats import apply_weight_format, format_available
from speculant.serving.server import exact_batch_limit
from speculant.trees.builders import ChainBuilder
from speculant.trees.tree import DraftTree
from speculant.runtime.executor import executor_of

METHODS = [("ar", {}), ("prompt-lookup", {}), ("early-exit", {"exit_layer": 2}),
           ("draft-model", {"draft_model": "truncated:2"}), ("rsd-c", {"exit_layer": 2, "branching": "2,2"}),
           ("rsd-s", {"exit_layer": 1, "beam_width": 2, "draft_length": 3}),
           ("specinfer", {"draft_model": "truncated:1", "branching": "2,1"})]
PROMPTS = [[1 + (i * 7 + j) % 60 for j in range(3 + 2 * i)] for i in range(6)]
LENGTHS = [5, 17, 9, 30, 2, 12]


BATCH_ROWS = 32
"""Rows of the largest batched product these tests run (6 sequences of up to 7 rows: a tree and its root)."""


@pytest.fixture(scope="module")
def model():
    """A tiny model in a weight format whose kernels the tuner finds batch-invariant up to :data:`BATCH_ROWS` rows
    on this machine (int8 where it is, else another): batched exactness rests on it, so it fails, never skips,
    when no format is (w4a8 is by construction, README "What is exact")."""
    for fmt in ("int8", "w4a8", "int4", "bf16"):
        if not format_available(fmt):
            continue
        m = tiny_model(seed=1, scale=2.5, layers=4)
        apply_weight_format(m.decoder, fmt)
        if tune.invariant_rows(tune.invariance_sample(m.decoder), (BATCH_ROWS,)) >= BATCH_ROWS:
            return m
        assert fmt != "w4a8", "w4a8 kernels are not batch-invariant on this machine (they are by construction)"
    pytest.fail(f"no weight format is batch-invariant up to {BATCH_ROWS} rows on this machine")


def batched_for(model, method, kw) -> BatchedGenerator:
    gen = build_generator(model, MethodSpec(method=method, **kw))
    return BatchedGenerator(model, gen.drafter, gen.builder)


def decode_staggered(bg: BatchedGenerator, configs) -> list[list[int]]:
    """One new sequence joins before each round (continuous batching); finished ones leave at once."""
    outs, active, pending = {}, [], list(range(len(PROMPTS)))
    max_batch = 0
    while pending or active:
        if pending:
            i = pending.pop(0)
            seq = bg.start(PROMPTS[i], configs[i])
            outs[i] = list(seq.last_block)
            if not seq.finished:
                active.append((i, seq))
        max_batch = max(max_batch, len(active))
        bg.step([s for _, s in active])
        for i, s in active:
            outs[i] += s.last_block
        active = [(i, s) for i, s in active if not s.finished]
    assert max_batch >= 4
    return [outs[i] for i in range(len(PROMPTS))]


@pytest.mark.parametrize("method,kw", METHODS, ids=[m for m, _ in METHODS])
def test_batched_greedy_equals_each_sequence_alone_with_ar(model, method, kw):
    ar = build_generator(model, method="ar")
    want = [ar.generate(p, GenerationConfig(max_new_tokens=n)).token_ids for p, n in zip(PROMPTS, LENGTHS)]
    bg = batched_for(model, method, kw)
    got = decode_staggered(bg, [GenerationConfig(max_new_tokens=n) for n in LENGTHS])
    assert got == want
    assert bg.batched_verification


@pytest.mark.parametrize("method,kw", [METHODS[0], METHODS[2], METHODS[4], METHODS[1]], ids=["ar", "early-exit",
                                                                                                "rsd-c", "prompt-lookup"])
def test_batched_sampling_draws_what_each_seed_draws_alone(model, method, kw):
    configs = [GenerationConfig(max_new_tokens=n, sampling=SamplingConfig(temperature=0.9, top_p=0.95, seed=50 + i))
               for i, n in enumerate(LENGTHS)]
    gen = build_generator(model, MethodSpec(method=method, **kw))
    want = [gen.generate(p, c).token_ids for p, c in zip(PROMPTS, configs)]
    assert decode_staggered(batched_for(model, method, kw), configs) == want


def test_ragged_forward_is_bitwise_the_one_sequence_forward(model):
    dec = executor_of(model)
    rows = 3 + 4 + 2
    assert tune.invariant_rows(tune.invariance_sample(dec.decoder), (rows,)) >= rows      # the premise (the fixture's)
    torch.manual_seed(0)
    with torch.inference_mode():
        caches = prefilled_caches(dec, [[5, 9, 2, 7], [1, 2, 3, 4, 5, 6], [8, 8]], 32)
        tree = DraftTree()
        a = tree.add(-1, 3)
        tree.add(-1, 4)
        tree.add(a, 5)
        n1 = caches[1].length
        blocks = [  # a causal chain from layer 0; a tree with its mask; an early-exit block resuming at layer 2
            Block(dec.embed(torch.tensor([[11, 12, 13]])), 0, torch.arange(4, 7), None, caches[0], 4),
            Block(dec.embed(tree.block_tokens(6)[None]), 0, tree.block_positions(n1), tree.attention_mask(n1),
                        caches[1], n1),
            Block(torch.randn(1, 2, dec.config.hidden_size), 2, torch.arange(2, 4), None, caches[2], 2)]
        alone_caches = [copy.deepcopy(c) for c in caches]
        alone = [dec.run_layers(b.hidden, b.start_layer, dec.num_layers, b.positions, b.mask, c, b.cache_position)
                 for b, c in zip(blocks, alone_caches)]
        together = ragged_run_layers(dec, blocks)
    for x, y in zip(together, alone):
        assert torch.equal(x, y)
    for c, d in zip(caches, alone_caches):
        assert torch.equal(c.keys, d.keys) and torch.equal(c.values, d.values)


def test_one_drafter_serves_many_generations_each_with_its_own_state(model):
    """A drafter holds configuration and networks only; what changes during a generation is the typed state its
    ``begin`` returns (``DecodingState.drafter_state``), one per generation, never shared."""
    dm = DraftModelDrafter(model.decoder)
    states = [DecodingState(model.decoder, executor_of(model).new_cache(16), [1, 2, 3], SamplingConfig()) for _ in "ab"]
    for state in states:
        state.drafter_state = dm.begin(state)
    assert states[0].drafter_state is not states[1].drafter_state
    assert states[0].drafter_state.cache is not states[1].drafter_state.cache
    ee = EarlyExitDrafter(4, 2)
    assert ee.begin(states[0]) is not ee.begin(states[0])
    assert ee.capabilities.drafts_into_target_cache and not dm.capabilities.drafts_into_target_cache


class _RowDependent(torch.nn.Module):
    """A projection whose results change once a product has more than ``exact_up_to`` rows."""

    def __init__(self, exact_up_to: int):
        super().__init__()
        self.in_features, self.exact_up_to = 8, exact_up_to

    def forward(self, x):
        return x * 2 + (1e-3 if x.shape[0] > self.exact_up_to else 0.0)


def test_invariant_rows_and_the_batch_limit(monkeypatch, model):
    assert tune.invariant_rows([_RowDependent(1000)], (32, 64)) == 64
    assert tune.invariant_rows([_RowDependent(40)], (32, 64)) == 32
    assert tune.invariant_rows([_RowDependent(20)], (32, 64)) == 16
    assert tune.invariant_rows([_RowDependent(3)], (32, 64)) == 0
    bg = batched_for(model, "rsd-c", {"exit_layer": 2, "branching": "2,2"})
    assert bg.rows_per_sequence == 7                      # 6 tree nodes + the root
    monkeypatch.setattr(tune, "invariant_rows", lambda mods, limits: 16)
    assert exact_batch_limit(bg, 8) == 2                  # 2 * 7 rows fit in 16
    monkeypatch.setattr(tune, "invariant_rows", lambda mods, limits: 0)
    assert exact_batch_limit(bg, 8) == 1                  # not invariant at all: no batching
    monkeypatch.setattr(tune, "invariant_rows", lambda mods, limits: max(limits))
    assert exact_batch_limit(bg, 8) == 8


@dataclass
class _Recorded:
    hidden: list = field(default_factory=list)


class _RecordingLookup(PromptLookupDrafter):
    """Prompt lookup that keeps the verified blocks' last-layer hidden states (the hook a draft head uses) in each
    generation's own state."""

    capabilities = DrafterCapabilities(needs_features=True)

    def __init__(self):
        super().__init__()
        self.states: list[_Recorded] = []

    def begin(self, state):
        self.states.append(_Recorded())
        return self.states[-1]

    def verification_hidden(self, state, tree, hidden):
        assert hidden.shape == (len(tree) + 1, state.target.config.hidden_size)
        state.drafter_state.hidden.append(hidden.clone())


def test_verification_hidden_gets_each_sequences_own_states(model):
    dec = executor_of(model)
    assert tune.invariant_rows(tune.invariance_sample(dec.decoder), (BATCH_ROWS,)) >= BATCH_ROWS      # the premise
    builder = ChainBuilder(3)
    configs = [GenerationConfig(max_new_tokens=n) for n in LENGTHS]
    alone = []
    for p, c in zip(PROMPTS, configs):
        d = _RecordingLookup()
        SpeculativeGenerator(model, d, builder).generate(p, c)
        alone.append(d.states[0].hidden)
    proto = _RecordingLookup()
    decode_staggered(BatchedGenerator(model, proto, builder), configs)
    assert len(proto.states) == len(PROMPTS)
    for st, want in zip(proto.states, alone):
        assert len(st.hidden) == len(want)
        assert all(torch.equal(a, b) for a, b in zip(st.hidden, want))


class _OwnVerification(PromptLookupDrafter):
    """A drafter that runs its verification itself (no batching hook): verified alone inside the round."""

    capabilities = DrafterCapabilities(batchable_verification=False)

    def verify_logits(self, state, tree):
        return super().verify_logits(state, tree)


def test_a_drafter_with_its_own_verification_is_verified_alone_and_stays_exact(model):
    ar = build_generator(model, method="ar")
    want = [ar.generate(p, GenerationConfig(max_new_tokens=n)).token_ids for p, n in zip(PROMPTS, LENGTHS)]
    bg = BatchedGenerator(model, _OwnVerification(), ChainBuilder(3))
    assert not bg.batched_verification
    assert decode_staggered(bg, [GenerationConfig(max_new_tokens=n) for n in LENGTHS]) == want


def test_batched_eagle_lookup_equals_each_sequence_alone_with_ar(model, tmp_path):
    """Prompt lookup before a draft head in a batch: each sequence's own n-gram index and head state."""
    from speculant.drafters.draft_head import new_head, save_head
    torch.manual_seed(0)
    save_head(new_head(tiny_model(seed=1, scale=2.5, layers=4), torch.arange(0, model.config.vocab_size, 2)), tmp_path)
    kw = {"draft_head": str(tmp_path), "min_ngram": 1}
    ar = build_generator(model, method="ar")
    want = [ar.generate(p, GenerationConfig(max_new_tokens=n)).token_ids for p, n in zip(PROMPTS, LENGTHS)]
    bg, seqs = batched_for(model, "eagle-lookup", kw), []
    start = bg.start
    bg.start = lambda *a: seqs.append(start(*a)) or seqs[-1]
    assert decode_staggered(bg, [GenerationConfig(max_new_tokens=n) for n in LENGTHS]) == want
    # each sequence's stats count its copying and head rounds apart (rounds_by_context), adding up to its totals
    for seq in seqs:
        by = seq.stats.rounds_by_context
        assert set(by) <= {"head"} | {f"lookup n-gram {n}" for n in range(1, 6)}
        assert sum(v["drafted_tokens"] for v in by.values()) == seq.stats.drafted_tokens
        assert sum(v["accepted_tokens"] for v in by.values()) == seq.stats.accepted_tokens
    assert any(k.startswith("lookup") for seq in seqs for k in seq.stats.rounds_by_context)
