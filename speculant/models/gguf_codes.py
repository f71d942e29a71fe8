"""The quantized codes a GGUF file stores, read as they are (no dequantize-requantize round trip).

A GGUF model's projections are stored block-wise (llama.cpp's ``ggml-quants``):

* ``Q4_0``: blocks of 32 weights, ``w = d * (q - 8)``, ``q`` in 0..15, ``d`` fp16;
* ``Q4_1``: blocks of 32 weights, ``w = d * q + m``, ``q`` in 0..15, ``d``, ``m`` fp16;
* ``Q8_0``: blocks of 32 weights, ``w = d * q``, ``q`` int8, ``d`` fp16;
* ``Q5_0``: blocks of 32, ``w = d * (q - 16)``, ``q`` in 0..31; ``Q5_1``: ``w = d * q + m``;
* ``Q4_K`` / ``Q5_K``: super-blocks of 256 (fp16 ``d``, ``dmin``), 8 sub-blocks of 32 with 6-bit ``sc_j``, ``m_j``:
  ``w = (d * sc_j) * q - (dmin * m_j)``, ``q`` in 0..15 / 0..31;
* ``Q6_K``: super-blocks of 256 (fp16 ``d``), 16 sub-blocks of 16 with int8 ``sc_j``: ``w = (d * sc_j) * (q - 32)``,
  ``q`` in 0..63.

A K-quant's products ``d * sc_j`` and ``dmin * m_j`` are exact in float32 (at most 11 + 8 significant bits), so its
super-block folds exactly into float32 scales (and offsets) per sub-block: :class:`GroupQuantized` with
``scale_dtype`` float32 (Q6_K: ``group`` 16), whose ``dequantize`` gives ``gguf.quants.dequantize``'s bits (the same
float32 operations: an exact product, then one rounded add).

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

from collections.abc import Callable, Mapping
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np
import torch

from ..errors import SpeculantError
from .config import ModelConfig

GROUP = 32
"""Weights per block in Q4_0, Q4_1, Q8_0, Q5_0, Q5_1 (and per sub-block in Q4_K, Q5_K)."""


@dataclass
class GroupQuantized:
    """A weight ``[O, I]`` stored as group-wise codes: ``w[o, i] = scale[o, g] * codes[o, i] + offset[o, g]``, ``g = i // group``.

    Attributes:
        codes: ``[O, I]`` uint8 (4-bit codes 0..15) or int8 (8-bit codes: Q8_0's, and Q5's and Q6_K's, which fit).
        scale: ``[O, I / group]`` float32 (the file's values, exact).
        offset: ``[O, I / group]`` float32, or ``None`` (symmetric).
        bits: 4 or 8.
        group: weights per group (32 for GGUF blocks and K-quant sub-blocks; 16 for Q6_K's).
        scale_dtype: ``torch.float16`` where every scale and offset is an fp16 value as stored (Q4_0, Q4_1, Q8_0,
            Q5_0, Q5_1), ``torch.float32`` where they are K-quant products, exact in float32 only.
        kind: the GGUF block type the codes were read from (``None``: made here).
        super_scale: Q6_K's and Q4_K's fp16 super-block scale ``d`` per 256 inputs, ``[O, I / 256]`` float32
            (``scale`` is ``d * sc_j`` exactly), or ``None``: what :class:`~speculant.runtime.formats.W6A8Linear`
            and :class:`~speculant.runtime.formats.W4A8KLinear` store instead of the folded scales.
        super_min: Q4_K's fp16 super-block min ``dmin`` per 256 inputs, ``[O, I / 256]`` float32 (``offset`` is
            ``-(dmin * m_j)`` exactly), or ``None``.
    """

    codes: torch.Tensor
    scale: torch.Tensor
    offset: torch.Tensor | None
    bits: int
    group: int = GROUP
    scale_dtype: torch.dtype = torch.float16
    kind: str | None = None
    super_scale: torch.Tensor | None = None
    super_min: torch.Tensor | None = None

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
        sup = None if self.super_scale is None else self.super_scale[index]
        smin = None if self.super_min is None else self.super_min[index]
        return GroupQuantized(self.codes[index], self.scale[index], off, self.bits, self.group, self.scale_dtype,
                              self.kind, sup, smin)

    def layout(self) -> tuple:
        """What a kernel layout depends on: codes of the same layout can share one projection."""
        return self.bits, self.group, self.offset is None, self.scale_dtype

    @staticmethod
    def cat(parts: list["GroupQuantized"]) -> "GroupQuantized":
        """Output rows of ``parts`` stacked (a fused projection: q|k|v, gate|up).

        Raises:
            SpeculantError: the parts differ in :meth:`layout` (a fused projection of such parts is a stack of
                projections, :class:`~speculant.runtime.formats.StackedLinear`).
        """
        first = parts[0]
        if any(p.layout() != first.layout() for p in parts):
            raise SpeculantError("cannot fuse projections stored in different GGUF block types ("
                                 + ", ".join(str(p.kind) for p in parts) + ") into one")
        off = None if first.offset is None else torch.cat([p.offset for p in parts])
        kinds = {p.kind for p in parts}
        sup = None if any(p.super_scale is None for p in parts) else torch.cat([p.super_scale for p in parts])
        smin = None if any(p.super_min is None for p in parts) else torch.cat([p.super_min for p in parts])
        return GroupQuantized(torch.cat([p.codes for p in parts]), torch.cat([p.scale for p in parts]), off,
                              first.bits, first.group, first.scale_dtype, kinds.pop() if len(kinds) == 1 else None, sup,
                              smin)


def _blocks(raw: np.ndarray, rows: int, block_bytes: int) -> np.ndarray:
    return np.ascontiguousarray(raw).reshape(rows, -1, block_bytes)


def _half(b: np.ndarray, at: int) -> np.ndarray:
    """The fp16 value at byte ``at`` of every block of ``b`` ``[rows, blocks, bytes]``, as float32 ``[rows, blocks]``."""
    return b[..., at:at + 2].copy().view(np.float16)[..., 0].astype(np.float32)


def _nibbles(packed: np.ndarray) -> np.ndarray:
    """GGUF's 32-code halves: bytes ``[..., 16]`` -> codes ``[..., 32]`` (low nibbles first, then high ones)."""
    return np.concatenate([packed & 0x0F, packed >> 4], axis=-1)


def _gq(codes: np.ndarray, scale: np.ndarray, offset: np.ndarray | None, bits: int, kind: str,
        group: int = GROUP, scale_dtype: torch.dtype = torch.float16) -> GroupQuantized:
    rows = codes.shape[0]
    t = torch.from_numpy(np.ascontiguousarray(codes.reshape(rows, -1)).astype(np.uint8 if bits == 4 else np.int8))
    return GroupQuantized(t, torch.from_numpy(np.ascontiguousarray(scale.reshape(rows, -1), dtype=np.float32)),
                          None if offset is None else torch.from_numpy(np.ascontiguousarray(offset.reshape(rows, -1),
                                                                                            dtype=np.float32)),
                          bits, group, scale_dtype, kind)


def _decode_q4(kind: str, b: np.ndarray) -> GroupQuantized:
    head = 2 if kind == "Q4_0" else 4
    d = _half(b, 0)
    offset = -8.0 * d if kind == "Q4_0" else _half(b, 2)
    return _gq(_nibbles(b[..., head:]), d, offset, 4, kind)


def _decode_q5(kind: str, b: np.ndarray) -> GroupQuantized:
    """Q5_0 / Q5_1: fp16 d (, m), 4 bytes of high bits (bit j: code j's), 16 bytes of nibbles."""
    head = 2 if kind == "Q5_0" else 4
    high = np.unpackbits(b[..., head:head + 4], axis=-1, bitorder="little")          # [rows, blocks, 32]
    q = _nibbles(b[..., head + 4:]) | (high << 4)
    if kind == "Q5_0":
        return _gq(q.astype(np.int16) - 16, _half(b, 0), None, 8, kind)
    return _gq(q, _half(b, 0), _half(b, 2), 8, kind)


def _decode_k(kind: str, b: np.ndarray) -> GroupQuantized:
    """Q4_K / Q5_K (fp16 d, dmin, 12 bytes of 6-bit scales and mins, [32 bytes of high bits,] 128 of nibbles) and
    Q6_K (128 bytes of low nibbles, 64 of high 2-bit pairs, 16 int8 scales, fp16 d), folded into float32 per
    sub-block: scale d * sc_j, offset -(dmin * m_j) (both exact)."""
    from gguf.quants import Q4_K
    rows, blocks = b.shape[:2]
    if kind == "Q6_K":
        ql = b[..., :128].reshape(rows, blocks, 2, 1, 64) >> np.array([0, 4], np.uint8).reshape(2, 1)
        qh = b[..., 128:192].reshape(rows, blocks, 2, 1, 32) >> np.array([0, 2, 4, 6], np.uint8).reshape(4, 1)
        q = (ql & 0x0F).reshape(rows, blocks, 8, 32) | ((qh & 0x03).reshape(rows, blocks, 8, 32) << 4)
        sc = b[..., 192:208].copy().view(np.int8).astype(np.float32)
        d = _half(b, 208)
        gq = _gq(q.astype(np.int16) - 32, d[..., None] * sc, None, 8, kind, 16, torch.float32)
        gq.super_scale = torch.from_numpy(np.ascontiguousarray(d.reshape(rows, -1)))
        return gq
    sc, m = Q4_K.get_scale_min(b[..., 4:16].reshape(-1, 12))
    scale = _half(b, 0)[..., None] * sc.reshape(rows, blocks, 8).astype(np.float32)
    offset = -(_half(b, 2)[..., None] * m.reshape(rows, blocks, 8).astype(np.float32))
    low = b[..., -128:].reshape(rows, blocks, 4, 1, 32) >> np.array([0, 4], np.uint8).reshape(2, 1)
    q = (low & 0x0F).reshape(rows, blocks, 8, 32)
    if kind == "Q4_K":
        gq = _gq(q, scale, offset, 4, kind, GROUP, torch.float32)
        gq.super_scale = torch.from_numpy(np.ascontiguousarray(_half(b, 0)))
        gq.super_min = torch.from_numpy(np.ascontiguousarray(_half(b, 2)))
        return gq
    high = b[..., 16:48].reshape(rows, blocks, 1, 32) >> np.arange(8, dtype=np.uint8).reshape(8, 1)
    return _gq(q | ((high & 0x01) << 4), scale, offset, 8, kind, GROUP, torch.float32)


_BLOCK_BYTES = {"Q4_0": 18, "Q4_1": 20, "Q8_0": 34, "Q5_0": 22, "Q5_1": 24, "Q4_K": 144, "Q5_K": 176, "Q6_K": 210}
"""Block types read as codes, and the bytes of one block (32 weights; 256 for the K-quants)."""


def _decode(tensor) -> GroupQuantized | None:
    if tensor.kind not in _BLOCK_BYTES:
        return None      # F32/F16/BF16 and the types we do not take as codes: the float weights are used instead
    return decode_blocks(tensor.kind, tensor.data)


DECODE_ROWS = 8192
"""Rows a tensor's blocks are decoded at a time: the decoders' numpy temporaries are several times the codes they
make (700 MB to decode a 128k-token Q4_0 LM head's 262 MB of codes at once)."""


def decode_blocks(kind: str, raw: np.ndarray) -> GroupQuantized:
    """GGUF blocks of type ``kind`` (a key of ``_BLOCK_BYTES``), ``raw`` uint8 ``[O, bytes per row]`` as a GGUF
    tensor's data (or ``gguf.quants.quantize``) holds them -> :class:`GroupQuantized` ``[O, I]``; decoded
    :data:`DECODE_ROWS` rows at a time into the result (each row's codes depend on its own blocks only)."""
    rows = int(raw.shape[0])
    if rows <= DECODE_ROWS:
        return _decode_rows(kind, raw)
    first = _decode_rows(kind, raw[:DECODE_ROWS])
    out = {}
    for name in ("codes", "scale", "offset", "super_scale", "super_min"):
        part = getattr(first, name)
        if part is not None:
            out[name] = torch.empty((rows, *part.shape[1:]), dtype=part.dtype)
            out[name][:DECODE_ROWS] = part
    for start in range(DECODE_ROWS, rows, DECODE_ROWS):
        part = _decode_rows(kind, raw[start:start + DECODE_ROWS])
        for name, whole in out.items():
            whole[start:start + DECODE_ROWS] = getattr(part, name)
    return replace(first, codes=out["codes"], scale=out["scale"], offset=out.get("offset"),
                   super_scale=out.get("super_scale"), super_min=out.get("super_min"))


def _decode_rows(kind: str, raw: np.ndarray) -> GroupQuantized:
    """:func:`decode_blocks` of rows decoded at once."""
    b = _blocks(raw, int(raw.shape[0]), _BLOCK_BYTES[kind])
    if kind in ("Q4_0", "Q4_1"):
        return _decode_q4(kind, b)
    if kind == "Q8_0":
        return _gq(b[..., 2:].copy().view(np.int8), _half(b, 0), None, 8, kind)
    if kind in ("Q5_0", "Q5_1"):
        return _decode_q5(kind, b)
    return _decode_k(kind, b)


def _unpermute(gq: GroupQuantized, n_head: int) -> GroupQuantized:
    """Undo llama.cpp's q/k row order (the inverse of transformers' ``reverse_permute_weights`` input)."""
    rows = gq.shape[0]
    dim = rows // n_head // 2
    index = torch.arange(rows).view(n_head, dim, 2).transpose(1, 2).reshape(rows)
    return gq.rows(index)


_F16, _F32 = torch.float16, torch.float32
_LAYOUTS = {"Q4_0": (4, GROUP, False, _F16), "Q4_1": (4, GROUP, False, _F16), "Q8_0": (8, GROUP, True, _F16),
            "Q5_0": (8, GROUP, True, _F16), "Q5_1": (8, GROUP, False, _F16), "Q4_K": (4, GROUP, False, _F32),
            "Q5_K": (8, GROUP, False, _F32), "Q6_K": (8, 16, True, _F32)}
"""Block type -> :meth:`GroupQuantized.layout` of its decoded codes (bits, group, without offsets, scale dtype), as
the decoders above make them, known without decoding: parts of one layout fuse into one (:class:`GGUFCodes`)."""
CODE_KINDS = tuple(_BLOCK_BYTES)
"""Block types read as codes."""


class GGUFCodes(Mapping):
    """The group-quantized projections of a GGUF file, keyed by our module names, decoded when asked for.

    A read-only mapping over the memory-mapped file: each ``codes[name]`` decodes (and unpermutes, fuses) that
    projection afresh and keeps nothing, so that packing a model one projection at a time never holds all its
    unpacked codes (~1 byte per weight) at once.  Keys are known without decoding (from the block types).  A fused
    projection (q|k|v, gate|up) whose tensors differ in :meth:`GroupQuantized.layout` (a Q4_K_M file's Q4_K q, k and
    Q6_K v) is a list of parts' codes in order, consecutive tensors of one layout fused into one part."""

    def __init__(self, index: "TensorIndex", specs: dict[str, list[tuple[str, int | None]]]):
        self._tensors = {t.name: t for t in index.tensors}
        self._specs = {k: parts for k, parts in specs.items()
                       if all(n in self._tensors and self._tensors[n].kind in CODE_KINDS for n, _ in parts)}

    def __getitem__(self, key: str) -> GroupQuantized | list[GroupQuantized]:
        parts = self._specs[key]                    # KeyError for what the file does not hold as codes
        decoded = [_decode(self._tensors[n]) for n, _ in parts]
        decoded = [p if h is None else _unpermute(p, h) for p, (_, h) in zip(decoded, parts)]
        runs: list[list[GroupQuantized]] = []          # consecutive parts of one layout fuse (Q4_K q|k, then Q6_K v)
        for p in decoded:
            if runs and runs[-1][0].layout() == p.layout():
                runs[-1].append(p)
            else:
                runs.append([p])
        fused = [r[0] if len(r) == 1 else GroupQuantized.cat(r) for r in runs]
        return fused[0] if len(fused) == 1 else fused

    def as_stored(self, key: str) -> bool:
        """Whether ``self[key]`` keeps the block type of every part it holds (each run of parts fused into one has a
        single type), known from the tensor table without decoding: what ``w4a8`` packs as stored, the float
        weight unread (:func:`~speculant.runtime.formats.pack_linear`); ``False`` for keys not held."""
        parts = self._specs.get(key)
        if parts is None:
            return False
        kinds = [self._tensors[n].kind for n, _ in parts]
        runs: list[list[str]] = []
        for kind in kinds:
            if runs and _LAYOUTS[runs[-1][0]] == _LAYOUTS[kind]:
                runs[-1].append(kind)
            else:
                runs.append([kind])
        return all(len(set(run)) == 1 for run in runs)

    def __iter__(self):
        return iter(self._specs)

    def __len__(self) -> int:
        return len(self._specs)

    def __contains__(self, key) -> bool:
        return key in self._specs                   # without decoding (Mapping's would decode the projection)

    def row_slices(self, key: str) -> tuple[int, Callable[[int, int], GroupQuantized]] | None:
        """``(rows, decode)`` where ``self[key]`` is one tensor in the file's row order (an LM head):
        ``decode(start, end)`` is ``self[key]`` restricted to rows ``[start, end)``, only those rows' blocks read
        (their file pages mapped only while decoded); ``None`` for a fused or unpermuted projection.

        Raises:
            KeyError: ``key`` not held as codes."""
        parts = self._specs[key]
        if len(parts) != 1 or parts[0][1] is not None:
            return None
        tensor = self._tensors[parts[0][0]]
        return tensor.data_shape[0], lambda start, end: decode_blocks(tensor.kind, tensor.data[start:end])

    def first_rows(self, key: str, rows: int) -> GroupQuantized | list[GroupQuantized]:
        """``self[key]`` restricted to its first ``rows`` output rows, decoding only those where the key is one
        tensor in the file's row order (an LM head: a sample of a large vocabulary's head without decoding it
        whole, :meth:`row_slices`); else ``self[key].rows(...)``."""
        sliced = self.row_slices(key)
        if sliced is not None:
            return sliced[1](0, rows)
        whole = self[key]
        index = torch.arange(rows)
        return [p.rows(index) for p in whole] if isinstance(whole, list) else whole.rows(index)


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
    """Read the tensor table of ``gguf_path`` (:func:`~speculant.models.gguf_header.read_header`: the header without
    the tokenizer's strings, well under a second) and keep only that; a split set's first shard gives the tensors of
    every shard (:func:`speculant.models.gguf_files.shard_paths`).

    Raises:
        SpeculantError: the file cannot be read as GGUF.
    """
    from .gguf_files import shard_paths
    from .gguf_header import read_header

    tensors = []
    for path in shard_paths(gguf_path):          # one file, or every shard of a split set
        try:
            header = read_header(path)
        except Exception as e:  # noqa: BLE001 - struct, numpy and value errors of a corrupt file
            raise SpeculantError(f"cannot read GGUF file {str(path)!r}: {e}") from None
        for t in header.tensors:
            tensors.append(IndexedTensor(t.name, t.tensor_type.name, t.data_offset, _byte_shape(t), str(path)))
    return TensorIndex(tensors)


def _byte_shape(t) -> tuple[int, ...]:
    """``[..., bytes per row]`` of a header tensor: its stored bytes, a row of the GGUF's last dimension per row."""
    dims = tuple(reversed(t.shape))
    return (*dims[:-1], t.n_bytes // max(1, int(np.prod(dims[:-1], dtype=np.int64))))


def read_group_quantized(gguf_path: Path, cfg: ModelConfig, index: TensorIndex | None = None) -> GGUFCodes:
    """Group-quantized projections of a Llama-family GGUF, keyed by our module names (a :class:`GGUFCodes`
    mapping: each decoded when it is looked up).

    Keys: ``layers.{i}.self_attn.qkv_proj``, ``layers.{i}.self_attn.o_proj``, ``layers.{i}.mlp.gate_up_proj``,
    ``layers.{i}.mlp.down_proj`` and ``lm_head_proj`` (the ``output`` tensor, or ``token_embd`` when tied).
    A projection with a tensor of another type (float, or a block type not in :data:`CODE_KINDS`) is left out; one
    whose tensors differ in layout is a list of parts (:class:`GGUFCodes`).  ``index``: the file's
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
