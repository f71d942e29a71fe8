"""A GGUF file's header read once and cheaply: its metadata and tensor table, without the tokenizer's strings.

``gguf.GGUFReader`` builds a numpy view for every part of every metadata value: for a 262k-token vocabulary
(Gemma 3) that is ~800k small arrays, a minute of a loaded 2-core CPU, and a loader that reads the file for its
tensors, its config and its tokenizer did it several times per load.  :func:`read_header` walks the same bytes
(GGUF v2/v3 layout: https://github.com/ggml-org/ggml/blob/master/docs/gguf.md, "File Structure") and keeps the
string arrays (``tokenizer.ggml.tokens``, ``merges``) only as their lengths unless asked for, in well under a second;
tensor types and block sizes come from the ``gguf`` package (``GGMLQuantizationType``, ``GGML_QUANT_SIZES``), and
:attr:`HeaderTensor.data` maps a tensor's bytes as ``GGUFReader``'s ``ReaderTensor.data`` does.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from pathlib import Path

import numpy as np

VERSIONS = (2, 3)
"""GGUF versions read (v1 counted in 32 bits; no file in use still has it)."""
_SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}
_STRING, _ARRAY = 8, 9
_TYPED = {"F32": np.float32, "F16": np.float16, "F64": np.float64, "I8": np.int8, "I16": np.int16, "I32": np.int32,
          "I64": np.int64}
"""Tensor types ``GGUFReader`` maps as typed values (every other type: bytes, a row of blocks per row)."""


@dataclass(frozen=True)
class StringArray:
    """A metadata array of strings left unread: only its length (``count``)."""

    count: int


@dataclass(frozen=True)
class HeaderTensor:
    """One tensor of the table: ``shape`` in GGUF order (fastest-moving dimension first, as ``ReaderTensor.shape``),
    ``data_offset`` from the start of the file [bytes], ``n_bytes`` its stored size [bytes]."""

    name: str
    tensor_type: object          # gguf.GGMLQuantizationType
    shape: tuple[int, ...]
    n_elements: int
    n_bytes: int
    data_offset: int
    path: str

    @property
    def data(self) -> np.ndarray:
        """The stored values, read-only mapped: typed values ``[... , shape[0]]`` for float and integer types, else
        bytes ``[..., bytes per row]`` (what ``gguf.dequantize`` takes).

        Raises:
            ValueError: the file ends before the tensor does.
        """
        dims = tuple(reversed(self.shape))
        dtype = _TYPED.get(self.tensor_type.name)
        if dtype is None:
            from gguf import quant_shape_to_byte_shape
            return np.memmap(self.path, np.uint8, "r", self.data_offset, (self.n_bytes,)).reshape(
                quant_shape_to_byte_shape(dims, self.tensor_type))
        return np.memmap(self.path, dtype, "r", self.data_offset, (self.n_elements,)).reshape(dims)


@dataclass(frozen=True)
class GGUFHeader:
    """What :func:`read_header` read: ``metadata`` (key -> int, float, bool, str, list of numbers or strings, or a
    :class:`StringArray`), the tensor table in file order, and the file's size [bytes]."""

    path: Path
    metadata: dict
    tensors: list[HeaderTensor]
    file_size: int

    def field(self, key: str):
        """The value of ``key``, or ``None`` when absent."""
        return self.metadata.get(key)


def read_header(path: str | Path, string_arrays=()) -> GGUFHeader:
    """Read the header of the GGUF file ``path``: metadata (string arrays named in ``string_arrays`` read in full,
    others kept as :class:`StringArray`) and tensor table; no tensor data is read.

    Raises:
        ValueError: not a GGUF file (magic), an unknown version, value type or tensor type, or a header that runs
            past the end of the file (truncated); ``struct.error`` for a file shorter than its counts say.
    """
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

    blob = np.memmap(path, np.uint8, "r")
    if bytes(blob[:4]) != b"GGUF":
        raise ValueError("no GGUF magic bytes")
    version, n_tensors, n_fields = struct.unpack_from("<IQQ", blob, 4)
    if version not in VERSIONS:
        raise ValueError(f"GGUF version {version}; read: {VERSIONS}")
    pos, metadata = 24, {}
    for _ in range(n_fields):
        key, pos = _string(blob, pos)
        (kind,) = struct.unpack_from("<I", blob, pos)
        metadata[key], pos = _value(blob, pos + 4, kind, key in string_arrays)
    entries = []
    for _ in range(n_tensors):
        name, pos = _string(blob, pos)
        (n_dims,) = struct.unpack_from("<I", blob, pos)
        dims = struct.unpack_from(f"<{n_dims}Q", blob, pos + 4)
        kind, offset = struct.unpack_from("<IQ", blob, pos + 4 + 8 * n_dims)
        pos += 4 + 8 * n_dims + 12
        entries.append((name, tuple(int(d) for d in dims), GGMLQuantizationType(kind), offset))
    align = int(metadata.get("general.alignment", 32))
    start = (pos + align - 1) // align * align
    tensors = []
    for name, dims, kind, offset in entries:
        block, size = GGML_QUANT_SIZES[kind]
        n = int(np.prod(dims, dtype=np.int64))
        tensors.append(HeaderTensor(name, kind, dims, n, n * size // block, start + offset, str(path)))
        if start + offset + n * size // block > blob.size:
            raise ValueError(f"tensor {name} runs past the end of the file")
    return GGUFHeader(Path(path), metadata, tensors, int(blob.size))


def _string(blob: np.ndarray, pos: int) -> tuple[str, int]:
    (n,) = struct.unpack_from("<Q", blob, pos)
    if pos + 8 + n > blob.size:
        raise ValueError("the header runs past the end of the file")
    return bytes(blob[pos + 8:pos + 8 + n]).decode("utf-8", errors="replace"), pos + 8 + n


def _value(blob: np.ndarray, pos: int, kind: int, keep_strings: bool):
    """One metadata value of GGUF value type ``kind`` at ``pos``, and the position after it."""
    if kind in _SCALARS:
        fmt = _SCALARS[kind]
        return struct.unpack_from(fmt, blob, pos)[0], pos + struct.calcsize(fmt)
    if kind == _STRING:
        return _string(blob, pos)
    if kind != _ARRAY:
        raise ValueError(f"unknown metadata value type {kind}")
    item, count = struct.unpack_from("<IQ", blob, pos)
    pos += 12
    if item in _SCALARS:
        fmt = _SCALARS[item]
        return list(struct.unpack_from(f"<{count}{fmt[1]}", blob, pos)), pos + count * struct.calcsize(fmt)
    if item != _STRING:
        raise ValueError(f"metadata array of value type {item}")
    if keep_strings:
        values = []
        for _ in range(count):
            s, pos = _string(blob, pos)
            values.append(s)
        return values, pos
    for _ in range(count):                          # only walked: each string's length, then past it
        pos += 8 + struct.unpack_from("<Q", blob, pos)[0]
    if pos > blob.size:
        raise ValueError("the header runs past the end of the file")
    return StringArray(count), pos
