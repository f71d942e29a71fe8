"""A draft head with prompt lookup first (method ``eagle-lookup``): where the last ``min_ngram`` or more tokens
recur earlier in prompt + output, the round drafts the tokens that followed them (Saxena 2023, as
:class:`~speculant.drafters.prompt_lookup.PromptLookupDrafter`); elsewhere the draft head drafts (EAGLE).

Copying costs no forward and is accepted far more often than a one-layer head's guess where the output quotes its
context (summaries, RAG answers, extraction, code edits), while the head drafts where nothing recurs.  The head
keeps its state through lookup rounds as through ``ar`` rounds: the verified block's target features become its
pending entries, caught up at its next round.  Each kind of round has its own round context (``("lookup", n)``
for an ``n``-token match, ``None`` for the head), so a cost-aware policy sizes them from their own acceptance and
their own cost per draft call (:meth:`LookupMixin.round_costs`).  Drafts never change what is emitted
(verification decides; a copied token is a point mass under sampling).
"""

from __future__ import annotations

from dataclasses import replace

from ..trees.builders import ChainBuilder
from .prompt_lookup import NgramIndex, allowed_continuation, continuation_tree


class LookupMixin:
    """Prompt lookup before a head drafter's own draft (mixed into its class by :func:`with_lookup`).

    Attributes:
        lookup_max_ngram, lookup_min_ngram: the n-gram sizes looked up [tokens]; shorter matches leave the round
            to the head.
        lookup_seconds: seconds of a copying round's first lookup draft call and of each further one,
            ``{greedy: (first, further)}`` (measured as prompt lookup's, greedy or sampled;
            :func:`speculant.engine.speculation.draft_seconds`) [s].
    """

    lookup_max_ngram = 5
    lookup_min_ngram = 2
    lookup_seconds: dict = {True: (0.0, 0.0), False: (0.0, 0.0)}

    def begin(self, state):
        st = super().begin(state)
        st.lookup = NgramIndex(self.lookup_max_ngram, self.lookup_min_ngram)
        return st

    def round_context(self, state):
        """``("lookup", n)`` when the last ``n >= lookup_min_ngram`` tokens recur (the round copies), else ``None``
        (the head drafts)."""
        n, _ = state.drafter_state.lookup.match(state.tokens, 1)
        return ("lookup", n) if n else None

    def context_name(self, context) -> str:
        """``"head"`` for the head's rounds, ``"lookup n-gram N"`` for a copying round that matched N tokens."""
        return "head" if context is None else f"lookup n-gram {context[1]}"

    def round_costs(self, state, context, costs):
        """The head's ``costs`` for its own rounds; a lookup round's draft calls cost :attr:`lookup_seconds` at any
        context (a copy reads no KV cache)."""
        if context is None:
            return costs
        first, further = self.lookup_seconds[state.sampling.greedy]
        return replace(costs, draft_seconds=further, first_draft_seconds=first, draft_growth=0.0)

    def round_extra_seconds(self, state, context=None) -> float:
        """The head's catch-up (:meth:`DraftHeadDrafter.round_extra_seconds`) in its own rounds; none in a round that
        copies."""
        return 0.0 if context is not None else super().round_extra_seconds(state, context)

    def free_draft(self, state, context, max_depth: int):
        """A copying round's continuation (no forward); ``None`` for the head's rounds (its draft costs a forward)."""
        if context is None:
            return None
        return allowed_continuation(state, state.drafter_state.lookup.match(state.tokens, max_depth)[1])

    def draft(self, state, builder, generator, max_nodes, max_depth):
        k = builder.num_speculations if isinstance(builder, ChainBuilder) else max_depth
        n, cont = state.drafter_state.lookup.match(state.tokens, min(k, max_nodes, max_depth))
        if not n or max_depth < 1:
            return super().draft(state, builder, generator, max_nodes, max_depth)
        state.drafter_state.processed = 0              # the head ran on no block entry this round
        return continuation_tree(state, cont)


def with_lookup(drafter, max_ngram: int, min_ngram: int):
    """``drafter`` (a draft-head drafter) drafting by prompt lookup where an n-gram of ``min_ngram .. max_ngram``
    tokens recurs: a copy of it whose class also derives from :class:`LookupMixin`, ``head_drafter`` the head drafter
    alone (what the head's rounds cost is its calibration's)."""
    cls = type(drafter)
    mixed = type(f"Lookup{cls.__name__}", (LookupMixin, cls), {"name": f"{cls.name}-lookup"})
    out = object.__new__(mixed)
    out.__dict__.update(drafter.__dict__)
    out.lookup_max_ngram, out.lookup_min_ngram = max_ngram, min_ngram
    out.head_drafter = drafter
    return out
