"""The quantized codes a GGUF file stores, read as they are (no dequantize-requantize round trip).

A GGUF model's projections are stored block-wise (llama.cpp's ``ggml-quants``):

* ``Q4_0``: blocks of 32 weights, ``w = d * (q - 8)``, ``q`` in 0..15, ``d`` fp16;
* ``Q4_1``: blocks of 32 weights, ``w = d * q + m``, ``q`` in 0..15, ``d``, ``m`` fp16;
* ``Q8_0``: blocks of 32 weights, ``w = d * q``, ``q`` int8, ``d`` fp16.

:func:`read_group_quantized` returns them as :class:`GroupQuantized` tensors named like our decoder's
projections (``layers.3.self_attn.qkv_proj`` ...), rows permuted and fused exactly as the float
weights transformers' GGUF loader produces (``reverse_permute_weights`` for q/k of ``llama`` files; ``qwen2``/``qwen3``
files store q/k rows in HF order), so
``GroupQuantized.dequantize()`` equals the cached float32 weight bit for bit.  The weight formats in
:mod:`speculant.runtime.formats` pack these codes for torch's int4 kernel without requantizing.
The file's tensor table is read once through the ``gguf`` package's reader (:func:`index_tensors`), the codes
through a memory map.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from ..errors import SpeculantError
from .config import ModelConfig

GROUP = 32
"""Weights per block in Q4_0, Q4_1 and Q8_0."""


@dataclass
class GroupQuantized:
    """A weight ``[O, I]`` stored as group-wise codes: ``w[o, i] = scale[o, g] * codes[o, i] + offset[o, g]``, ``g = i // group``.

    Attributes:
        codes: ``[O, I]`` uint8 (4-bit codes 0..15) or int8 (8-bit codes).
        scale: ``[O, I / group]`` float32 (the file's fp16 values, exact).
        offset: ``[O, I / group]`` float32, or ``None`` (symmetric).
        bits: 4 or 8.
        group: weights per group (32 for GGUF blocks).
    """

    codes: torch.Tensor
    scale: torch.Tensor
    offset: torch.Tensor | None
    bits: int
    group: int = GROUP

    @property
    def shape(self) -> tuple[int, int]:
        return tuple(self.codes.shape)

    def dequantize(self) -> torch.Tensor:
        """The float32 weight ``[O, I]``."""
        o, i = self.codes.shape
        w = self.codes.float().view(o, i // self.group, self.group) * self.scale[..., None]
        if self.offset is not None:
            w = w + self.offset[..., None]
        return w.view(o, i)

    def rows(self, index) -> "GroupQuantized":
        """The same weight restricted (or permuted) to output rows ``index``."""
        off = None if self.offset is None else self.offset[index]
        return GroupQuantized(self.codes[index], self.scale[index], off, self.bits, self.group)

    @staticmethod
    def cat(parts: list["GroupQuantized"]) -> "GroupQuantized":
        """Output rows of ``parts`` stacked (a fused projection: q|k|v, gate|up)."""
        first = parts[0]
        if any(p.bits != first.bits or p.group != first.group or (p.offset is None) != (first.offset is None)
               for p in parts):
            raise SpeculantError("cannot fuse projections stored in different GGUF block types")
        off = None if first.offset is None else torch.cat([p.offset for p in parts])
        return GroupQuantized(torch.cat([p.codes for p in parts]), torch.cat([p.scale for p in parts]), off,
                              first.bits, first.group)


def _blocks(raw: np.ndarray, rows: int, block_bytes: int) -> np.ndarray:
    return np.ascontiguousarray(raw).reshape(rows, -1, block_bytes)


def _decode(tensor) -> GroupQuantized | None:
    kind = tensor.kind
    rows = int(tensor.data.shape[0])
    if kind in ("Q4_0", "Q4_1"):
        head = 2 if kind == "Q4_0" else 4
        b = _blocks(tensor.data, rows, head + GROUP // 2)
        d = b[..., 0:2].copy().view(np.float16)[..., 0].astype(np.float32)
        packed = b[..., head:]
        codes = np.concatenate([packed & 0x0F, packed >> 4], axis=-1).reshape(rows, -1)   # low nibbles = first 16
        if kind == "Q4_0":
            offset = -8.0 * d
        else:
            offset = b[..., 2:4].copy().view(np.float16)[..., 0].astype(np.float32)
        return GroupQuantized(torch.from_numpy(codes.astype(np.uint8)), torch.from_numpy(d),
                              torch.from_numpy(offset), 4)
    if kind == "Q8_0":
        b = _blocks(tensor.data, rows, 2 + GROUP)
        d = b[..., 0:2].copy().view(np.float16)[..., 0].astype(np.float32)
        codes = b[..., 2:].copy().view(np.int8).reshape(rows, -1)
        return GroupQuantized(torch.from_numpy(codes), torch.from_numpy(d), None, 8)
    return None          # F32/F16/K-quants...: the float weights are used instead


def _unpermute(gq: GroupQuantized, n_head: int) -> GroupQuantized:
    """Undo llama.cpp's q/k row order (the inverse of transformers' ``reverse_permute_weights`` input)."""
    rows = gq.shape[0]
    dim = rows // n_head // 2
    index = torch.arange(rows).view(n_head, dim, 2).transpose(1, 2).reshape(rows)
    return gq.rows(index)


_KINDS = {"Q4_0": (4, False), "Q4_1": (4, False), "Q8_0": (8, True)}
"""Block types read as codes: (bits, symmetric)."""


class GGUFCodes(Mapping):
    """The group-quantized projections of a GGUF file, keyed by our module names, decoded when asked for.

    A read-only mapping over the memory-mapped file: each ``codes[name]`` decodes (and unpermutes, fuses) that
    projection afresh and keeps nothing, so that packing a model one projection at a time never holds all its
    unpacked codes (~1 byte per weight) at once.  Keys are known without decoding (from the block types)."""

    def __init__(self, index: "TensorIndex", specs: dict[str, list[tuple[str, int | None]]]):
        self._tensors = {t.name: t for t in index.tensors}
        kinds = {n: _KINDS.get(t.kind) for n, t in self._tensors.items()}
        self._specs = {k: parts for k, parts in specs.items()
                       if all(kinds.get(n) is not None for n, _ in parts) and len({kinds[n] for n, _ in parts}) == 1}

    def __getitem__(self, key: str) -> GroupQuantized:
        parts = self._specs[key]                    # KeyError for what the file does not hold as codes
        decoded = [_decode(self._tensors[n]) for n, _ in parts]
        decoded = [p if h is None else _unpermute(p, h) for p, (_, h) in zip(decoded, parts)]
        return decoded[0] if len(decoded) == 1 else GroupQuantized.cat(decoded)

    def __iter__(self):
        return iter(self._specs)

    def __len__(self) -> int:
        return len(self._specs)


@dataclass
class IndexedTensor:
    """Where one tensor of a GGUF file lies: its name, block type (``kind``: ``Q4_1``, ``F32`` ...), byte
    offset and the shape of its raw data (``[rows, bytes per row]`` for block types), as the ``gguf`` reader
    found them; ``data`` maps those bytes read-only."""

    name: str
    kind: str
    offset: int
    data_shape: tuple[int, ...]
    path: str

    @property
    def data(self) -> np.ndarray:
        return np.memmap(self.path, dtype=np.uint8, mode="r", offset=self.offset, shape=self.data_shape)


@dataclass
class TensorIndex:
    """The tensors of a GGUF file (:class:`IndexedTensor`), without the reader's tables of metadata (the
    tokenizer's ~100 k strings): what :class:`GGUFCodes` needs, in a few kilobytes."""

    tensors: list[IndexedTensor]


def index_tensors(gguf_path: Path) -> TensorIndex:
    """Read the tensor table of ``gguf_path`` (through the ``gguf`` package's reader, which parses the whole
    header: ~5-10 s for SmolLM2's on a 2-core CPU, most of it the tokenizer's metadata) and keep only that; a split
    set's first shard gives the tensors of every shard (:func:`speculant.models.gguf_files.shard_paths`).

    Raises:
        SpeculantError: the file cannot be read as GGUF.
    """
    from gguf import GGUFReader

    from .gguf_files import shard_paths

    tensors = []
    for path in shard_paths(gguf_path):          # one file, or every shard of a split set
        try:
            reader = GGUFReader(str(path))
        except Exception as e:  # noqa: BLE001 - the reader raises many kinds
            raise SpeculantError(f"cannot read GGUF file {str(path)!r}: {e}") from None
        for t in reader.tensors:
            raw = t.data if t.data.dtype == np.uint8 else t.data.view(np.uint8).reshape(*t.data.shape[:-1], -1)
            tensors.append(IndexedTensor(t.name, t.tensor_type.name, int(t.data_offset), tuple(raw.shape), str(path)))
    return TensorIndex(tensors)


def read_group_quantized(gguf_path: Path, cfg: ModelConfig, index: TensorIndex | None = None) -> GGUFCodes:
    """Group-quantized projections of a Llama-family GGUF, keyed by our module names (a :class:`GGUFCodes`
    mapping: each decoded when it is looked up).

    Keys: ``layers.{i}.self_attn.qkv_proj``, ``layers.{i}.self_attn.o_proj``, ``layers.{i}.mlp.gate_up_proj``,
    ``layers.{i}.mlp.down_proj`` and ``lm_head_proj`` (the ``output`` tensor, or ``token_embd`` when tied).
    A projection whose tensors are not all Q4_0/Q4_1/Q8_0 of one kind is left out.  ``index``: the file's
    :func:`index_tensors`, if already read.  q/k rows are put back in HF order for ``llama``/``mistral`` configs
    (llama.cpp's converter permutes them for the ``llama`` architecture only).

    Raises:
        SpeculantError: the file cannot be read as GGUF.
    """
    index = index if index is not None else index_tensors(gguf_path)
    names = {t.name for t in index.tensors}
    permuted = cfg.model_type in ("llama", "mistral")
    specs: dict[str, list[tuple[str, int | None]]] = {}
    for i in range(cfg.num_hidden_layers):
        b = f"blk.{i}."
        specs[f"layers.{i}.self_attn.qkv_proj"] = [(b + "attn_q.weight", cfg.num_attention_heads if permuted else None),
                                                   (b + "attn_k.weight", cfg.num_key_value_heads if permuted else None),
                                                   (b + "attn_v.weight", None)]
        specs[f"layers.{i}.self_attn.o_proj"] = [(b + "attn_output.weight", None)]
        specs[f"layers.{i}.mlp.gate_up_proj"] = [(b + "ffn_gate.weight", None), (b + "ffn_up.weight", None)]
        specs[f"layers.{i}.mlp.down_proj"] = [(b + "ffn_down.weight", None)]
    specs["lm_head_proj"] = [("output.weight" if "output.weight" in names else "token_embd.weight", None)]
    return GGUFCodes(index, specs)
