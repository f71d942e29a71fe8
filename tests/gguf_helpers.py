"""Tiny GGUF files written inside the tests with the ``gguf`` package (no download, fixed seeds)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
from gguf import GGMLQuantizationType, GGUFWriter, quants

from helpers import MERGES, byte_tokenizer

T = GGMLQuantizationType


def _stored(data: np.ndarray, kind: str) -> tuple[np.ndarray, GGMLQuantizationType]:
    """``data`` (float32 ``[rows, cols]`` or ``[n]``) stored as GGUF type ``kind``: the raw array and its type."""
    qtype = T[kind]
    if kind == "F32":
        return data.astype(np.float32), qtype
    if kind == "F16":
        return data.astype(np.float16), qtype
    return quants.quantize(data.astype(np.float32), qtype), qtype


K_QUANTS = ("Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K")
_K_SCALES = {"Q2_K": (80, 82), "Q3_K": (108,), "Q4_K": (0, 2), "Q5_K": (0, 2), "Q6_K": (208,)}
"""Byte offsets of each K-quant block's fp16 super-block scales (d, and dmin where the type has one)."""


def k_quant_blocks(rows: int, cols: int, kind: str, rng: np.random.Generator, scale: float | None = None) -> np.ndarray:
    """Random K-quant blocks (:data:`K_QUANTS`) ``[rows, cols / 256 * block bytes]`` with finite fp16 super-block
    scales (the ``gguf`` package cannot quantize to K-quants; their blocks are any bytes with finite scales): every
    scale ``scale``, or (``None``) each drawn log-uniformly in [1e-4, 1e-2]."""
    from gguf import GGML_QUANT_SIZES
    block, size = GGML_QUANT_SIZES[T[kind]]
    raw = rng.integers(0, 256, size=(rows, cols // block, size), dtype=np.uint8)
    for at in _K_SCALES[kind]:
        if scale is None:
            values = np.exp(rng.uniform(np.log(1e-4), np.log(1e-2), size=(rows, cols // block)))
        else:
            values = np.full((rows, cols // block), scale)
        raw[..., at:at + 2] = values.astype(np.float16).view(np.uint8).reshape(rows, cols // block, 2)
    return raw.reshape(rows, -1)


def write_tiny_gguf(path: Path, kind: str = "Q8_0", arch: str = "llama", *, layers: int = 2, hidden: int = 64,
                    heads: int = 4, kv_heads: int = 2, inter: int = 128, tie: bool = False, seed: int = 0,
                    tokenizer: bool = True, types: dict[str, str] | None = None, name: str = "tiny",
                    head_dim: int | None = None, window: int = 6, split_max_tensors: int = 0,
                    extra: tuple[str, ...] = ()) -> Path:
    """A random Llama-family GGUF with the byte-level BPE tokenizer of :func:`helpers.byte_tokenizer`.

    ``kind``: the type of every 2-D weight (``F32``, ``F16``, ``BF16``, ``Q8_0``, ``Q4_0``, ``Q4_1``, ``Q5_0`` ...);
    norms are F32.  ``types``: per-tensor overrides (GGUF tensor name -> type, ``Q4_K``/``Q6_K`` as random blocks).
    ``arch``: ``llama``, ``qwen2`` (adds q/k/v biases), ``qwen3`` (adds q/k norms, F32, and ``attention.key_length``
    / ``value_length`` = ``head_dim``), ``gemma3`` (q/k norms, the norms after attention and around the MLP, stored
    as llama.cpp writes them: ``1 + weight``; ``attention.sliding_window`` = ``window``, RoPE base 1e6 for the global
    layers; tied: no ``output.weight``) or any name (for the refusal tests).  ``head_dim``: default ``hidden / heads``.
    ``split_max_tensors``: write a split set of shards of at most that many tensors (gguf-py's own splitting, named
    ``<stem>-00001-of-0000N.gguf`` ...) and return the first shard.  ``extra``: names of more F32 tensors of
    ``hidden`` values (``blk.0.attn_output.bias`` in a file whose config has none ...)."""
    rng = np.random.default_rng(seed)
    tok = byte_tokenizer()
    vocab = len(tok)
    w = GGUFWriter(str(path), arch, split_max_tensors=split_max_tensors)
    w.add_name(name)
    w.add_block_count(layers)
    w.add_context_length(2048)
    w.add_embedding_length(hidden)
    w.add_feed_forward_length(inter)
    w.add_head_count(heads)
    w.add_head_count_kv(kv_heads)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_rope_freq_base(1e6 if arch == "gemma3" else 10000.0)
    w.add_vocab_size(vocab)
    if tokenizer:
        ids = sorted(tok.get_vocab().items(), key=lambda kv: kv[1])
        w.add_tokenizer_model("gpt2")
        w.add_tokenizer_pre("default")
        w.add_token_list([t for t, _ in ids])
        w.add_token_types([3 if t == "<eos>" else 1 for t, _ in ids])
        w.add_token_merges([f"{a} {b}" for a, b in MERGES])
        w.add_eos_token_id(0)
        w.add_bos_token_id(0)
    types = dict(types or {})
    head_dim = head_dim or hidden // heads
    if arch in ("qwen3", "gemma3"):
        w.add_key_length(head_dim)
        w.add_value_length(head_dim)
    if arch == "gemma3":
        w.add_sliding_window(window)
        tie = True

    def add(name: str, shape: tuple[int, ...], scale: float = 0.1, own: str | None = None):
        kind_here = types.get(name, own or kind)
        if kind_here in K_QUANTS:
            w.add_tensor(name, k_quant_blocks(shape[0], shape[1], kind_here, rng), raw_dtype=T[kind_here])
            return
        data = (rng.standard_normal(shape) * scale).astype(np.float32)
        raw, qtype = _stored(data, kind_here)
        w.add_tensor(name, raw, raw_dtype=qtype if kind_here != "F32" else None)

    add("token_embd.weight", (vocab, hidden), 0.5)
    add("output_norm.weight", (hidden,), own="F32")
    if not tie:
        add("output.weight", (vocab, hidden), 0.2)
    for i in range(layers):
        b = f"blk.{i}."
        add(b + "attn_norm.weight", (hidden,), own="F32")
        add(b + "ffn_norm.weight", (hidden,), own="F32")
        add(b + "attn_q.weight", (heads * head_dim, hidden))
        add(b + "attn_k.weight", (kv_heads * head_dim, hidden))
        add(b + "attn_v.weight", (kv_heads * head_dim, hidden))
        add(b + "attn_output.weight", (hidden, heads * head_dim))
        add(b + "ffn_gate.weight", (inter, hidden))
        add(b + "ffn_up.weight", (inter, hidden))
        add(b + "ffn_down.weight", (hidden, inter))
        if arch == "qwen2":
            for n, rows in (("q", heads * head_dim), ("k", kv_heads * head_dim), ("v", kv_heads * head_dim)):
                add(b + f"attn_{n}.bias", (rows,), own="F32")
        if arch in ("qwen3", "gemma3"):
            for n in ("q", "k"):
                w.add_tensor(b + f"attn_{n}_norm.weight", rng.uniform(0.5, 1.5, head_dim).astype(np.float32))
        if arch == "gemma3":
            for n in ("post_attention_norm", "post_ffw_norm"):
                w.add_tensor(b + f"{n}.weight", rng.uniform(0.5, 1.5, hidden).astype(np.float32))
    for name in extra:
        add(name, (hidden,), own="F32")
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    if split_max_tensors:
        return Path(path).with_name(f"{Path(path).stem}-00001-of-{len(w.tensors):05d}.gguf")
    return Path(path)
