"""Drafter interface and the depth-by-depth drafting loop shared by model-based drafters.

The engine keeps the target's KV cache such that slots ``0 .. n-1`` hold every
committed token but the last one (the *root* of the next tree, not yet in the
cache).  A verification block is ``[root] + tree nodes`` at slots ``n ..``.
"""

from __future__ import annotations

import copy
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


@dataclass
class VerificationInput:
    """What the target runs to verify one tree: the block's hidden states entering layer ``start_layer``.

    Attributes:
        hidden: ``[1, T, D]`` (``T`` = tree nodes + 1, root first): token embeddings when
            ``start_layer == 0``; an early-exit drafter's exit-query cache when it resumes at its exit layer.
        start_layer: first target layer to run.
        positions: RoPE positions ``[T]``.
        mask: bool ``[T, cache_position + T]`` (tree attention), or ``None`` for a causal block (a chain).
        cache_position: first KV-cache slot the block writes (``n``, the committed length) [tokens].
    """

    hidden: torch.Tensor
    start_layer: int
    positions: torch.Tensor
    mask: torch.Tensor | None
    cache_position: int


class Drafter:
    """Proposes a :class:`DraftTree`; may also run the verification forward (to reuse its work).

    Verification is split in two hooks so that a batch of sequences can be verified in one target forward
    (:mod:`speculant.engine.batch`): :meth:`verification_input` says what to run, the engine runs layers
    ``start_layer .. L-1`` (alone, or with other sequences' blocks), and :meth:`verification_hidden` receives
    the block's last-layer hidden states.  :meth:`verify_logits` is the one-sequence composition of the two.
    """

    name = "none"

    def fork(self) -> "Drafter":
        """A drafter for one more sequence: the same networks and settings, its own per-sequence state.

        The default (a shallow copy) suits drafters that keep no per-sequence state on the object or
        re-create it in :meth:`prefill` / :meth:`begin`; drafters holding a cache or buffers override it.
        """
        return copy.copy(self)

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

    def verification_input(self, state: DecodingState, tree: DraftTree) -> VerificationInput:
        """The block to verify ``tree``: by default the embedded ``[root] + tree`` tokens from layer 0."""
        n = state.n
        ids = tree.block_tokens(state.tokens[-1])[None]
        return VerificationInput(state.target.embed(ids), 0, tree.block_positions(n),
                                 None if tree.is_chain else tree.attention_mask(n), n)

    def verification_hidden(self, state: DecodingState, tree: DraftTree, hidden: torch.Tensor) -> None:
        """Receives the verified block's hidden states ``[T, D]`` leaving the target's last layer (before the
        final norm), e.g. for a draft head that reads the target's features.  Default: nothing."""

    def verify_logits(self, state: DecodingState, tree: DraftTree) -> torch.Tensor:
        """Target logits ``[N + 1, V]`` (fp32) after each block entry; writes the block's KV at slots ``n ..``."""
        target, block = state.target, self.verification_input(state, tree)
        h = target.run_layers(block.hidden, block.start_layer, target.num_layers, block.positions, block.mask,
                              state.cache, block.cache_position)
        self.verification_hidden(state, tree, h[0])
        return target.lm_head(target.final_norm(h))[0]

    def commit(self, state: DecodingState, path: list[int]) -> None:
        """Called after acceptance with the accepted node indices (before ``state.tokens`` grows)."""


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
