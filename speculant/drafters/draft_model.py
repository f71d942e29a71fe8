"""Two-model speculative decoding: a separate draft model with its own KV cache.

Leviathan et al. 2023 / Chen et al. 2023.  The draft model must share the
target's tokenizer.  ``truncated_copy`` builds the standalone first-E-layers
copy of the target (shares no tensor and no cache with it): the baseline that
measures what LayerSkip's shared KV and exit-query caches buy.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass

import torch

from ..errors import SpeculantError
from ..models.kv_cache import KVCache
from ..models.llama import LlamaDecoder
from .base import DecodingState, ModelDrafterBase, ModelDraftState, last_position_logits


def truncated_copy(target: LlamaDecoder, exit_layer: int) -> LlamaDecoder:
    """A deep copy of layers ``[0, exit_layer)`` + final norm + LM head of ``target``.

    Raises:
        SpeculantError: ``exit_layer`` outside ``[1, L-1]``.
    """
    if not 1 <= exit_layer < target.num_layers:
        raise SpeculantError(f"truncated:{exit_layer} is out of range; allowed: truncated:1..truncated:{target.num_layers - 1}")
    layers = target.layers
    target.layers = torch.nn.ModuleList(list(layers)[:exit_layer])
    try:
        draft = copy.deepcopy(target)
    finally:
        target.layers = layers
    draft.config = target.config.with_layers(exit_layer)
    draft.layer_token_counts = [0] * exit_layer
    return draft


def check_vocab_compatible(target_tok, draft_tok, target: LlamaDecoder, draft: LlamaDecoder) -> None:
    """Raise :class:`SpeculantError` unless the draft model shares the target's vocabulary."""
    if target.config.vocab_size != draft.config.vocab_size:
        raise SpeculantError(f"draft vocab_size={draft.config.vocab_size} differs from the target's "
                             f"{target.config.vocab_size}; a draft model must share the target's tokenizer")
    if target_tok is not None and draft_tok is not None and target_tok is not draft_tok:
        if target_tok.get_vocab() != draft_tok.get_vocab():
            raise SpeculantError("the draft model's tokenizer vocabulary differs from the target's; "
                                 "a draft model must share the target's tokenizer")


@dataclass
class DraftModelState(ModelDraftState):
    """Per-generation state of :class:`DraftModelDrafter`: the draft model's own KV cache
    (``cache.length`` committed tokens cached)."""

    cache: KVCache | None = None


class DraftModelDrafter(ModelDrafterBase[DraftModelState]):
    """Drafts with a separate decoder and its own KV cache (one per generation, in ``state.drafter_state``).

    A draft model with a shorter context than the target drafts only while the positions it would run stay
    inside its context (``config.context_length``); past that the round drafts nothing and the target
    goes on alone (one token per round), so the output is unchanged and never fails.
    """

    name = "draft-model"

    def __init__(self, draft: LlamaDecoder):
        self.model = draft

    def cache_share(self, target_config) -> float:
        """The draft model's keys/values per token over the target's."""
        d, t = self.model.config, target_config
        return (d.num_hidden_layers * d.num_key_value_heads * d.head_dim
                / (t.num_hidden_layers * t.num_key_value_heads * t.head_dim))

    def begin(self, state: DecodingState[DraftModelState]) -> DraftModelState:
        return DraftModelState(cache=self.model.new_cache(state.cache.max_length))

    def draft(self, state, builder, generator, max_nodes, max_depth):
        # the frontier of depth d-1 (children at depth d) runs at position len(tokens) - 1 + d - 1
        room = self.model.config.context_length - len(state.tokens) + 1
        return super().draft(state, builder, generator, max_nodes, min(max_depth, room))

    def frontier_logits(self, state, tree, first_entry, depth):
        cache = state.drafter_state.cache
        m = cache.length
        if first_entry == 0:
            # catch up on every committed token not yet cached, the root last; only the root's logits are needed
            ids = torch.tensor([state.tokens[m:]], dtype=torch.long)
            positions = torch.arange(m, len(state.tokens))
            h = self.model.run_layers(self.model.embed(ids), 0, self.model.num_layers, positions, None, cache, m)
            return last_position_logits(self.model, h)
        n = len(state.tokens)           # slots m .. n-1 hold the committed tokens, root included
        ids = torch.tensor([tree.tokens[first_entry - 1:]], dtype=torch.long)
        positions = tree.block_positions(n - 1)[first_entry:]
        mask = None if tree.is_chain else tree.attention_mask(n - 1, slice(first_entry, None))
        return self.model(ids, positions, mask, cache, n - 1 + first_entry)[0]

    def commit(self, state, path):
        # keep the root and the accepted nodes the draft model has already processed
        ds = state.drafter_state
        n = len(state.tokens)
        done = [i for i in path if i + 1 < ds.processed]
        ds.cache.crop(n if ds.processed else ds.cache.length)
        if ds.processed:
            ds.cache.keep([n + i for i in done], start=n)
