"""LayerSkip self-speculative drafter: the target's own first E layers draft.

Elhoushi et al. 2024, "LayerSkip: Enabling Early Exit Inference and
Self-Speculative Decoding", Sec. 5: the draft exits after layer E through the
shared final norm and LM head (or a trained exit adapter); verification runs
only the remaining layers, reusing

* the KV entries of layers < E that drafting wrote into the one target cache, and
* the *exit-query cache*: hidden states entering layer E for every drafted entry,

so each layer processes each token exactly once (the decoder's
``layer_token_counts`` proves it).  Works for chains and for trees (the
frontier of each depth runs as one batch with the tree mask), which makes
self-speculative RSD possible.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import torch

from ..errors import SpeculantError
from ..trees.tree import DraftTree
from .base import (DecodingState, DrafterCapabilities, ModelDrafterBase, ModelDraftState, VerificationInput,
                   full_vocab_logits)


@dataclass
class EarlyExitState(ModelDraftState):
    """Per-generation state of :class:`EarlyExitDrafter`.

    Attributes:
        exit_queries: the exit-query cache of the current tree: hidden states entering layer E,
            ``[1, F_d, D]`` per draft forward, in block order.
    """

    exit_queries: list[torch.Tensor] = field(default_factory=list)


class EarlyExitDrafter(ModelDrafterBase[EarlyExitState]):
    """Drafts with layers ``[0, exit_layer)`` of the target.

    Args:
        exit_layer: E, 1 <= E < number of layers.
        exit_head: optional callable mapping hidden states ``[..., D]`` leaving layer
            E-1 to fp32 draft logits ``[..., V]`` (a trained exit adapter, possibly with a
            reduced-vocabulary head that puts -inf outside its vocabulary);
            ``None`` uses the shared final norm and LM head.
    Raises:
        SpeculantError: E outside ``[1, L-1]``.
    """

    name = "early-exit"
    capabilities = DrafterCapabilities(drafts_into_target_cache=True, draft_confidence=True)

    def __init__(self, num_layers: int, exit_layer: int, exit_head: Callable | None = None):
        if not 1 <= exit_layer < num_layers:
            raise SpeculantError(f"exit_layer={exit_layer} is out of range; allowed: 1..{num_layers - 1}")
        self.num_layers = num_layers
        self.exit_layer = exit_layer
        self.exit_head = exit_head

    def cache_share(self, target_config) -> float:
        """Layers ``< E`` of the target's: ``E / L`` of its KV cache per draft call."""
        return self.exit_layer / self.num_layers

    def begin(self, state: DecodingState[EarlyExitState]) -> EarlyExitState:
        return EarlyExitState()

    def _exit_logits(self, state: DecodingState, h: torch.Tensor) -> torch.Tensor:
        if self.exit_head is not None:
            return self.exit_head(h)
        return state.target.lm_head(state.target.final_norm(h))

    def _run_prefix(self, state: DecodingState, tree: DraftTree, first_entry: int) -> torch.Tensor:
        """Layers < E over block entries ``first_entry ..`` (KV into the target cache); returns ``[1, F, D]``."""
        n = state.n
        ids = torch.tensor([[state.tokens[-1]] + tree.tokens], dtype=torch.long)[:, first_entry:]
        positions = tree.block_positions(n)[first_entry:]
        mask = None if tree.is_chain else tree.attention_mask(n, slice(first_entry, None))
        h = state.run_layers(state.target.embed(ids), 0, self.exit_layer, positions, mask, n + first_entry)
        state.drafter_state.exit_queries.append(h)
        return h

    def frontier_logits(self, state, tree, first_entry, depth):
        return full_vocab_logits(*self.frontier_draft_logits(state, tree, first_entry, depth),
                                 state.target.config.vocab_size)

    def frontier_draft_logits(self, state, tree, first_entry, depth):
        """Over an exit adapter's reduced vocabulary where it has one (``(logits [F, V'], vocab_ids [V'])``)."""
        if first_entry == 0:
            state.drafter_state.exit_queries = []
        h = self._run_prefix(state, tree, first_entry)[0]
        reduced = getattr(self.exit_head, "reduced", None)
        return reduced(h) if reduced is not None else (self._exit_logits(state, h), None)

    def draft(self, state, builder, generator, max_nodes, max_depth):
        """The tree (:meth:`ModelDrafterBase.draft`), then layers < E over the block entries drafting did not run
        (the deepest frontier), so that the exit-query cache holds the whole block and verification resumes at the
        exit layer.  A round that ran no draft forward (an ``ar`` round of the cost-aware policy) leaves the cache
        empty: its verification is the plain one-token step from layer 0, one call instead of two."""
        tree = super().draft(state, builder, generator, max_nodes, max_depth)
        ds = state.drafter_state
        if ds.processed == 0 and len(tree) == 0:
            ds.exit_queries = []
        elif ds.processed < len(tree) + 1:
            if ds.processed == 0:
                ds.exit_queries = []
            self._run_prefix(state, tree, ds.processed)
            ds.processed = len(tree) + 1
        return tree

    def verification_input(self, state, tree):
        """Resume at the exit layer from the exit-query cache ``[1, N+1, D]`` that :meth:`draft` filled (from layer
        0 where it is empty: an ``ar`` round)."""
        n = state.n
        if not state.drafter_state.exit_queries:
            return super().verification_input(state, tree)
        h = torch.cat(state.drafter_state.exit_queries, dim=1)
        return VerificationInput(h, self.exit_layer, tree.block_positions(n),
                                 None if tree.is_chain else tree.attention_mask(n), n)

    def commit(self, state, path):
        state.drafter_state.exit_queries = []
