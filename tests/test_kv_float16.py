"""A float16 KV cache (``--kv-cache float16``): what our attention kernel computes over it, rows that keep the
one-token step's bits, every method exact over it (fused w4a8 step and the torch layer step), and the choices
that are refused."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from helpers import prefilled_caches, tiny_model

from speculant import GenerationConfig, build_generator
from speculant.engine.methods import MethodSpec
from speculant.errors import SpeculantError
from speculant.kernels import attention as kernel
from speculant.kernels import build
from speculant.models.kv_cache import KVCache
from speculant.runtime.blocks import Block
from speculant.runtime.ragged import ragged_run_layers
from speculant.runtime import loader
from speculant.runtime.formats import apply_weight_format
from speculant.runtime.executor import executor_of

pytestmark = pytest.mark.skipif(not build.available(), reason=f"kernels: {build.unavailable_reason()}")


def _cache16(hkv=2, smax=200, d=16, seed=0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(1, hkv, smax, d, generator=g) * 2).half(), torch.randn(1, hkv, smax, d, generator=g).half()


def test_attention_over_a_float16_cache_is_the_softmax_of_its_values():
    """The kernel reads float16 keys/values exactly (as float32) and sums in float32: float64 SDPA over the same
    float16 values agrees to float32 rounding; the float32 copy of the cache gives the same bits."""
    keys, values = _cache16()
    g = torch.Generator().manual_seed(1)
    q = torch.randn(1, 6, 5, 16, generator=g) * 3
    mask = torch.rand(5, 150, generator=g) < 0.6
    mask[:, 0] = True
    got = kernel.attention(q, keys, values, mask, 0.25)
    want = F.scaled_dot_product_attention(q.double(), keys[:, :, :150].double(), values[:, :, :150].double(),
                                          attn_mask=mask, scale=0.25, enable_gqa=True).transpose(1, 2).reshape(1, 5, -1)
    assert got.dtype == torch.float32
    assert float((got.double() - want).abs().max()) < 2e-6 * float(want.abs().max())
    assert torch.equal(got, kernel.attention(q, keys.float(), values.float(), mask, 0.25))


def test_a_batched_pass_takes_caches_of_one_dtype():
    caches = [KVCache(3, 2, 16, 8, dtype=torch.float16), KVCache(3, 2, 16, 8)]
    with pytest.raises(ValueError, match="one dtype"):
        kernel.RaggedPlan([1, 1], [0, 0], caches, [torch.ones(1, 1, dtype=torch.bool)] * 2)
    with pytest.raises(ValueError, match="bfloat16.*allowed: float32, float16"):
        kernel.kv_bytes(torch.bfloat16)


@pytest.fixture(scope="module", params=["w4a8", "int8"])
def model16(request):
    """A tiny model with float16 KV caches: w4a8 (the fused C step) and int8 (the torch layer step)."""
    m = tiny_model(seed=7, scale=2.0, vocab=96, layers=4)
    apply_weight_format(m.decoder, request.param)
    loader.set_kv_cache(executor_of(m), "float16")
    assert executor_of(m).new_cache(8).dtype == torch.float16
    assert (executor_of(m).fused_layers() is not None) == (request.param == "w4a8")
    return m


def test_a_prompt_stores_its_float32_keys_rounded(model16):
    """A prompt's forward attends over its own keys/values as computed (float32) and stores them rounded: its
    float16 cache is its float32 cache rounded, in every layer."""
    dec = executor_of(model16)
    ids = torch.tensor([[4, 8, 15, 16, 23, 42]])
    caches = {}
    with torch.inference_mode():
        for dt in (torch.float16, torch.float32):
            dec.kv_dtype = dt
            caches[dt] = dec.new_cache(16)
            dec(ids, None, None, caches[dt], 0)
    dec.kv_dtype = torch.float16
    assert torch.equal(caches[torch.float16].keys[..., :6, :], caches[torch.float32].keys[..., :6, :].half())
    assert torch.equal(caches[torch.float16].values[..., :6, :], caches[torch.float32].values[..., :6, :].half())


def test_float16_keys_move_the_logits_by_their_rounding():
    """Float32 weights (no activation quantization to amplify it): decoding over a float16 cache moves the logits
    by about float16's relative rounding (2^-11) of the attention, far from what would change a token."""
    m = tiny_model(seed=7, scale=1.0, vocab=96, layers=4)
    dec = executor_of(m)
    ids = torch.tensor([[4, 8, 15, 16, 23, 42, 7, 1, 2, 3]])
    out = {}
    with torch.inference_mode():
        for dt in (torch.float16, torch.float32):
            dec.kv_dtype = dt
            cache = dec.new_cache(16)
            dec(ids[:, :6], None, None, cache, 0)
            out[dt] = torch.cat([dec(ids[:, 6 + j:7 + j], None, None, cache, 6 + j) for j in range(4)], 1)
    assert 0 < float((out[torch.float16] - out[torch.float32]).abs().max()) <= 2e-3 * float(out[torch.float32].std())


def test_float16_block_rows_get_the_one_token_steps_bits(model16):
    dec = executor_of(model16)
    prompt, block = [5, 9, 2, 7, 1], [11, 12, 13, 14, 15, 16, 17]
    with torch.inference_mode():
        c1, c2 = dec.new_cache(32), dec.new_cache(32)
        for c in (c1, c2):
            dec(torch.tensor([prompt]), None, None, c, 0)
        together = dec(torch.tensor([block]), None, None, c1, len(prompt))
        alone = [dec(torch.tensor([[t]]), None, None, c2, len(prompt) + j) for j, t in enumerate(block)]
    for j in range(len(block)):
        assert torch.equal(together[0, j], alone[j][0, 0]), j
    assert torch.equal(c1.keys[..., :12, :], c2.keys[..., :12, :])


@pytest.mark.parametrize("method,kw", [("prompt-lookup", {}), ("early-exit", {"exit_layer": 2}),
                                       ("rsd-s", {"exit_layer": 1, "beam_width": 2, "draft_length": 3}),
                                       ("draft-model", {"draft_model": "truncated:2"})])
def test_every_method_is_exact_over_a_float16_cache(model16, method, kw):
    prompts = [[1 + (i * 5 + j) % 90 for j in range(2 + 3 * i)] for i in range(4)] + [[3, 4, 3, 4, 3, 4, 3]]
    ar = build_generator(model16, method="ar")
    gen = build_generator(model16, MethodSpec(method=method, **kw))
    for p in prompts:
        cfg = GenerationConfig(max_new_tokens=16)
        assert gen.generate(p, cfg).token_ids == ar.generate(p, cfg).token_ids


def test_a_batched_round_over_float16_caches_gives_each_sequence_its_own_bits(model16):
    dec = executor_of(model16)
    with torch.inference_mode():
        caches = prefilled_caches(dec, [[5, 9, 2, 7], [1, 2, 3, 4, 5, 6], [8, 8]], 32)
        blocks = [Block(dec.embed(torch.tensor([[11, 12, 13]])), 0, torch.arange(4, 7), None, caches[0], 4),
                  Block(dec.embed(torch.tensor([[21]])), 0, torch.arange(6, 7), None, caches[1], 6),
                  Block(dec.embed(torch.tensor([[31, 32]])), 0, torch.arange(2, 4), None, caches[2], 2)]
        alone_caches = [copy.deepcopy(c) for c in caches]
        alone = [dec.run_layers(b.hidden, 0, dec.num_layers, b.positions, None, c, b.cache_position)
                 for b, c in zip(blocks, alone_caches)]
        together = ragged_run_layers(dec, blocks)
    if dec.weight_format != "w4a8":
        # int8's torch products are batch-invariant only up to a measured row count; the attention still is
        assert all(torch.allclose(x, y, rtol=1e-4, atol=1e-5) for x, y in zip(together, alone))
        return
    for x, y in zip(together, alone):
        assert torch.equal(x, y)
    for c, d in zip(caches, alone_caches):
        assert torch.equal(c.keys, d.keys) and torch.equal(c.values, d.values)


def test_the_kv_cache_choices_that_are_refused(monkeypatch):
    m = tiny_model(seed=3, layers=2)
    with pytest.raises(SpeculantError, match="kv_cache='bfloat16'.*allowed: float32, float16, float64"):
        loader.set_kv_cache(executor_of(m), "bfloat16")
    with pytest.raises(SpeculantError, match="kv_cache='half'.*allowed: auto, float32, float16, float64"):
        loader.load_model("tiny-that-is-never-loaded", kv_cache="half")
    monkeypatch.setattr(kernel, "supports", lambda head_dim, dtype=torch.float32: False)
    with pytest.raises(SpeculantError, match="float16' needs our attention kernel.*allowed here: auto, float32"):
        loader.set_kv_cache(executor_of(m), "float16")
    assert executor_of(m).kv_dtype == torch.float32                      # unchanged
    monkeypatch.undo()
    loader.set_kv_cache(executor_of(m), "float16")
    cache = KVCache(2, m.config.num_key_value_heads, m.config.head_dim, 8, batch=2, dtype=torch.float16)
    with torch.inference_mode(), pytest.raises(SpeculantError, match="float16 KV cache is read by our attention"):
        executor_of(m)(torch.tensor([[1, 2], [3, 4]]), None, None, cache, 0)
