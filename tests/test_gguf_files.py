"""``--model PATH.gguf``: tiny GGUF files written here with the ``gguf`` package, loaded through our runtime.

Checked: the float32 weights equal ``gguf.dequantize`` of the file bit for bit (q/k rows in HF order, as transformers'
GGUF loader puts them) for every type taken; fp32 logits equal transformers' forward of the same file; ``w4a8`` packs
the file's own Q4_0/Q4_1 codes; greedy ``prompt-lookup`` equals ``ar``; the CLI runs a file end to end; bad files are
refused in one line (exit code 2) with nothing left in the cache.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from gguf import GGUFReader, dequantize
from gguf_helpers import write_tiny_gguf
from helpers import one_line_error

from speculant import GenerationConfig, build_generator
from speculant.cli import main
from speculant.engine.stats import GenerationStats
from speculant.errors import SpeculantError
from speculant.models import loading
from speculant.models.loading import ours_to_hf_state, read_checkpoint
from speculant.runtime.formats import format_available
from speculant.runtime.loader import load_model

PROMPT_IDS = [258, 260, 221, 263, 258, 260, 221, 263, 258, 260]


@pytest.fixture(scope="module")
def files(tmp_path_factory) -> dict[str, Path]:
    d = tmp_path_factory.mktemp("gguf")
    out = {kind: write_tiny_gguf(d / f"tiny-{kind}.gguf", kind) for kind in
           ("F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1")}
    out["Q4_1-tied"] = write_tiny_gguf(d / "tiny-q41-tied.gguf", "Q4_1", tie=True, seed=1)
    out["qwen2"] = write_tiny_gguf(d / "tiny-qwen2.gguf", "Q4_0", arch="qwen2", seed=2)
    out["mistral"] = write_tiny_gguf(d / "tiny-mistral.gguf", "Q8_0", seed=4, name="mistral")
    out["K"] = write_tiny_gguf(d / "tiny-k.gguf", "Q8_0", inter=256, seed=3,
                               types={"blk.0.ffn_down.weight": "Q4_K", "blk.1.ffn_down.weight": "Q6_K"})
    return out


def _file_weights(path: Path) -> dict[str, torch.Tensor]:
    """``gguf.dequantize`` of every tensor of ``path``, named as HF names them, q/k rows put back in HF order for
    ``llama`` files (the inverse of llama.cpp's converter's permutation)."""
    reader = GGUFReader(str(path))
    llama = reader.fields["general.architecture"].contents() == "llama"
    heads = int(reader.fields[f"{reader.fields['general.architecture'].contents()}.attention.head_count"].contents())
    kv_heads = int(reader.fields[f"{reader.fields['general.architecture'].contents()}.attention.head_count_kv"].contents())
    names = {"token_embd.weight": "model.embed_tokens.weight", "output_norm.weight": "model.norm.weight",
             "output.weight": "lm_head.weight"}
    parts = {"attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
             "attn_output": "self_attn.o_proj", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
             "ffn_down": "mlp.down_proj", "attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm"}
    out = {}
    for t in reader.tensors:
        w = np.array(dequantize(t.data, t.tensor_type), dtype=np.float32)
        if t.name.startswith("blk."):
            _, i, part, kind = t.name.split(".")
            name = f"model.layers.{i}.{parts[part]}.{kind}"
            if llama and part in ("attn_q", "attn_k") and kind == "weight":
                n = heads if part == "attn_q" else kv_heads
                w = w.reshape(n, w.shape[0] // n // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)
        else:
            name = names[t.name]
        out[name] = torch.from_numpy(w)
    if "lm_head.weight" not in out:
        out["lm_head.weight"] = out["model.embed_tokens.weight"]
    return out


CASES = ("F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q4_1-tied", "qwen2", "mistral", "K")


@pytest.mark.parametrize("case", CASES)
def test_float32_weights_are_the_files_dequantized_and_logits_match_transformers(case, files, in_process):
    from transformers import AutoModelForCausalLM
    model = read_checkpoint(str(files[case]))
    ours = ours_to_hf_state(model.decoder)
    expected = _file_weights(files[case])
    assert set(ours) == set(expected)
    for name, w in expected.items():
        assert torch.equal(ours[name], w), name
    if case == "mistral":      # transformers' GGUF loader names no tensors for model_type mistral: its forward of
        ref = AutoModelForCausalLM.from_pretrained(str(model.path), dtype=torch.float32).eval()    # the weights
    else:
        ref = AutoModelForCausalLM.from_pretrained(str(files[case].parent), gguf_file=files[case].name,
                                                   dtype=torch.float32).eval()
    ids = torch.tensor([PROMPT_IDS])
    with torch.inference_mode():
        got, want = model.decoder(ids)[0], ref(ids).logits[0]
    assert float((got - want).abs().max() / want.abs().max()) < 1e-4
    assert model.config.model_type == {"qwen2": "qwen2", "mistral": "mistral"}.get(case, "llama")


def _q4_blocks(path: Path, tensor: str) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(codes ``[O, I]``, scale ``[O, I/32]``, offset ``[O, I/32]``) of a Q4_0/Q4_1 tensor, read from its bytes."""
    t = next(t for t in GGUFReader(str(path)).tensors if t.name == tensor)
    head = 2 if t.tensor_type.name == "Q4_0" else 4
    b = np.asarray(t.data).reshape(t.data.shape[0], -1, head + 16)
    d = b[..., 0:2].copy().view(np.float16)[..., 0].astype(np.float32)
    m = -8 * d if head == 2 else b[..., 2:4].copy().view(np.float16)[..., 0].astype(np.float32)
    q = b[..., head:]
    return np.concatenate([q & 15, q >> 4], -1).reshape(t.data.shape[0], -1), d, m


@pytest.mark.skipif(not format_available("w4a8"), reason="our w4a8 kernel does not build on this machine")
@pytest.mark.parametrize("case", ("Q4_1-tied", "qwen2"))
def test_w4a8_packs_the_files_own_codes_and_prompt_lookup_equals_ar(case, files):
    model = load_model(str(files[case]), weights="w4a8", compile=False)       # converted in a child process
    assert model.weights == "w4a8" and model.fused and model.name == str(files[case])
    assert (loading.converted_dir(str(files[case])) / "gguf.json").is_file()
    layer = model.decoder.layers[1]
    for proj, tensor in ((layer.mlp.down_proj, "blk.1.ffn_down.weight"), (layer.self_attn.o_proj, "blk.1.attn_output.weight")):
        gq = proj.group_quantized()
        codes, scale, offset = _q4_blocks(files[case], tensor)
        assert torch.equal(gq.codes, torch.from_numpy(codes.astype(np.uint8)))
        assert torch.equal(gq.scale, torch.from_numpy(scale)) and torch.equal(gq.offset, torch.from_numpy(offset))
    q_rows = model.config.num_attention_heads * model.config.head_dim
    q = layer.self_attn.qkv_proj.group_quantized().codes[:q_rows]
    file_q = torch.from_numpy(_q4_blocks(files[case], "blk.1.attn_q.weight")[0].astype(np.uint8))
    if case == "qwen2":                        # qwen2 files keep q/k rows in HF order
        assert torch.equal(q, file_q)
    else:                                      # llama files: llama.cpp's permutation undone
        h = model.config.num_attention_heads
        assert torch.equal(q, file_q.view(h, -1, 2, file_q.shape[1]).transpose(1, 2).reshape(file_q.shape))
    for weights in ("w4a8", "fp32"):
        m = model if weights == "w4a8" else load_model(str(files[case]), weights="fp32", compile=False)
        config = GenerationConfig(max_new_tokens=16)
        specs = {"ar": {"method": "ar"}, "prompt-lookup": {"method": "prompt-lookup", "num_speculations": 3}}
        runs = {name: [t for b in build_generator(m, **spec).generate_blocks(PROMPT_IDS, config, GenerationStats())
                       for t in b] for name, spec in specs.items()}
        assert runs["ar"] == runs["prompt-lookup"] and len(runs["ar"]) > 0, weights


def test_q2_k_and_q3_k_load_in_fp32_only(in_process, capsys, tmp_path):
    """Q2_K/Q3_K: exact in fp32 only (the other K-quants and Q5 run as stored in w4a8: tests/test_kquants.py)."""
    path = str(write_tiny_gguf(tmp_path / "k.gguf", "Q8_0", inter=256, types={"blk.1.ffn_down.weight": "Q3_K",
                                                                             "blk.0.ffn_down.weight": "Q4_K"}))
    for weights in ("w4a8", "int4", "int8", "bf16"):
        with pytest.raises(SpeculantError, match=f"weights='{weights}' would requantize the Q3_K weights .* allowed "
                                                 "for this file: fp32, auto"):
            load_model(path, weights=weights, compile=False)
    assert not loading.converted_dir(path).exists()                  # refused before any conversion
    model = load_model(path, weights="auto", compile=False)
    assert model.weights == "fp32"
    assert "holds Q3_K, Q4_K weights, taken exactly in fp32 only: weights auto loads fp32" in capsys.readouterr().err
    assert loading.weights_for(path, "auto") == "fp32"           # now read from the conversion's gguf.json


def test_the_conversion_is_cached_by_path_size_and_mtime_and_never_left_half_written(tmp_path, monkeypatch, in_process):
    monkeypatch.setenv("SPECULANT_CACHE", str(tmp_path / "cache"))
    path = write_tiny_gguf(tmp_path / "m.gguf", "Q8_0", layers=1)
    first = loading.converted_dir(str(path))
    assert first.parent == tmp_path / "cache" / "gguf" and first.name.startswith("m-")

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt
    with monkeypatch.context() as m:
        m.setattr(loading, "write_safetensors_stream", interrupted)
        with pytest.raises(KeyboardInterrupt):
            read_checkpoint(str(path))
    assert list((tmp_path / "cache" / "gguf").iterdir()) == []
    read_checkpoint(str(path))
    assert (first / "model.safetensors").is_file()
    os.utime(path, ns=(path.stat().st_atime_ns, path.stat().st_mtime_ns + 10**9))
    assert loading.converted_dir(str(path)) != first                 # a changed file is converted again


def test_a_known_models_own_file_by_path_is_that_model(tmp_path):
    """SmolLM2's installed GGUF by its path, or by a link to it, loads as ``smollm2-135m`` (one conversion, one packed
    copy, its shipped artefacts); any other file, and a name, stay as given."""
    own = loading.find_gguf(loading.KNOWN_MODELS["smollm2-135m"])
    link = tmp_path / "my-smollm2.gguf"
    link.symlink_to(own)
    assert loading.known_name(str(own)) == loading.known_name(str(link)) == "smollm2-135m"
    other = write_tiny_gguf(tmp_path / "other.gguf", "Q8_0", layers=1)
    copy = tmp_path / "copy.gguf"                        # the same bytes elsewhere: another file (keyed by path)
    copy.write_bytes(own.read_bytes()[:4096])
    for name in (str(other), str(copy), "smollm2-135m", str(tmp_path)):
        assert loading.known_name(name) == name


def _bad_files(d: Path) -> dict[str, tuple[Path, str]]:
    good = write_tiny_gguf(d / "good.gguf", "Q8_0", layers=1)
    raw = good.read_bytes()
    (d / "truncated.gguf").write_bytes(raw[: len(raw) - 100])
    (d / "not-gguf.gguf").write_bytes(b"GGUX" + raw[4:])
    split = d / "model-00001-of-00002.gguf"
    split.write_bytes(raw)
    f64 = d / "f64.gguf"
    from gguf import GGUFWriter
    w = GGUFWriter(str(f64), "llama")                    # one F64 tensor among a valid header
    w.add_tokenizer_model("gpt2")
    w.add_token_list(["a", "b"])
    w.add_tensor("token_embd.weight", np.zeros((2, 32), dtype=np.float64))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return {
        "missing": (d / "absent.gguf", "does not exist"),
        "truncated": (d / "truncated.gguf", "truncated or corrupt"),
        "corrupt": (d / "not-gguf.gguf", "truncated or corrupt"),
        "split": (split, "shard .*model-00002-of-00002.gguf.* of the split GGUF set .* is missing"),
        "architecture": (write_tiny_gguf(d / "phi.gguf", "Q8_0", arch="phi3", layers=1),
                         "architecture 'phi3' .* not supported; allowed: llama, qwen2"),
        "gemma2": (write_tiny_gguf(d / "g2.gguf", "Q8_0", arch="gemma2", layers=1), "'gemma2' .*soft-capping"),
        "tokenizer": (write_tiny_gguf(d / "notok.gguf", "Q8_0", tokenizer=False, layers=1), "has no tokenizer"),
        "type": (f64, "tensor token_embd.weight .* has type F64, which speculant cannot take; allowed types: F32"),
        "blocks": (write_tiny_gguf(d / "rows.gguf", "Q8_0", layers=1, types={"blk.0.ffn_up.weight": "Q4_K"}),
                   "tensor blk.0.ffn_up.weight .* corrupt: empty, or its rows are not whole blocks of 256 values"),
    }


def test_bad_files_are_one_line_exit_2_and_leave_nothing_in_the_cache(tmp_path, monkeypatch, capsys):
    import re
    cache = tmp_path / "cache"
    monkeypatch.setenv("SPECULANT_CACHE", str(cache))
    for case, (path, needle) in _bad_files(tmp_path).items():
        code = main(["generate", "hi", "--model", str(path), "--raw", "--max-new-tokens", "2", "--no-compile"])
        err = capsys.readouterr().err
        assert code == 2 and one_line_error(err) and re.search(needle, err), (case, err)
        assert not (cache / "gguf").exists() or list((cache / "gguf").iterdir()) == [], case


def test_the_cli_generates_from_a_gguf_file(tmp_path):
    path = write_tiny_gguf(tmp_path / "cli.gguf", "Q4_1", seed=5)     # first load: converted in a child process
    env = dict(os.environ, SPECULANT_COMPILE="0", SPECULANT_NUM_THREADS="1")
    out = subprocess.run([sys.executable, "-m", "speculant.cli", "generate", "cat on", "--model", str(path),
                          "--raw", "--json", "--max-new-tokens", "6", "--method", "prompt-lookup", "--weights", "fp32"],
                         capture_output=True, text=True, env=env, timeout=120)
    assert out.returncode == 0, out.stderr
    import json
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert len(result["token_ids"]) == 6
    converted = loading.converted_dir(str(path))
    assert (converted / "gguf.json").is_file() and (converted / "tokenizer.json").is_file()
    assert not (converted / "model.safetensors").exists()       # the weights were read from the file: no float32 copy
    assert not [p for p in converted.parent.iterdir() if p.name.startswith(converted.name + ".")]   # no temporary left


def test_speculant_models_lists_converted_gguf_files_and_each_models_artefacts(tmp_path, monkeypatch, in_process,
                                                                              capsys):
    """``speculant models``: the known models with their shipped draft heads and exit adapters, then the GGUF files
    converted into this cache (a file removed since is marked, not hidden)."""
    import json

    from speculant.cli import main
    monkeypatch.setenv("SPECULANT_CACHE", str(tmp_path / "cache"))
    path = write_tiny_gguf(tmp_path / "m.gguf", "Q8_0", layers=1)
    read_checkpoint(str(path))
    assert main(["models", "--json"]) == 0
    rows = {r["name"]: r for r in json.loads(capsys.readouterr().out)}
    assert rows["smollm2-135m"]["draft_heads"] == ["default", "eagle3"] and rows["smollm2-135m"]["exit_adapters"] == ["default"]
    row = rows[str(path.resolve())]
    assert row["cached"] and row["exists"] and row["draft_heads"] == [] and "llama (1 layers" in row["description"]
    path.unlink()
    assert main(["models"]) == 0
    out = capsys.readouterr().out
    assert f"{path.resolve()} file gone" in out and "draft heads: none; exit adapters: none" in out


def test_a_conversion_child_is_interrupted_when_its_parent_is_terminated(tmp_path):
    """The conversion child's guard (``child_process.interrupted_with_parent``): a parent ended by SIGTERM (no
    Python handler runs, so it cannot interrupt the child itself) leaves a child that is interrupted as by Ctrl-C,
    not one that converts on alone, even where the child inherited SIGINT ignored and blocked (as from a test
    runner's worker)."""
    import signal
    import time
    marker = tmp_path / "interrupted"
    child = ("import os, sys, time\nfrom speculant.models.child_process import interrupted_with_parent\n"
             "interrupted_with_parent(int(sys.argv[1]))\n"
             "try:\n    open(sys.argv[2] + '.ready', 'w').close()\n    time.sleep(60)\n"
             "except KeyboardInterrupt:\n    open(sys.argv[2], 'w').close()\n")   # ready inside the try: no window
    parent = ("import os, signal, subprocess, sys, time\n"          # SIGINT ignored and blocked: the child inherits both
              "signal.signal(signal.SIGINT, signal.SIG_IGN)\nsignal.pthread_sigmask(signal.SIG_BLOCK, [signal.SIGINT])\n"
              "subprocess.Popen([sys.executable, '-c', sys.argv[1], str(os.getpid()), sys.argv[2]])\ntime.sleep(60)\n")
    proc = subprocess.Popen([sys.executable, "-c", parent, child, str(marker)])
    try:
        deadline = time.monotonic() + 30
        while not Path(str(marker) + ".ready").exists():
            assert time.monotonic() < deadline, "the child never started"
            time.sleep(0.05)
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=10)
        deadline = time.monotonic() + 10
        while not marker.exists() and time.monotonic() < deadline:
            time.sleep(0.05)
        assert marker.exists(), "the child was not interrupted when its parent ended"
    finally:
        proc.kill()
