"""Prompt lookup decoding: draft the tokens that followed the last n-gram's previous occurrence.

Saxena 2023 ("Prompt Lookup Decoding"), as in transformers'
``PromptLookupCandidateGenerator``: try n-gram sizes from ``max_ngram`` down
to ``min_ngram``, take the most recent earlier match in prompt + output, and
propose up to ``num_speculations`` following tokens.  The draft has no
distribution: each drafted token is a point mass ``q = one_hot(x)``, which the
sampling rules accept with probability ``p(x)`` (and otherwise sample ``p``
with ``x`` removed), so sampling stays exact.

The matches come from an index of every n-gram's latest end position (:class:`NgramIndex`), extended by the
tokens appended since the last round (``max_ngram - min_ngram + 1`` dictionary updates a token), so a round's
lookup costs microseconds whatever the prompt's length (vLLM's n-gram proposer and llama.cpp's lookup decoding keep
such tables too).  The size of the n-gram that matched is the round's :meth:`PromptLookupDrafter.round_context`: a
cost-aware policy keeps its acceptance per size (a 1-token match is a weak guess, a 5-token one in a summary
copies a sentence).
"""

from __future__ import annotations

import torch

from ..errors import SpeculantError
from ..trees.builders import ChainBuilder
from ..trees.tree import DraftTree
from .base import Drafter


def find_continuation(tokens: list[int], max_ngram: int, min_ngram: int, length: int) -> list[int]:
    """Tokens that followed the most recent earlier occurrence of the longest matching suffix n-gram (at most
    ``length``; ``[]``: no n-gram of ``min_ngram .. max_ngram`` tokens recurs).  The reference that
    :class:`NgramIndex` computes incrementally."""
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


class NgramIndex:
    """For each n-gram size ``n`` in ``min_ngram .. max_ngram``: the latest end position (exclusive) of every
    n-gram of a growing token list, the suffix itself excluded; one generation's prompt-lookup state.

    :meth:`match` gives :func:`find_continuation`'s answer and the size of the n-gram that matched.
    """

    def __init__(self, max_ngram: int, min_ngram: int):
        self.sizes = range(max_ngram, min_ngram - 1, -1)
        self.ends: dict[int, dict[tuple, int]] = {n: {} for n in self.sizes}
        self.indexed = 0          # n-grams ending at positions < self.indexed are in the tables [tokens]

    def _extend(self, tokens: list[int]) -> None:
        """Index the n-grams ending at positions ``indexed .. len(tokens) - 1`` (not the suffix's end)."""
        if len(tokens) < self.indexed:                  # the list was cut: start over
            self.ends = {n: {} for n in self.sizes}
            self.indexed = 0
        for end in range(self.indexed, len(tokens)):
            for n in self.sizes:
                if end >= n:
                    self.ends[n][tuple(tokens[end - n:end])] = end
        self.indexed = len(tokens)

    def match(self, tokens: list[int], length: int) -> tuple[int, list[int]]:
        """``(n, continuation)``: the size of the longest suffix n-gram that occurred before (0: none) and the at most
        ``length`` tokens that followed its latest earlier occurrence (as :func:`find_continuation`)."""
        self._extend(tokens)
        total = len(tokens)
        for n in self.sizes:
            if n >= total:
                continue
            end = self.ends[n].get(tuple(tokens[total - n:]))
            if end is not None:                          # end < total: a continuation of at least one token
                return n, tokens[end:end + length]
        return 0, []


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

    def begin(self, state) -> NgramIndex:
        return NgramIndex(self.max_ngram, self.min_ngram)

    def _index(self, state) -> NgramIndex:
        index = state.drafter_state
        if not isinstance(index, NgramIndex):            # a subclass keeping other state: a fresh index per call
            index = NgramIndex(self.max_ngram, self.min_ngram)
        return index

    def round_context(self, state) -> int:
        """The size of the n-gram the next round's draft continues [tokens] (0: no match, nothing to draft)."""
        return self._index(state).match(state.tokens, 1)[0]

    def context_name(self, context: int) -> str:
        """``"n-gram N"``: the round continued a matched N-gram (``"no match"``: nothing to copy)."""
        return f"n-gram {context}" if context else "no match"

    def draft(self, state, builder, generator, max_nodes, max_depth):
        k = builder.num_speculations if isinstance(builder, ChainBuilder) else max_depth
        _, cont = self._index(state).match(state.tokens, min(k, max_nodes, max_depth))
        return continuation_tree(state, cont)

    def free_draft(self, state, context, max_depth: int) -> list[int] | None:
        """The continuation a round would copy (:meth:`Drafter.free_draft`): a lookup costs no forward."""
        return allowed_continuation(state, self._index(state).match(state.tokens, max_depth)[1])


def allowed_continuation(state, cont: list[int]) -> list[int]:
    """``cont`` cut before the first token the generation's controls forbid after the tokens before it (grammar,
    ``min_tokens``)."""
    if state.controls is not None and state.controls.active:
        return cont[:state.controls.allowed_prefix(cont)]
    return cont


def continuation_tree(state, cont: list[int]) -> DraftTree:
    """The chain of drafted tokens ``cont`` (cut where the generation's controls forbid a token), each a point mass
    under sampling, kept sparse: ``[1]`` over its token id."""
    tree = DraftTree()
    cont = allowed_continuation(state, cont)
    vocab = state.target.config.vocab_size
    one = torch.ones(1)
    parent = -1
    for tok in cont:
        if not state.sampling.greedy:
            tree.set_draft_probs(parent, one, torch.tensor([tok]), vocab)
        parent = tree.add(parent, tok)
    return tree
