"""Drafter interface and the depth-by-depth drafting loop shared by model-based drafters.

The engine keeps the target's KV cache such that slots ``0 .. n-1`` hold every
committed token but the last one (the *root* of the next tree, not yet in the
cache).  A verification block is ``[root] + tree nodes`` at slots ``n ..``.

A drafter's lifecycle, per generation (the engine calls these and nothing else):

1. :meth:`Drafter.begin` returns the drafter's typed per-generation state (``state.drafter_state``), made when
   the generation's :class:`DecodingState` is, before the prompt's forward;
2. the prompt's forward: the plain target forward (:func:`target_prefill`, which the engine may batch with other
   prompts or take from a prefix cache), or :meth:`Drafter.prefill` where the drafter declares ``own_prefill``;
3. per round: :meth:`Drafter.draft` (which may also run layers the verification resumes from), then
   :meth:`Drafter.verification_input` (a pure description of the block: no layer runs, no cache changes), the
   engine's forward of that block (alone, or with other sequences' blocks), :meth:`Drafter.verification_hidden`
   where the drafter declares ``needs_features``, acceptance, and :meth:`Drafter.commit` with the accepted path.

What the engine may rely on is declared, per class, in :class:`DrafterCapabilities`; the engine reads the
declaration, never which methods a class overrides.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable, ClassVar, Generic, TypeVar

import numpy as np
import torch

from ..errors import SpeculantError
from ..models.kv_cache import KVCache
from ..models.llama import LlamaDecoder
from ..sampling.processors import SamplingConfig, logits_to_probs
from ..trees.builders import TreeBuilder
from ..trees.tree import DraftTree


S = TypeVar("S")
"""A drafter's per-generation state type."""


@dataclass(frozen=True)
class DrafterCapabilities:
    """What a drafter class declares to the engine (``Drafter.capabilities``).

    Attributes:
        batchable_verification: the round's verification is the plain target forward of the block that
            :meth:`Drafter.verification_input` describes, so the engine may run it together with other sequences'
            blocks (:mod:`speculant.engine.batch`); ``False``: :meth:`Drafter.verify_logits` runs it alone.
        own_prefill: the prompt's forward is :meth:`Drafter.prefill` (it keeps more of the prompt than its KV, e.g.
            the target's features); ``False``: the plain :func:`target_prefill`, which the engine may batch with
            other prompts or take from a prefix cache.
        needs_features: :meth:`Drafter.verification_hidden` wants the verified block's last-layer hidden states.
        drafts_into_target_cache: drafting writes rows of the target's KV cache (early exit: layers < E), so the
            committed slots are not all from the target's own verification forwards (and not cached for reuse).
        draft_confidence: the drafter gives each drafted token its draft probability (a distribution per
            frontier), which a cost-aware policy may read to stop drafting early (EAGLE-2's dynamic tree,
            llama.cpp's ``--draft-p-min``).
    """

    batchable_verification: bool = True
    own_prefill: bool = False
    needs_features: bool = False
    drafts_into_target_cache: bool = False
    draft_confidence: bool = False


@dataclass
class NoDraftState:
    """The per-generation state of a drafter that keeps none (``ar``, prompt lookup)."""


@dataclass
class DecodingState(Generic[S]):
    """Everything one generation owns: what a drafter may read, and the drafter's own per-generation state.

    One object per generation, so generations on one model (even from one generator) may interleave.

    Attributes:
        target: the target decoder.
        cache: the target's KV cache; ``cache.length`` = n committed slots.
        tokens: prompt + emitted token ids; ``tokens[-1]`` is the root (slot n, not cached).
        sampling: the logits processing in force.
        draft_forwards: draft network calls so far.
        first_draft_seconds: time of the rounds' first depth of drafting so far (its draft forward, which also
            runs the entries committed since the last round, and the choice of its children) [s].
        layer_tokens: tokens each target layer has processed in this generation (``[L]``), counted by
            :meth:`run_layers`; the decoder's own ``layer_token_counts`` is shared by every generation.
        drafter_state: the drafter's per-generation state, returned by :meth:`Drafter.begin`.
        controls: the per-position processing that reads the prefix (penalties, logit bias, grammar,
            ``min_tokens``) and the log-probabilities asked for, a
            :class:`~speculant.sampling.controls.SequenceControls`; ``None`` = none.
        draft_stop: set by a cost-aware policy for the round (else ``None``): ``draft_stop(depth, confidence)``
            is true when a drafter declaring ``draft_confidence`` should not add the nodes of ``depth`` whose best
            path confidence (product of draft probabilities, in [0, 1]) is ``confidence``; it then stops drafting.
            Its optional ``refuses(depth, bound)`` is asked before a depth's draft call with the best path
            confidence so far, and a true answer ends the tree without that call.
    """

    target: LlamaDecoder
    cache: KVCache
    tokens: list[int]
    sampling: SamplingConfig
    draft_forwards: int = 0
    first_draft_seconds: float = 0.0
    layer_tokens: list[int] = field(default_factory=list)
    drafter_state: S | None = None
    controls: object = None
    draft_stop: Callable[[int, float], bool] | None = None

    def __post_init__(self):
        if not self.layer_tokens:
            self.layer_tokens = [0] * self.target.num_layers

    @property
    def n(self) -> int:
        return self.cache.length

    def run_layers(self, hidden: torch.Tensor, start: int, end: int, positions: torch.Tensor,
                   mask: torch.Tensor | None, cache_position: int) -> torch.Tensor:
        """Target layers ``start .. end-1`` over ``hidden`` ``[1, T, D]`` with this generation's cache
        (:meth:`LlamaDecoder.run_layers`), counting ``T`` tokens for each layer in :attr:`layer_tokens`."""
        out = self.target.run_layers(hidden, start, end, positions, mask, self.cache, cache_position)
        self.count_layers(start, end, hidden.shape[1])
        return out

    def count_layers(self, start: int, end: int, tokens: int) -> None:
        """Count ``tokens`` for target layers ``start .. end-1`` in :attr:`layer_tokens` (a forward run elsewhere,
        e.g. a batched prefill)."""
        for i in range(start, end):
            self.layer_tokens[i] += tokens


@dataclass
class VerificationInput:
    """What the target runs to verify one tree: the block's hidden states entering layer ``start_layer``
    (a description: making it runs no layer and changes no cache).

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


class Drafter(Generic[S]):
    """Proposes a :class:`DraftTree`, one round at a time (the lifecycle in the module docstring).

    A drafter object holds configuration (and networks) only, so one object serves any number of generations at
    once; whatever changes during a generation lives in its typed state ``S`` (``state.drafter_state``), made by
    :meth:`begin`.  :attr:`capabilities` declares what the engine may rely on.
    """

    name = "none"
    capabilities: ClassVar[DrafterCapabilities] = DrafterCapabilities()
    cost_signature = ""
    """What the cost of a draft call depends on beyond the method's parameters (appended to the key its measured
    cost is kept under: a choice the tune made for this drafter, e.g. a draft head's LM-head rows)."""
    feature_layers: tuple[int, ...] = ()
    """Hidden-state boundaries (``k``: the residual stream entering target layer ``k``; ``L``: leaving the last)
    whose rows of the verified block :meth:`verification_hidden` also receives (``aux``), for a drafter declaring
    ``needs_features`` (an EAGLE-3 head reads three target layers); ``()``: the last layer's only."""

    def begin(self, state: DecodingState[S]) -> S:
        """The per-generation state of a new generation (``state.cache`` made, the prompt not yet run)."""
        return NoDraftState()

    def prefill(self, state: DecodingState[S]) -> torch.Tensor:
        """The prompt's forward of a drafter that declares ``own_prefill`` (see :func:`target_prefill`, which it
        must compute, bit for bit): KV of ``state.tokens`` into ``state.cache`` slots ``0 .. T-1``; returns fp32
        logits ``[1, V]`` of the last position."""
        return target_prefill(state)

    def draft(self, state: DecodingState[S], builder: TreeBuilder | None, generator: torch.Generator | None,
              max_nodes: int, max_depth: int) -> DraftTree:
        """A tree of at most ``max_nodes`` nodes and ``max_depth`` depths (both in tokens; 0: an empty tree, an
        ``ar`` round).  A drafter whose verification resumes from layers it runs itself runs them here."""
        return DraftTree()

    def free_draft(self, state: DecodingState[S], context, max_depth: int) -> list[int] | None:
        """The chain of point-mass drafts (at most ``max_depth`` tokens) a round of ``context`` would draft now, where
        knowing it costs nothing (no forward: a copy from the context), else ``None`` (default: a model's draft
        costs its forward).  A cost-aware policy checks such a chain against the tokens the round without drafts and
        the next ones emit (:meth:`speculant.engine.speculation.RoundSizer.shadow`): the matched prefix's length is
        distributed as a verification round's accepted length (a point mass ``x`` is accepted with probability
        ``p(x)``, the probability that the target emits ``x``, greedy or sampled), so its acceptance stays current
        without drafting rounds that do not pay."""
        return None

    def round_context(self, state: DecodingState[S]):
        """A hashable summary of what the next round's draft will rest on, read before the round is sized: a
        cost-aware policy keeps the acceptance per depth of each context apart (prompt lookup: the size of the
        n-gram that matched).  Default ``None``: one context."""
        return None

    def context_name(self, context) -> str | None:
        """The name under which a round of ``context`` is counted in the generation's stats
        (:attr:`~speculant.engine.stats.GenerationStats.rounds_by_context`, ``--json``); default ``None``: rounds are
        not counted by context (a drafter with one context)."""
        return None

    def cache_share(self, target_config) -> float:
        """What one draft call reads of the KV cache per cached token, as a share of what the target's one-row
        forward reads (key/value elements over the target's, layers times KV heads times head size): the cost
        table's draft figures grow with the context by this share of the target step's growth
        (:meth:`~speculant.engine.goodput.CostTable.at`).  Default 0: no attention over the context (a copy)."""
        return 0.0

    def round_costs(self, state: DecodingState[S], context, costs):
        """The :class:`~speculant.engine.goodput.CostTable` that sizes rounds of ``context``: by default the
        drafter's own ``costs`` (a drafter drafting two ways, e.g. prompt lookup before a head, gives each its own
        cost per draft call)."""
        return costs

    def round_extra_seconds(self, state: DecodingState[S], context) -> float:
        """Seconds a drafting round of ``context`` in this state pays beyond its cost table's figures [s] (an EAGLE
        head's catch-up after ``ar`` rounds); a cost-aware policy counts them in what its rounds lost, which bounds its probes
        (:class:`~speculant.engine.goodput.SequenceSpeculation`), not in the depth it chooses.  Default 0."""
        return 0.0

    def one_off_work(self, state: DecodingState[S]) -> bool:
        """Whether the next round, if it drafts, also does work done once a generation (a draft head's catch-up over
        the prompt): a timing of rounds leaves such a round out (:class:`~speculant.engine.speculation.RoundTiming`).
        Default ``False``."""
        return False

    def verification_input(self, state: DecodingState[S], tree: DraftTree) -> VerificationInput:
        """The block to verify ``tree``: by default the embedded ``[root] + tree`` tokens from layer 0.
        A description only: no layer runs, no cache changes."""
        n = state.n
        ids = tree.block_tokens(state.tokens[-1])[None]
        return VerificationInput(state.target.embed(ids), 0, tree.block_positions(n),
                                 None if tree.is_chain else tree.attention_mask(n), n)

    def verification_hidden(self, state: DecodingState[S], tree: DraftTree, hidden: torch.Tensor,
                            aux: list[torch.Tensor] | None = None) -> None:
        """Receives the verified block's hidden states ``[T, D]`` leaving the target's last layer (before the
        final norm), called only where the class declares ``needs_features`` (a draft head reads the target's
        features); where :attr:`feature_layers` is not empty, ``aux`` holds the block's ``[T, D]`` rows at each of
        those boundaries, in order (else ``None``).  Default: nothing."""

    def verify_logits(self, state: DecodingState[S], tree: DraftTree) -> torch.Tensor:
        """Target logits ``[N + 1, V]`` (fp32) after each block entry; writes the block's KV at slots ``n ..``.
        The one-sequence composition of :meth:`verification_input`, the forward and :meth:`verification_hidden`;
        a drafter declaring ``batchable_verification=False`` overrides it."""
        target, block = state.target, self.verification_input(state, tree)

        def run(hidden, start, end):
            return state.run_layers(hidden, start, end, block.positions, block.mask, block.cache_position)

        h, aux = run_with_features(run, block.hidden, block.start_layer, target.num_layers, self.feature_layers)
        if self.capabilities.needs_features:
            self.verification_hidden(state, tree, h[0], *([[a[0] for a in aux]] if self.feature_layers else []))
        return target.lm_head(target.final_norm(h))[0]

    def commit(self, state: DecodingState[S], path: list[int]) -> None:
        """Called after acceptance with the accepted node indices (before ``state.tokens`` grows)."""


def run_with_features(run: Callable, hidden, start: int, end: int, boundaries) -> tuple[object, list]:
    """Target layers ``start .. end-1`` as ``run(hidden, start, stop)`` calls that stop at each hidden-state boundary
    of ``boundaries`` (``k``: entering layer ``k``), so the boundaries' hidden states are kept; each row gets the bits
    of the one call (every layer reads the previous one's output, whatever call it ran in).

    Returns:
        ``(hidden leaving layer end-1, [hidden at each boundary, in the order given])``; ``hidden`` is whatever
        ``run`` takes (a tensor, or a list of one per block).
    Raises:
        SpeculantError: a boundary outside ``start .. end``.
    """
    taken = {}
    for b in sorted(set(boundaries)):
        if not start <= b <= end:
            raise SpeculantError(f"hidden-state boundary {b} is outside the layers run; allowed: {start}..{end}")
        if b > start:
            hidden, start = run(hidden, start, b), b
        taken[b] = hidden
    if start < end:
        hidden = run(hidden, start, end)
    return hidden, [taken[b] for b in boundaries]


def target_prefill(state: DecodingState) -> torch.Tensor:
    """The target's forward over the prompt ``state.tokens`` (KV into ``state.cache`` slots ``0 .. T-1``).
    Returns fp32 logits ``[1, V]`` of the last position (the LM head runs on it only)."""
    target = state.target
    ids = torch.tensor([state.tokens], dtype=torch.long)
    h = state.run_layers(target.embed(ids), 0, target.num_layers, torch.arange(len(state.tokens)), None, 0)
    return last_position_logits(target, h)


def last_position_logits(decoder: LlamaDecoder, hidden: torch.Tensor) -> torch.Tensor:
    """LM-head logits ``[1, V]`` (fp32) of the last position of ``hidden`` ``[1, T, D]`` only (a prefill
    needs no more: ``[T, V]`` logits of a long prompt would cost ``T * V * 4`` bytes)."""
    return decoder.lm_head(decoder.final_norm(hidden[0, -1:]))


def full_vocab_logits(logits: torch.Tensor, vocab_ids: torch.Tensor | None, vocab_size: int) -> torch.Tensor:
    """Logits ``[..., V']`` over a reduced draft vocabulary ``vocab_ids`` -> ``[..., V]`` with ``-inf`` outside
    it (identity when ``vocab_ids`` is ``None``)."""
    if vocab_ids is None:
        return logits
    full = logits.new_full((*logits.shape[:-1], vocab_size), float("-inf"))
    full[..., vocab_ids] = logits
    return full


def draft_distribution(logits: torch.Tensor, sampling: SamplingConfig, controls=None,
                       paths: list[tuple[int, ...]] | None = None) -> torch.Tensor:
    """Draft probabilities ``[F, V]``: processed like the target's, or the plain softmax under greedy decoding.

    With ``controls`` (a :class:`~speculant.sampling.controls.SequenceControls` that is active), row f is
    first processed for its own prefix, the committed tokens + ``paths[f]`` (the drafted tokens on the
    frontier node's path), exactly as the target's row at that node will be: a token the grammar or
    ``min_tokens`` forbids there gets probability 0, so no draft proposes it.
    """
    if controls is None or not controls.active:
        return torch.softmax(logits.float(), -1) if sampling.greedy else logits_to_probs(logits, sampling)
    logits = controls.process(logits, paths)
    q = torch.softmax(logits, -1) if sampling.greedy else logits_to_probs(logits, sampling)
    return torch.nan_to_num(q, nan=0.0)       # a row whose every draft token is forbidden proposes nothing


def allowed_children(q: torch.Tensor, kids: list[list[int]]) -> list[list[int]]:
    """``kids`` without the tokens of draft probability 0 in their parent's row of ``q`` ``[F, V]`` (a tree
    builder may pick them when fewer tokens than its branching are allowed); such a child could never be
    accepted (``q(x) = 0``), so dropping it leaves the acceptance rule's output unchanged."""
    return [[t for t in toks if float(q[f, t]) > 0.0] for f, toks in enumerate(kids)]


def top_tokens(logits: torch.Tensor) -> tuple[list[int], list[float]]:
    """Each row's top index and its softmax probability, ``(top [F], probs [F])``, of float32 logits ``[F, V]``:
    the first largest logit (:func:`~speculant.sampling.argmax.rows_argmax`) and ``1 / sum_j exp(l_j - l_top)``,
    in numpy on the calling thread (no ``[F, V]`` softmax, no wake-up of torch's thread pool).  The probability
    is the softmax's largest entry within float32 rounding (summed in another order); a row with a NaN has
    probability NaN."""
    a = logits.detach().float().numpy()
    top = a.argmax(-1)
    best = a[np.arange(a.shape[0]), top]
    with np.errstate(invalid="ignore", over="ignore"):
        probs = 1.0 / np.exp(a - best[:, None]).sum(-1, dtype=np.float64)
    return top.tolist(), probs.tolist()


def frontier_paths(tree: DraftTree, frontier: list[int]) -> list[tuple[int, ...]]:
    """The drafted tokens from the root down to each frontier node (``-1`` = the root: ``()``)."""
    return [tuple(tree.tokens[i] for i in tree.path_to(node)) if node >= 0 else () for node in frontier]


def depth_confidence(confidence: dict[int, float], frontier: list[int], q: torch.Tensor, kids) -> float:
    """The value of drafting the next depth: the best frontier path confidence (``confidence[node]``, the product of
    its tokens' draft probabilities) times the top draft probability in that node's row of ``q`` ``[F, V]``.  A
    function of the tree so far and of ``q`` only, never of the tokens just sampled (``kids``, unused): refusing a
    depth for the probability of what was sampled there would bias the draft law and break sampling exactness
    (``tests/test_cost_policy.py`` has that broken variant).  Under greedy decoding the top token is the child."""
    top = q.amax(-1).tolist()
    return max((confidence[node] * p for node, p in zip(frontier, top)), default=0.0)


@dataclass
class ModelDraftState:
    """Per-generation state of a :class:`ModelDrafterBase`.

    Attributes:
        processed: block entries (root first, breadth-first) the draft network has run on in the current tree.
    """

    processed: int = 0


MS = TypeVar("MS", bound=ModelDraftState)


class ModelDrafterBase(Drafter[MS]):
    """Drafting with a network, one batched forward per depth over the whole frontier.

    Subclasses implement :meth:`frontier_logits` (and :meth:`begin`, returning their state).
    ``state.drafter_state.processed`` counts the block entries the draft network has run on; the deepest
    frontier is never run (its children are not needed).
    """

    capabilities = DrafterCapabilities(draft_confidence=True)

    def begin(self, state: DecodingState[MS]) -> MS:
        return ModelDraftState()

    def frontier_logits(self, state: DecodingState[MS], tree: DraftTree, first_entry: int, depth: int) -> torch.Tensor:
        """Draft logits ``[F, V]`` for block entries ``first_entry .. N`` (the frontier, all of depth ``depth``)."""
        raise NotImplementedError

    def frontier_draft_logits(self, state: DecodingState[MS], tree: DraftTree, first_entry: int,
                              depth: int) -> tuple[torch.Tensor, torch.Tensor | None]:
        """What :meth:`draft` reads: ``(logits [F, V'], vocab_ids [V'])`` over a reduced draft vocabulary (token ids,
        ``-inf`` elsewhere), or ``(logits [F, V], None)``; by default :meth:`frontier_logits` over the full one.  A
        drafter with a reduced head overrides it, so that drafting samples over ``V'`` tokens only."""
        return self.frontier_logits(state, tree, first_entry, depth), None

    def draft(self, state, builder, generator, max_nodes, max_depth):
        """Depth by depth: one :meth:`frontier_draft_logits` call per depth, the builder picks the children (over the
        draft's own vocabulary: a reduced one is mapped to token ids after).  With a ``state.draft_stop`` rule (a
        cost-aware policy), a depth whose best path confidence (the product of the draft probabilities of the path's
        tokens and of the top token at this depth, EAGLE-2's value of a node) the rule refuses ends the tree before it."""
        tree = DraftTree()
        ds = state.drafter_state
        ds.processed = 0
        if builder is None or max_nodes < 1 or max_depth < 1:
            return tree
        builder.reset()
        frontier, confidence = [-1], {-1: 1.0}
        controlled = state.controls is not None and state.controls.active
        t0 = time.perf_counter()
        vocab = state.target.config.vocab_size
        stop = state.draft_stop
        top_only = state.sampling.greedy and not controlled     # children from each row's top token, if the builder can
        for depth in range(1, max_depth + 1):
            if (depth > 1 and stop is not None and getattr(stop, "refuses", None) is not None
                    and stop.refuses(depth, max(confidence[node] for node in frontier))):
                break                                           # the call could not pay, whatever it drafts
            logits, ids = self.frontier_draft_logits(state, tree, frontier[0] + 1, depth - 1)
            state.draft_forwards += 1
            ds.processed = len(tree) + 1
            kids = None
            if top_only:                # greedy: a chain's child is the row's top token, no [F, V] softmax needed
                top, top_probs = top_tokens(logits)
                kids = builder.expand_top(depth, top, top_probs)
            if kids is None:
                top_only = False
                if controlled and ids is not None:             # the controls process full-vocabulary rows
                    logits, ids = full_vocab_logits(logits, ids, vocab), None
                q = draft_distribution(logits, state.sampling, state.controls,
                                       frontier_paths(tree, frontier) if controlled else None)
                if not state.sampling.greedy:
                    for node, row in zip(frontier, q):
                        tree.set_draft_probs(node, row, ids, vocab)
                kids = builder.expand(depth, q, state.sampling.greedy, generator)
                if controlled:
                    kids = allowed_children(q, kids)
            if depth == 1:                                      # the cost policy's first-call figure (calibration)
                state.first_draft_seconds += time.perf_counter() - t0
            if stop is not None:
                value = (max((confidence[node] * p for node, p in zip(frontier, top_probs)), default=0.0) if top_only
                         else depth_confidence(confidence, frontier, q, kids))
                if stop(depth, value):
                    break
            rows = [f for f, toks in enumerate(kids) for _ in toks]
            parents = [frontier[f] for f in rows]
            room = max_nodes - len(tree)
            tokens = [t for toks in self._vocabulary_tokens(kids, ids) for t in toks][:room]
            new = [tree.add(p, t) for p, t in zip(parents, tokens)]     # per node: cheaper than batched writes here
            if stop is not None and new:                        # a path's confidence: its parent's times q(child)
                if top_only:                                    # the child is its row's top token
                    probs = [top_probs[f] for f in rows[:room]]
                else:
                    probs = q[rows[:room], [t for toks in kids for t in toks][:room]].tolist()
                confidence.update(zip(new, (confidence[p] * c for p, c in zip(parents, probs))))
            if not new or len(parents) > room:
                break
            frontier = new
        return tree

    def _vocabulary_tokens(self, kids: list[list[int]], ids: torch.Tensor | None) -> list[list[int]]:
        """Children given as columns of a reduced draft vocabulary -> token ids ``ids[column]`` (identity when
        ``ids`` is ``None``), through a list copy of ``ids`` kept from the last call (the same tensor every round):
        no tensor indexing per depth."""
        if ids is None:
            return kids
        kept = getattr(self, "_vocab_list", None)
        if kept is None or kept[0] is not ids:
            kept = self._vocab_list = (ids, ids.tolist())
        table = kept[1]
        return [[table[t] for t in toks] for toks in kids]
