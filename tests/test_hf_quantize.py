"""HF checkpoints quantized on load by llama.cpp's reference quantizers (issue 26 item 4).

A tiny random Llama-3.2-shaped checkpoint (llama3 RoPE scaling, tied embeddings, bfloat16, sharded: what a LayerSkip
checkpoint such as facebook/layerskip-llama3.2-1B is) loaded with ``--weights w4a8``: every projection's codes are the
bytes ``gguf.quants.quantize`` writes (Q4_1 for the layers, Q8_0 for the LM head), and early-exit self-speculation on
it is token-identical to ``ar``.
"""

import pytest
import torch
from gguf import GGMLQuantizationType
from gguf.quants import dequantize, quantize
from helpers import word_tokenizer
from transformers import LlamaConfig, LlamaForCausalLM

from speculant import GenerationConfig, build_generator
from speculant.kernels import build
from speculant.models.loading import read_checkpoint
from speculant.runtime.formats import PROJECTIONS, quantize_q4, quantize_q8
from speculant.runtime.loader import load_model

VOCAB = 96
LLAMA32 = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
               num_key_value_heads=2, tie_word_embeddings=True, max_position_embeddings=256, bos_token_id=None,
               eos_token_id=None, pad_token_id=None,
               rope_parameters={"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                "original_max_position_embeddings": 64, "rope_theta": 500000.0})


def reference(w: torch.Tensor, kind: GGMLQuantizationType) -> torch.Tensor:
    """``w`` through gguf's quantizer and back."""
    return torch.from_numpy(dequantize(quantize(w.float().numpy(), kind), kind)).reshape(w.shape)


@pytest.mark.parametrize("make, kind", [(quantize_q4, GGMLQuantizationType.Q4_1), (quantize_q8, GGMLQuantizationType.Q8_0)])
def test_our_quantizers_are_gguf_s(make, kind):
    torch.manual_seed(0)
    w = torch.randn(40, 128) * 0.05
    w[1, 32:64] = 0.0                                   # an all-zero block (scale 0)
    w[2, :32] = 0.3                                     # a constant block
    assert torch.equal(make(w).dequantize(), reference(w, kind))
    # the check can fail: codes made from the float16-rounded scale (our quantizers before) are not gguf's
    plain = w[3:]                                       # no zero-scale blocks (they would give NaN there)
    assert not torch.equal(rounded_scale_quantizer(plain, kind is GGMLQuantizationType.Q4_1), reference(plain, kind))


def rounded_scale_quantizer(w: torch.Tensor, offset: bool) -> torch.Tensor:
    """Dequantized ``w`` by a quantizer that rounds the scale (and min) to float16 before making the codes."""
    g = w.view(w.shape[0], -1, 32)
    if offset:
        lo = g.amin(-1, keepdim=True).half().float()
        d = ((g.amax(-1, keepdim=True) - lo) / 15).half().float()
        return (torch.round((g - lo) / d).clamp(0, 15) * d + lo).view_as(w)
    d = (g.abs().amax(-1, keepdim=True) / 127).half().float()
    return (torch.round(g / d).clamp(-127, 127) * d).view_as(w)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    path = tmp_path_factory.mktemp("layerskip-like")
    torch.manual_seed(0)
    hf = LlamaForCausalLM(LlamaConfig(**LLAMA32)).eval()
    with torch.no_grad():
        for name, p in hf.named_parameters():
            p.copy_(1 + 0.1 * torch.randn_like(p) if "norm" in name else 0.3 * torch.randn_like(p))
    hf.to(torch.bfloat16).save_pretrained(path, max_shard_size="100KB")
    word_tokenizer(VOCAB).save_pretrained(path)
    return path


@pytest.mark.skipif(not build.available(), reason="our kernels do not build here (no C compiler)")
def test_checkpoint_quantized_on_load_is_gguf_s_bytes_and_self_speculation_is_exact(checkpoint):
    assert len(list(checkpoint.glob("*.safetensors"))) > 1            # sharded
    floats = read_checkpoint(str(checkpoint)).decoder
    model = load_model(str(checkpoint), weights="w4a8", compile=False)
    for i, (ours, ref) in enumerate(zip(model.decoder.layers, floats.layers)):
        for name in PROJECTIONS:
            w = ref.get_submodule(name).weight
            assert torch.equal(ours.get_submodule(name).dequantized_weight(),
                               reference(w, GGMLQuantizationType.Q4_1)), (i, name)
    cfg = GenerationConfig(max_new_tokens=24, chat=False)
    prompt = [5, 17, 33, 2, 71, 5, 17]
    ar = build_generator(model, method="ar").generate(prompt, cfg).token_ids
    for spec in (dict(method="early-exit", exit_layer=2, num_speculations=3),
                 dict(method="rsd-s", exit_layer=1, beam_width=2, draft_length=3)):
        gen = build_generator(model, speculation="always", **spec)
        out = gen.generate(prompt, cfg)
        assert out.token_ids == ar, spec
        assert out.stats.drafted_tokens > 0
