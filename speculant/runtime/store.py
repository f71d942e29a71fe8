"""Packed decoders on disk: a model in a weight format saved once, loaded in a fraction of a second later.

Packing SmolLM2 in ``int4`` from the GGUF's codes takes several seconds (reading and unpacking the
blocks, torch's int4 repacking); the packed tensors are saved next to the float32 weights as
``packed-<format>-torch<version>.safetensors`` (torch's packed int4 layout can change between versions)
with a JSON description of every projection in the file's metadata.  Written atomically; a file that
does not match the model config is ignored.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch

from ..models.config import ModelConfig
from ..models.llama import LlamaDecoder
from .formats import PACKED_CLASSES, PackedLinear

SCHEMA = "speculant-packed-8"      # 2: w4a8/w8a8 rows interleaved by 8, float16 scales; 3: GGUF codes of every type
#                                    as stored (K layouts with float32 scales, stacked projections); 4: projections
#                                    quantized here (HF checkpoints) by gguf's reference Q4_1 / Q8_0 quantizers; 5: Q6_K
#                                    in 6 bits (W6A8Linear); 6: Q4_K with its integer scales and mins
#                                    (W4A8KLinear); 7: Q4_0 without stored mins; 8: Q5_0 in 5 bits (W5A8Linear)


MAPPED = frozenset({"embed_tokens.weight"})
"""Tensors of a packed decoder that loads map instead of reading (:func:`read_safetensors`): the float32 token
embedding, gathered a few rows a step (a packed model's LM head is its own packed projection)."""


def packed_path(model_dir: Path, fmt: str) -> Path:
    """Where a model directory's packed copy in format ``fmt`` lives."""
    return Path(model_dir) / f"packed-{fmt}-torch{torch.__version__.split('+')[0]}.safetensors"


def save_packed(decoder: LlamaDecoder, path: Path) -> Path:
    """Write ``decoder`` (weights already in a packed format) to ``path`` (safetensors, atomic: written under a
    temporary name, renamed into place, removed on any error).  A tensor of ``decoder.spooled`` (name ->
    :class:`~speculant.models.streaming.Spool`: open file, address of its data, mapping) still at that address is
    copied from its file, not read through its mapping (which would hold all its pages in this process)."""
    modules = {name: [type(m).__name__, m.in_features, m.out_features]
               for name, m in decoder.named_modules() if isinstance(m, PackedLinear)}
    meta = {"schema": SCHEMA, "format": decoder.weight_format, "config": json.dumps(decoder.config.to_hf_dict()),
            "modules": json.dumps(modules)}
    state = decoder.state_dict()
    spooled = {k: spool.file for k, spool in getattr(decoder, "spooled", {}).items()
               if k in state and state[k].data_ptr() == spool.address and state[k].is_contiguous()}
    path = Path(path)
    tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
    try:
        write_safetensors(tmp, state, meta, spooled)
        tmp.replace(path)
    finally:
        tmp.unlink(missing_ok=True)
    return path


_NAMES = {}     # torch dtype -> safetensors dtype name (filled below from _DTYPES)


def write_safetensors(path: Path, state: dict[str, torch.Tensor], metadata: dict[str, str],
                      from_files: dict | None = None) -> None:
    """Write ``state`` as the safetensors file ``path`` (format: an 8-byte little-endian header length, a JSON header
    of ``name -> {dtype, shape, data_offsets}`` and ``__metadata__`` = ``metadata``, padded with spaces to a multiple
    of 8 bytes, then the tensors back to back, largest elements first so that each lies at a multiple of its element
    size), one tensor at a time; ``from_files``: name -> an open file whose bytes from offset 0 are that tensor's,
    copied file to file (``os.copy_file_range``, else read in 16 MiB pieces).

    Raises:
        OSError: the file cannot be written; KeyError: a dtype safetensors has no name for.
    """
    from_files = from_files or {}
    order = sorted(state, key=lambda k: (-state[k].element_size(), k))
    header, offset = {}, 0
    for k in order:
        t = state[k]
        n = t.numel() * t.element_size()
        header[k] = {"dtype": _NAMES[t.dtype], "shape": list(t.shape), "data_offsets": [offset, offset + n]}
        offset += n
    header["__metadata__"] = metadata
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    with open(path, "wb") as out:
        out.write(len(text).to_bytes(8, "little") + text)
        for k in order:
            t = state[k]
            n = t.numel() * t.element_size()
            if k in from_files:
                out.flush()
                _copy_file(from_files[k], out, n)
            elif n:
                out.write(memoryview(t.contiguous().view(-1).view(torch.uint8).numpy()))


def _copy_file(src, out, n: int) -> None:
    """Append the first ``n`` bytes of the open file ``src`` to the open file ``out`` (flushed), file to file."""
    src_fd, out_fd = src.fileno(), out.fileno()
    done = 0
    try:
        while done < n:
            step = os.copy_file_range(src_fd, out_fd, n - done, done)
            if step <= 0:
                break
            done += step
    except (AttributeError, OSError):
        pass                                         # no copy_file_range here: read and write what is left
    os.lseek(out_fd, 0, os.SEEK_END)
    while done < n:
        piece = os.pread(src_fd, min(16 << 20, n - done), done)
        if not piece:
            raise OSError(f"{src.name}: ends after {done} of {n} bytes")
        out.write(piece)
        out.flush()
        done += len(piece)


_DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
           "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
           "BOOL": torch.bool}
"""safetensors dtype names -> torch dtypes (the safetensors format's table)."""
_NAMES.update({v: k for k, v in _DTYPES.items()})


def read_safetensors(path: Path, header_only: bool = False,
                     mapped: frozenset[str] = frozenset()) -> tuple[dict, dict[str, torch.Tensor]]:
    """``(metadata, tensors)`` of the safetensors file ``path`` (format: an 8-byte little-endian header length, a
    JSON header of ``name -> {dtype, shape, data_offsets}`` and ``__metadata__``, then the data).  Each tensor is
    read (``readinto``, one sequential pass) into its own torch allocation: aligned for our kernels (torch's int8
    kernel crashed on a tensor at an unaligned file offset) and without the page faults of first touching a mapped
    file (copying mapped tensors took seconds for SmolLM2's 210 MB).  ``header_only``: no tensors read.
    ``mapped``: names of tensors mapped from the file instead (copy-on-write: a write stays in this process), where
    their bytes sit at an offset of a multiple of their element size: only the pages a process touches are read and
    held (a token embedding, of which a generation gathers a few rows: 1 GB in float32 for a 128k-token vocabulary).

    Raises:
        OSError: unreadable file; ValueError: a malformed header, an unknown dtype or a short file.
    """
    with open(path, "rb") as f:
        meta, header, base = _header(f, path)
        if header_only:
            return meta, {}
        state = {}
        for name, info in sorted(header.items(), key=lambda kv: kv[1]["data_offsets"][0]):
            start, end = info["data_offsets"]
            t = torch.empty(info["shape"], dtype=_DTYPES[info["dtype"]], device="meta")   # checks the shape
            if t.numel() * t.element_size() != end - start:
                raise ValueError(f"{path}: tensor {name} holds {end - start} bytes for shape {info['shape']}")
            if name in mapped and end > start and (base + start) % t.element_size() == 0:
                try:
                    state[name] = _mapped(f, base + start, end - start, t)
                    continue
                except OSError:
                    pass                        # a file system that cannot map: read as the others
            t = torch.empty(t.shape, dtype=t.dtype)      # (empty_like from a meta tensor: ~3 ms a tensor)
            if end > start:
                f.seek(base + start)
                if f.readinto(memoryview(t.view(-1).view(torch.uint8).numpy())) != end - start:
                    raise ValueError(f"{path}: file ends inside tensor {name}")
            state[name] = t
    return meta, state


def _header(f, path: Path) -> tuple[dict, dict, int]:
    """``(metadata, name -> {dtype, shape, data_offsets}, offset of the data)`` of the safetensors file open as ``f``.

    Raises:
        ValueError: a malformed header.
    """
    size = int.from_bytes(f.read(8), "little")
    if not 2 <= size <= 100_000_000:
        raise ValueError(f"{path}: bad safetensors header length {size}")
    header = json.loads(f.read(size))
    return header.pop("__metadata__", None) or {}, header, 8 + size


def _mapped(f, offset: int, n_bytes: int, like: torch.Tensor) -> torch.Tensor:
    """The ``n_bytes`` at ``offset`` of the open file ``f`` (the one whose header gave the offset, even if the path
    is replaced meanwhile) as a tensor of the dtype and shape of ``like``, mapped copy-on-write (numpy's ``memmap``
    mode ``c``), with the file's size checked first.  The file must not be cut short in place while mapped (a read
    of a page past its end is a SIGBUS); :func:`save_packed` replaces files by renaming, never in place.

    Raises:
        ValueError: the file ends before ``offset + n_bytes``.
        OSError: the file cannot be mapped.
    """
    import numpy as np
    if os.fstat(f.fileno()).st_size < offset + n_bytes:
        raise ValueError(f"{f.name}: file ends inside a tensor at bytes {offset}..{offset + n_bytes}")
    raw = np.memmap(f, dtype=np.uint8, mode="c", offset=offset, shape=(n_bytes,))
    return torch.from_numpy(raw).view(like.dtype).view(like.shape)


def map_saved(decoder: LlamaDecoder, path: Path) -> int:
    """Swap ``decoder``'s tensors named in :data:`MAPPED` for their mappings in ``path``, the packed copy just
    saved from it (:func:`save_packed`, which wrote those bytes: they are not compared, which would read every
    page), as a later load would have them (the first load of a model then holds its token embedding's gathered
    rows only, as later loads do).  A tensor of another shape or dtype than the file's, or that the file cannot
    map, is kept.  Returns the number of bytes no longer held in memory.

    Raises:
        OSError, ValueError: as :func:`read_safetensors`, for an unreadable file.
    """
    freed = 0
    with open(path, "rb") as f:
        _, header, base = _header(f, path)
        for name in MAPPED & header.keys():
            parent, _, attr = name.rpartition(".")
            module = decoder.get_submodule(parent)
            held, info = getattr(module, attr), header[name]
            start, end = info["data_offsets"]
            if (_DTYPES.get(info["dtype"]) != held.dtype or list(info["shape"]) != list(held.shape)
                    or end - start != held.numel() * held.element_size() or end == start
                    or (base + start) % held.element_size()):
                continue
            mapped = _mapped(f, base + start, end - start, held)
            setattr(module, attr, torch.nn.Parameter(mapped, requires_grad=False))
            getattr(decoder, "spooled", {}).pop(name, None)     # its temporary file goes with the last reference
            freed += end - start
    return freed


def load_packed(path: Path, cfg: ModelConfig) -> LlamaDecoder | None:
    """The packed decoder stored at ``path``, or ``None`` when absent, unreadable or made for another config."""
    path = Path(path)
    if not path.is_file():
        return None
    try:
        meta, _ = read_safetensors(path, header_only=True)
        if meta.get("schema") != SCHEMA or json.loads(meta["config"]) != json.loads(json.dumps(cfg.to_hf_dict())):
            return None
        modules = json.loads(meta["modules"])
        _, state = read_safetensors(path, mapped=MAPPED)
    except (OSError, ValueError, KeyError):
        return None
    with torch.device("meta"):
        dec = LlamaDecoder(cfg)
    for name, (cls_name, in_f, out_f) in modules.items():
        parent_name, _, attr = name.rpartition(".")
        parent = dec.get_submodule(parent_name) if parent_name else dec
        buffers = {k[len(name) + 1:]: v for k, v in state.items() if k.startswith(name + ".")}
        setattr(parent, attr, PACKED_CLASSES[cls_name].empty(in_f, out_f, buffers))
    dec.load_state_dict(state, strict=True, assign=True)
    # the RoPE tables are real already: LlamaDecoder computes them on the CPU even on the meta device
    dec.layer_token_counts = [0] * cfg.num_hidden_layers
    dec.weight_format = meta["format"]
    return dec.eval().requires_grad_(False)
