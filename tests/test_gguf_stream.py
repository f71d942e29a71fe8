"""GGUF weights read straight from the file, tensor by tensor (speculant/models/gguf_tensors.py): bit for bit
transformers' GGUF loader, a first load that writes no float32 copy of the model, and one that equals the float32
conversion's load."""

from __future__ import annotations

import pytest
import torch
from gguf_helpers import write_tiny_gguf

from speculant.errors import SpeculantError
from speculant.models import gguf_tensors, loading
from speculant.models.gguf_header import read_header
from speculant.models.loading import read_checkpoint
from speculant.runtime.loader import load_model

CASES = ["llama", "llama-tied", "qwen2", "qwen3", "gemma3", "mistral", "split"]


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    d = tmp_path_factory.mktemp("stream")
    return {"llama": write_tiny_gguf(d / "l.gguf", "Q4_1", inter=256, types={"blk.0.ffn_down.weight": "Q4_K",
                                                                            "blk.1.ffn_down.weight": "Q6_K"}),
            "llama-tied": write_tiny_gguf(d / "lt.gguf", "Q8_0", tie=True, seed=5),
            "qwen2": write_tiny_gguf(d / "q2.gguf", "Q8_0", arch="qwen2", seed=1),
            "qwen3": write_tiny_gguf(d / "q3.gguf", "BF16", arch="qwen3", seed=2, head_dim=32),
            "gemma3": write_tiny_gguf(d / "g3.gguf", "F16", arch="gemma3", seed=3),
            "mistral": write_tiny_gguf(d / "m.gguf", "Q5_0", seed=4, name="mistral"),
            "split": write_tiny_gguf(d / "s.gguf", "Q4_0", seed=6, split_max_tensors=7)}


def _headers(path):
    from speculant.models.gguf_files import shard_paths
    return [read_header(p) for p in shard_paths(path)]


@pytest.mark.parametrize("case", CASES)
def test_each_tensor_is_transformers_gguf_loaders_bit_for_bit(case, files, in_process):
    """Every weight :class:`GGUFTensors` takes equals ``load_gguf_checkpoint(return_tensors=True)``'s tensor of that
    name (its dequantization, tensor processor and name map), and the name map built from our config's weight names
    equals the one built from transformers' own model."""
    import numpy as np
    from transformers import AutoModelForCausalLM, AutoConfig
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    path = files[case]
    cfg = read_checkpoint(str(path)).config
    tensors = gguf_tensors.open_gguf(path, cfg)
    assert tensors.keys == loading.expected_hf_keys(cfg) and tensors.unmapped == []
    hf_config = AutoConfig.from_pretrained(str(loading.converted_dir(str(path))))
    with torch.device("meta"):
        meta = AutoModelForCausalLM.from_config(hf_config)
    headers = _headers(path)
    assert gguf_tensors.weights_map(cfg, headers, tensors._processor, model=meta) == tensors._names
    if case in ("split", "mistral"):   # transformers' loader reads one file, and fails on a llama file named
        return                         # "mistral" (no gguf-py names for that model_type): the name map is checked above
    reference = load_gguf_checkpoint(str(path), return_tensors=True, model_to_load=meta)["tensors"]
    for name in sorted(tensors.keys):
        want = torch.from_numpy(np.asarray(reference[name], dtype=np.float32))
        got = tensors.take(name)
        assert got.dtype == torch.float32 and torch.equal(got, want), name
    ordered = [name for name, _ in tensors.items()]
    assert sorted(ordered) == sorted(tensors.keys)


@pytest.mark.parametrize("case", ["llama", "gemma3", "split"])
def test_a_streamed_load_equals_the_float32_conversions_and_writes_no_float32_copy(case, files, tmp_path, monkeypatch,
                                                                                   in_process):
    monkeypatch.setenv("SPECULANT_CACHE", str(tmp_path / "cache"))
    path = str(files[case])
    streamed = load_model(path, weights="fp32", compile=False)
    converted = loading.converted_dir(path)
    assert (converted / "gguf.json").is_file() and not (converted / "model.safetensors").exists()
    whole = read_checkpoint(path)                   # adds model.safetensors to the same directory
    assert (converted / "model.safetensors").is_file()
    ours, theirs = streamed.decoder.state_dict(), whole.decoder.state_dict()
    assert ours.keys() == theirs.keys()
    for k in ours:
        assert torch.equal(ours[k], theirs[k]), k
    again = load_model(path, weights="fp32", compile=False)      # the directory's weights file is not read back
    assert all(torch.equal(v, again.decoder.state_dict()[k]) for k, v in ours.items())


def test_a_layer_tensor_the_config_has_no_place_for_is_refused_in_one_line(tmp_path, monkeypatch, in_process):
    monkeypatch.setenv("SPECULANT_CACHE", str(tmp_path / "cache"))
    path = write_tiny_gguf(tmp_path / "b.gguf", "Q8_0", extra=("blk.0.attn_output.bias",))
    with pytest.raises(SpeculantError, match=r"has unexpected ones \['blk.0.attn_output.bias'\].*allowed: exactly"):
        load_model(str(path), weights="w4a8", compile=False)
    assert not loading.converted_dir(str(path)).exists()


def test_a_w4a8_load_reads_no_float_weight_it_packs_from_codes_and_keeps_the_embedding_in_a_file(
        tmp_path, monkeypatch, in_process):
    """The projections ``w4a8`` packs from the file's own codes are never dequantized (only the tuner's sample
    layer is), the token embedding is spooled to a file and copied into the packed file from there, and the packed
    file loads back to the same model."""
    from speculant.runtime import store, tune

    monkeypatch.setenv("SPECULANT_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(tune, "sample_layers", lambda n, shapes=None: [0])
    path = write_tiny_gguf(tmp_path / "w.gguf", "Q4_1", layers=4, seed=8)
    taken = []
    take = gguf_tensors.GGUFTensors.take
    monkeypatch.setattr(gguf_tensors.GGUFTensors, "take", lambda self, name: taken.append(name) or take(self, name))
    copied = []
    copy = store._copy_file
    monkeypatch.setattr(store, "_copy_file", lambda src, out, n: copied.append(n) or copy(src, out, n))
    first = load_model(str(path), weights="w4a8", compile=False)
    assert first.decoder.weight_format == "w4a8"
    projections = [n for n in taken if n.startswith("model.layers.") and n.endswith("proj.weight")]
    assert projections and {n.split(".")[2] for n in projections} == {"0"}
    assert "model.embed_tokens.weight" not in taken
    cfg = read_checkpoint(str(path)).config
    embed = gguf_tensors.open_gguf(path, cfg).take("model.embed_tokens.weight")
    assert copied == [embed.numel() * 4]
    packed = store.packed_path(loading.converted_dir(str(path)), "w4a8")
    assert torch.equal(store.read_safetensors(packed)[1]["embed_tokens.weight"], embed)
    assert torch.equal(first.decoder.embed_tokens.weight, embed)
    again = load_model(str(path), weights="w4a8", compile=False)
    ours, theirs = first.decoder.state_dict(), again.decoder.state_dict()
    assert ours.keys() == theirs.keys() and all(torch.equal(ours[k], theirs[k]) for k in ours)


def test_a_deep_copy_of_a_streamed_gguf_decoder_holds_its_embedding_in_memory(tmp_path, monkeypatch, in_process):
    """A truncated draft model deep-copies the target's decoder: an ``fp32`` GGUF decoder's embedding is mapped from
    an open temporary file, which the copy does not share (its embedding is an in-memory copy of the same values)."""
    import copy

    from speculant.models.streaming import SpooledFiles
    monkeypatch.setenv("SPECULANT_CACHE", str(tmp_path / "cache"))
    decoder = load_model(str(write_tiny_gguf(tmp_path / "c.gguf", "Q8_0", seed=9)), weights="fp32",
                         compile=False).decoder
    assert set(decoder.spooled) == {"embed_tokens.weight"} and isinstance(decoder.spooled, SpooledFiles)
    twin = copy.deepcopy(decoder)
    assert twin.spooled == {} and set(decoder.spooled) == {"embed_tokens.weight"}
    assert torch.equal(twin.embed_tokens.weight, decoder.embed_tokens.weight)
    assert twin.embed_tokens.weight.data_ptr() != decoder.embed_tokens.weight.data_ptr()


def test_a_spooled_tensor_reads_the_same_after_its_resident_pages_are_handed_back(tmp_path):
    """The loader hands back the pages of a spooled embedding after the timings read it whole: later reads map
    the same values from the file again; the file holds the tensor's bytes from offset 0 (what the packed copy
    copies); blocks that do not make the shape are refused."""
    from speculant.models.streaming import spool_rows
    blocks = [torch.randn(3, 2048), torch.randn(5, 2048)]
    expect = torch.cat(blocks)
    tensor, spool = spool_rows(iter(blocks), (8, 2048), tmp_path)
    assert torch.equal(tensor, expect) and spool.address == tensor.data_ptr()
    spool.drop_pages()
    assert torch.equal(tensor, expect)
    spool.file.seek(0)
    assert spool.file.read() == expect.numpy().tobytes()
    with pytest.raises(ValueError, match="3 rows written for a tensor of shape"):
        spool_rows(iter(blocks[:1]), (8, 2048), tmp_path)
    with pytest.raises(ValueError, match=r"a block of shape \(3, 2048\) in a tensor of shape \(3, 1024\)"):
        spool_rows(iter(blocks[:1]), (3, 1024), tmp_path)


@pytest.mark.parametrize("case", ["llama", "gemma3"])
def test_the_transformers_baseline_of_a_packed_gguf_model_has_its_float32_weights(case, files, tmp_path, monkeypatch,
                                                                                  in_process):
    """``bench``'s ``hf-*`` baselines run transformers on the model's float32 weights: a GGUF model loaded in
    ``w4a8`` has no float32 checkpoint (only its packed copy, which is not one), so the baseline writes it once; its
    logits are our float32 forward's (Gemma's scaled embedding included)."""
    from speculant.bench.hf_baselines import hf_model_for
    monkeypatch.setenv("SPECULANT_CACHE", str(tmp_path / "cache"))
    path = str(files[case])
    packed = load_model(path, weights="w4a8", compile=False)
    converted = loading.converted_dir(path)
    assert not (converted / "model.safetensors").exists() and list(converted.glob("packed-*.safetensors"))
    with pytest.raises(SpeculantError, match="has no \\*.safetensors weight files"):
        loading.weight_files(converted)                 # the packed copy is not the checkpoint
    hf = hf_model_for(packed)
    assert (converted / "model.safetensors").is_file()
    ours = read_checkpoint(path)
    ids = torch.tensor([[3, 1, 4, 1, 5, 9, 2, 6]])
    with torch.no_grad():
        torch.testing.assert_close(hf(ids).logits, ours.decoder(ids), rtol=1e-4, atol=1e-4)


def test_projections_left_unread_are_fused_without_importing_torch_dynamo():
    """The projections ``w4a8`` packs from the file's codes stay meta tensors while a layer is read
    (``streaming.WithoutWeights``); fusing them (q|k|v, gate|up) gives the fused shape and, unlike torch's meta
    ``cat`` (a Python reference whose first call imports ``torch._dynamo`` and sympy, ~70 MiB of a first load),
    imports nothing (a fresh interpreter: the test process may have imported them already)."""
    import subprocess
    import sys
    code = ("import sys, torch\n"
            "from speculant.models.loading import _cat_rows\n"
            "parts = [torch.empty(4, 8, device='meta'), torch.empty(2, 8, device='meta')]\n"
            "out = _cat_rows(parts)\n"
            "assert out.is_meta and out.shape == (6, 8) and out.dtype == torch.float32, out\n"
            "assert 'torch._dynamo' not in sys.modules and 'sympy' not in sys.modules\n"
            "real = [torch.randn(4, 8), torch.randn(2, 8)]\n"
            "assert torch.equal(_cat_rows(real), torch.cat(real))\n"
            "torch.cat(parts)\n"
            "print('torch._dynamo' in sys.modules)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip() == "True"          # the premise: torch's own meta cat does import it
