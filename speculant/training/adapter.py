"""Creating and saving exit adapters for training (:mod:`speculant.drafters.exit_adapter` holds the
forward and the loading that decoding needs)."""

from __future__ import annotations

from pathlib import Path

import torch

from ..drafters.artifacts import write_dir
from ..drafters.exit_adapter import FORMAT, ExitAdapter
from ..errors import SpeculantError
from ..runtime.formats import lm_head_rows_weight


def new_adapter(model, exit_layer: int, num_blocks: int = 1, vocab_ids: torch.Tensor | None = None) -> ExitAdapter:
    """An adapter for ``model`` at ``exit_layer``, blocks initialised from the MLPs of layers E, E+1, ...

    Raises:
        SpeculantError: ``exit_layer`` outside ``[1, L-1]`` or ``num_blocks`` outside ``[0, L-E]``.
    """
    dec = model.decoder
    cfg = dec.config
    L = dec.num_layers
    if not 1 <= exit_layer < L:
        raise SpeculantError(f"exit_layer={exit_layer} is out of range; allowed: 1..{L - 1}")
    if not 0 <= num_blocks <= L - exit_layer:
        raise SpeculantError(f"num_blocks={num_blocks} is out of range; allowed: 0..{L - exit_layer}")
    conf = {"format": FORMAT, "version": 1, "base_model": model.name, "hidden_size": cfg.hidden_size,
            "intermediate_size": cfg.intermediate_size, "num_blocks": num_blocks, "rms_norm_eps": cfg.rms_norm_eps,
            "exit_layer": exit_layer, "num_layers": L, "vocab_size": cfg.vocab_size,
            "draft_vocab_size": cfg.vocab_size if vocab_ids is None else int(len(vocab_ids))}
    head = lm_head_rows_weight(dec, None if vocab_ids is None else vocab_ids.long())
    ad = ExitAdapter(conf, head.float(), vocab_ids)
    with torch.no_grad():
        for j, b in enumerate(ad.blocks):
            layer = dec.layers[exit_layer + j]
            norm = layer.post_attention_layernorm           # its scale: weight + offset (Gemma: 1 + weight)
            b.norm.weight.copy_(norm.weight + norm.offset)
            b.gate_up_proj.weight.copy_(layer.mlp.gate_up_proj.weight)
            b.down_proj.weight.copy_(layer.mlp.down_proj.weight)
        ad.norm.weight.copy_(dec.norm.weight + dec.norm.offset)
    return ad.float()


def save_adapter(adapter: ExitAdapter, out_dir: str | Path, card: str | None = None, metrics: dict | None = None,
                 dtype: torch.dtype = torch.bfloat16) -> Path:
    """Write ``adapter.safetensors`` (float tensors in ``dtype``), ``config.json`` and ``README.md``."""
    return write_dir(out_dir, "adapter.safetensors", adapter.trained_state(), dtype, FORMAT,
                     dict(adapter.config, stored_dtype=str(dtype).replace("torch.", "")), metrics, card)
