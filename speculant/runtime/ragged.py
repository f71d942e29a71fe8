"""The multi-sequence ("ragged") target forward: several sequences' blocks in one pass over the weights.

Decoding on a CPU is bound by reading the weights; a forward over ``T`` rows costs about what one row
costs while ``T`` is small.  So a batch of sequences, each with its own verification block (a tree or a
chain, ``T_i`` rows) and its own KV cache, is run as one ``[1, sum T_i, D]`` batch through each layer's
projections, norms and MLP (:func:`~speculant.models.llama.attention_inputs`,
:func:`~speculant.models.llama.layer_output`), while attention runs per sequence against its own cache with
its own mask (:func:`~speculant.models.llama.attend`, in the cache's dtype; with float32 or float16 caches every
sequence's attention runs in one call of our kernel, :func:`speculant.kernels.attention.ragged_attention`).  No padding: the rows are
simply concatenated, as in vLLM's flattened batches (Kwon et al. 2023) or Orca's selective batching
(Yu et al. 2022, Sec. 4.2: batch the token-wise operations, split for attention).

Each row's result equals, bit for bit, what the one-sequence forward (:meth:`~speculant.runtime.executor.Executor.run_layers`)
gives it, provided the projection kernels are batch-invariant at ``sum T_i`` rows (measured, see
:func:`speculant.runtime.tune.invariant_rows`): the per-row operations (RMSNorm, RoPE, SiLU, residuals)
do not mix rows, and attention is computed exactly as the single-sequence step computes it.
"""

from __future__ import annotations

import torch

from ..errors import SpeculantError
from ..kernels import attention as attention_kernel
from ..models.kv_cache import mark_dynamic
from ..models.llama import attention_inputs, dense_mask, layer_output
from .blocks import Block
from .steps import attend


# Over 80 lines with its docstring: one loop over the layers whose state (the rows of the blocks that have joined,
# their attention plan and RoPE rows) carries from layer to layer; split, that state would be passed around.
def ragged_run_layers(executor, blocks: list[Block], end: int | None = None,
                      halves=None) -> list[torch.Tensor]:
    """Run every block through its layers ``start_layer .. end-1`` in one batched pass per layer.

    At layer ``i`` the rows of every block with ``start_layer <= i`` are concatenated (``[1, R, D]``) for
    the projections and MLP; attention is per block.  Counts ``R`` tokens in the decoder's ``layer_token_counts[i]``.

    Args:
        executor: the target's :class:`~speculant.runtime.executor.Executor` (its fused step where it applies).
        blocks: the sequences' blocks (each its own cache).
        end: one past the last layer to run (default: all layers).
        halves: the ``(attention_inputs, layer_output)`` functions to use; default the executor's (compiled ones
            where its steps are compiled, :func:`speculant.runtime.compiled.enable_compile`), else the model's.
    Returns:
        per block, the hidden states ``[1, T, D]`` leaving layer ``end - 1``.
    Raises:
        SpeculantError: a block would write past its cache's ``max_length``, or its mask has the wrong shape.
    """
    decoder = executor.decoder
    end = decoder.num_layers if end is None else end
    first_half, second_half = halves or executor.halves or (attention_inputs, layer_output)
    hidden = [b.hidden for b in blocks]
    masks, tables = [], []
    for b in blocks:
        t = b.hidden.shape[1]
        if b.cache_position + t > b.cache.max_length:
            raise SpeculantError(f"KV cache overflow: slot {b.cache_position + t} > max_length={b.cache.max_length}")
        mask = dense_mask(b.mask, t, b.cache_position, b.hidden.device)
        if tuple(mask.shape) != (t, b.cache_position + t):
            raise SpeculantError(f"mask shape {tuple(mask.shape)} does not match the block; "
                                 f"allowed: ({t}, {b.cache_position + t})")
        decoder.ensure_rope(int(b.positions.max()) + 1)
        local = decoder.local_rows(b.positions, b.hidden, mask, torch.arange(b.cache_position + t), range(end))
        masks.append((mask, local[2] if local else None))   # (global, sliding-window layers') masks: Gemma 3
        tables.append((decoder.rope_cos[b.positions], decoder.rope_sin[b.positions])
                      + ((local[0].squeeze(-2), local[1].squeeze(-2)) if local else ()))
    # float32 or float16 caches, all one dtype (our attention kernel, see speculant.models.llama.attend): one call per layer for all sequences
    one_call = (len({b.cache.dtype for b in blocks}) == 1
                and all(b.cache.dtype in attention_kernel.CACHE_DTYPES and b.cache.keys.shape[1] == 1 for b in blocks))
    members: list[int] = []
    cos = sin = x = None
    sizes: list[int] = []
    fused = executor.fused_layers() if one_call else None      # speculant.kernels.decode_step
    i = min((b.start_layer for b in blocks), default=end)
    while i < end:
        now = [j for j, b in enumerate(blocks) if b.start_layer <= i]
        if now != members:                     # a block joins at its start layer: regroup the rows
            if x is not None:
                for j, h in zip(members, x.split(sizes, 1)):
                    hidden[j] = h
            members = now
            sizes = [hidden[j].shape[1] for j in members]
            x = torch.cat([hidden[j] for j in members], dim=1) if len(members) > 1 else hidden[members[0]]
            plans, rows = [], []        # per kind (0 global, 1 sliding window): attention plan, RoPE rows
            for kind in range(2 if decoder.local_layers and any(decoder.local_layers) else 1):
                if one_call:
                    plans.append(attention_kernel.RaggedPlan(sizes, [blocks[j].cache_position for j in members],
                                                             [blocks[j].cache for j in members],
                                                             [masks[j][kind] for j in members]))
                rows.append([torch.cat([tables[j][2 * kind + n] for j in members]).to(x.dtype).unsqueeze(-2)
                             for n in (0, 1)])                                             # [R, 1, Dh]
            plan = plans[0] if one_call else None
            cos, sin = rows[0]
        if fused is not None:         # layers i .. (the next block's start layer) in one C call
            stop = min([b.start_layer for b in blocks if b.start_layer > i] + [end])
            local = (rows[1][0].reshape(x.shape[1], -1), rows[1][1].reshape(x.shape[1], -1), plans[1]) \
                if len(plans) > 1 else None                     # Gemma 3's sliding-window layers
            x = fused.run(x.reshape(-1, x.shape[-1]), i, stop, cos.reshape(x.shape[1], -1),
                          sin.reshape(x.shape[1], -1), plan, local).view(1, x.shape[1], -1).to(x.dtype)
            for layer_index in range(i, stop):
                decoder.layer_token_counts[layer_index] += x.shape[1]
            i = stop
            continue
        layer = decoder.layers[i]
        kind = int(decoder.local_layers[i])
        cos, sin = rows[kind]
        if x.shape[1] > 1:            # one compiled graph for every row count 2..R
            mark_dynamic(x, 1)
            mark_dynamic(cos, 0)
            mark_dynamic(sin, 0)
        q, k, v = first_half(layer, x, cos, sin)
        dtype, adtype = x.dtype, blocks[members[0]].cache.dtype
        if one_call:               # every sequence's attention (and KV write) in one kernel call
            attended = attention_kernel.ragged_attention(q, k, v, plans[kind], i, q.shape[-1] ** -0.5)
        else:
            q, k, v = q.to(adtype), k.to(adtype), v.to(adtype)    # once per layer, not per sequence (same values)
            attended = []
            for j, qj, kj, vj in zip(members, q.split(sizes, 2), k.split(sizes, 2), v.split(sizes, 2)):
                b = blocks[j]
                attended.append(attend(qj, kj, vj, masks[j][kind], False, b.cache, i, b.cache_position))
            attended = torch.cat(attended, dim=1) if len(attended) > 1 else attended[0]
        attended = attended.to(dtype)
        if x.shape[1] > 1:
            mark_dynamic(attended, 1)
        x = second_half(layer, x, attended)
        decoder.layer_token_counts[i] += x.shape[1]
        i += 1
    if x is not None:
        for j, h in zip(members, x.split(sizes, 1)):
            hidden[j] = h
    return hidden
