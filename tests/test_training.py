"""Training recipes (LayerSkip, exit adapter) on tiny random models built here."""

from __future__ import annotations

import json
import math
from dataclasses import replace

import pytest
import torch

from helpers import pattern_corpus as _pattern_corpus
from helpers import one_line_error, tiny_model
from speculant import GenerationConfig, build_generator
from speculant.errors import SpeculantError
from speculant.drafters import exit_adapter as exit_adapter_mod
from speculant.training import adapter as adapter_mod
from speculant.training.curricula import enabled_exits
from speculant.training.data import read_corpus, split_prompts, Prompt
from speculant.training.losses import early_exit_loss, exit_scales, topk_distill_loss
from speculant.training.schedules import layer_dropout_rates, sample_keep_mask, time_scale
from speculant.training.train import (ExitAdapterConfig, LayerSkipConfig, layerskip_forward, remap, select_vocab,
                                      train_exit_adapter, train_layerskip)


# ----------------------------------------------------------------------------- schedules
def test_dropout_rates_follow_the_exponential_schedule():
    L, p = 5, 0.2
    rates = layer_dropout_rates(L, p)
    want = [p * (math.exp(layer * math.log(2) / (L - 1)) - 1) for layer in range(L)]
    assert rates == pytest.approx(want)
    assert rates[0] == 0.0 and rates[-1] == pytest.approx(p)
    assert all(a < b for a, b in zip(rates, rates[1:]))
    # exponential time curriculum: 0 at step 0, full at the last step
    assert layer_dropout_rates(L, p, 0, 10, "exp") == pytest.approx([0.0] * L)
    assert layer_dropout_rates(L, p, 9, 10, "exp") == pytest.approx(want)
    assert 0 < time_scale(5, 10, "exp") < 1
    with pytest.raises(SpeculantError, match="p_max"):
        layer_dropout_rates(L, 1.5)
    with pytest.raises(SpeculantError, match="allowed: constant, exp"):
        time_scale(0, 10, "linear")


def test_keep_mask_empirical_rate_matches():
    g = torch.Generator().manual_seed(0)
    keep = sample_keep_mask([0.0, 0.5, 1.0], 4000, g)
    assert keep[0].all() and not keep[2].any()
    assert abs((~keep[1]).float().mean().item() - 0.5) < 0.05


def test_p_max_zero_runs_every_layer_and_matches_the_forward():
    m = tiny_model(layers=4)
    dec = m.decoder
    ids = torch.randint(0, 64, (2, 10), generator=torch.Generator().manual_seed(1))
    keep = sample_keep_mask(layer_dropout_rates(4, 0.0), 2)
    assert keep.all()
    before = list(dec.layer_token_counts)
    out = layerskip_forward(dec, ids, keep, [3])
    assert [a - b for a, b in zip(dec.layer_token_counts, before)] == [10] * 4   # counts tokens per row
    torch.testing.assert_close(out[3], dec(ids))


def test_dropped_layer_is_skipped_per_sequence():
    m = tiny_model(layers=3)
    dec = m.decoder
    ids = torch.randint(0, 64, (2, 6), generator=torch.Generator().manual_seed(2))
    keep = torch.tensor([[True, True], [True, False], [True, True]])   # layer 1 skipped for sequence 1 only
    out = layerskip_forward(dec, ids, keep, [2])[2]
    pos = torch.arange(6)
    h = dec.run_layers(dec.embed(ids[1:]), 0, 1, pos)
    h = dec.run_layers(h, 2, 3, pos)
    torch.testing.assert_close(out[1], dec.lm_head(dec.final_norm(h))[0])
    torch.testing.assert_close(out[0], dec(ids[:1])[0])


# ----------------------------------------------------------------------------- losses
def test_exit_scales_grow_with_depth_and_sum_to_one():
    s = exit_scales(3, [1, 2])
    # e(1) = 0 + 1 = 1 ; e(L-1=2) = (L-1) + (0 + 1) = 3
    assert s == pytest.approx({1: 0.25, 2: 0.75})
    s = exit_scales(8, list(range(8)))
    assert sum(s.values()) == pytest.approx(1.0)
    assert all(s[layer] <= s[layer + 1] for layer in range(7))
    with pytest.raises(SpeculantError, match="out of range"):
        exit_scales(3, [3])


def test_early_exit_loss_equals_hand_computed_value():
    logits = {1: torch.tensor([[0.0, 0.0]]), 2: torch.tensor([[math.log(3.0), 0.0]])}
    loss = early_exit_loss(logits, torch.tensor([0]), exit_scales(3, [1, 2]))
    want = 0.25 * math.log(2) + 0.75 * math.log(4 / 3)
    assert loss.item() == pytest.approx(want, rel=1e-6)


def test_topk_distill_loss_is_kl_and_drops_tokens_outside_the_vocab():
    p = torch.tensor([[0.5, 0.3, 0.2]])
    student = torch.tensor([[0.0, 0.0, 0.0, 5.0]])
    idx = torch.tensor([[0, 1, 2]])
    loss = topk_distill_loss(student, idx, p.log())
    q = torch.softmax(student, -1)[0, :3]
    assert loss.item() == pytest.approx(float((p[0] * (p[0] / q).log()).sum()), rel=1e-5)
    # token 2 outside the draft vocabulary: teacher renormalised over {0, 1}
    loss2 = topk_distill_loss(student, torch.tensor([[0, 1, -1]]), p.log())
    pr = torch.tensor([0.625, 0.375])
    assert loss2.item() == pytest.approx(float((pr * (pr / q[:2]).log()).sum()), rel=1e-5)
    assert topk_distill_loss(torch.tensor([[2.0, 1.0]]), torch.tensor([[0, 1]]),
                             torch.log_softmax(torch.tensor([[2.0, 1.0]]), -1)).item() == pytest.approx(0, abs=1e-6)


# ----------------------------------------------------------------------------- curricula
def test_rotational_curriculum_enables_one_exit_every_r_layers_rotated():
    assert enabled_exits("rotational", 0, 8, rotation=4) == [3, 7]
    assert enabled_exits("rotational", 1, 8, rotation=4) == [2, 6, 7]
    assert enabled_exits("rotational", 2, 8, rotation=4) == [1, 5, 7]
    assert enabled_exits("rotational", 3, 8, rotation=4) == [0, 4, 7]
    assert enabled_exits("rotational", 4, 8, rotation=4) == [3, 7]


def test_gradual_curriculum_enables_exits_from_the_last_layer_backwards():
    # L = 4, T = 80: one more exit every T / 2L = 10 steps
    assert enabled_exits("gradual", 0, 4, total_steps=80) == [3]
    assert enabled_exits("gradual", 9, 4, total_steps=80) == [3]
    assert enabled_exits("gradual", 10, 4, total_steps=80) == [2, 3]
    assert enabled_exits("gradual", 25, 4, total_steps=80) == [1, 2, 3]
    assert enabled_exits("gradual", 30, 4, total_steps=80) == [0, 1, 2, 3]
    assert enabled_exits("gradual", 79, 4, total_steps=80) == [0, 1, 2, 3]
    assert enabled_exits("none", 5, 4) == [3]
    assert enabled_exits("all", 5, 4) == [0, 1, 2, 3]
    with pytest.raises(SpeculantError, match="allowed: rotational, gradual, all, none"):
        enabled_exits("random", 0, 4)


# ----------------------------------------------------------------------------- data
def test_split_is_seeded_and_keeps_sources_apart():
    ps = [Prompt(f"a-{i}", "a", "x") for i in range(20)] + [Prompt(f"b-{i}", "b", "y") for i in range(5)]
    s1, s2 = split_prompts(ps, 0.2, 0), split_prompts(ps, 0.2, 0)
    assert s1 == s2
    assert sum(v == "heldout" for k, v in s1.items() if k.startswith("a")) == 4
    assert sum(v == "heldout" for k, v in s1.items() if k.startswith("b")) == 1
    with pytest.raises(SpeculantError, match="heldout_fraction"):
        split_prompts(ps, 1.0, 0)


# ----------------------------------------------------------------------------- training
def test_layerskip_steps_lower_heldout_loss_full_and_lora(tmp_path):
    corpus = _pattern_corpus(tmp_path / "c.jsonl")
    for rank in (0, 4):
        m = tiny_model(layers=4)
        cfg = LayerSkipConfig(steps=30, lr=3e-3 if rank == 0 else 1e-2, lora_rank=rank, p_max=0.2,
                              exit_curriculum="rotational", rotation=2, seq_len=16, batch=4, eval_tokens=200,
                              eval_exit=2, progress=False)
        metrics = train_layerskip(m, str(corpus), str(tmp_path / f"ls{rank}"), cfg)
        assert metrics["heldout_after"]["nll"] < metrics["heldout_before"]["nll"] - 0.1, metrics
        # the merged model reloads as a plain HF directory
        from speculant.models.loading import load_hf_dir
        re = load_hf_dir(tmp_path / f"ls{rank}" / "model")
        assert not any("lora" in k for k in re.decoder.state_dict())
        ids = torch.tensor([[1, 2, 3]])
        torch.testing.assert_close(re.decoder(ids), m.decoder(ids))
        # a model card: the base model, what the folder holds, the settings, the metrics, what it was trained on
        card = (tmp_path / f"ls{rank}" / "README.md").read_text()
        assert card.startswith("# LayerSkip fine-tune: tiny") and metrics["trained_on"].startswith("a CPU")
        assert ("`lora.safetensors`" in card) == (rank > 0) and f"on {metrics['trained_on']}" in card
        assert f"{metrics['heldout_after']['ppl']:.3f}" in card and "rotational (R = 2)" in card
        assert "at exit layer 2" in card


def test_trained_weights_are_written_with_the_umask_mode(tmp_path):
    """safetensors writes a 0600 temporary file and renames it: trained weights get an ordinary file's mode."""
    import os
    from speculant.training.train import save_lora
    old = os.umask(0o027)
    try:
        m = tiny_model(layers=4)
        _saved_adapter(m, tmp_path / "a", 2)                      # write_dir: adapters, draft heads, EAGLE-3 heads
        from speculant.training.train import add_lora
        save_lora(add_lora(m.decoder, 2, 4.0), tmp_path / "lora.safetensors", LayerSkipConfig(lora_rank=2))
    finally:
        os.umask(old)
    for f in (tmp_path / "a" / "adapter.safetensors", tmp_path / "lora.safetensors"):
        assert f.stat().st_mode & 0o777 == 0o640, (f, oct(f.stat().st_mode))


def test_exit_adapter_training_improves_agreement_and_resumes(tmp_path):
    corpus = _pattern_corpus(tmp_path / "c.jsonl")
    m = tiny_model(layers=4, scale=2.0)
    out = tmp_path / "ad"
    cfg = ExitAdapterConfig(exit_layer=1, blocks=1, draft_vocab=48, topk=8, steps=60, lr=3e-3, batch_tokens=128,
                            eval_every=30, checkpoint_every=30, progress=False)
    met = train_exit_adapter(m, str(corpus), str(out), cfg)
    assert met["final"]["kl_topk"] < met["init"]["kl_topk"]
    assert met["final"]["top1"] > met["init"]["top1"]
    assert (out / "adapter.safetensors").is_file() and (out / "README.md").is_file()
    met2 = train_exit_adapter(m, str(corpus), str(out), replace(cfg, steps=70, checkpoint_every=200, resume=True))
    assert met2["steps_done"] == 70
    with pytest.raises(SpeculantError, match="exit-layer"):
        train_exit_adapter(m, str(corpus), str(out), ExitAdapterConfig(exit_layer=2, steps=80, resume=True,
                                                                       progress=False))


def test_select_vocab_keeps_heaviest_tokens_and_remaps():
    idx = torch.tensor([[5, 3], [5, 7]])
    logp = torch.tensor([[0.9, 0.1], [0.8, 0.2]]).log()
    v = select_vocab(idx, logp, 2, 10)
    assert v.tolist() == [5, 7]
    assert remap(idx, v, 10).tolist() == [[0, -1], [0, 1]]


# ----------------------------------------------------------------------------- adapter in the drafter
def _saved_adapter(m, path, exit_layer=2, vocab=None):
    torch.manual_seed(0)
    ad = adapter_mod.new_adapter(m, exit_layer, 1, vocab)
    with torch.no_grad():
        ad.head_bias.normal_(0, 0.5)       # make it differ from the shared head
    adapter_mod.save_adapter(ad, path, card="card")
    return ad


@pytest.mark.parametrize("vocab", [None, torch.arange(0, 64, 2)])
def test_adapter_drafter_is_token_identical_to_ar_under_greedy(tmp_path, vocab):
    m = tiny_model(layers=4, scale=2.0)
    _saved_adapter(m, tmp_path / "a", 2, vocab)
    head, e = exit_adapter_mod.load_exit_adapter(str(tmp_path / "a"), m, None)
    assert e == 2
    logits = head(torch.randn(3, 64))
    assert logits.shape == (3, 64) and logits.dtype == torch.float32
    if vocab is not None:
        assert torch.isinf(logits[:, 1::2]).all() and torch.isfinite(logits[:, ::2]).all()
    prompt = [3, 17, 5, 9, 22]
    cfg = GenerationConfig(max_new_tokens=30)
    ar = build_generator(m, method="ar").generate(prompt, cfg)
    gen = build_generator(m, method="early-exit", exit_adapter=str(tmp_path / "a"), num_speculations=3)
    assert gen.drafter.exit_layer == 2 and gen.drafter.exit_head is not None
    ee = gen.generate(prompt, cfg)
    assert ee.token_ids == ar.token_ids
    assert ee.stats.drafted_tokens > 0


@pytest.mark.parametrize("weights", ["int8", "w8a8"])
def test_a_quantized_target_drafts_with_a_packed_adapter_and_stays_exact(tmp_path, weights):
    """For a quantized target the adapter's projections are packed (int8: torch's kernel; w8a8: ours): its logits
    stay close to the float adapter's, the draft moves by the rounding only, and early exit stays token-identical
    to AR."""
    from speculant.kernels import qgemm
    from speculant.runtime.formats import Int8Linear, W8A8Linear, apply_weight_format
    if weights == "w8a8" and not qgemm.available():
        pytest.skip(f"w8a8: {qgemm.unavailable_reason()}")
    kind = Int8Linear if weights == "int8" else W8A8Linear
    vocab = torch.arange(0, 64, 2)
    _saved_adapter(tiny_model(layers=4, scale=2.0), tmp_path / "a", 2, vocab)     # trained on the float model
    m = tiny_model(layers=4, scale=2.0)
    apply_weight_format(m.decoder, "int8")
    float_head, _ = exit_adapter_mod.load_exit_adapter(str(tmp_path / "a"), m, None, weights="fp32")
    head, exit_layer = exit_adapter_mod.load_exit_adapter(str(tmp_path / "a"), m, None, weights=weights)
    ad = head.adapter
    assert exit_layer == 2
    assert isinstance(ad.packed_head, kind) and all(isinstance(b.gate_up_proj, kind) for b in ad.blocks)
    assert float_head.adapter.packed_head is None
    h = torch.randn(6, 64, generator=torch.Generator().manual_seed(2))
    got, want = head(h), float_head(h)
    keep = torch.isfinite(want)
    assert torch.equal(keep, torch.isfinite(got))
    assert float((got[keep] - want[keep]).abs().max()) <= 0.05 * float(want[keep].abs().max())
    with pytest.raises(SpeculantError, match="packed exit adapter cannot be saved"):
        ad.trained_state()
    with pytest.raises(SpeculantError, match="drafter weights='int3' is not allowed; allowed: fp32, int8, w8a8"):
        exit_adapter_mod.load_exit_adapter(str(tmp_path / "a"), m, None, weights="int3")
    prompt, cfg = [3, 17, 5, 9, 22], GenerationConfig(max_new_tokens=30)
    ar = build_generator(m, method="ar").generate(prompt, cfg)
    gen = build_generator(m, method="early-exit", exit_adapter=str(tmp_path / "a"), num_speculations=3)
    out = gen.generate(prompt, cfg)
    assert out.token_ids == ar.token_ids and out.stats.drafted_tokens > 0


def test_the_adapters_format_is_measured_once_per_machine_and_kept(tmp_path, monkeypatch):
    """Loading an adapter measures nothing; the method factory's tune step times a quantized target's adapter in each
    drafter format once per machine and drafter shape, keeps the fastest in the tune (and its file), packs the
    adapter in it, and later loads read that choice; a float target keeps a float adapter, unmeasured."""
    from speculant import build_generator
    from speculant.runtime import tune
    from speculant.runtime.formats import apply_weight_format
    monkeypatch.setenv("SPECULANT_CACHE", str(tmp_path / "cache"))
    _saved_adapter(tiny_model(layers=4, scale=2.0), tmp_path / "a", 2)
    fp32 = tiny_model(layers=4, scale=2.0)
    timed = []
    real = tune.measure_drafter_weights
    monkeypatch.setattr(tune, "measure_drafter_weights", lambda *a, **k: timed.append(1) or real(*a, **k))
    spec = dict(method="early-exit", exit_adapter=str(tmp_path / "a"), speculation="always")
    assert build_generator(fp32, **spec).drafter.exit_head.adapter.packed_head is None and not timed
    m = tiny_model(layers=4, scale=2.0)
    apply_weight_format(m.decoder, "int8")
    m.tune = tune.TuneResult(key=tune.tune_key(m.decoder.config, 1), weights="int8", fp32_route="linear", threads=1)
    head, _ = exit_adapter_mod.load_exit_adapter(str(tmp_path / "a"), m, None)
    assert not timed and head.adapter.packed_head is None and not m.tune.drafter_weights    # the loader: nothing timed
    tuned = build_generator(m, **spec).drafter.exit_head.adapter
    assert len(timed) == 1 and len(m.tune.drafter_weights) == 1
    (key, choice), = m.tune.drafter_weights.items()
    assert key.startswith("exit-adapter:64x") and set(choice["ms"]) >= {"fp32", "int8"}
    assert choice["weights"] == min(choice["ms"], key=choice["ms"].get) == tuned.weight_format
    assert tune.load(m.tune.key).drafter_weights == m.tune.drafter_weights              # saved with the tune
    assert f"drafter exit-adapter: **{choice['weights']}**" in tune.format_table(m.tune)
    head, _ = exit_adapter_mod.load_exit_adapter(str(tmp_path / "a"), m, None)
    build_generator(m, **spec)
    assert len(timed) == 1                                                             # reused, not measured
    assert head.adapter.weight_format == choice["weights"]
    assert (head.adapter.packed_head is None) == (choice["weights"] == "fp32")


def test_adapter_errors_name_the_value(tmp_path):
    m = tiny_model(layers=4)
    _saved_adapter(m, tmp_path / "a", 2)
    with pytest.raises(SpeculantError, match="exit_layer=3 conflicts"):
        exit_adapter_mod.load_exit_adapter(str(tmp_path / "a"), m, 3)
    with pytest.raises(SpeculantError, match="not found for model 'tiny'"):
        exit_adapter_mod.load_exit_adapter("nope", m, None)
    other = tiny_model(layers=4, hidden=32, heads=4, kv_heads=2)
    with pytest.raises(SpeculantError, match="hidden_size=64"):
        exit_adapter_mod.load_exit_adapter(str(tmp_path / "a"), other, None)
    with pytest.raises(SpeculantError, match="num_blocks"):
        adapter_mod.new_adapter(m, 3, 2)


def test_adapter_round_trip_matches_in_memory(tmp_path):
    m = tiny_model(layers=4)
    ad = _saved_adapter(m, tmp_path / "a", 2, torch.arange(40))
    loaded = exit_adapter_mod.load_adapter(tmp_path / "a", m)
    h = torch.randn(5, 64)
    torch.testing.assert_close(loaded(h), ad(h), atol=0.05, rtol=0.05)   # stored in bf16


def test_corpus_reader_rejects_unknown_split(tmp_path):
    p = _pattern_corpus(tmp_path / "c.jsonl", 2, 1)
    assert len(read_corpus(p, "heldout")) == 1
    with pytest.raises(SpeculantError, match="allowed: train, heldout"):
        read_corpus(p, "dev")


# ----------------------------------------------------------------------------- CLI
def test_cli_bad_input_exits_2(tmp_path, capsys):
    from speculant.cli import main
    assert main(["train", "--recipe", "nope", "--corpus", "c", "--out", str(tmp_path)]) == 2
    assert "--recipe='nope' is unknown; allowed: layerskip, exit-adapter" in capsys.readouterr().err
    assert main(["make-data", "--out", str(tmp_path / "o.jsonl"), "--spec-bench", str(tmp_path / "missing.jsonl")]) == 2
    assert "does not exist" in capsys.readouterr().err


def test_train_flags_make_each_recipes_config_and_bad_values_fail_before_loading(tmp_path, capsys, monkeypatch):
    """`speculant train` / `make-data` flags map to the recipes' configs (defaults and renamed flags), and a bad
    value is a one-line error before any model loads."""
    from speculant.cli import build_parser, main
    from speculant.models import loading
    from speculant.training.data import MakeDataConfig
    from speculant.training.head import DraftHeadConfig
    base = ["train", "--corpus", "c", "--out", str(tmp_path), "--model", "m"]
    args = build_parser().parse_args(base + ["--recipe", "draft-head", "--head-batch", "3", "--feature-noise", "0.2"])
    head = DraftHeadConfig.from_args(args)
    assert (head.batch_seqs, head.noise, head.lr, head.draft_vocab, head.checkpoint_every) == (3, 0.2, 1e-3, 8192, 200)
    args = build_parser().parse_args(base + ["--recipe", "exit-adapter", "--cache-exits", "6,8", "--steps", "7"])
    adapter = ExitAdapterConfig.from_args(args)
    assert (adapter.cache_exits, adapter.steps, adapter.lr, adapter.exit_layer) == ((6, 8), 7, 1e-3, 6)
    args = build_parser().parse_args(base + ["--recipe", "layerskip", "--lora-rank", "0"])
    ls = LayerSkipConfig.from_args(args)
    assert (ls.lora_rank, ls.lr, ls.steps, ls.eval_tokens) == (0, 1e-4, 1000, 4000)
    args = build_parser().parse_args(["make-data", "--out", "o", "--text-file", "a", "--text-file", "b"])
    assert MakeDataConfig.from_args(args).text_files == ("a", "b")

    def no_loading(*a, **k):
        raise AssertionError("the model was loaded before the flags were checked")

    monkeypatch.setattr(loading, "read_checkpoint", no_loading)
    for recipe, flag in (("draft-head", ["--unroll", "3"]), ("exit-adapter", ["--batch-tokens", "0"]),
                         ("layerskip", ["--exit-curriculum", "nope"]), ("layerskip", ["--steps", "0"])):
        assert main(base + ["--recipe", recipe, *flag]) == 2
        err = capsys.readouterr().err
        assert one_line_error(err) and ("nope" in err or "=0" in err or "=3" in err), err
    assert main(["make-data", "--out", str(tmp_path / "o.jsonl"), "--builtin", "--max-new-tokens", "0"]) == 2
    assert "--max-new-tokens=0 is out of range" in capsys.readouterr().err


@pytest.mark.parametrize("flags, says", [
    (["--recipe", "draft-head", "--head-seq-len", "0"], "--head-seq-len=0 is out of range"),
    (["--recipe", "eagle3", "--head-batch", "0"], "--head-batch=0 is out of range"),
    (["--recipe", "eagle3", "--aux-layers", "3,2,1"], "--aux-layers=[3, 2, 1] is invalid"),
    (["--recipe", "eagle3", "--ttt-decay", "2"], "--ttt-decay=2.0 is out of range"),
    (["--recipe", "layerskip", "--seq-len", "0"], "--seq-len=0 is out of range"),
    (["--recipe", "layerskip", "--rotation", "0"], "--rotation=0 is out of range"),
    (["--recipe", "layerskip", "--p-max", "2"], "--p-max=2.0 is out of range"),
    (["--recipe", "exit-adapter", "--steps", "5", "--stop-at", "9"], "--stop-at=9 is out of range"),
    (["--recipe", "exit-adapter", "--eval-every", "0"], "--eval-every=0 is out of range"),
    (["--recipe", "layerskip", "--threads", "0"], "--threads=0 is out of range"),
])
def test_train_range_errors_name_the_flag_as_typed(tmp_path, capsys, monkeypatch, flags, says):
    """A bad value is one line naming the flag the user typed (`--head-seq-len`, not the config's `seq_len`), before
    the model loads."""
    from speculant.cli import main
    from speculant.models import loading

    def no_loading(*a, **k):
        raise AssertionError("the model was loaded before the flags were checked")

    monkeypatch.setattr(loading, "read_checkpoint", no_loading)
    assert main(["train", "--corpus", "c", "--out", str(tmp_path / "o"), "--model", "m", *flags]) == 2
    err = capsys.readouterr().err
    assert one_line_error(err), err
    assert says in err, err


@pytest.mark.parametrize("flags, says", [
    (["--heldout-fraction", "2"], "--heldout-fraction=2.0 is out of range"),
    (["--top-p", "0"], "--top-p=0.0 is out of range"),
    (["--temperature", "-1"], "--temperature=-1.0 is out of range"),
    (["--batch-size", "0"], "--batch-size=0 is out of range"),
    (["--chunk-tokens", "0"], "--chunk-tokens=0 is out of range"),
    (["--threads", "-1"], "--threads=-1 is out of range"),
])
def test_make_data_range_errors_name_the_flag_as_typed(tmp_path, capsys, flags, says):
    from speculant.cli import main
    assert main(["make-data", "--out", str(tmp_path / "o.jsonl"), "--builtin", *flags]) == 2
    err = capsys.readouterr().err
    assert one_line_error(err) and says in err, err
    assert not (tmp_path / "o.jsonl").exists()


def test_spec_bench_reader_uses_first_turn(tmp_path):
    from speculant.training.data import spec_bench_prompts
    p = tmp_path / "sb.jsonl"
    p.write_text(json.dumps({"question_id": 7, "category": "math", "turns": ["first", "second"]}) + "\n")
    (pr,) = spec_bench_prompts(p)
    assert (pr.id, pr.source, pr.text) == ("specbench-7", "spec-bench/math", "first")
    p.write_text(json.dumps({"question_id": 8, "turns": []}) + "\n")
    with pytest.raises(SpeculantError, match="turns"):
        spec_bench_prompts(p)


def test_shipped_default_adapter_is_found_by_name():
    assert exit_adapter_mod.default_adapter_for("smollm2-135m") == "default"
    conf = json.loads((exit_adapter_mod.ARTIFACTS / "smollm2-135m" / "default" / "config.json").read_text())
    E = conf["exit_layer"]
    assert exit_adapter_mod.default_adapter_for("smollm2-135m", E) == "default"
    assert exit_adapter_mod.default_adapter_for("smollm2-135m", E + 1) is None     # explicit other layer: no adapter
    assert exit_adapter_mod.default_adapter_for("tiny") is None
    m = tiny_model(layers=4)
    m = replace(m, name="smollm2-135m")                   # resolves the shipped files, then rejects the shape
    with pytest.raises(SpeculantError, match="hidden_size=576 but model 'smollm2-135m' has 64"):
        exit_adapter_mod.load_exit_adapter("default", m, None)


@pytest.mark.parametrize("temperature", [0.0, 0.9])
def test_make_data_output_does_not_depend_on_the_batch_size(tmp_path, temperature):
    """Continuous batching decodes each prompt as it would be decoded alone (prompt i samples with seed + i),
    and the split of the prompts does not move with the sampling seed."""
    from speculant.training.data import MakeDataConfig, make_data
    model = tiny_model(seed=11, scale=2.5, vocab=64, layers=3, eos=7)
    prompts = [Prompt(f"p{i}", "t", " ".join(f"t{(5 * i + j) % 60 + 2}" for j in range(3 + i % 4)))
               for i in range(9)]
    runs = {}
    for b in (1, 4):
        out = tmp_path / f"b{b}.jsonl"
        make_data(model, prompts, out, MakeDataConfig(temperature=temperature, max_new_tokens=12, batch_size=b,
                                                      seed=3, progress=False))
        runs[b] = {r["id"]: (r["response_ids"], r["split"]) for r in read_corpus(out)}
    assert runs[1] == runs[4] and len(runs[1]) == 9
    assert any(len(r) < 12 for r, _ in runs[1].values())            # some stopped at EOS, freeing their slot
    other = tmp_path / "seed.jsonl"
    make_data(model, prompts, other, MakeDataConfig(temperature=temperature, max_new_tokens=4, batch_size=4, seed=99,
                                                    progress=False))
    assert {r["id"]: r["split"] for r in read_corpus(other)} == {k: v[1] for k, v in runs[1].items()}
