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

SCHEMA = "speculant-packed-4"      # 2: w4a8/w8a8 rows interleaved by 8, float16 scales; 3: GGUF codes of every type
#                                    as stored (K layouts with float32 scales, stacked projections); 4: projections
#                                    quantized here (HF checkpoints) by gguf's reference Q4_1 / Q8_0 quantizers


def packed_path(model_dir: Path, fmt: str) -> Path:
    """Where a model directory's packed copy in format ``fmt`` lives."""
    return Path(model_dir) / f"packed-{fmt}-torch{torch.__version__.split('+')[0]}.safetensors"


def save_packed(decoder: LlamaDecoder, path: Path) -> Path:
    """Write ``decoder`` (weights already in a packed format) to ``path`` (safetensors, atomic)."""
    from safetensors.torch import save_file

    modules = {name: [type(m).__name__, m.in_features, m.out_features]
               for name, m in decoder.named_modules() if isinstance(m, PackedLinear)}
    meta = {"schema": SCHEMA, "format": decoder.weight_format, "config": json.dumps(decoder.config.to_hf_dict()),
            "modules": json.dumps(modules)}
    state = {k: v.contiguous() for k, v in decoder.state_dict().items()}
    path = Path(path)
    tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
    save_file(state, str(tmp), metadata=meta)
    tmp.replace(path)
    return path


def load_packed(path: Path, cfg: ModelConfig) -> LlamaDecoder | None:
    """The packed decoder stored at ``path``, or ``None`` when absent, unreadable or made for another config."""
    from safetensors import safe_open
    from safetensors.torch import load_file

    path = Path(path)
    if not path.is_file():
        return None
    try:
        with safe_open(str(path), "pt") as f:
            meta = f.metadata() or {}
        if meta.get("schema") != SCHEMA or json.loads(meta["config"]) != json.loads(json.dumps(cfg.to_hf_dict())):
            return None
        modules = json.loads(meta["modules"])
        # torch's int8 kernel crashed on a tensor at an unaligned safetensors offset: copy those
        state = {k: v if v.data_ptr() % 64 == 0 else v.clone() for k, v in load_file(str(path)).items()}
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
    dec.set_rope_tables()
    dec.layer_token_counts = [0] * cfg.num_hidden_layers
    dec.weight_format = meta["format"]
    return dec.eval().requires_grad_(False)
