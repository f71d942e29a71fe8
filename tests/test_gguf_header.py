"""The GGUF header read once (speculant/models/gguf_header.py) and what transformers makes of it
(speculant/models/gguf_hf.py): equal to ``gguf.GGUFReader``'s tensors and to transformers' config and tokenizer, and
a load that never parses the file with ``GGUFReader`` / ``load_gguf_checkpoint`` (first load) or reads its header at
all (later loads)."""

from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch
import transformers.modeling_gguf_pytorch_utils as hf_gguf
from gguf_helpers import write_tiny_gguf
from transformers import AutoTokenizer

from speculant.models import gguf_header, gguf_hf, loading
from speculant.models.gguf_header import StringArray, read_header


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    d = tmp_path_factory.mktemp("hdr")
    return {"llama": write_tiny_gguf(d / "l.gguf", "Q4_1", inter=256, types={"blk.0.ffn_down.weight": "Q4_K"}),
            "qwen2": write_tiny_gguf(d / "q2.gguf", "Q8_0", arch="qwen2", seed=1),
            "qwen3": write_tiny_gguf(d / "q3.gguf", "BF16", arch="qwen3", seed=2, head_dim=32),
            "gemma3": write_tiny_gguf(d / "g3.gguf", "F16", arch="gemma3", seed=3),
            "mistral": write_tiny_gguf(d / "m.gguf", "Q5_0", seed=4, name="mistral")}


@pytest.mark.parametrize("case", ["llama", "qwen2", "qwen3", "gemma3", "mistral"])
def test_header_tensors_config_and_tokenizer_equal_gguf_and_transformers(files, case):
    path = files[case]
    ours, ref = read_header(path), gguf.GGUFReader(str(path))
    assert [t.name for t in ours.tensors] == [t.name for t in ref.tensors]
    for a, b in zip(ours.tensors, ref.tensors):
        assert (a.tensor_type, a.shape, a.n_bytes, a.data_offset) == (b.tensor_type, tuple(b.shape.tolist()),
                                                                      int(b.n_bytes), int(b.data_offset)), a.name
        assert a.data.dtype == b.data.dtype and np.array_equal(a.data, b.data), a.name
    assert isinstance(ours.field("tokenizer.ggml.tokens"), StringArray)
    assert ours.field("tokenizer.ggml.tokens").count == len(ref.fields["tokenizer.ggml.tokens"].data)
    assert read_header(path, ("tokenizer.ggml.tokens",)).field("tokenizer.ggml.tokens") == \
        ref.fields["tokenizer.ggml.tokens"].contents()
    parsed = hf_gguf.load_gguf_checkpoint(str(path), return_tensors=False)["config"]
    assert gguf_hf.config_dict(ours) == parsed
    tok = gguf_hf.tokenizer(path, parsed["model_type"])
    want = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    assert type(tok) is type(want)
    text = "hello world, the cat sat"
    assert tok.encode(text) == want.encode(text) and tok.all_special_ids == want.all_special_ids


def test_a_truncated_file_is_refused_by_the_header_reader(files, tmp_path):
    raw = files["llama"].read_bytes()
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(raw[:len(raw) - 100])
    with pytest.raises(ValueError, match="past the end"):
        read_header(cut)


def test_first_load_never_parses_with_gguf_reader_and_later_loads_read_no_header(files, monkeypatch, in_process):
    def refuse(*a, **k):
        raise AssertionError("the full GGUF parse ran")
    monkeypatch.setattr(gguf.GGUFReader, "__init__", refuse)
    monkeypatch.setattr(hf_gguf, "load_gguf_checkpoint", refuse)
    path = str(files["gemma3"])
    ids = torch.tensor([[3, 9, 27, 81]])
    with torch.inference_mode():
        want = loading.read_checkpoint(path).decoder(ids)
    monkeypatch.setattr(gguf_header, "read_header", refuse)        # later: the conversion's files only
    assert loading.weights_for(path, "auto") == "auto"
    with torch.inference_mode():
        assert torch.equal(loading.read_checkpoint(path).decoder(ids), want)
    assert (loading.converted_dir(path) / "tokenizer.json").is_file()
