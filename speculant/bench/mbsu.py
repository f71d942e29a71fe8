"""Memory-bound speed-up (MBSU) of a speculative method.

Jeon et al. 2024, "Recursive Speculative Decoding: Accelerating LLM Inference via
Sampling Without Replacement" (arXiv:2402.14160), Sec. 5: when decoding is bound by
reading weights from memory, a call costs in proportion to the bytes of weights it
reads.  With block efficiency tau (emitted tokens per target call), a draft/target
size ratio ``c`` and ``D`` draft forwards per block (the tree depth)::

    MBSU = tau / (1 + c * D)

which is the paper's ``MBSU = c' * tau / (c' + D)`` with ``c' = 1/c`` the target/draft size
ratio.  The target call costs 1 and each draft forward ``c``.  ``c`` counts the bytes of weights
each call reads: for a separate draft model its weights over the target's; for an
early-exit drafter at layer E of an L-layer target (and a ``truncated:E`` copy)
``c = (E * layer_bytes + head_bytes) / (L * layer_bytes + head_bytes)`` where
``head_bytes`` is the final norm plus the LM head (the embedding lookup reads one row
per token and is ignored); with a trained exit adapter the adapter's bytes (its blocks, norm, bias
and reduced-vocabulary head rows) replace the final norm and LM head; a feature-level draft head
(EAGLE) is ``exit_layer=0`` with its own bytes (fc, one layer, reduced-vocabulary head rows).  Prompt lookup reads no weights (``c = 0``); AR has tau = 1,
MBSU = 1.
"""

from __future__ import annotations

from ..models.llama import LlamaDecoder


def _bytes(module) -> int:
    from ..runtime.formats import weight_bytes as module_bytes
    return module_bytes(module)


def weight_bytes(decoder: LlamaDecoder, layers: int | None = None) -> int:
    """Bytes of weights one forward of ``decoder`` reads when it runs its first ``layers`` layers
    (all by default) plus the final norm and LM head [bytes]."""
    n = decoder.num_layers if layers is None else layers
    return sum(_bytes(decoder.layers[i]) for i in range(n)) + _bytes(decoder.norm) + _bytes(decoder.lm_head_proj)


def exit_head_bytes(exit_head) -> int | None:
    """Bytes of weights an exit head reads per forward [bytes]: an
    :class:`~speculant.drafters.exit_adapter.ExitHead`'s adapter (parameters + LM-head rows), else ``None``."""
    adapter = getattr(exit_head, "adapter", None)
    if adapter is None:
        return None
    from ..runtime.formats import PackedLinear
    packed = {id(b) for m in adapter.modules() if isinstance(m, PackedLinear) for b in m.buffers()}
    float_buffers = [b for b in adapter.buffers() if b.is_floating_point() and id(b) not in packed]
    return _bytes(adapter) + sum(b.numel() * b.element_size() for b in float_buffers)


def draft_cost_ratio(target: LlamaDecoder, exit_layer: int | None = None, draft: LlamaDecoder | None = None,
                     head_bytes: int | None = None) -> float:
    """``c``: bytes read by one draft forward / bytes read by one target forward (0 when neither is given).

    ``head_bytes``: bytes of an exit adapter used at ``exit_layer`` instead of the final norm + LM head.
    """
    full = weight_bytes(target)
    if draft is not None:
        return weight_bytes(draft) / full
    if exit_layer is not None:
        if head_bytes is None:
            return weight_bytes(target, exit_layer) / full
        return (sum(_bytes(target.layers[i]) for i in range(exit_layer)) + head_bytes) / full
    return 0.0


def mbsu(block_efficiency: float, cost_ratio: float, draft_depth: float) -> float:
    """``tau / (1 + c * D)`` (Jeon et al. 2024); ``draft_depth`` D = draft forwards per target call."""
    return block_efficiency / (1.0 + cost_ratio * draft_depth)
