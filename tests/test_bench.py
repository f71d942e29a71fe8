"""Benchmark suite on a tiny random model: JSON schema, speed-up arithmetic, greedy equality, parsing."""

import json

import pytest

from helpers import tiny_model
from speculant.bench.datasets import load_prompts
from speculant.bench.mbsu import draft_cost_ratio, mbsu, weight_bytes
from speculant.bench.report import summarize
from speculant.bench.runner import BenchConfig, check_equality, run_benchmark
from speculant.bench.specs import parse_methods
from speculant.errors import SpeculantError


@pytest.fixture(scope="module")
def bench(tmp_path_factory):
    out = tmp_path_factory.mktemp("bench")
    data = out / "q.jsonl"
    rows = [{"question_id": 1, "category": "writing", "turns": ["t1 t2 t3 t4", "again"]},
            {"question_id": 2, "category": "qa", "turns": ["t5 t6 t7 t5 t6"]},
            {"question_id": 3, "category": "qa", "turns": ["t9 t8 t7"]}]
    data.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    model = tiny_model(seed=1, scale=2.0)
    prompts = load_prompts(str(data), limit=2)
    methods = parse_methods("ar,early-exit:E=2,K=3,hf-ar")
    res = run_benchmark(model, prompts, methods, BenchConfig(max_new_tokens=12, repeats=2), out,
                        dataset=str(data), progress=False)
    return res, out


def test_files_and_schema(bench):
    res, out = bench
    on_disk = json.loads((out / "results.json").read_text())
    assert on_disk["schema_version"] == 1 and not on_disk["meta"]["interrupted"]
    assert (out / "report.md").read_text().startswith("# speculant bench")
    assert f"- weights={on_disk['meta']['weights']} " in (out / "report.md").read_text()    # the weight format
    assert (out / "speedup.png").stat().st_size > 0 and (out / "acceptance_by_position.png").stat().st_size > 0
    assert [p["category"] for p in on_disk["prompts"]] == ["mt_bench", "qa", "qa"]
    assert len(on_disk["records"]) == 3 * 3                      # every prompt x every method
    for r in on_disk["records"]:
        assert {"prompt_id", "category", "method", "token_ids", "text", "new_tokens", "seconds", "seconds_median",
                "seconds_min", "tokens_per_second", "tokens_per_second_best", "stats", "equal_to_ar",
                "equal_to_hf_ar"} <= set(r)
        assert len(r["seconds"]) == 2 and r["new_tokens"] == len(r["token_ids"]) == 12
    assert set(on_disk["summary"]) == {"all", "mt_bench", "qa"}
    row = on_disk["summary"]["all"]["early-exit:E=2,K=3"]
    assert 0 <= row["acceptance_rate"] <= 1 and row["block_efficiency"] >= 1
    assert row["mbsu"] == pytest.approx(mbsu(row["block_efficiency"], row["cost_ratio"], row["draft_forwards_per_block"]))
    # greedy speculative output equals AR on our runtime, and our AR equals transformers' generate
    assert row["mismatches_vs_ar"] == 0
    assert on_disk["summary"]["all"]["ar"]["mismatches_vs_hf_ar"] == 0
    assert on_disk["summary"]["all"]["ar"]["speedup_vs_ar"] == pytest.approx(1.0)


def test_speedup_is_ratio_of_mean_tokens_per_second(bench):
    res, _ = bench
    for cat in ("all", "qa"):
        recs = [r for r in res["records"] if cat == "all" or r["category"] == cat]

        def mean_tps(m):
            xs = [r["tokens_per_second"] for r in recs if r["method"] == m]
            return sum(xs) / len(xs)
        row = res["summary"][cat]["early-exit:E=2,K=3"]
        assert row["speedup_vs_ar"] == pytest.approx(mean_tps("early-exit:E=2,K=3") / mean_tps("ar"))
        assert row["speedup_vs_hf_ar"] == pytest.approx(mean_tps("early-exit:E=2,K=3") / mean_tps("hf-ar"))
    r = res["records"][0]
    assert r["seconds_median"] == pytest.approx(sum(r["seconds"]) / 2) and r["seconds_min"] == min(r["seconds"])
    assert r["tokens_per_second"] == pytest.approx(r["new_tokens"] / r["seconds_median"])
    assert r["tokens_per_second_best"] == pytest.approx(r["new_tokens"] / r["seconds_min"])


def test_a_different_greedy_output_is_counted(bench):
    res, _ = bench
    res = json.loads(json.dumps(res))
    rec = next(r for r in res["records"] if r["method"] == "early-exit:E=2,K=3" and r["category"] == "qa")
    rec["token_ids"] = [(t + 1) % 64 for t in rec["token_ids"]]
    check_equality(res)
    summ = summarize(res)
    assert rec["equal_to_ar"] is False
    assert summ["all"]["early-exit:E=2,K=3"]["mismatches_vs_ar"] == 1
    assert summ["qa"]["early-exit:E=2,K=3"]["mismatches_vs_ar"] == 1
    assert summ["mt_bench"]["early-exit:E=2,K=3"]["mismatches_vs_ar"] == 0
    # under sampling nothing is compared
    res["meta"]["temperature"] = 1.0
    check_equality(res)
    assert summarize(res)["all"]["early-exit:E=2,K=3"]["mismatches_vs_ar"] is None


def test_method_syntax():
    ms = parse_methods("ar,early-exit:E=8,K=4,rsd-s:W=4,L=4,draft-model:E=3,K=2,rsd-c:b=3x2x1,draft=truncated:2,"
                       "prompt-lookup:K=5,N=2,hf-ar,hf-early-exit:E=8,hf-prompt-lookup:K=10,hf-assistant:E=8,K=4",
                       exit_adapter="myadapter")
    by = {m.label: m for m in ms}
    assert by["early-exit:E=8,K=4"].spec.exit_layer == 8 and by["early-exit:E=8,K=4"].spec.num_speculations == 4
    assert by["early-exit:E=8,K=4"].spec.exit_adapter == "myadapter"
    assert by["rsd-s:W=4,L=4"].spec.beam_width == 4 and by["rsd-s:W=4,L=4"].spec.draft_length == 4
    assert by["draft-model:E=3,K=2"].spec.draft_model == "truncated:3"
    rc = by["rsd-c:b=3x2x1,draft=truncated:2"].spec
    assert rc.branching == "3,2,1" and rc.draft_model == "truncated:2" and rc.exit_adapter is None
    assert by["prompt-lookup:K=5,N=2"].spec.max_ngram == 2
    assert by["hf-assistant:E=8,K=4"].is_hf and by["hf-assistant:E=8,K=4"].params == {"E": 8, "K": 4}
    for bad in ("", "nope", "ar,ar", "early-exit:Z=1", "early-exit:E=0", "hf-assistant", "E=3,ar", "hf-ar:K=x"):
        with pytest.raises(SpeculantError):
            parse_methods(bad)


def test_method_syntax_verification_rule():
    ms = parse_methods("early-exit:E=2,verif=block,eagle:K=3,verif=traversal,rsd-c:b=2x1,verif=traversal,specinfer")
    assert [m.spec.verification for m in ms] == ["block", "traversal", "traversal", "token"]
    for bad in ("early-exit:verif=nope", "rsd-c:verif=block", "rsd-s:verif=traversal", "ar:verif=block",
                "hf-ar:verif=block"):
        with pytest.raises(SpeculantError, match="verif"):
            parse_methods(bad)


def test_datasets_and_errors(tmp_path):
    assert len(load_prompts("builtin", limit=1)) == len({p.category for p in load_prompts("builtin")})
    he = load_prompts("humaneval", limit=2)
    assert len(he) == 2 and he[0].id == "HumanEval/0" and "def " in he[0].text
    with pytest.raises(SpeculantError, match="allowed"):
        load_prompts("builtin", categories=["nope"])
    with pytest.raises(SpeculantError):
        load_prompts(str(tmp_path / "missing.jsonl"))
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"x": 1}\n')
    with pytest.raises(SpeculantError, match="line 1"):
        load_prompts(str(bad))


def test_mbsu_cost_ratio():
    model = tiny_model()
    dec = model.decoder
    c = draft_cost_ratio(dec, exit_layer=2)
    assert 0 < c < 1
    assert weight_bytes(dec, 2) < weight_bytes(dec)
    assert mbsu(3.0, 0.5, 4) == pytest.approx(1.0)
    assert mbsu(1.0, 0.0, 0) == 1.0


def test_best_config(tmp_path, monkeypatch):
    from speculant.bench.sweep import best_config, run_sweep
    monkeypatch.setenv("SPECULANT_CACHE", str(tmp_path))
    with pytest.raises(SpeculantError, match="speculant sweep"):
        best_config("tiny")
    with pytest.raises(SpeculantError, match=r"speculant sweep --model tiny --exit-layers 4,8,12 --num-spec"):
        best_config("tiny", num_layers=13)              # exit layers the model has (1 .. 12)
    model = tiny_model(seed=1, scale=2.0)
    out = run_sweep(model, load_prompts("builtin", limit=1)[:1], [1, 2], [2, 3], BenchConfig(max_new_tokens=6),
                    tmp_path / "sw", progress=False)
    assert len(out["grid"]) == 4 and (tmp_path / "sw" / "sweep_acceptance_rate.png").is_file()
    best = best_config("tiny")
    assert best == out["best"] and set(best) == {"exit_layer", "num_speculations"}


def test_interrupt_leaves_partial_results(tmp_path, monkeypatch):
    from speculant.bench import runner
    model = tiny_model(seed=1, scale=2.0)
    prompts = load_prompts("builtin")[:3]
    real, calls = runner._Ours.run, []

    def run(self, ids, cfg, max_new):
        calls.append(1)
        if len(calls) == 4:                 # warm-up, prompt 1, prompt 2, then Ctrl-C on prompt 3
            raise KeyboardInterrupt
        return real(self, ids, cfg, max_new)
    monkeypatch.setattr(runner._Ours, "run", run)
    with pytest.raises(KeyboardInterrupt):
        run_benchmark(model, prompts, parse_methods("ar"), BenchConfig(max_new_tokens=4), tmp_path, progress=False)
    saved = json.loads((tmp_path / "results.json").read_text())
    assert saved["meta"]["interrupted"] and len(saved["records"]) == 2
    assert (tmp_path / "report.md").is_file()


def test_cost_model_formulas():
    from speculant.bench.costs import expected_block_efficiency, expected_speedup, required_acceptance
    assert expected_block_efficiency(0.0, 4) == 1.0
    assert expected_block_efficiency(1.0, 4) == 5.0
    assert abs(expected_block_efficiency(0.5, 2) - 1.75) < 1e-12          # 1 + 0.5 + 0.25
    assert abs(expected_speedup(0.5, 2, 0.25, 1.0) - 1.75 / 1.5) < 1e-12
    a = required_acceptance(1.6, 3, 0.1, 1.0)
    assert abs(expected_speedup(a, 3, 0.1, 1.0) - 1.6) < 1e-6
    assert expected_speedup(a - 1e-3, 3, 0.1, 1.0) < 1.6
    assert required_acceptance(1.6, 1, 0.5, 1.0) is None                   # 2 / 1.5 < 1.6 even at alpha = 1
    with pytest.raises(SpeculantError, match="alpha=1.5"):
        expected_block_efficiency(1.5, 2)
    with pytest.raises(SpeculantError, match="c_verify=0"):
        expected_speedup(0.5, 2, 0.1, 0)


def test_measure_step_costs_tiny_model():
    from speculant.bench.costs import measure_step_costs
    dec = tiny_model().decoder
    costs = measure_step_costs(dec, [1, 2], [1, 3], context=8, repeats=2)
    assert costs.ar_step_s > 0 and set(costs.draft_step_s) == {1, 2}
    assert set(costs.verify_s) == {(1, 1), (1, 3), (2, 1), (2, 3)}
    assert all(costs.c_verify(e, k) > 0 for e, k in costs.verify_s)
    with pytest.raises(SpeculantError, match="exit layer 9"):
        measure_step_costs(dec, [9], [1], context=8)
    with pytest.raises(SpeculantError, match="num_speculations=0"):
        measure_step_costs(dec, [1], [0], context=8)


def test_cost_ratio_with_exit_adapter_counts_adapter_bytes():
    import torch

    from speculant.bench.mbsu import exit_head_bytes
    from speculant.drafters.exit_adapter import ExitHead
    from speculant.training.adapter import new_adapter
    model = tiny_model()
    dec = model.decoder
    ad = new_adapter(model, 1, num_blocks=1, vocab_ids=torch.arange(8))
    head = ExitHead(ad, dec.config.vocab_size)
    nbytes = exit_head_bytes(head)
    blocks = sum(p.numel() * 4 for p in ad.parameters())
    assert nbytes == blocks + 8 * dec.config.hidden_size * 4          # + the 8 head rows (fp32)
    layer0 = sum(p.numel() * 4 for p in dec.layers[0].parameters())
    assert draft_cost_ratio(dec, exit_layer=1, head_bytes=nbytes) == (layer0 + nbytes) / weight_bytes(dec)
    assert exit_head_bytes(None) is None


def test_methods_in_another_runtime_are_compared_within_it(tmp_path, monkeypatch):
    """``rt=`` runs a method on the same model in another weight format: greedy exactness is checked
    against the ``ar`` of that runtime, speed against the run's ``ar``."""
    from speculant.models.loading import save_hf_dir
    from speculant.runtime.loader import load_model
    monkeypatch.setenv("SPECULANT_CACHE", str(tmp_path / "cache"))
    src = save_hf_dir(tiny_model(seed=1, scale=2.0, vocab=64, hidden=64, inter=128), tmp_path / "m")
    model = load_model(str(src), weights="fp32", compile=False)
    data = tmp_path / "q.jsonl"
    data.write_text(json.dumps({"question_id": 1, "category": "qa", "turns": ["t5 t6 t7 t5 t6 t7"]}) + "\n")
    methods = parse_methods("ar,prompt-lookup:K=2,ar:rt=int4-eager,prompt-lookup:K=2,rt=int4-eager")
    res = run_benchmark(model, load_prompts(str(data)), methods, BenchConfig(max_new_tokens=10), None,
                        progress=False, chat=False)
    rows = res["summary"]["all"]
    assert all(r["mismatches_vs_ar"] == 0 for r in rows.values())
    assert rows["ar:rt=int4-eager"]["speedup_vs_ar"] is not None
    with pytest.raises(SpeculantError, match="rt='int5' is unknown"):
        parse_methods("ar:rt=int5")


def test_ignore_eos_times_every_method_on_max_new_tokens(tmp_path, monkeypatch):
    """``--ignore-eos``: an output that would end at its first token (that token made the EOS) is generated to
    ``max_new_tokens`` by ours and by transformers' baseline; without it, it ends there (the premise)."""
    data = tmp_path / "q.jsonl"
    data.write_text(json.dumps({"question_id": 1, "category": "qa", "turns": ["t5 t6 t7 t5 t6"]}) + "\n")
    model = tiny_model(seed=1, scale=2.0)
    prompts = load_prompts(str(data))
    methods = parse_methods("ar,early-exit:E=2,K=3,hf-ar")
    first = run_benchmark(model, prompts, methods[:1], BenchConfig(max_new_tokens=2), None, progress=False)
    eos = first["records"][0]["token_ids"][0]
    monkeypatch.setattr(type(model), "eos_token_ids", property(lambda self: [eos]))
    for ignore, length in ((False, 1), (True, 9)):
        res = run_benchmark(model, prompts, methods, BenchConfig(max_new_tokens=9, ignore_eos=ignore), None,
                            progress=False, chat=False)
        assert [len(r["token_ids"]) for r in res["records"]] == [length] * 3, ignore
