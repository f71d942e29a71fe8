"""An HF-format checkpoint (or a GGUF file's weights by HF name) read into our decoder layer by layer: the model is
never whole in float32 in memory.

:func:`open_streamed` builds the decoder on the meta device with its token embedding, final norm and (untied) LM
head read in float32; :func:`fill_layers` then reads the given decoder layers, one at a time (``pread``, no file
pages mapped), and hands each to a callback (the loader packs its projections there, so a layer's float32 weights
live only until it is packed).  Weights are those of :func:`speculant.models.loading.load_hf_dir`, bit for bit
(the same names, fusions and norm values: :func:`speculant.models.loading.hf_state_to_ours`).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import NamedTuple

import torch

from ..errors import SpeculantError
from .config import ModelConfig
from .llama import LlamaDecoder


class StreamedCheckpoint:
    """The tensors of an HF checkpoint's weight files, read one by one (safetensors' ``pread`` backend).

    Attributes:
        keys: every tensor name in the files.
    """

    def __init__(self, files: list[Path]):
        from safetensors import safe_open

        self._handles, self._where = [], {}
        for f in files:
            try:
                handle = safe_open(str(f), framework="pt", backend="pread")
            except Exception as e:          # safetensors raises its own error types for corrupt files
                raise SpeculantError(f"cannot read weights {str(f)!r} ({type(e).__name__}: {e})") from None
            self._handles.append(handle)
            for k in handle.keys():
                self._where[k] = handle
        self.keys = set(self._where)

    def take(self, name: str) -> torch.Tensor:
        """The tensor ``name`` as float32 (a fresh copy)."""
        return self._where[name].get_tensor(name).to(torch.float32)


PROJECTION_WEIGHTS = {"self_attn.qkv_proj": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
                      "self_attn.o_proj": ("self_attn.o_proj",),
                      "mlp.gate_up_proj": ("mlp.gate_proj", "mlp.up_proj"), "mlp.down_proj": ("mlp.down_proj",)}
"""Our decoder layer's projections -> the HF modules whose weights make them (fused in this order)."""


class WithoutWeights:
    """``checkpoint`` with the tensors of ``shapes`` (HF name -> shape) left unread: :meth:`take` gives a meta tensor
    of their shape (weights a packing replaces by a GGUF file's own codes without looking at them).

    Attributes:
        keys: ``checkpoint.keys``.
    """

    def __init__(self, checkpoint, shapes: dict[str, tuple[int, ...]]):
        self.checkpoint, self.shapes, self.keys = checkpoint, shapes, checkpoint.keys

    def take(self, name: str) -> torch.Tensor:
        if name in self.shapes:
            return torch.empty(self.shapes[name], device="meta")
        return self.checkpoint.take(name)


class Spool(NamedTuple):
    """A tensor spooled to a file (:func:`spool_rows`): the open temporary ``file`` (the tensor's bytes from offset
    0), the ``address`` of the tensor's data, and its copy-on-write ``mapping`` (an ``mmap.mmap``)."""

    file: object
    address: int
    mapping: object

    def drop_pages(self) -> None:
        """Hand back the mapping's resident pages (``MADV_DONTNEED``): the next read of a row maps it from the file
        again.  For a tensor nothing has written (a write to a copy-on-write page would be lost): the loader calls
        it after a timing has read the whole tensor (a tied model's float32 LM head), before packing.  Where the
        platform lacks ``madvise``, nothing happens."""
        import mmap
        if hasattr(mmap, "MADV_DONTNEED") and hasattr(self.mapping, "madvise"):
            self.mapping.madvise(mmap.MADV_DONTNEED)


class SpooledFiles(dict):
    """A decoder's spooled tensors: state-dict name -> :class:`Spool`.  A deep copy of the decoder (a truncated
    draft model) copies the tensors into memory, so its copy of this is empty: an open file cannot be copied, and the
    copies are not the file's mapping."""

    def __deepcopy__(self, memo) -> "SpooledFiles":
        return SpooledFiles()

    def drop_pages(self) -> None:
        """:meth:`Spool.drop_pages` of each."""
        for spool in self.values():
            spool.drop_pages()


def spool_rows(blocks, shape: tuple[int, int], directory: Path) -> Spool:
    """The float32 ``[O, I]`` tensor whose consecutive row ``blocks`` are given, written block by block to an
    unnamed temporary file in ``directory`` and mapped from it copy-on-write (a write stays in this process): its
    pages are held only where read (a token embedding, of which decoding gathers a few rows a step), never the whole
    tensor in memory.  Returns ``(tensor, spool)``: the :class:`Spool` keeps the open file (its bytes are the
    tensor's, from offset 0; :func:`~speculant.runtime.store.save_packed` copies them from there without reading
    the mapping) and the mapping.

    Raises:
        ValueError: the blocks do not make ``shape``.
        OSError: the file cannot be written or mapped.
    """
    import mmap
    import tempfile

    import numpy as np

    f = tempfile.TemporaryFile(dir=directory)
    rows = 0
    for block in blocks:
        if block.dim() != 2 or block.shape[1] != shape[1]:
            raise ValueError(f"a block of shape {tuple(block.shape)} in a tensor of shape {tuple(shape)}")
        f.write(memoryview(block.contiguous().view(-1).view(torch.uint8).numpy()))
        rows += block.shape[0]
    if rows != shape[0]:
        raise ValueError(f"{rows} rows written for a tensor of shape {tuple(shape)}")
    f.flush()
    mapping = mmap.mmap(f.fileno(), rows * shape[1] * 4, access=mmap.ACCESS_COPY)
    tensor = torch.from_numpy(np.frombuffer(mapping, dtype=np.float32).reshape(tuple(shape)))
    return tensor, Spool(f, tensor.data_ptr(), mapping)


def streamable(cfg: ModelConfig, keys: set[str]) -> bool:
    """Whether a checkpoint holding ``keys`` is exactly ``cfg``'s weights, so it can be read layer by layer (a tied
    model's saved LM head copy or stored RoPE frequencies need :func:`~speculant.models.loading.check_hf_state`'s
    comparisons on the whole state: those are read whole)."""
    from .loading import expected_hf_keys
    return keys == expected_hf_keys(cfg)


def open_streamed(path: Path, cfg: ModelConfig, checkpoint=None,
                  spool: Path | None = None) -> tuple[LlamaDecoder, StreamedCheckpoint] | None:
    """``(decoder, checkpoint)``: the decoder of the HF-format directory ``path`` with float32 token embedding,
    final norm and LM head and every layer still on the meta device (:func:`fill_layers` reads them); ``None`` when
    the checkpoint is not :func:`streamable` (read it whole then: :func:`~speculant.models.loading.load_hf_dir`
    names what is wrong).  ``checkpoint``: where the weights come from instead of ``path``'s weight files (anything
    with ``keys`` and ``take(name)`` of HF names: a GGUF file's
    :class:`~speculant.models.gguf_tensors.GGUFTensors`).  ``spool``: a directory where the token embedding of a
    checkpoint that gives it by blocks of rows (``rows(name)``) is written and mapped from (:func:`spool_rows`;
    ``decoder.spooled``, a :class:`SpooledFiles`, then maps its state-dict name to its :class:`Spool`), instead of
    held in memory.

    Raises:
        SpeculantError: an unreadable weight file.
    """
    from .loading import weight_files

    if checkpoint is None:
        checkpoint = StreamedCheckpoint(weight_files(Path(path)))
    if not streamable(cfg, checkpoint.keys):
        return None
    with torch.device("meta"):
        dec = LlamaDecoder(cfg)
    dec.spooled = SpooledFiles()
    if spool is not None and hasattr(checkpoint, "rows") and "model.embed_tokens.weight" in checkpoint.keys:
        embed, dec.spooled["embed_tokens.weight"] = spool_rows(checkpoint.rows("model.embed_tokens.weight"),
                                                               checkpoint.shape("model.embed_tokens.weight"), spool)
    else:
        embed = checkpoint.take("model.embed_tokens.weight")
    dec.embed_tokens.weight = torch.nn.Parameter(embed, requires_grad=False)
    dec.norm.weight = torch.nn.Parameter(checkpoint.take("model.norm.weight"), requires_grad=False)
    if cfg.tie_word_embeddings:
        dec.lm_head_proj.weight = dec.embed_tokens.weight
    else:
        dec.lm_head_proj.weight = torch.nn.Parameter(checkpoint.take("lm_head.weight"), requires_grad=False)
    dec.set_rope_tables()               # buffers were on the meta device
    dec.layer_token_counts = [0] * cfg.num_hidden_layers
    expected = {"model.embed_tokens.weight": (dec.embed_tokens.weight, (cfg.vocab_size, cfg.hidden_size)),
                "lm_head.weight": (dec.lm_head_proj.weight, (cfg.vocab_size, cfg.hidden_size)),
                "model.norm.weight": (dec.norm.weight, (cfg.hidden_size,))}
    bad = [f"{k} {tuple(t.shape)} (expected {shape})" for k, (t, shape) in expected.items() if tuple(t.shape) != shape]
    if bad:
        raise SpeculantError(f"weight shape(s) differ from config.json: {'; '.join(bad)}")
    return dec.eval().requires_grad_(False), checkpoint


def on_meta(decoder: LlamaDecoder, i: int) -> bool:
    """Whether decoder layer ``i`` is still unread (on the meta device)."""
    return any(p.is_meta for p in decoder.layers[i].parameters())


def fill_layers(decoder: LlamaDecoder, checkpoint: StreamedCheckpoint, layers, on_layer=None) -> None:
    """Read decoder layers ``layers`` (indices; those already read are skipped) from ``checkpoint`` into ``decoder``,
    one at a time, and call ``on_layer(i, layer)`` after each (``None``: nothing).

    Raises:
        SpeculantError: a weight whose shape differs from the config's (named).
    """
    from .loading import hf_layer_to_ours

    cfg = decoder.config
    for i in layers:
        if not on_meta(decoder, i):
            if on_layer is not None:
                on_layer(i, decoder.layers[i])
            continue
        ours = hf_layer_to_ours(checkpoint.take, cfg, i)
        prefix = f"layers.{i}."
        ours = {k[len(prefix):]: v.contiguous() for k, v in ours.items()}
        layer = decoder.layers[i]
        shapes = {k: v.shape for k, v in layer.state_dict().items()}
        bad = [f"{prefix}{k} {tuple(v.shape)} (expected {tuple(shapes[k])})" for k, v in ours.items()
               if v.shape != shapes.get(k)]
        if bad:
            raise SpeculantError(f"weight shape(s) differ from config.json: {'; '.join(bad[:3])}")
        layer.load_state_dict(ours, strict=True, assign=True)      # replaces the meta tensors: no second copy
        layer.requires_grad_(False)
        del ours
        if on_layer is not None:
            on_layer(i, layer)


def config_of(path: Path) -> ModelConfig:
    """The config of the HF-format directory ``path``.

    Raises:
        SpeculantError: missing or invalid ``config.json`` (:meth:`ModelConfig.from_hf_dict`).
    """
    try:
        return ModelConfig.from_hf_dict(json.loads((Path(path) / "config.json").read_text()))
    except (OSError, json.JSONDecodeError, UnicodeDecodeError) as e:
        raise SpeculantError(f"cannot read {str(Path(path) / 'config.json')!r} ({e})") from None
