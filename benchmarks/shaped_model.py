"""A random-weight ``w4a8`` decoder of a given model's shape, built in memory (no download, no conversion).

Not a test.  Benchmarks time our kernels at shapes larger than SmolLM2-135M's with it: every projection gets
random 4-bit codes (Q4_0: a float16 scale per block of 32, offset -8 x scale, as a GGUF's Q4_0 blocks read
into :class:`~speculant.runtime.formats.W4A8Linear`), the LM head random Q8_0 codes
(:class:`~speculant.runtime.formats.W8A8Linear`, the ``w4a8`` head), norms of ones and a normal float32
embedding.  The text it writes is noise; the work of a forward (bytes read, products, attention) is that of the
real model in our runtime.

    from shaped_model import shaped_decoder
    from speculant.runtime.executor import Executor
    decoder = shaped_decoder("llama-3.2-1b")      # ~0.9 GB of codes, ~1 GB of embedding; a few seconds
    run = Executor(decoder, torch.float16)        # the fused step over a float16 KV cache
"""

from __future__ import annotations

import torch

from speculant.models.config import ModelConfig
from speculant.models.llama import LlamaDecoder
from speculant.models.rope import rope_tables
from speculant.runtime.formats import LANES, W4A8Linear, W8A8Linear

SHAPES = {
    # meta-llama/Llama-3.2-1B's config.json (shape fields; RoPE scaling left out: it changes no cost)
    "llama-3.2-1b": dict(vocab_size=128256, hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
                         num_attention_heads=32, num_key_value_heads=8, head_dim=64, max_position_embeddings=4096,
                         rms_norm_eps=1e-5, rope_theta=500000.0, tie_word_embeddings=True),
    # Qwen/Qwen3-0.6B's config.json (shape fields): per-head q/k norms, head_dim 128 != hidden / heads
    "qwen3-0.6b": dict(vocab_size=151936, hidden_size=1024, intermediate_size=3072, num_hidden_layers=28,
                       num_attention_heads=16, num_key_value_heads=8, head_dim=128, max_position_embeddings=40960,
                       rms_norm_eps=1e-6, rope_theta=1000000.0, tie_word_embeddings=True, model_type="qwen3",
                       qk_norm=True),
}
"""Shape name -> :class:`~speculant.models.config.ModelConfig` fields."""


def _scales(out_features: int, blocks: int, g: torch.Generator) -> torch.Tensor:
    """float16 block scales ``[O, blocks]`` around 0.01 (a trained 1B model's Q4_0 range)."""
    return (0.005 + 0.01 * torch.rand(out_features, blocks, generator=g)).to(torch.float16)


def random_w4a8(in_features: int, out_features: int, g: torch.Generator) -> W4A8Linear:
    """A projection ``[O, I]`` of random Q4_0 blocks (codes 0..15, offset -8 x scale, computed by the kernel as for a
    GGUF's Q4_0), in the kernel's layout (random bytes need no interleaving: any permutation of random codes is random
    codes)."""
    blocks = in_features // 32
    codes = torch.randint(0, 256, (out_features, in_features // 2), generator=g, dtype=torch.uint8)
    return W4A8Linear.empty(in_features, out_features, {"codes": codes, "scales": _scales(out_features, blocks, g)})


def random_w8a8(in_features: int, out_features: int, g: torch.Generator) -> W8A8Linear:
    """A projection ``[O, I]`` of random Q8_0 blocks (codes -127..127), in the kernel's layout."""
    codes = torch.randint(-127, 128, (out_features, in_features), generator=g, dtype=torch.int8)
    return W8A8Linear.empty(in_features, out_features, {"codes": codes, "scales": _scales(out_features,
                                                                                         in_features // 32, g)})


def shaped_decoder(shape: str, seed: int = 0) -> LlamaDecoder:
    """A :class:`~speculant.models.llama.LlamaDecoder` of shape ``shape`` (a key of :data:`SHAPES`) in ``w4a8``,
    random weights from ``seed``; run it through an executor
    (``speculant.runtime.executor.Executor(decoder, kv_dtype)``: the fused step, its KV cache dtype).

    Raises:
        KeyError: an unknown shape.
    """
    cfg = ModelConfig(**SHAPES[shape])
    g = torch.Generator().manual_seed(seed)
    with torch.device("meta"):
        dec = LlamaDecoder(cfg)
    d, inter = cfg.hidden_size, cfg.intermediate_size
    q, kv = cfg.num_attention_heads * cfg.head_dim, cfg.num_key_value_heads * cfg.head_dim
    assert d % LANES == 0
    for layer in dec.layers:
        layer.self_attn.qkv_proj = random_w4a8(d, q + 2 * kv, g)
        layer.self_attn.o_proj = random_w4a8(q, d, g)
        layer.mlp.gate_up_proj = random_w4a8(d, 2 * inter, g)
        layer.mlp.down_proj = random_w4a8(inter, d, g)
        for norm in (layer.input_layernorm, layer.post_attention_layernorm):
            norm.weight = torch.nn.Parameter(torch.ones(d), requires_grad=False)
        for norm in (layer.self_attn.q_norm, layer.self_attn.k_norm):     # Qwen3's per-head norms
            if norm is not None:
                norm.weight = torch.nn.Parameter(torch.ones(cfg.head_dim), requires_grad=False)
    dec.norm.weight = torch.nn.Parameter(torch.ones(d), requires_grad=False)
    dec.embed_tokens.weight = torch.nn.Parameter(torch.randn(cfg.vocab_size, d, generator=g) * 0.02,
                                                 requires_grad=False)
    dec.lm_head_proj = random_w8a8(d, cfg.vocab_size, g)
    dec.rope_cos, dec.rope_sin = rope_tables(cfg)
    dec.weight_format = "w4a8"
    return dec.eval().requires_grad_(False)
