"""Prompt lookup decoding: draft the tokens that followed the last n-gram's previous occurrence.

Saxena 2023 ("Prompt Lookup Decoding"), as in transformers'
``PromptLookupCandidateGenerator``: try n-gram sizes from ``max_ngram`` down
to ``min_ngram``, take the most recent earlier match in prompt + output, and
propose up to ``num_speculations`` following tokens.  The draft has no
distribution: each drafted token is a point mass ``q = one_hot(x)``, which the
sampling rules accept with probability ``p(x)`` (and otherwise sample ``p``
with ``x`` removed), so sampling stays exact.
"""

from __future__ import annotations

import torch

from ..errors import SpeculantError
from ..trees.builders import ChainBuilder
from ..trees.tree import DraftTree
from .base import Drafter


def find_continuation(tokens: list[int], max_ngram: int, min_ngram: int, length: int) -> list[int]:
    """Tokens that followed the most recent earlier occurrence of the longest matching suffix n-gram."""
    seq = torch.tensor(tokens, dtype=torch.long)
    total = len(tokens)
    for n in range(min(max_ngram, total - 1), min_ngram - 1, -1):
        windows = seq.unfold(0, n, 1)[:-1]                       # every n-gram but the suffix itself
        hits = (windows == seq[total - n:]).all(-1).nonzero().flatten()
        if hits.numel():
            start = int(hits[-1]) + n
            cont = tokens[start:start + length]
            if cont:
                return cont
    return []


class PromptLookupDrafter(Drafter):
    """n-gram drafter over prompt and generated text (no model).

    Raises:
        SpeculantError: ``min_ngram < 1`` or ``max_ngram < min_ngram``.
    """

    name = "prompt-lookup"

    def __init__(self, max_ngram: int = 3, min_ngram: int = 1):
        if min_ngram < 1 or max_ngram < min_ngram:
            raise SpeculantError(f"max_ngram={max_ngram}, min_ngram={min_ngram}; allowed: 1 <= min_ngram <= max_ngram")
        self.max_ngram, self.min_ngram = max_ngram, min_ngram

    def draft(self, state, builder, generator, max_nodes, max_depth):
        tree = DraftTree()
        k = builder.num_speculations if isinstance(builder, ChainBuilder) else max_depth
        cont = find_continuation(state.tokens, self.max_ngram, self.min_ngram, min(k, max_nodes, max_depth))
        if state.controls is not None and state.controls.active:
            # never draft a token the grammar or min_tokens forbids after the tokens before it
            cont = cont[:state.controls.allowed_prefix(cont)]
        vocab = state.target.config.vocab_size
        parent = -1
        for tok in cont:
            if not state.sampling.greedy:
                tree.set_draft_probs(parent, torch.nn.functional.one_hot(torch.tensor(tok), vocab).float())
            parent = tree.add(parent, tok)
        return tree
