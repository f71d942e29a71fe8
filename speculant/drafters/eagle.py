"""Drafting with a feature-level draft head (EAGLE, Li et al. 2024; trees as in EAGLE-2 / RSD).

Indexing (the engine's, see :mod:`speculant.drafters.base`): committed tokens ``x_0 .. x_n``, the
root ``x_n`` not yet in the target's cache.  Head entry ``i`` reads ``(f_i, x_{i+1})`` and predicts
``f^_{i+1}``; its KV sits at head-cache slot ``i`` with RoPE position ``i``.  Every committed entry
uses the *target's* features, so entries ``0 .. n-1`` are known once the target has verified up to the
root: the root's draft distribution comes from entry ``n-1``.  A drafted node ``k`` (depth ``d``) gets
the entry ``(f^_parent, x_k)`` at slot ``n + k``, position ``n + d - 1``, attending the committed slots
and its tree ancestors.  After verification those tree entries are dropped (their inputs were the
head's own predictions); the accepted path's *target* features become the next round's catch-up
entries.  Each depth of a tree is one head forward over the whole frontier
(:class:`~speculant.drafters.base.ModelDrafterBase`), so chains, RSD-C, RSD-S and SpecInfer trees work alike.

A long prompt's head entries are its last ``prompt_window`` positions only (``offset`` = the positions before them;
slot ``i - offset`` holds entry ``i``, RoPE positions stay the target's): the head's catch-up over a 900-token
prompt costs ~6 target steps, paid by the first drafting round whether drafting then pays or not, and a one-layer
head's drafts rest on the recent context.  Drafts never change what is emitted (verification decides), only how
many are accepted.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

from ..errors import SpeculantError
from ..models.kv_cache import KVCache
from .base import (DecodingState, DrafterCapabilities, ModelDrafterBase, ModelDraftState, full_vocab_logits,
                   last_position_logits)
from .draft_head import DraftHead


PROMPT_WINDOW: int | None = 256
"""The prompt positions a head's catch-up runs over by default (the last ones; ``None``: all) [tokens].  Prompts up
to this length are caught up whole; over longer ones (summaries, RAG: 670-930 tokens) the whole-prompt catch-up cost
~2 % of a generation whether drafting then paid or not, and the window lifted the head methods 2-9 % there
(BENCHMARKS.md AW.5; a 64-token window lowered RSD-C's acceptance on a shorter math prompt, AV)."""


@dataclass
class HeadState(ModelDraftState):
    """One generation's drafting state (``state.drafter_state``), made by :meth:`DraftHeadDrafter.begin` and
    given the prompt's features by :meth:`DraftHeadDrafter.prefill`.

    Attributes:
        cache: the head's KV cache; slots ``0 .. cache.length-1`` hold committed entries ``offset ..``.
        offset: prompt positions without head entries (a prompt longer than the drafter's ``prompt_window``).
        pending: target features ``[P_i, D]``, in order, of committed positions ``cache.length ..
            cache.length+P-1`` (``P`` = :attr:`pending_count`) whose entries the head has not run yet (the next root
            step runs them); kept as the blocks' parts and concatenated once, at the catch-up (a round without drafts
            appends one part, not a copy of all).
        pending_count: ``P``, the rows of :attr:`pending` [entries].
        prompt_pending: how many of ``pending`` are the prompt's (0 once the first catch-up ran) [entries].
        block_features: target features ``[N+1, D]`` of the last verified block (root first).
        predicted: the head's predicted features ``[1, D]`` of each block entry drafted from so far this
            round (root at index 0), by block entry.
    Invariant after each commit: ``offset + cache.length + P == `` the target cache's length.
    """

    cache: KVCache | None = None
    offset: int = 0
    pending: list[torch.Tensor] | None = None
    pending_count: int = 0
    prompt_pending: int = 0
    block_features: torch.Tensor | None = None
    predicted: list[torch.Tensor] = field(default_factory=list)


def target_features(target, hidden: torch.Tensor, feature: str) -> torch.Tensor:
    """Target hidden ``[..., D]`` leaving its last layer -> the features the head reads (post- or pre-norm)."""
    return target.final_norm(hidden) if feature == "post-norm" else hidden


class DraftHeadDrafter(ModelDrafterBase[HeadState]):
    """Drafts with a :class:`~speculant.drafters.draft_head.DraftHead`; verification also hands it the
    target features the head needs next (:meth:`verification_hidden`, so a batch of sequences is verified
    in one forward too).  Its own prefill keeps the prompt's features."""

    name = "eagle"
    capabilities = DrafterCapabilities(own_prefill=True, needs_features=True, draft_confidence=True)
    prompt_window = PROMPT_WINDOW
    catchup_seconds = 0.0
    """Seconds of the head's catch-up per committed entry beyond one [s] (:func:`measure_catchup_seconds`; 0: not
    measured), charged to a drafting round's first draft call (:meth:`round_extra_seconds`)."""

    def __init__(self, head: DraftHead):
        self.head = head

    def keep_prompt_features(self, state: DecodingState[HeadState], features: torch.Tensor) -> None:
        """The prompt's features ``[T, F]`` as the head's pending entries: the last :attr:`prompt_window` of them
        (``None``: all), the positions before them the state's ``offset``."""
        st = state.drafter_state
        st.offset = max(0, len(features) - self.prompt_window) if self.prompt_window is not None else 0
        st.pending = [features[st.offset:]]
        st.pending_count = st.prompt_pending = len(st.pending[0])

    def cache_share(self, target_config) -> float:
        """The head's one layer's keys/values over the target's layers' (an upper bound: the head's cache holds
        the last :attr:`prompt_window` of the prompt only)."""
        attn, t = self.head.layer.self_attn, target_config
        return attn.kv_size / (t.num_hidden_layers * t.num_key_value_heads * t.head_dim)

    def round_extra_seconds(self, state: DecodingState[HeadState], context=None) -> float:
        """The head's catch-up of the entries committed since it last ran, beyond one [s]: what a drafting round
        after a stretch of ``ar`` rounds pays on top of the cost table's first-call figure (measured with every
        round drafting).  The prompt's entries are not counted: their one catch-up serves every later round.  A
        count times a measured constant, so the sizing stays a function of the tokens."""
        st = state.drafter_state
        extra = max(0, st.pending_count - st.prompt_pending - 1)
        return extra * self.catchup_seconds

    @property
    def cost_signature(self) -> str:
        """The head's LM-head rows where they are not the target's (:meth:`DraftHead.pack_lm_rows`): 4-bit rows
        make a draft call cheaper, so their calls are measured apart."""
        fmt = getattr(self.head, "lm_rows_format", "target")          # (an EAGLE-3 head has its own head)
        return "" if fmt == "target" else f",lm_rows={fmt}"

    def one_off_work(self, state: DecodingState[HeadState]) -> bool:
        """The prompt's entries are still to be caught up (the generation's first drafting round runs them)."""
        return state.drafter_state.prompt_pending > 0

    # ---------------------------------------------------------------- target forwards
    def begin(self, state: DecodingState[HeadState]) -> HeadState:
        return HeadState(cache=self.head.new_cache(state.cache.max_length))

    def prefill(self, state: DecodingState[HeadState]) -> torch.Tensor:
        """Target forward over the prompt; keeps the prompt's features for the head.  Returns fp32 logits
        ``[1, V]`` of the last position."""
        target = state.target
        ids = torch.tensor([state.tokens], dtype=torch.long)
        h = state.run_layers(target.embed(ids), 0, target.num_layers, torch.arange(ids.shape[1]), None, 0)
        self.keep_prompt_features(state, target_features(target, h, self.head.feature)[0])
        return last_position_logits(target, h)

    def verification_hidden(self, state: DecodingState, tree, hidden: torch.Tensor) -> None:
        state.drafter_state.block_features = target_features(state.target, hidden, self.head.feature)

    def commit(self, state: DecodingState, path: list[int]) -> None:
        st = state.drafter_state
        n = len(state.tokens) - 1                        # the root's position, before the tokens grow
        st.cache.crop(min(st.cache.length, n - st.offset))   # drop this round's tree entries
        kept = st.block_features[[0] + [i + 1 for i in path]]
        st.pending.append(kept)
        st.pending_count += len(kept)
        st.block_features = None

    # ---------------------------------------------------------------- drafting
    def frontier_logits(self, state: DecodingState, tree, first_entry: int, depth: int) -> torch.Tensor:
        logits = self.draft_vocab_logits(state, tree, first_entry, depth)
        return full_vocab_logits(logits, self.head.vocab_ids, state.target.config.vocab_size)

    def frontier_draft_logits(self, state: DecodingState, tree, first_entry: int, depth: int):
        """``(logits [F, V'], vocab_ids)`` over the head's draft vocabulary (``(logits [F, V], None)`` for a head
        over the whole vocabulary): drafting softmaxes and samples over ``V'`` tokens only."""
        return self.draft_vocab_logits(state, tree, first_entry, depth), self.head.vocab_ids

    def draft_vocab_logits(self, state: DecodingState, tree, first_entry: int, depth: int) -> torch.Tensor:
        """The head's fp32 logits ``[F, V']`` over its draft vocabulary (``vocab_ids``) for block entries
        ``first_entry .. N`` (the frontier, depth ``depth``): the catch-up of committed entries first when
        ``first_entry == 0``, then one head call over the frontier (:meth:`DraftHead.step`)."""
        st, head = state.drafter_state, self.head
        n, base = state.n, st.offset
        if first_entry == 0:
            if st.pending is None or base + st.cache.length + st.pending_count != n:
                raise SpeculantError("the eagle drafter needs its own prefill (Drafter.prefill) before drafting")
            # catch up: entries m .. n-1 read the target features of positions m .. n-1 (the last: the root's parent)
            m = base + st.cache.length
            toks = torch.tensor(state.tokens[m + 1:n + 1], dtype=torch.long)
            pending = st.pending[0] if len(st.pending) == 1 else torch.cat(st.pending)
            out, logits = head.step(pending.to(head.dtype), toks, torch.arange(m, n), None, st.cache, m - base, 1)
            st.cache.crop(n - base)
            st.pending, st.pending_count, st.prompt_pending = [], 0, 0
            st.predicted = [out[-1:]]
        else:
            nodes = range(first_entry - 1, len(tree))
            parents = tree.parents
            feats = torch.cat([st.predicted[parents[k] + 1] for k in nodes])
            toks = torch.tensor(tree.tokens[first_entry - 1:], dtype=torch.long)
            positions = torch.full((len(nodes),), n + depth - 1, dtype=torch.long)
            mask = None
            if not tree.is_chain:
                anc = tree.ancestor_mask()[first_entry:, 1:]            # frontier rows x drafted nodes
                mask = torch.cat([torch.ones(len(nodes), n - base, dtype=torch.bool), anc], dim=1)
            out, logits = head.step(feats, toks, positions, mask, st.cache, n - base + first_entry - 1)
            st.predicted.extend(out[i:i + 1] for i in range(len(nodes)))
        return logits


def measure_catchup_seconds(head: DraftHead, feature_size: int, vocab_size: int, rows: int = 33,
                            repeats: int = 5) -> float:
    """Seconds per entry of a :class:`DraftHead` catch-up beyond one: ``(t(rows) - t(1)) / (rows - 1)`` of
    :meth:`DraftHead.step` over ``rows`` and 1 random entries ``[rows, feature_size]`` into a fresh cache, each the
    least of ``repeats`` [s] (>= 0)."""
    gen = torch.Generator().manual_seed(3)
    feats = torch.randn(rows, feature_size, generator=gen).to(head.dtype)
    toks = torch.randint(vocab_size, (rows,), generator=gen)

    def seconds(p: int) -> float:
        best = float("inf")
        for _ in range(repeats):
            cache = head.new_cache(rows + 1)
            t0 = time.perf_counter()
            head.step(feats[:p], toks[:p], torch.arange(p), None, cache, 0, 1)
            best = min(best, time.perf_counter() - t0)
        return best
    with torch.inference_mode():
        seconds(rows)                                       # warm-up
        return max(0.0, (seconds(rows) - seconds(1)) / (rows - 1))
