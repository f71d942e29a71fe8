"""Drafter interface and the depth-by-depth drafting loop shared by model-based drafters.

The engine keeps the target's KV cache such that slots ``0 .. n-1`` hold every
committed token but the last one (the *root* of the next tree, not yet in the
cache).  A verification block is ``[root] + tree nodes`` at slots ``n ..``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..models.kv_cache import KVCache
from ..models.llama import LlamaDecoder
from ..sampling.processors import SamplingConfig, logits_to_probs
from ..trees.builders import TreeBuilder
from ..trees.tree import DraftTree


@dataclass
class DecodingState:
    """What a drafter may read about the sequence being decoded.

    Attributes:
        target: the target decoder.
        cache: the target's KV cache; ``cache.length`` = n committed slots.
        tokens: prompt + emitted token ids; ``tokens[-1]`` is the root (slot n, not cached).
        sampling: the logits processing in force.
    """

    target: LlamaDecoder
    cache: KVCache
    tokens: list[int]
    sampling: SamplingConfig
    draft_forwards: int = 0

    @property
    def n(self) -> int:
        return self.cache.length


class Drafter:
    """Proposes a :class:`DraftTree`; may also run the verification forward (to reuse its work)."""

    name = "none"

    def prefill(self, target: LlamaDecoder, ids: torch.Tensor, cache: KVCache) -> torch.Tensor:
        """The target's forward over a new prompt ``ids`` ``[1, T]`` (KV into ``cache`` slots ``0 .. T-1``).

        The first call of every generation.  Returns fp32 logits ``[1, T, V]``.  Drafters that need
        more of the prompt than its KV (a draft head reads the target's features) override it.
        """
        return target(ids, None, None, cache, 0)

    def begin(self, state: DecodingState) -> None:
        """Called once after the target's prefill of a new prompt."""

    def draft(self, state: DecodingState, builder: TreeBuilder | None, generator: torch.Generator | None,
              max_nodes: int, max_depth: int) -> DraftTree:
        """A tree of at most ``max_nodes`` nodes and ``max_depth`` depths (both in tokens)."""
        return DraftTree()

    def verify_logits(self, state: DecodingState, tree: DraftTree) -> torch.Tensor:
        """Target logits ``[N + 1, V]`` (fp32) after each block entry; writes the block's KV at slots ``n ..``."""
        n = state.n
        mask = None if tree.is_chain else tree.attention_mask(n)
        ids = tree.block_tokens(state.tokens[-1])[None]
        logits = state.target(ids, tree.block_positions(n), mask, state.cache, n)
        return logits[0]

    def commit(self, state: DecodingState, path: list[int]) -> None:
        """Called after acceptance with the accepted node indices (before ``state.tokens`` grows)."""


def full_vocab_logits(logits: torch.Tensor, vocab_ids: torch.Tensor | None, vocab_size: int) -> torch.Tensor:
    """Logits ``[..., V']`` over a reduced draft vocabulary ``vocab_ids`` -> ``[..., V]`` with ``-inf`` outside
    it (identity when ``vocab_ids`` is ``None``)."""
    if vocab_ids is None:
        return logits
    full = logits.new_full((*logits.shape[:-1], vocab_size), float("-inf"))
    full[..., vocab_ids] = logits
    return full


def draft_distribution(logits: torch.Tensor, sampling: SamplingConfig) -> torch.Tensor:
    """Draft probabilities ``[F, V]``: processed like the target's, or the plain softmax under greedy decoding."""
    return torch.softmax(logits.float(), -1) if sampling.greedy else logits_to_probs(logits, sampling)


class ModelDrafterBase(Drafter):
    """Drafting with a network, one batched forward per depth over the whole frontier.

    Subclasses implement :meth:`frontier_logits`.  ``self.processed`` counts the
    block entries (root first, breadth-first) the draft network has run on; the
    deepest frontier is never run (its children are not needed).
    """

    processed: int = 0

    def frontier_logits(self, state: DecodingState, tree: DraftTree, first_entry: int, depth: int) -> torch.Tensor:
        """Draft logits ``[F, V]`` for block entries ``first_entry .. N`` (the frontier, all of depth ``depth``)."""
        raise NotImplementedError

    def draft(self, state, builder, generator, max_nodes, max_depth):
        tree = DraftTree()
        self.processed = 0
        if builder is None or max_nodes < 1 or max_depth < 1:
            return tree
        builder.reset()
        frontier = [-1]
        for depth in range(1, max_depth + 1):
            first_entry = frontier[0] + 1
            logits = self.frontier_logits(state, tree, first_entry, depth - 1)
            state.draft_forwards += 1
            self.processed = len(tree) + 1
            q = draft_distribution(logits, state.sampling)
            if not state.sampling.greedy:
                for node, row in zip(frontier, q):
                    tree.set_draft_probs(node, row)
            kids = builder.expand(depth, q, state.sampling.greedy, generator)
            new, full = [], False
            for node, toks in zip(frontier, kids):
                for tok in toks:
                    if len(tree) >= max_nodes:
                        full = True
                        break
                    new.append(tree.add(node, tok))
            if not new or full:
                break
            frontier = new
        return tree
