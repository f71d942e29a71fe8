"""The float32 weights of a GGUF file, one tensor at a time, as transformers' GGUF loader makes them.

``load_gguf_checkpoint(return_tensors=True)`` dequantizes every tensor (``gguf.dequantize``), passes it through the
architecture's tensor processor (``TENSOR_PROCESSORS``: llama's q/k row order, Gemma's ``norm - 1``) and names it
with its GGUF -> HF name map (``get_gguf_hf_weights_map``), holding the whole model in float32 at once.
:class:`GGUFTensors` applies the same three steps to one tensor when it is asked for (:meth:`GGUFTensors.take`), so
a loader can read the model layer by layer straight from the file (:mod:`speculant.models.streaming`): no float32
copy of the model on disk or in memory.  The name map is built from the names of our config's weights
(:func:`~speculant.models.loading.expected_hf_keys`) instead of a transformers model instance: the same map
(``tests/test_gguf_stream.py`` holds it equal to the one built from transformers' own model).
"""

from __future__ import annotations

import re
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import torch

from ..errors import SpeculantError
from .config import ModelConfig
from .gguf_header import GGUFHeader


_LAYER_TENSOR = re.compile(r"blk\.\d+\.")


class _WeightNames:
    """What ``get_gguf_hf_weights_map`` reads of a transformers model: its config's ``model_type`` and layer count,
    and its ``state_dict()``'s names (here the HF names of ``cfg``'s weights, the tied LM head included as
    transformers' state dict lists it)."""

    def __init__(self, cfg: ModelConfig):
        from .loading import expected_hf_keys
        self.config = SimpleNamespace(model_type=cfg.model_type, num_hidden_layers=cfg.num_hidden_layers)
        self._names = sorted(expected_hf_keys(cfg) | {"lm_head.weight"})

    def state_dict(self) -> dict:
        return dict.fromkeys(self._names)

    def named_children(self) -> list:
        return []


def processor_config(headers: list[GGUFHeader]) -> dict:
    """The config dict transformers' GGUF loader gives the tensor processor (``parsed_parameters["config"]``), with
    what our loader adds to it (:func:`~speculant.models.loading.complete_gguf_config`)."""
    from . import gguf_hf
    from .loading import complete_gguf_config

    conf = gguf_hf.config_dict(headers[0])
    complete_gguf_config(headers[0], str(headers[0].field("general.architecture")), conf)
    return conf


def weights_map(cfg: ModelConfig, headers: list[GGUFHeader], processor, model=None) -> dict[str, str]:
    """GGUF tensor name -> HF name (transformers' ``get_gguf_hf_weights_map``) of a file of ``cfg``'s model; ``model``:
    a transformers model to build it from (default: the names of ``cfg``'s weights, :class:`_WeightNames`).  The
    file's own architecture names its tensors (a llama file named ``mistral`` loads as transformers' Mistral, whose
    model_type gguf-py has no tensor names for)."""
    from transformers.modeling_gguf_pytorch_utils import get_gguf_hf_weights_map

    architecture = str(headers[0].field("general.architecture"))
    return get_gguf_hf_weights_map(model if model is not None else _WeightNames(cfg), processor,
                                   model_type=architecture, num_layers=cfg.num_hidden_layers)


class GGUFTensors:
    """The weights of the GGUF file(s) ``headers`` (one file, or a split set's shards) by HF name, dequantized to
    float32 one tensor at a time when asked for: bit for bit what transformers' GGUF loader holds for that name.

    Attributes:
        keys: the HF names of the file's weights (a tied model's stored ``output.weight`` left out, as the float32
            conversion leaves it out; tensors the name map does not know, e.g. llama 3's ``rope_freqs``, too).
        unmapped: names of the file's layer tensors (``blk.N.*``) that are none of ``cfg``'s weights (a bias the
            config does not have ...): a file our decoder would not compute as written
            (:func:`~speculant.models.loading.check_gguf_weights` refuses it).

    Raises:
        SpeculantError: (:meth:`take`) a tensor the architecture's processor renames (not one of ours).
    """

    def __init__(self, headers: list[GGUFHeader], cfg: ModelConfig, model=None):
        from transformers.modeling_gguf_pytorch_utils import TENSOR_PROCESSORS, TensorProcessor

        architecture = str(headers[0].field("general.architecture"))
        self._parsed = {"config": processor_config(headers), "tensors": {}}
        self._processor = TENSOR_PROCESSORS.get(architecture, TensorProcessor)(config=self._parsed["config"])
        self._names = weights_map(cfg, headers, self._processor, model)
        self._by_name, self.unmapped = {}, []
        for tensor in (t for h in headers for t in h.tensors):
            hf = self._names.get(tensor.name)
            if hf is None and _LAYER_TENSOR.match(tensor.name):
                self.unmapped.append(tensor.name)
            elif hf is not None and not (cfg.tie_word_embeddings and hf == "lm_head.weight"):
                self._by_name[hf] = tensor
        self.keys = set(self._by_name)

    def take(self, name: str) -> torch.Tensor:
        """The float32 tensor ``name`` (an HF name of :attr:`keys`; a fresh, writable array's tensor).

        Raises:
            KeyError: ``name`` is not in :attr:`keys`.
            SpeculantError: the processor renamed the tensor.
        """
        tensor = self._by_name[name]
        result = self._processor.process(weights=dequantize_by_rows(tensor.data, tensor.tensor_type),
                                         name=tensor.name, tensor_key_mapping=self._names,
                                         parsed_parameters=self._parsed)
        if self._names.get(result.name) != name:
            raise SpeculantError(f"GGUF tensor {tensor.name!r} is renamed {result.name!r} by transformers' "
                                 "tensor processor; allowed: architectures whose tensors keep their names")
        # a copy only of what is not already a fresh writable array (the file's mapped F32 tensors)
        return torch.from_numpy(np.require(result.weights, np.float32, ["C", "W"]))

    def shape(self, name: str) -> tuple[int, ...]:
        """The shape of weight ``name`` as :meth:`take` gives it (torch order), read from the header alone."""
        return tuple(int(n) for n in reversed(self._by_name[name].shape))

    def rows(self, name: str, rows: int = 4096):
        """The float32 weight ``name`` ``[O, I]`` as consecutive blocks of at most ``rows`` rows (each a fresh array's
        tensor): :meth:`take`'s values, never the whole tensor at once (a token embedding spooled to a file,
        :func:`~speculant.models.streaming.spool_rows`).  Only for tensors the processor passes through unchanged
        (the token embedding of every supported architecture; checked on each block: ValueError otherwise)."""
        tensor = self._by_name[name]
        data = tensor.data
        for start in range(0, data.shape[0], rows):
            block = dequantize_by_rows(data[start:start + rows], tensor.tensor_type)
            result = self._processor.process(weights=block, name=tensor.name, tensor_key_mapping=self._names,
                                             parsed_parameters=self._parsed)
            if result.weights is not block and not np.array_equal(result.weights, block):
                raise ValueError(f"GGUF tensor {tensor.name!r} is changed by its processor: read it with take()")
            yield torch.from_numpy(np.require(result.weights, np.float32, ["C", "W"]))

    def items(self):
        """``(HF name, float32 tensor)`` of every weight in file order, one at a time."""
        for name in sorted(self._by_name, key=lambda k: (self._by_name[k].path, self._by_name[k].data_offset)):
            yield name, self.take(name)


def open_gguf(path: Path, cfg: ModelConfig, model=None) -> GGUFTensors:
    """:class:`GGUFTensors` of the GGUF file ``path`` (every shard of a split set), headers read once without the
    tokenizer's strings (:func:`~speculant.models.gguf_header.read_header`).

    Raises:
        SpeculantError: a missing shard (:func:`~speculant.models.gguf_files.shard_paths`).
    """
    from .gguf_files import shard_paths
    from .gguf_header import read_header
    return GGUFTensors([read_header(p) for p in shard_paths(path)], cfg, model)


def dequantize_by_rows(data, kind, rows: int = 4096):
    """``gguf.dequantize(data, kind)`` computed ``rows`` rows at a time into one float32 array (the same values: a
    block never spans rows): a large tensor's (the token embedding's) dequantization never holds the reader's
    intermediate arrays for the whole tensor at once."""
    from gguf import dequantize

    if data.ndim < 2 or data.shape[0] <= rows:
        return dequantize(data, kind)
    first = dequantize(data[:rows], kind)
    out = np.empty((data.shape[0],) + first.shape[1:], dtype=first.dtype)
    out[:rows] = first
    del first
    for start in range(rows, data.shape[0], rows):
        out[start:start + rows] = dequantize(data[start:start + rows], kind)
    return out
