"""A block of decoding: one sequence's rows in one forward, the unit the executor runs.

One sequence's one-token step, its verification block (a chain or a tree under its mask), its prompt, and each
sequence of a batched round are all a :class:`Block`; :meth:`speculant.runtime.executor.Executor.run` takes a list
of them.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..models.kv_cache import KVCache


@dataclass
class Block:
    """One sequence's rows in a forward.

    Attributes:
        hidden: ``[1, T, D]`` hidden states entering layer ``start_layer`` (``[B, T, D]`` for a block run alone
            over a batched cache of ``B`` sequences, or without a cache).
        start_layer: the first layer this block runs (0 for tokens; an exit layer for early-exit verification).
        positions: RoPE positions ``[T]`` (int64).
        mask: bool ``[T, cache_position + T]`` (True = may attend; ``[B, 1, T, S]`` for a batched block), or ``None``
            for causal rows.
        cache: this sequence's KV cache, the block's keys/values going to slots ``cache_position ..``; ``None`` (a
            block run alone): no cache, attention over the block's own rows.
        cache_position: first slot written [tokens].
    """

    hidden: torch.Tensor
    start_layer: int
    positions: torch.Tensor
    mask: torch.Tensor | None
    cache: KVCache | None
    cache_position: int
