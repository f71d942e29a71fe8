"""Automatic prefix caching: the KV of recent prompts, reused for the longest prefix a new prompt shares with one.

Chat requests share long prefixes: the chat template's system prompt (SmolLM2's default one and the template
header are 24 tokens of every one-turn chat), a conversation's earlier turns, a few-shot preamble.  vLLM
(block hashes of 16 tokens, ``--enable-prefix-caching``) and SGLang (a radix tree, "RadixAttention") keep
the KV of such prefixes and prefill only the rest of a new prompt.  This cache keeps whole prompts' KV in LRU
order within a token budget, and matches any prefix length against them (a linear scan: the budget
holds a few dozen prompts).

Entries come from prompts just prefilled (:meth:`~speculant.engine.batch.BatchedGenerator.start_many`) and from
finished sequences, prompt and answer (:meth:`~speculant.engine.batch.BatchedGenerator.release`, ``ar`` and prompt
lookup): a conversation's next turn repeats both.

Exactness: entries are stored and loaded only on the fused step (prompts within its prompt route, rounds verified
by the target's own forward); there every row gets the bits of a one-token step with the same cache before it
(:mod:`speculant.kernels.decode_step`), so a prompt prefilled from a cached prefix gets bit for bit the KV cache
and the logits of its full prefill.
"""

from __future__ import annotations

import collections
from dataclasses import dataclass

import torch

from ..errors import SpeculantError
from ..models.kv_cache import KVCache


@dataclass
class _Entry:
    tokens: tuple[int, ...]
    keys: torch.Tensor          # [layers, 1, kv_heads, len(tokens), head_dim]
    values: torch.Tensor


class PrefixCache:
    """The KV of up to ``max_tokens`` prompt tokens, whole prompts in least-recently-used order.

    Args:
        max_tokens: budget in tokens (>= 0; 0 keeps nothing).  A token costs
            ``2 * layers * kv_heads * head_dim * 4`` bytes in float32 (SmolLM2-135M: 46 080 bytes).

    Attributes:
        queries: prompt tokens looked up so far [tokens] (vLLM's ``prefix_cache_queries``).
        hits: of those, tokens whose KV came from the cache [tokens] (vLLM's ``prefix_cache_hits``).

    Raises:
        SpeculantError: ``max_tokens`` is negative.
    """

    def __init__(self, max_tokens: int):
        if max_tokens < 0:
            raise SpeculantError(f"prefix cache max_tokens={max_tokens} is negative; allowed: >= 0")
        self.max_tokens = max_tokens
        self._entries: collections.OrderedDict[tuple[int, ...], _Entry] = collections.OrderedDict()
        self.tokens = 0                  # tokens held [tokens]
        self.queries = 0
        self.hits = 0

    def __len__(self) -> int:
        return len(self._entries)

    @property
    def nbytes(self) -> int:
        """Bytes of KV held."""
        return sum(e.keys.nbytes + e.values.nbytes for e in self._entries.values())

    def match(self, tokens: list[int]) -> tuple[int, tuple[int, ...] | None]:
        """The longest prefix of ``tokens`` held, at most ``len(tokens) - 1`` long (the last position is always
        computed: its logits pick the next token).  Returns ``(length [tokens], key)``, ``(0, None)`` if none.
        Counts ``len(tokens)`` queries and ``length`` hits."""
        best, key, limit = 0, None, len(tokens) - 1
        for k in reversed(self._entries):           # most recent first: ties go to the entry just used
            n = 0
            for a, b in zip(k, tokens[:limit]):
                if a != b:
                    break
                n += 1
            if n > best:
                best, key = n, k
        self.queries += len(tokens)
        self.hits += best
        if key is not None:
            self._entries.move_to_end(key)
        return best, key

    def load(self, key: tuple[int, ...], length: int, cache: KVCache) -> None:
        """Copy the KV of the entry ``key``'s first ``length`` slots into slots ``0 .. length-1`` of ``cache``.

        Raises:
            SpeculantError: the entry's shape or dtype does not fit ``cache`` (another model's), or
                ``length`` exceeds the entry or the cache.
        """
        entry = self._entries[key]
        k = entry.keys
        if (k.shape[:3] != cache.keys.shape[:3] or k.shape[4] != cache.keys.shape[4] or k.dtype != cache.dtype
                or not 0 <= length <= min(len(entry.tokens), cache.max_length)):
            raise SpeculantError(f"prefix cache entry {tuple(k.shape)} {k.dtype}, length={length}, does not fit "
                                 f"the KV cache {tuple(cache.keys.shape)} {cache.dtype}")
        cache.keys[:, :, :, :length] = k[:, :, :, :length]
        cache.values[:, :, :, :length] = entry.values[:, :, :, :length]

    def store(self, tokens: list[int], cache: KVCache) -> None:
        """Keep the KV of ``tokens`` (slots ``0 .. len(tokens)-1`` of ``cache``, filled by their prefill), then
        drop least recently used prompts until at most ``max_tokens`` are held.  A prompt over the budget, or
        the prefix of a prompt held, is not stored; an entry that is a prefix of ``tokens`` is replaced."""
        key = tuple(tokens)
        if not key or len(key) > self.max_tokens or len(key) > cache.max_length:
            return
        for k in list(self._entries):
            if len(k) >= len(key) and k[:len(key)] == key:
                self._entries.move_to_end(k)
                return
            if k == key[:len(k)]:
                self._drop(k)
        n = len(key)
        self._entries[key] = _Entry(key, cache.keys[:, :, :, :n].clone(), cache.values[:, :, :, :n].clone())
        self.tokens += n
        while self.tokens > self.max_tokens:
            self._drop(next(iter(self._entries)))

    def _drop(self, key: tuple[int, ...]) -> None:
        self.tokens -= len(self._entries.pop(key).tokens)
