"""Preallocated static KV cache with rollback and compaction.

The cache is a pair of tensors ``keys``/``values`` of shape
``[num_layers, batch, num_kv_heads, max_length, head_dim]`` indexed by *slot*
(the position in the cache, not the RoPE position: tree nodes at equal depth
share a RoPE position but have their own slots).  ``length`` counts the slots
holding committed tokens (``0 .. length-1``); a forward may write past it
(draft tokens, tree nodes), and the engine then calls :meth:`keep` or
:meth:`crop` to make the cache hold exactly the committed tokens again.
Design follows gpt-fast's static cache (index by position, no reallocation).
"""

from __future__ import annotations

import sys

import torch

from ..errors import SpeculantError


def mark_dynamic(tensor: torch.Tensor, dim: int) -> None:
    """``torch._dynamo.maybe_mark_dynamic(tensor, dim)`` (one compiled graph for every size of that dimension), only
    once ``torch._dynamo`` is imported: without compiled steps (e.g. ``w4a8``'s fused step) there is nothing to
    mark, and importing it costs ~2.5 s of a warm start."""
    if "torch._dynamo" in sys.modules:
        torch._dynamo.maybe_mark_dynamic(tensor, dim)


class KVCache:
    """Static per-layer key/value storage.

    Args:
        num_layers: decoder layers stored (a truncated draft model stores fewer).
        num_kv_heads, head_dim: attention shape of the model.
        max_length: slots per layer (tokens).
        batch: batch size (generation uses 1).
        dtype: storage dtype; ``nbytes`` gives the size in bytes.
    """

    def __init__(self, num_layers: int, num_kv_heads: int, head_dim: int, max_length: int,
                 batch: int = 1, dtype: torch.dtype = torch.float32, device="cpu"):
        shape = (num_layers, batch, num_kv_heads, max_length, head_dim)
        self.keys = torch.zeros(shape, dtype=dtype, device=device)
        self.values = torch.zeros(shape, dtype=dtype, device=device)
        self.max_length = max_length
        self.length = 0
        # per-layer views [batch, kv_heads, max_length, head_dim], marked so one compiled step serves any max_length
        self.layer_keys, self.layer_values = list(self.keys.unbind(0)), list(self.values.unbind(0))
        for view in self.layer_keys + self.layer_values:
            mark_dynamic(view, 2)

    @property
    def dtype(self) -> torch.dtype:
        return self.keys.dtype

    @property
    def nbytes(self) -> int:
        """Size of the storage in bytes."""
        return self.keys.nbytes + self.values.nbytes

    def write(self, layer: int, k: torch.Tensor, v: torch.Tensor, start: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Store ``k``/``v`` ``[batch, kv_heads, T, head_dim]`` at slots ``start..start+T-1``.

        Returns the keys and values of slots ``0 .. start+T-1`` (views).

        Raises:
            SpeculantError: if the write would pass ``max_length``.
        """
        end = start + k.shape[2]
        if end > self.max_length:
            raise SpeculantError(f"KV cache overflow: slot {end} > max_length={self.max_length}")
        self.keys[layer, :, :, start:end] = k
        self.values[layer, :, :, start:end] = v
        return self.keys[layer, :, :, :end], self.values[layer, :, :, :end]

    def crop(self, length: int) -> None:
        """Forget every slot from ``length`` on (O(1): slots are overwritten later)."""
        if not 0 <= length <= self.max_length:
            raise SpeculantError(f"crop length={length} outside [0, {self.max_length}]")
        self.length = length

    def rollback(self, num_tokens: int) -> None:
        """Drop the last ``num_tokens`` committed tokens."""
        self.crop(self.length - num_tokens)

    def keep(self, slots: torch.Tensor | list[int], start: int | None = None) -> None:
        """Gather ``slots`` (ascending, all ``>= start``) into the contiguous slots ``start..``.

        Slots below ``start`` (default: ``self.length``) are untouched; afterwards
        ``length == start + len(slots)``.  Used after tree verification to keep the
        accepted path only.
        """
        start = self.length if start is None else start
        if isinstance(slots, list) and not slots:       # nothing accepted (an ar round, or no draft kept): no tensor
            self.length = start
            return
        slots = torch.as_tensor(slots, dtype=torch.long, device=self.keys.device)
        n = int(slots.numel())
        if n and int(slots[0]) < start:
            raise SpeculantError(f"keep: slot {int(slots[0])} is below start={start}")
        if n and not bool((slots == torch.arange(start, start + n, device=slots.device)).all()):
            self.keys[:, :, :, start:start + n] = self.keys[:, :, :, slots]
            self.values[:, :, :, start:start + n] = self.values[:, :, :, slots]
        self.length = start + n
