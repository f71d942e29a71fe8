"""GGUF tensor types on our kernels as stored (issue 26, item 2): Q4_0, Q4_1, Q8_0, Q5_0, Q5_1, Q4_K, Q5_K, Q6_K.

Checked: the codes we read decode to ``gguf.quants.dequantize``'s bits for every type (K-quant super-blocks folded
into float32 per-sub-block scales, no requantization); each type's product on every kernel variant (AVX2, the VNNI
code with ``vpdpbusd``, 512-bit vectors and AMX tiles emulated, and the variant in use) gives the AVX2 bits, which are
the float64 product of the dequantized weight and the int8-quantized activations within float32 accumulation; a tiny
Llama GGUF mixing the types (fused q|k|v and gate|up of different types included) runs ``w4a8`` through the fused
step, its logits close to transformers' forward of the same file with the activations quantized as our kernels do,
and greedy decoding of every method equals ``ar``; types we do not take are refused in one line.
"""

from __future__ import annotations

import io
from dataclasses import replace

import numpy as np
import pytest
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, dequantize, quants
from gguf_helpers import k_quant_blocks, write_tiny_gguf
from helpers import one_line_error, use_kernels

from speculant import GenerationConfig, build_generator
from speculant.errors import SpeculantError
from speculant.kernels import build, qgemm
from speculant.models import loading
from speculant.models.gguf_codes import IndexedTensor, _decode
from speculant.runtime import occupancy, tune
from speculant.runtime.formats import (StackedLinear, W4A8KLinear, W4A8Linear, W5A8Linear, W6A8Linear,
                                       W8A8Linear, block_linear, format_available)
from speculant.runtime.loader import load_model

needs_kernel = pytest.mark.skipif(not qgemm.available(), reason=f"our kernels: {qgemm.unavailable_reason()}")
TYPES = ("Q4_0", "Q4_1", "Q8_0", "Q5_0", "Q5_1", "Q4_K", "Q5_K", "Q6_K")
KERNEL_CLASS = {"Q4_0": W4A8Linear, "Q4_1": W4A8Linear, "Q4_K": W4A8KLinear, "Q8_0": W8A8Linear, "Q5_0": W5A8Linear,
                "Q5_1": W8A8Linear, "Q5_K": W8A8Linear, "Q6_K": W6A8Linear}


def _raw(kind: str, rows: int, cols: int, rng: np.random.Generator) -> np.ndarray:
    """``[rows, cols]`` weights stored as ``kind``: the ``gguf`` package's quantization of normal values (types it
    writes), random blocks with super-block scales spread over two decades (K-quants)."""
    if kind.endswith("_K"):
        return k_quant_blocks(rows, cols, kind, rng)        # super-block scales log-uniform in [1e-4, 1e-2]
    return quants.quantize((rng.standard_normal((rows, cols)) * 0.1).astype(np.float32), GGMLQuantizationType[kind])


def _codes(kind: str, raw: np.ndarray, tmp_path):
    """Our decoding of the raw blocks (through a file, as a GGUF's tensors are read)."""
    path = tmp_path / f"{kind}.bin"
    raw.tofile(path)
    return _decode(IndexedTensor("w", kind, 0, raw.shape, str(path)))


@pytest.mark.parametrize("kind", TYPES)
def test_decoding_by_blocks_of_rows_gives_the_whole_tensors_codes(kind, tmp_path, monkeypatch):
    """A tensor's blocks are decoded :data:`DECODE_ROWS` rows at a time (a large LM head's temporaries stay
    small): the codes, scales and offsets equal decoding every row at once, with a partial block of rows last."""
    from speculant.models import gguf_codes
    raw = _raw(kind, 43, 256, np.random.default_rng(12))
    monkeypatch.setattr(gguf_codes, "DECODE_ROWS", 10**6)
    whole = _codes(kind, raw, tmp_path)
    monkeypatch.setattr(gguf_codes, "DECODE_ROWS", 8)
    blocks = _codes(kind, raw, tmp_path)
    assert torch.equal(blocks.codes, whole.codes) and torch.equal(blocks.scale, whole.scale)
    assert (blocks.offset is None) == (whole.offset is None)
    assert blocks.offset is None or torch.equal(blocks.offset, whole.offset)
    assert (blocks.bits, blocks.group, blocks.scale_dtype, blocks.kind) == (whole.bits, whole.group,
                                                                          whole.scale_dtype, whole.kind)


@pytest.mark.parametrize("kind", TYPES)
def test_packing_by_blocks_of_rows_gives_the_whole_matrix_layout(kind, tmp_path, monkeypatch):
    """The codes of a block projection are interleaved :data:`PACK_ROWS` outputs at a time (a large LM head's
    temporaries stay small): every buffer equals packing the whole matrix at once, for an output count with a
    partial group of :data:`LANES` at the end, and the codes read back as stored."""
    from speculant.runtime import formats
    gq = _codes(kind, _raw(kind, 8 * 5 + 3, 256, np.random.default_rng(11)), tmp_path)
    monkeypatch.setattr(formats, "PACK_ROWS", 10**6)
    whole = block_linear(gq)
    for rows in (8, 16, 24):
        monkeypatch.setattr(formats, "PACK_ROWS", rows)
        blocks = block_linear(gq)
        assert whole.state_dict().keys() == blocks.state_dict().keys()
        assert all(torch.equal(v, blocks.state_dict()[k]) for k, v in whole.state_dict().items()), rows
    assert torch.equal(blocks.group_quantized().dequantize(), gq.dequantize())


@pytest.mark.parametrize("kind", TYPES)
def test_a_head_decoded_and_packed_by_slices_of_rows_is_the_whole_heads_packing(kind, tmp_path, monkeypatch):
    """An LM head that is one tensor of the file is decoded and packed :data:`PACK_ROWS` rows at a time
    (:func:`block_linear_by_rows` over :meth:`GGUFCodes.row_slices`: one slice's codes held at a time): the same
    class and every buffer equal to packing the whole decoded tensor, with a partial slice last; each slice decodes
    only its own rows."""
    from speculant.models import gguf_codes
    from speculant.runtime import formats
    raw = _raw(kind, 8 * 7 + 5, 256, np.random.default_rng(13))
    path = tmp_path / f"{kind}.bin"
    raw.tofile(path)
    tensor = IndexedTensor("token_embd.weight", kind, 0, raw.shape, str(path))
    codes = gguf_codes.GGUFCodes(gguf_codes.TensorIndex([tensor]), {"lm_head_proj": [("token_embd.weight", None)]})
    rows, decode = codes.row_slices("lm_head_proj")
    assert rows == raw.shape[0]
    whole = block_linear(codes["lm_head_proj"])
    asked = []
    monkeypatch.setattr(formats, "PACK_ROWS", 16)
    sliced = formats.block_linear_by_rows(rows, lambda a, b: asked.append((a, b)) or decode(a, b))
    assert asked == [(0, 16), (16, 32), (32, 48), (48, 61)]
    assert type(sliced) is type(whole) is KERNEL_CLASS[kind]
    assert whole.state_dict().keys() == sliced.state_dict().keys()
    assert all(torch.equal(v, sliced.state_dict()[k]) for k, v in whole.state_dict().items())
    assert torch.equal(sliced.group_quantized().dequantize(), codes["lm_head_proj"].dequantize())


def test_slices_that_pack_into_different_classes_leave_the_head_to_the_whole_packing(tmp_path, monkeypatch):
    """Where one slice of rows packs into another class than the first (a K-quant whose scales factor exactly in
    some rows only), :func:`block_linear_by_rows` returns ``None`` (the whole is packed instead)."""
    from speculant.runtime import formats
    rng = np.random.default_rng(14)
    q4, q8 = (_codes(k, _raw(k, 16, 256, rng), tmp_path) for k in ("Q4_0", "Q8_0"))
    monkeypatch.setattr(formats, "PACK_ROWS", 8)
    assert formats.block_linear_by_rows(16, lambda a, b: q4.rows(torch.arange(a, b)) if a == 0
                                        else q8.rows(torch.arange(a, b))) is None
    assert isinstance(formats.block_linear_by_rows(16, lambda a, b: q8.rows(torch.arange(a, b))), W8A8Linear)


@pytest.mark.parametrize("kind", TYPES)
def test_decoded_codes_are_gguf_dequantize_bit_for_bit(kind, tmp_path):
    rng = np.random.default_rng(TYPES.index(kind))
    raw = _raw(kind, 24, 512, rng)
    gq = _codes(kind, raw, tmp_path)
    want = torch.from_numpy(np.asarray(dequantize(raw, GGMLQuantizationType[kind]), dtype=np.float32))
    assert torch.equal(gq.dequantize(), want)
    assert gq.kind == kind and gq.group == (16 if kind == "Q6_K" else 32)
    assert gq.scale_dtype == (torch.float32 if kind.endswith("_K") else torch.float16)
    if gq.scale_dtype == torch.float16:                  # the fp16 kernels' scales: the file's values exactly
        assert torch.equal(gq.scale.half().float(), gq.scale)
    lo, hi = {4: (0, 15), 8: (-128, 127)}[gq.bits]
    assert lo <= int(gq.codes.min()) and int(gq.codes.max()) <= hi


def test_the_layout_table_is_the_decoded_codes_layout(tmp_path):
    """``GGUFCodes.as_stored`` decides from ``_LAYOUTS`` without decoding which parts fuse into one projection (and
    so which float weights a ``w4a8`` load never reads): the table must be what decoding gives, for every type."""
    from speculant.models.gguf_codes import _LAYOUTS, CODE_KINDS

    assert sorted(_LAYOUTS) == sorted(CODE_KINDS) == sorted(TYPES)
    rng = np.random.default_rng(7)
    for kind in TYPES:
        assert _codes(kind, _raw(kind, 4, 256, rng), tmp_path).layout() == _LAYOUTS[kind], kind


def _q8_1(x: torch.Tensor) -> torch.Tensor:
    """Activations as our kernels take them (llama.cpp's Q8_1): per block of 32, ``d = max|x| / 127``,
    ``q = round-half-even(x / d)``, in float32; returned dequantized ``q * d`` in float64."""
    blocks = x.float().reshape(*x.shape[:-1], -1, 32)
    d = blocks.abs().amax(-1, keepdim=True) / 127.0
    q = torch.round(blocks * torch.where(d > 0, 1.0 / d, torch.zeros_like(d)))
    return (q.double() * d.double()).reshape(x.shape)


VARIANTS = ("avx2", "vnni-emulated", "zmm-emulated", "amx-emulated")


@needs_kernel
@pytest.mark.parametrize("kind", TYPES)
def test_every_variant_computes_the_dequantized_product_bit_for_bit_alike(kind, tmp_path, monkeypatch):
    """Each type's projection (29 outputs: 3 groups of 8 and 5 row by row) for 1..17 rows: every kernel variant gives
    the AVX2 bits, every row the bits it gets alone, and those are the float64 product of the dequantized weight and
    the int8-quantized rows within float32 accumulation (~1e-6 of the output scale)."""
    rng = np.random.default_rng(10 + TYPES.index(kind))
    gq = _codes(kind, _raw(kind, 29, 512, rng), tmp_path)
    lin = block_linear(gq)
    assert type(lin) is KERNEL_CLASS[kind] and torch.equal(lin.dequantized_weight(), gq.dequantize())
    x = torch.from_numpy(rng.standard_normal((17, 512)).astype(np.float32)) * 4.0
    x[2, 64:96] = 0.0                                            # an all-zero activation block
    libs = {"in use": build.load(), **{isa: build.load_variant(isa) for isa in VARIANTS}}
    use_kernels(monkeypatch, libs["avx2"])
    want = lin(x)
    ref = _q8_1(x) @ gq.dequantize().double().t()
    assert float((want.double() - ref).abs().max()) <= 1e-5 * float(ref.abs().max()), kind
    for rows in (1, 2, 5, 9, 16, 17):                            # row tiles of 1..8; AMX tiles from 8 rows
        for name, lib in libs.items():
            use_kernels(monkeypatch, lib)
            assert torch.equal(lin(x[:rows]), want[:rows]), (kind, name, rows)
    use_kernels(monkeypatch, libs["in use"])
    assert torch.equal(torch.cat([lin(x[i:i + 1]) for i in range(17)]), want)
    rows = lin.select_rows(torch.tensor([28, 3, 17, 0, 9]))      # a reduced LM head: the same bits per output
    assert torch.equal(rows(x), want[:, [28, 3, 17, 0, 9]])


@needs_kernel
def test_q6k_in_six_bits_gives_the_eight_bit_layouts_bits_from_fewer_bytes(tmp_path, monkeypatch):
    """Q6_K packed in 6 bits with int8 sub-block scales and float32 super-block scales (``W6A8Linear``) multiplies
    exactly as the same codes unpacked to bytes with folded float32 scales (``W8A8Linear``, group 16) on every kernel
    variant, in 0.83 bytes a weight instead of 1.25, and reads back as stored; codes whose scales do not factor into a
    super-block scale times integers (made elsewhere) keep the 8-bit layout."""
    rng = np.random.default_rng(33)
    gq = _codes("Q6_K", _raw("Q6_K", 43, 768, rng), tmp_path)            # 5 groups of 8 and 3 rows by row
    six, eight = block_linear(gq), W8A8Linear(gq)
    assert type(six) is W6A8Linear
    back = six.group_quantized()
    assert torch.equal(back.codes, gq.codes) and torch.equal(back.scale, gq.scale)
    assert torch.equal(back.super_scale, gq.super_scale)
    size = lambda lin: sum(t.numel() * t.element_size() for t in lin.buffers()) / gq.codes.numel()   # noqa: E731
    assert size(six) == 0.75 + 1 / 16 + 4 / 256 and size(eight) == 1.25
    x = torch.from_numpy(rng.standard_normal((17, 768)).astype(np.float32))
    for name in ("in use", *VARIANTS):
        use_kernels(monkeypatch, build.load() if name == "in use" else build.load_variant(name))
        for rows in (1, 3, 8, 17):
            assert torch.equal(six(x[:rows]), eight(x[:rows])), (name, rows)
    odd = replace(gq, super_scale=gq.super_scale * 3.0)                  # scale / super_scale not integers
    assert type(block_linear(odd)) is W8A8Linear and type(block_linear(replace(gq, super_scale=None))) is W8A8Linear
    with pytest.raises(SpeculantError, match="w6a8 takes Q6_K codes"):
        W6A8Linear(odd)


@needs_kernel
def test_q5_0_in_five_bits_gives_the_eight_bit_layouts_bits_from_fewer_bytes(tmp_path, monkeypatch):
    """Q5_0 packed in 5 bits (``W5A8Linear``) multiplies exactly as the same codes in bytes (``W8A8Linear``, fp16
    scales) on every kernel variant, for 1..17 rows and outputs in groups of 8 and row by row, in 0.69 bytes a weight
    instead of 1.06, and reads back as stored (a reduced LM head's rows included); 8-bit codes outside -16..15 (Q8_0's)
    keep the 8-bit layout; a flipped high bit changes its output's product only."""
    rng = np.random.default_rng(35)
    gq = _codes("Q5_0", _raw("Q5_0", 43, 768, rng), tmp_path)            # 5 groups of 8 and 3 rows by row
    assert int(gq.codes.min()) == -16 and int(gq.codes.max()) == 15      # every code value, high bit set and not
    five, eight = block_linear(gq), W8A8Linear(gq)
    assert type(five) is W5A8Linear
    back = five.group_quantized()
    assert torch.equal(back.codes, gq.codes) and torch.equal(back.scale, gq.scale)
    size = lambda lin: sum(t.numel() * t.element_size() for t in lin.buffers()) / gq.codes.numel()   # noqa: E731
    assert size(five) == 5 / 8 + 2 / 32 and size(eight) == 1 + 2 / 32
    x = torch.from_numpy(rng.standard_normal((17, 768)).astype(np.float32))
    x[4, 96:128] = 0.0
    for name in ("in use", *VARIANTS):
        use_kernels(monkeypatch, build.load() if name == "in use" else build.load_variant(name))
        for rows in (1, 3, 8, 17):
            assert torch.equal(five(x[:rows]), eight(x[:rows])), (name, rows)
    index = torch.tensor([42, 7, 40, 0, 13])
    assert torch.equal(five.select_rows(index)(x), eight(x)[:, index])
    five.codes[0, 128] ^= 1                  # output 0's code 0: its high bit, so bit 4 of q + 16, flipped
    changed = (five(x) != eight(x)).any(0)
    assert changed[0] and not changed[1:].any()
    q8 = _codes("Q8_0", _raw("Q8_0", 16, 256, rng), tmp_path)
    assert type(block_linear(q8)) is W8A8Linear
    with pytest.raises(SpeculantError, match="w5a8 takes Q5_0 codes"):
        W5A8Linear(q8)


@needs_kernel
def test_q4k_with_integer_scales_gives_the_float32_layouts_bits_from_fewer_bytes(tmp_path, monkeypatch):
    """Q4_K with its 6-bit sub-block scales and mins as int8 and its super-block d, -dmin as float32
    (``W4A8KLinear``) multiplies exactly as the same codes with the scales and offsets folded into float32
    (``W4A8Linear``) on every kernel variant, in 0.59 bytes a weight instead of 0.75, and reads back as stored; codes
    whose scales or offsets do not factor into super-block values times integers keep the float32 layout."""
    rng = np.random.default_rng(34)
    gq = _codes("Q4_K", _raw("Q4_K", 43, 768, rng), tmp_path)            # 5 groups of 8 and 3 rows by row
    compact, folded = block_linear(gq), W4A8Linear(gq)
    assert type(compact) is W4A8KLinear and folded.scales.dtype == torch.float32
    back = compact.group_quantized()
    for name in ("codes", "scale", "offset", "super_scale", "super_min"):
        assert torch.equal(getattr(back, name), getattr(gq, name)), name
    size = lambda lin: sum(t.numel() * t.element_size() for t in lin.buffers()) / gq.codes.numel()   # noqa: E731
    assert size(compact) == 0.5 + 2 / 32 + 8 / 256 and size(folded) == 0.75
    x = torch.from_numpy(rng.standard_normal((17, 768)).astype(np.float32))
    x[1, 32:64] = 0.0
    for name in ("in use", *VARIANTS):
        use_kernels(monkeypatch, build.load() if name == "in use" else build.load_variant(name))
        for rows in (1, 3, 8, 17):
            assert torch.equal(compact(x[:rows]), folded(x[:rows])), (name, rows)
    for odd in (replace(gq, super_scale=gq.super_scale * 3.0), replace(gq, super_min=gq.super_min * 3.0),
                replace(gq, super_min=None)):
        assert type(block_linear(odd)) is W4A8Linear
    with pytest.raises(SpeculantError, match="w4a8 with Q4_K scales takes Q4_K codes"):
        W4A8KLinear(replace(gq, super_scale=gq.super_scale * 3.0))


@needs_kernel
def test_q4_0_without_stored_mins_gives_the_stored_mins_bits(tmp_path, monkeypatch):
    """Q4_0's mins are ``-8 d``: ``W4A8Linear`` keeps its fp16 scales only (0.56 bytes a weight instead of 0.63) and
    the kernel computes the mins, every variant giving the bits of the same codes with the mins stored in fp16;
    Q4_1's mins stay stored; the weight reads back as stored."""
    rng = np.random.default_rng(35)
    gq = _codes("Q4_0", _raw("Q4_0", 43, 512, rng), tmp_path)
    lin = block_linear(gq)
    assert type(lin) is W4A8Linear and not hasattr(lin, "offsets")
    assert hasattr(block_linear(_codes("Q4_1", _raw("Q4_1", 8, 512, rng), tmp_path)), "offsets")
    back = lin.group_quantized()
    assert torch.equal(back.codes, gq.codes) and torch.equal(back.scale, gq.scale) and torch.equal(back.offset, gq.offset)
    stored = W4A8Linear.empty(512, 43, {"codes": lin.codes, "scales": lin.scales,
                                        "offsets": (-8.0 * lin.scales.float()).half()})
    size = lambda m: sum(t.numel() * t.element_size() for t in m.buffers()) / gq.codes.numel()   # noqa: E731
    assert size(lin) == 0.5 + 2 / 32 and size(stored) == 0.5 + 4 / 32
    x = torch.from_numpy(rng.standard_normal((17, 512)).astype(np.float32))
    for name in ("in use", *VARIANTS):
        use_kernels(monkeypatch, build.load() if name == "in use" else build.load_variant(name))
        for rows in (1, 3, 8, 17):
            assert torch.equal(lin(x[:rows]), stored(x[:rows])), (name, rows)


MIXED = {"token_embd.weight": "Q4_K", "output.weight": "Q6_K",
         "blk.0.attn_q.weight": "Q4_K", "blk.0.attn_k.weight": "Q4_K", "blk.0.attn_v.weight": "Q6_K",
         "blk.0.attn_output.weight": "Q5_0", "blk.0.ffn_gate.weight": "Q4_K", "blk.0.ffn_up.weight": "Q5_K",
         "blk.0.ffn_down.weight": "Q6_K",
         "blk.1.attn_q.weight": "Q5_1", "blk.1.attn_k.weight": "Q5_1", "blk.1.attn_v.weight": "Q5_1",
         "blk.1.attn_output.weight": "Q8_0", "blk.1.ffn_gate.weight": "Q4_0", "blk.1.ffn_up.weight": "Q4_1",
         "blk.1.ffn_down.weight": "Q5_K"}
"""A Q4_K_M-like mix (Q4_K q, k with a Q6_K v; Q6_K head) and every other type, fused projections of one layout
(Q5_1 q|k|v, Q4_0|Q4_1 gate|up) and of several (stacks)."""
PROMPT = [258, 260, 221, 263, 258, 260, 221, 263, 258, 260]


@pytest.fixture(scope="module")
def mixed(tmp_path_factory):
    d = tmp_path_factory.mktemp("kquants")
    return {tie: write_tiny_gguf(d / f"mixed-{tie}.gguf", "Q8_0", hidden=256, heads=4, kv_heads=2, inter=512,
                                 tie=tie, seed=21 + tie, types=MIXED) for tie in (False, True)}


def _hf_reference(path, quantized: bool) -> torch.nn.Module:
    """transformers' model of the GGUF file (its own dequantization), in float64; ``quantized``: every projection's
    input rounded as our kernels quantize it (:func:`_q8_1`), so that its logits are what our ``w4a8`` computes up
    to float32 rounding."""
    from transformers import AutoModelForCausalLM
    ref = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32).double()
    if quantized:
        for m in ref.modules():
            if isinstance(m, torch.nn.Linear):
                m.register_forward_pre_hook(lambda _, args: (_q8_1(args[0]),))
    return ref.eval()


@needs_kernel
@pytest.mark.parametrize("tie", (False, True))
def test_a_mixed_k_quant_llama_runs_w4a8_on_its_stored_types_close_to_transformers(tie, mixed, in_process):
    from speculant.runtime.loader import load_model
    path = mixed[tie]
    # a float32 KV cache: the reference attends in float64, and a float16 cache rounds keys and values (its own,
    # documented change of the logits, ~1e-2 here)
    # w4a8 named: `auto` picks between w4a8 and fp32 by timing a one-row pass (on this 2-layer file, within the noise
    # of a loaded machine: fp32 was picked under pytest-xdist); that pick is tested on fixed timings below
    model = load_model(str(path), weights="w4a8", compile=False, kv_cache="float32")
    assert model.weights == "w4a8" and model.fused                 # as stored, on our kernels
    l0, l1 = model.decoder.layers
    qkv0 = l0.self_attn.qkv_proj
    assert type(qkv0) is StackedLinear and [type(p) for p in qkv0.parts] == [W4A8KLinear, W6A8Linear]
    assert qkv0.parts[0].scales.dtype == torch.int8 and qkv0.parts[1].scale_group == 16
    assert type(l0.mlp.gate_up_proj) is StackedLinear and type(l0.mlp.down_proj) is W6A8Linear
    assert type(l1.self_attn.qkv_proj) is W8A8Linear and l1.self_attn.qkv_proj.offsets.dtype == torch.float32
    assert type(l1.mlp.gate_up_proj) is W4A8Linear and l1.mlp.gate_up_proj.scales.dtype == torch.float16
    head = model.decoder.lm_head_proj
    assert type(head) is (W4A8KLinear if tie else W6A8Linear) and head.scales.dtype == torch.int8
    fp32 = load_model(str(path), weights="fp32", compile=False)
    ids = torch.tensor([PROMPT])
    with torch.inference_mode():
        ex = model.executor
        ex.fused_prompt_tokens = 64                                  # the prompt through the fused step
        ours = ex(ids, None, None, ex.new_cache(32), 0)[0].double()
        ex.use_fused = False                                         # the torch layer step on the same projections
        torch_step = ex(ids, None, None, ex.new_cache(32), 0)[0].double()
        ex.use_fused = True
        want = _hf_reference(path, quantized=True)(ids).logits[0]
        plain = _hf_reference(path, quantized=False)(ids).logits[0]
        ours_fp32 = fp32.decoder(ids)[0].double()
    scale = float(want.abs().max())
    assert float((ours_fp32 - plain).abs().max()) < 1e-4 * scale     # fp32: the file's weights, dequantized
    # w4a8 (the fused step, and the torch layer step on the same projections) vs the same forward in float64 with
    # the activations quantized as our kernels do: what remains is float32 rounding (~1e-6 of the scale per
    # operation), the 1e-4 of fp32 weights.  An activation whose float32 and float64 values round to different int8
    # codes adds one code (~1/127 of its block's range) times its weights to that row and the rows after it attend
    # to: the fused step has none on these seeds; the torch layer step has one, in the last row of the untied file,
    # on a Zen 5 EPYC (2.4e-3 of the scale, where the file's quantized activations move the logits by 2.3e-2), so it
    # is allowed one row off by less than a quarter of that.  A kernel that quantized or scaled any block otherwise
    # would move every row by far more
    err = float((ours - want).abs().max()) / scale
    quantization = float((plain - want).abs().max()) / scale
    rows = (torch_step - want).abs().amax(-1) / scale
    assert int((rows >= 1e-4).sum()) <= 1 and float(rows.max()) < quantization / 4, rows.tolist()
    assert err < 1e-4, err
    # and the quantized activations themselves move the logits by far more than that: the check above is not vacuous
    assert quantization > 10 * err


SPECS = {"early-exit": dict(method="early-exit", exit_layer=1, num_speculations=3),
         "prompt-lookup": dict(method="prompt-lookup", num_speculations=4),
         "rsd-s": dict(method="rsd-s", exit_layer=1, beam_width=3, draft_length=3),
         "specinfer": dict(method="specinfer", exit_layer=1, branching=(2, 2)),
         "draft-model": dict(method="draft-model", draft_model="truncated:1", num_speculations=3)}


@needs_kernel
def test_greedy_methods_equal_ar_on_the_mixed_file_in_w4a8(mixed, in_process):
    from speculant.runtime.loader import load_model
    model = load_model(str(mixed[False]), weights="w4a8", compile=False)
    assert model.fused
    config = GenerationConfig(max_new_tokens=24)
    ar = build_generator(model, method="ar").generate(PROMPT, config).token_ids
    assert len(ar) == 24
    for name, spec in SPECS.items():
        assert build_generator(model, **spec).generate(PROMPT, config).token_ids == ar, name
    # a batched round (several sequences in one call of the fused step, stacks included): each row the bits of its
    # sequence alone
    import copy

    from helpers import prefilled_caches

    from speculant.runtime.blocks import Block
    from speculant.runtime.ragged import ragged_run_layers
    ex = model.executor
    with torch.inference_mode():
        caches = prefilled_caches(ex, [PROMPT[:4], PROMPT[:7]], 32)
        blocks = [Block(ex.embed(torch.tensor([[11, 12, 13]])), 0, torch.arange(4, 7), None, caches[0], 4),
                  Block(ex.embed(torch.tensor([[40, 41]])), 0, torch.arange(7, 9), None, caches[1], 7)]
        alone = [ex.run_layers(b.hidden, 0, ex.num_layers, b.positions, b.mask, c, b.cache_position)
                 for b, c in zip(blocks, [copy.deepcopy(c) for c in caches])]
        together = ragged_run_layers(ex, blocks)
    assert all(torch.equal(x, y) for x, y in zip(together, alone))


def _write_raw(path, kind: str):
    """A tiny Llama GGUF whose one projection is of a type we do not take as codes (random blocks)."""
    if kind in ("Q2_K", "Q3_K"):
        return write_tiny_gguf(path, "Q8_0", layers=1, hidden=256, inter=256, types={"blk.0.ffn_up.weight": kind})
    from gguf import GGUFWriter
    src = write_tiny_gguf(path.with_suffix(".src.gguf"), "Q8_0", layers=1, hidden=256, inter=256)
    from gguf import GGUFReader
    reader = GGUFReader(str(src))
    w = GGUFWriter(str(path), "llama")
    for field in reader.fields.values():
        if field.name.startswith("GGUF.") or field.name == "general.architecture":
            continue
        w.add_key_value(field.name, field.contents(), field.types[0],
                        field.types[-1] if field.types[0].name == "ARRAY" else None)
    qtype = GGMLQuantizationType[kind]
    block, size = GGML_QUANT_SIZES[qtype]
    for t in reader.tensors:
        if t.name == "blk.0.ffn_up.weight":
            rows, cols = int(t.shape[1]), int(t.shape[0])
            raw = np.zeros((rows, cols // block * size), dtype=np.uint8)
            w.add_tensor(t.name, raw, raw_dtype=qtype)
        else:
            w.add_tensor(t.name, np.asarray(t.data), raw_dtype=t.tensor_type)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


@pytest.mark.parametrize("kind", ("Q3_K", "Q2_K", "IQ4_NL", "TQ2_0"))
def test_types_we_do_not_take_are_one_line_exit_2_with_nothing_in_the_cache(kind, tmp_path, monkeypatch, capsys):
    """Q2_K/Q3_K: exact in fp32 only (w4a8 would requantize them); IQ*/TQ*: no weight format at all."""
    from speculant.cli import main
    cache = tmp_path / "cache"
    monkeypatch.setenv("SPECULANT_CACHE", str(cache))
    path = _write_raw(tmp_path / f"{kind}.gguf", kind)
    code = main(["generate", "hi", "--model", str(path), "--raw", "--max-new-tokens", "2", "--no-compile",
                 "--weights", "w4a8"])
    err = capsys.readouterr().err
    assert code == 2 and one_line_error(err) and kind in err, err
    if kind.endswith("_K"):
        assert "would requantize the" in err and "allowed for this file: fp32, auto" in err, err
    else:
        assert "which speculant cannot take; allowed types: F32, F16, BF16, Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, Q4_K, " \
               "Q5_K, Q6_K" in err, err
    assert not (cache / "gguf").exists() or list((cache / "gguf").iterdir()) == []


def test_torch_packed_formats_refuse_k_quants_and_auto_takes_w4a8(tmp_path):
    path = str(write_tiny_gguf(tmp_path / "k.gguf", "Q8_0", layers=1, hidden=256, inter=256,
                               types={"blk.0.ffn_down.weight": "Q6_K"}))
    for weights in ("int4", "int8", "bf16"):
        with pytest.raises(SpeculantError, match=f"weights='{weights}' would requantize the Q6_K weights .* allowed "
                                                 "for this file: fp32, w4a8, auto"):
            loading.weights_for(path, weights)
    assert loading.weights_for(path, "w4a8") == "w4a8" and loading.weights_for(path, "fp32") == "fp32"
    assert loading.weights_for(path, "auto") == "w4a8"
    assert loading.weights_for(path, "auto", kernels=False) == "fp32"       # where our kernels do not run
    assert format_available("w4a8") == qgemm.available()


@needs_kernel
def test_a_stack_of_parts_is_its_parts_side_by_side_and_torch_formats_requantize_it(tmp_path):
    """A fused projection of Q4_K and Q6_K tensors: ``w4a8`` stacks them as stored (columns in order, bias after),
    ``int4`` quantizes the float weight as it did for mixed types before (one layout per projection)."""
    from speculant.runtime.formats import pack_linear
    rng = np.random.default_rng(7)
    parts = [_codes(k, _raw(k, n, 256, rng), tmp_path) for k, n in (("Q4_K", 16), ("Q6_K", 16))]
    weight = torch.cat([p.dequantize() for p in parts])
    bias = torch.from_numpy(rng.standard_normal(32).astype(np.float32))
    stack = pack_linear("w4a8", weight, bias, codes=parts)
    assert type(stack) is StackedLinear and torch.equal(stack.dequantized_weight(), weight)
    x = torch.from_numpy(rng.standard_normal((3, 256)).astype(np.float32))
    assert torch.equal(stack(x), torch.cat([block_linear(p)(x) for p in parts], -1) + bias)
    assert type(pack_linear("int4", weight, bias, codes=parts)).__name__ == "Int4Linear"


def _k_file(tmp_path, inter: int) -> str:
    """A one-layer Q8_0 Llama GGUF with a Q6_K down projection (``inter``: a tune key of its own)."""
    return str(write_tiny_gguf(tmp_path / f"k{inter}.gguf", "Q8_0", layers=1, hidden=256, inter=inter,
                               types={"blk.0.ffn_down.weight": "Q6_K"}))


@needs_kernel
def test_auto_on_k_quants_is_measured_among_the_formats_taking_them_as_stored(tmp_path, in_process):
    path = _k_file(tmp_path, 512)
    assert loading.stored_weights(path) == (("w4a8", "fp32"), "Q6_K")
    assert loading.stored_weights(path, kernels=False) == (("fp32",), "Q6_K")
    log = io.StringIO()
    model = load_model(path, compile=False, log=log)
    entry = tune.load(model.tune.key).stored_weights["Q6_K"]          # recorded in the tune file
    assert entry["candidates"] == ["w4a8", "fp32"] and set(entry["ms"]) == {"w4a8", "fp32"}
    busy = entry["busy_cores"] is not None and entry["busy_cores"] >= occupancy.BUSY_CORE    # another test worker
    assert model.weights == entry["weights"] == ("w4a8" if busy else tune.keep_default_format(entry["ms"], "w4a8"))
    assert f"weights auto loads {model.weights} (one-row pass measured here" in log.getvalue()


@needs_kernel
def test_a_format_measured_faster_while_a_core_was_busy_is_not_taken(tmp_path, monkeypatch, in_process):
    """The formats give different text, so a choice from timings of a shared core keeps the default: fp32
    measured faster (w4a8 at 22x its quiet time beside another process) while other processes kept a core busy
    loads w4a8, and says so."""
    path = _k_file(tmp_path, 1024)
    monkeypatch.setattr(tune, "measure_stored_weights", lambda decoder, codes, candidates, route: {
        "w4a8": 310.0, "fp32": 203.0})
    monkeypatch.setattr(occupancy, "other_cores", lambda since, now=None: 1.0)
    log = io.StringIO()
    model = load_model(path, compile=False, log=log)
    assert model.weights == "w4a8" and model.tune.stored_weights["Q6_K"]["busy_cores"] == 1.0
    assert "kept while other processes kept a core busy" in log.getvalue()


@needs_kernel
def test_fp32_faster_by_more_than_the_noise_is_chosen_and_the_choice_kept(tmp_path, monkeypatch, in_process):
    assert tune.keep_default_format({"w4a8": 1.0, "fp32": 0.97}, "w4a8") == "w4a8"      # within the noise
    assert tune.keep_default_format({"w4a8": 1.0, "fp32": 0.9}, "w4a8") == "fp32"
    path = _k_file(tmp_path, 768)
    monkeypatch.setattr(tune, "measure_stored_weights", lambda decoder, codes, candidates, route: {
        "w4a8": 1.0, "fp32": 1.0 * (1 - 2 * tune.CHOICE_NOISE)})
    monkeypatch.setattr(occupancy, "other_cores", lambda since, now=None: 0.0)          # a quiet machine
    assert load_model(path, compile=False, log=io.StringIO()).weights == "fp32"

    def refuse(*a, **k):
        raise AssertionError("measured again")
    monkeypatch.setattr(tune, "measure_stored_weights", refuse)
    again = load_model(path, compile=False, log=io.StringIO())
    assert again.weights == "fp32" and again.tune.stored_weights["Q6_K"]["weights"] == "fp32"


@needs_kernel
def test_a_packing_only_load_reads_no_layer_when_fp32_is_chosen(tmp_path, monkeypatch, in_process):
    """The first-load child (``loader.first_load_main``) makes the packed copy only: where ``auto`` takes fp32
    (nothing to pack) it reads no layer beyond the tuner's sample and returns no model; the loading process then
    reads the model itself, once."""
    from speculant.models import streaming
    from speculant.runtime import loader

    path = str(write_tiny_gguf(tmp_path / "k3.gguf", "Q8_0", layers=3, hidden=256, inter=1280,
                               types={"blk.0.ffn_down.weight": "Q6_K"}))
    monkeypatch.setattr(tune, "sample_layers", lambda n, shapes=None: [1])
    monkeypatch.setattr(tune, "measure_stored_weights", lambda decoder, codes, candidates, route: {
        "w4a8": 1.0, "fp32": 1.0 * (1 - 2 * tune.CHOICE_NOISE)})
    monkeypatch.setattr(occupancy, "other_cores", lambda since, now=None: 0.0)          # a quiet machine
    filled = []
    fill = streaming.fill_layers
    monkeypatch.setattr(streaming, "fill_layers", lambda d, c, layers, *a: filled.append(list(layers)) or fill(
        d, c, layers, *a))
    stored = loading.stored_weights(path)
    model, result, fmt = loader._read_and_pack(path, torch.float32, "auto", None, 1, None, stored, io.StringIO(),
                                               packed_only=True)
    assert model is None and fmt == "fp32" and result.stored_weights["Q6_K"]["weights"] == "fp32"
    assert filled == [[1]]                                        # the tuner's sample layer, no other
    assert not list(loading.converted_dir(path).glob("packed-*"))                          # nothing saved


@needs_kernel
def test_the_stored_format_choice_reads_the_lm_heads_sample_rows_only(tmp_path, monkeypatch):
    """A large vocabulary's float32 LM head (a tied model's, mapped from its spooled embedding) is timed on its
    first rows (``tune.head_sample``), its GGUF codes decoded for those rows alone (``GGUFCodes.first_rows``, the
    rows of the whole head's codes), the time scaled to the whole head."""
    from speculant.models.gguf_codes import read_group_quantized
    path = write_tiny_gguf(tmp_path / "h.gguf", "Q8_0", layers=1, hidden=256, inter=256,
                           types={"output.weight": "Q6_K"})
    model = loading.read_checkpoint(str(path))
    codes = read_group_quantized(path, model.config)
    vocab = model.config.vocab_size
    assert "lm_head_proj" in codes and "no.such.projection" not in codes
    whole, first = codes["lm_head_proj"], codes.first_rows("lm_head_proj", 40)
    for name in ("codes", "scale", "super_scale"):
        assert torch.equal(getattr(first, name), getattr(whole, name)[:40]), name
    packed = []
    real_pack = tune.pack_linear

    def recording(fmt, weight, bias=None, codes=None):
        packed.append((weight.shape[0], None if codes is None else codes.shape[0]))
        return real_pack(fmt, weight, bias, codes)
    monkeypatch.setattr(tune, "pack_linear", recording)
    rows = 40
    monkeypatch.setattr(tune, "HEAD_SAMPLE_BYTES", rows * 4 * 256)
    sample, scale = tune.head_sample(model.decoder.lm_head_proj)
    assert sample.out_features == rows and scale == vocab / rows
    ms = tune.measure_stored_weights(model.decoder, codes, ["w4a8", "fp32"], repeats=1)
    assert set(ms) == {"w4a8", "fp32"} and all(v > 0 for v in ms.values())
    assert packed[-1] == (rows, rows)                       # the head: its sample's rows, codes of those rows
    assert all(out != vocab for out, _ in packed)
