"""GGUF files given by path (``--model PATH.gguf``): checked before anything is converted, and where their
float32 conversion is cached.

:func:`inspect_gguf` reads a file's header (:func:`~speculant.models.gguf_header.read_header`: no tensor data, the
tokenizer's strings skipped) and refuses, in one
line naming the bad value and what is allowed: a missing file or shard, a later shard of a split set (the first
holds the metadata; :func:`shard_paths` finds the others by llama.cpp's names), a truncated or corrupt file, an
architecture our decoder does not implement, a file without a tokenizer, a tensor type we cannot take.  Tensor types:

* taken in every weight format: ``F32``, ``F16``, ``BF16`` (floats), ``Q8_0``, ``Q4_0``, ``Q4_1`` (their codes are
  used as stored by the ``int4``/``w4a8`` formats; :mod:`speculant.models.gguf_codes`);
* taken in ``fp32`` and ``w4a8`` (:data:`KERNEL_TYPES`: ``Q5_0``, ``Q5_1``, ``Q4_K``, ``Q5_K``, ``Q6_K``): ``w4a8``
  runs their codes as stored on our kernels (K-quant super-block scales folded exactly into float32 per sub-block),
  ``fp32`` dequantizes them exactly; ``int4``/``int8``/``bf16`` would requantize them;
* taken in ``fp32`` weights only (:data:`FP32_ONLY_TYPES`: ``Q2_K``, ``Q3_K``): ``gguf.dequantize`` turns them into
  float32 exactly, but every packed format would requantize them.

The conversion of a file lives in ``$SPECULANT_CACHE/gguf/<stem>-<key>/`` where ``key`` hashes the file's resolved
path, size and modification time (:func:`cache_dir`): a changed file is converted again.
"""

from __future__ import annotations

import hashlib
import os
import re
from dataclasses import dataclass
from pathlib import Path

from ..errors import SpeculantError
from ..paths import cache_root

SUPPORTED_ARCHITECTURES = ("llama", "qwen2", "qwen3", "gemma3")
"""``general.architecture`` values our decoder runs (Mistral files use ``llama``)."""
NOT_YET = {"gemma2": "its soft-capping is not implemented yet"}
"""Architectures asked for that are not implemented, with why (said in the refusal)."""
FLOAT_TYPES = ("F32", "F16", "BF16")
CODE_TYPES = ("Q8_0", "Q4_0", "Q4_1")
"""Block types whose codes the packed formats use as stored."""
KERNEL_TYPES = ("Q5_0", "Q5_1", "Q4_K", "Q5_K", "Q6_K")
"""Block types whose codes ``w4a8`` runs as stored on our kernels (``fp32``: dequantized exactly); torch's packed
formats would requantize them."""
FP32_ONLY_TYPES = ("Q2_K", "Q3_K")
"""Block types dequantized exactly to float32 but requantized by every packed format: ``fp32`` weights only."""
W4A8_TYPES = FLOAT_TYPES + CODE_TYPES + KERNEL_TYPES
"""Every type a ``w4a8`` model takes (floats: the token embedding, norms; a float projection is quantized to 4 bits
as for HF models)."""
TOKENIZER_MODELS = ("gpt2", "llama")
"""``tokenizer.ggml.model`` values (byte-level BPE, SentencePiece) transformers' GGUF tokenizer reader builds for
these architectures."""
SPLIT_NAME = re.compile(r"-(\d{5})-of-(\d{5})\.gguf$", re.IGNORECASE)
"""llama.cpp's shard names (``gguf-split``, gguf-py's ``SHARD_NAME_FORMAT``): ``<stem>-00001-of-00003.gguf`` ..."""


def is_gguf_path(name_or_path: str) -> bool:
    """Whether ``--model`` names a GGUF file: a ``.gguf`` name, or any existing file (a directory is an HF model)."""
    return str(name_or_path).lower().endswith(".gguf") or os.path.isfile(name_or_path)


def _stat(path: str | Path) -> tuple[Path, os.stat_result]:
    p = Path(path).expanduser()
    try:
        st = p.stat()
    except OSError:
        st = None
    if st is None or not p.is_file():
        raise SpeculantError(f"GGUF file {str(path)!r} does not exist; allowed: a path to a .gguf file, "
                             "an HF-format directory or a known model name (speculant models)")
    return p.resolve(), st


def shard_paths(path: str | Path) -> list[Path]:
    """The files of the GGUF model ``path``: itself, or for the first shard of a split set (``-00001-of-0000N.gguf``)
    every shard by llama.cpp's names, in order.

    Raises:
        SpeculantError: ``path`` is a later shard (the first is needed: it holds the metadata), or a shard is missing.
    """
    p = Path(path).expanduser()
    m = SPLIT_NAME.search(p.name)
    if m is None:
        return [p]
    number, count = int(m.group(1)), int(m.group(2))
    stem = p.name[:m.start()]
    if number != 1 or count < 1:
        raise SpeculantError(f"{str(path)!r} is shard {number} of a split GGUF set; allowed: its first shard, "
                             f"{stem}-00001-of-{count:05d}.gguf (it holds the model's metadata)")
    shards = [p.with_name(f"{stem}-{i:05d}-of-{count:05d}.gguf") for i in range(1, count + 1)]
    missing = [str(s) for s in shards if not s.is_file()]
    if missing:
        raise SpeculantError(f"shard {missing[0]!r} of the split GGUF set {str(path)!r} is missing; allowed: all "
                             f"{count} shards side by side, named as llama-gguf-split writes them")
    return shards


def cache_dir(path: str | Path) -> Path:
    """Where the float32 conversion of the GGUF file ``path`` is kept: ``$SPECULANT_CACHE/gguf/<stem>-<12 hex>``, the
    hex digits a hash of its resolved path, size [bytes] and modification time [ns] (of every shard of a split set).

    Raises:
        SpeculantError: the file (or a shard) does not exist.
    """
    resolved, st = _stat(path)
    stats = [(resolved, st)] + [_stat(s) for s in shard_paths(path)[1:]]
    key = hashlib.sha1("|".join(f"{r}|{t.st_size}|{t.st_mtime_ns}" for r, t in stats).encode()).hexdigest()[:12]
    return cache_root() / "gguf" / f"{resolved.stem}-{key}"


@dataclass(frozen=True)
class GGUFFile:
    """What :func:`inspect_gguf` read of a GGUF file's header.

    Attributes:
        path: the resolved path.
        architecture: ``general.architecture`` (one of :data:`SUPPORTED_ARCHITECTURES`).
        tensor_types: GGUF tensor name -> its type name (``Q4_1``, ``F32`` ...), in file order (shard by shard).
        shards: every file of a split set, the first included (resolved); ``()`` for a single file.
    """

    path: Path
    architecture: str
    tensor_types: dict[str, str]
    shards: tuple[Path, ...] = ()

    @property
    def requantized(self) -> list[tuple[str, str]]:
        """``(tensor, type)`` of the weights a torch packed format (``int4``, ``int8``, ``bf16``) would requantize
        (types of :data:`KERNEL_TYPES` and :data:`FP32_ONLY_TYPES`; ``w4a8`` takes the former as stored,
        :func:`check_weights`), the token embedding left out when the file has a separate LM head (the embedding
        stays float32: a lookup)."""
        untied = "output.weight" in self.tensor_types
        return [(n, t) for n, t in self.tensor_types.items()
                if t in KERNEL_TYPES + FP32_ONLY_TYPES and not (untied and n == "token_embd.weight")]


def _field(header, key: str):
    """The value of metadata field ``key`` of a :class:`~speculant.models.gguf_header.GGUFHeader` (a string, a
    number, a list, a :class:`~speculant.models.gguf_header.StringArray`), or ``None`` when absent."""
    return header.field(key)


_INSPECTED: dict[tuple, GGUFFile] = {}


def inspect_gguf(path: str | Path) -> GGUFFile:
    """Check the GGUF file ``path`` from its header (cheap: no tensor is read) and describe it.

    Raises:
        SpeculantError: one line naming the problem and what is allowed: the file or a shard is missing, a later
            shard of a split set, not readable as GGUF (truncated or corrupt), of an unsupported architecture, without a tokenizer,
            or holding a tensor of a type we cannot take.
    """
    resolved, st = _stat(path)
    shards = [s.resolve() for s in shard_paths(resolved)]       # every shard must be there, also when memoized
    memo = (str(resolved), st.st_size, st.st_mtime_ns, len(shards))
    if memo in _INSPECTED:
        return _INSPECTED[memo]
    name = str(path)
    readers = _shard_readers(shards, name)
    reader = readers[0]
    arch = _field(reader, "general.architecture")
    if arch not in SUPPORTED_ARCHITECTURES:
        why = f" ({NOT_YET[arch]})" if arch in NOT_YET else ""
        raise SpeculantError(f"GGUF architecture {arch!r} of {name!r} is not supported{why}; "
                             f"allowed: {', '.join(SUPPORTED_ARCHITECTURES)}")
    tok_model = _field(reader, "tokenizer.ggml.model")
    if tok_model is None or "tokenizer.ggml.tokens" not in reader.metadata:
        raise SpeculantError(f"GGUF file {name!r} has no tokenizer (tokenizer.ggml.model/tokens missing); allowed: "
                             "a GGUF file with its tokenizer, as llama.cpp's converters write it")
    if tok_model not in TOKENIZER_MODELS:
        raise SpeculantError(f"tokenizer.ggml.model={tok_model!r} of {name!r} is not supported; "
                             f"allowed: {', '.join(TOKENIZER_MODELS)}")
    from gguf import GGML_QUANT_SIZES

    tensors = [t for r in readers for t in r.tensors]
    r_size = {str(r.path): r.file_size for r in readers}
    types = {t.name: t.tensor_type.name for t in tensors}
    for t in tensors:
        kind = t.tensor_type.name
        if kind not in FLOAT_TYPES + CODE_TYPES + KERNEL_TYPES + FP32_ONLY_TYPES:
            raise SpeculantError(
                f"tensor {t.name} of {name!r} has type {kind}, which speculant cannot take; allowed types: "
                f"{', '.join(FLOAT_TYPES + CODE_TYPES + KERNEL_TYPES)}, and with --weights fp32 "
                f"{', '.join(FP32_ONLY_TYPES)}")
        block = GGML_QUANT_SIZES[t.tensor_type][0]
        if not t.n_elements or t.shape[0] % block or t.data_offset + t.n_bytes > r_size[t.path]:
            raise SpeculantError(f"tensor {t.name} of {name!r} ({kind}, shape {[int(n) for n in t.shape]}) is "
                                 f"corrupt: empty, or its rows are not whole blocks of {block} values; allowed: a "
                                 "complete GGUF file")
    info = GGUFFile(resolved, arch, types, tuple(shards) if len(shards) > 1 else ())
    _INSPECTED[memo] = info
    return info


def _shard_readers(shards: list[Path], name: str) -> list:
    """The :class:`~speculant.models.gguf_header.GGUFHeader` of each file of the model ``name`` (one, or a split set's shards in order), their split
    metadata checked (``split.no``, ``split.count``, ``split.tensors.count``: llama.cpp's ``gguf-split``).

    Raises:
        SpeculantError: a file unreadable as GGUF, a single file saying it is one shard of several, or shards whose
            split metadata do not fit their names or tensor count.
    """
    from .gguf_header import read_header

    readers = []
    for shard in shards:
        try:
            readers.append(read_header(shard))
        except Exception as e:  # noqa: BLE001 - the reader raises ValueError, struct/numpy errors, MemoryError ...
            detail = str(e).splitlines()[0] if str(e) else type(e).__name__
            raise SpeculantError(f"cannot read {str(shard) if len(shards) > 1 else name!r} as a GGUF file ({detail}); "
                                 "it is truncated or corrupt, or not GGUF: allowed: a complete GGUF file") from None
    count = _field(readers[0], "split.count")
    if len(shards) == 1:
        if isinstance(count, int) and count > 1:
            raise SpeculantError(f"{name!r} says it is one shard of {count} (split.count) but is not named as one; "
                                 "allowed: the first shard of a set named <stem>-00001-of-0000N.gguf")
        return readers
    numbers = [_field(r, "split.no") for r in readers]
    total = _field(readers[0], "split.tensors.count")
    found = sum(len(r.tensors) for r in readers)
    if count != len(shards) or numbers != list(range(len(shards))) or (isinstance(total, int) and total != found):
        raise SpeculantError(f"the split GGUF set {name!r} is inconsistent (split.count={count}, split.no={numbers}, "
                             f"split.tensors.count={total}, {found} tensors in {len(shards)} files); allowed: a complete "
                             "set as llama-gguf-split writes it")
    return readers


def stored_formats(requantized: list[tuple[str, str]], kernels: bool = True) -> tuple[str, ...]:
    """The weight formats that take a file's :attr:`GGUFFile.requantized` tensors as stored, the default first:
    ``("w4a8", "fp32")`` when every such type is a :data:`KERNEL_TYPES` one and our kernels run here (``kernels``),
    else ``("fp32",)``."""
    if kernels and not any(t in FP32_ONLY_TYPES for _, t in requantized):
        return ("w4a8", "fp32")
    return ("fp32",)


def check_weights(requantized: list[tuple[str, str]], weights: str, name: str, kernels: bool = True) -> str:
    """The weight format to load a GGUF file in, given its :attr:`GGUFFile.requantized` tensors: ``weights`` itself
    when nothing would be requantized, it is ``fp32``, or it is ``w4a8`` and every such tensor is of a
    :data:`KERNEL_TYPES` type; for ``auto``: ``w4a8`` when that holds and our kernels run here (``kernels``),
    ``fp32`` otherwise.

    Raises:
        SpeculantError: a format asked for a file holding tensors it would requantize (the first one named, with
            the formats allowed for this file).
    """
    if not requantized or weights == "fp32":
        return weights
    fp32_only = [(n, t) for n, t in requantized if t in FP32_ONLY_TYPES]
    if weights == "auto":
        return stored_formats(requantized, kernels)[0]
    if weights == "w4a8" and not fp32_only:
        return weights
    tensor, kind = (fp32_only or requantized)[0]
    allowed = "fp32, auto" if fp32_only else "fp32, w4a8, auto"
    raise SpeculantError(f"weights={weights!r} would requantize the {kind} weights of {name!r} (e.g. {tensor}); "
                         f"allowed for this file: {allowed}")
