"""Cost-aware speculation for one sequence: each round drafts the depth (zero included) that maximizes its expected
tokens per second (``--speculation cost``, the default; ``always`` drafts every round as deep as the method says).

The decision is :meth:`speculant.engine.goodput.GoodputPolicy.draft_depth` at ``batch = 1`` (the server's goodput
policy calls the same function with its batch size), through
:class:`~speculant.engine.goodput.SequenceSpeculation`, from:

* ``cost(T)``: seconds of the target's forward over ``T`` new tokens, measured once per machine and model by the
  tuner (:func:`speculant.runtime.tune.measure_forward_rows`, ``T`` from 1 to 16 on the fused step; other formats: the
  tuner's pass over all projections at 1, 2, 4, 5, 8 and 16 rows), linear in between;
* ``c``: seconds of one draft call (one depth of drafting) of this drafter, measured once per machine, model and
  drafter by :func:`draft_seconds` (a short greedy generation that drafts every round, the draft calls timed as they
  run between verifications) and kept with the tune, the round's first call apart (``c_1``: a model drafter's first
  call also runs the entries committed since its last round, and it is the only call of a depth-1 round); for sampled generations a second figure, measured the same way
  at temperature 1, also holds the acceptance's time per draft call (recursive rejection sampling's residual
  distributions over the vocabulary, which a greedy round does not compute), so that sampling does not draft where
  its extra work makes a round cost more than it gives;
* ``alpha_d``: the sequence's running acceptance per depth (:class:`~speculant.engine.goodput.DepthAcceptance`,
  counts only);
* where the drafter declares ``draft_confidence``: the draft probability of the top token at each depth, times that
  of the path above it, which stops drafting once another depth is expected to lower the round's tokens per second
  (:meth:`~speculant.engine.goodput.SequenceSpeculation.stop_rule`; EAGLE-2's dynamic depth, llama.cpp's
  ``--draft-p-min``).

A round with zero drafts is an ``ar`` round: the target's token from one row, so greedy outputs are token-identical
and sampled outputs keep the target's law (a zero-draft round samples from the target itself).  Every input is
fixed before the generation or a count of its own tokens, so a seeded output does not depend on timing noise.
A model without a tune (built in memory, or loaded in a dtype other than float32) has no measured costs: its
generator drafts as ``always`` does unless given a :class:`~speculant.engine.goodput.CostTable`.
"""

from __future__ import annotations

import time

import torch

from ..errors import SpeculantError
from ..trees.builders import ChainBuilder, ConstantBranchingBuilder, StochasticBeamBuilder, TreeBuilder
from .goodput import CostTable

SPECULATION = ("cost", "always")
"""``--speculation`` choices."""
CALIBRATION_TOKENS = 32
"""New tokens of each timed calibration generation of :func:`draft_seconds` [tokens] (the warm-up makes a quarter)."""
CALIBRATION_SECONDS = 1.0
"""Timed calibration generations stop repeating once they took this long in all [s] (a slow weight format, e.g.
eager float32, is timed once rather than ``repeats`` times: each generation already averages over its draft calls)."""


def check_speculation(value: str) -> str:
    """``value`` if it is one of :data:`SPECULATION`; raises :class:`SpeculantError` naming it otherwise."""
    if value not in SPECULATION:
        raise SpeculantError(f"speculation={value!r} is unknown; allowed: {', '.join(SPECULATION)}")
    return value


def nodes_at_depth(builder: TreeBuilder | None):
    """``f(d)``: nodes of the builder's full tree cut at depth ``d`` [tokens] (``f(0) = 0``): ``d`` for a chain,
    the cumulative products of the branching for RSD-C/SpecInfer, ``W * d`` for RSD-S (``W`` beams per depth)."""
    if builder is None:
        return lambda d: 0
    if isinstance(builder, ChainBuilder):
        return lambda d: d
    if isinstance(builder, ConstantBranchingBuilder):
        sizes, width, total = [0], 1, 0
        for b in builder.branching:
            width *= b
            total += width
            sizes.append(total)
        return lambda d: sizes[min(d, len(sizes) - 1)]
    if isinstance(builder, StochasticBeamBuilder):
        return lambda d: builder.beam_width * d
    per = builder.budget() / max(builder.max_depth, 1)
    return lambda d: round(per * d)


def forward_seconds(model) -> dict[int, float] | None:
    """``{T: seconds}`` of the target's forward over ``T`` new tokens from ``model.tune``: its ``forward_ms`` (the
    whole forward, fused step), else the tuner's projection pass in ``model.weights``; ``None`` without a tune."""
    tune = getattr(model, "tune", None)
    if tune is None:
        return None
    if tune.forward_ms:
        return monotone({int(t): ms / 1e3 for t, ms in tune.forward_ms.items()})
    try:
        row = tune.row(model.weights, tune.fp32_route if model.weights == "fp32" else None)
    except KeyError:
        return None
    return monotone({int(t): ms / 1e3 for t, ms in row["ms"].items()})


def monotone(table: dict[int, float]) -> dict[int, float]:
    """``table`` with each cost replaced by the least cost measured at as many rows or more: a forward over fewer
    rows never needs more time than one over more (it could run padded), so a larger figure is another process's
    interference on a shared machine (timing is a minimum over repeats for the same reason)."""
    out, best = {}, float("inf")
    for rows in sorted(table, reverse=True):
        best = min(best, table[rows])
        out[rows] = best
    return dict(sorted(out.items()))


SAMPLED = " sampled"
"""Suffix of a drafter signature in ``draft_ms`` for the figure measured at temperature 1 (:func:`draft_seconds`)."""
FIRST = " first"
"""Suffix (after :data:`SAMPLED`, if any) of the key of a round's first draft call in ``draft_ms``."""


def draft_seconds(model, drafter, builder: TreeBuilder, signature: str, sampled: bool = False) -> tuple[float, float]:
    """Seconds of a round's first draft call and of each further one of ``drafter`` on ``model`` [s]:
    ``model.tune.draft_ms[signature + FIRST]`` and ``[signature]`` (``sampled``: ``signature + SAMPLED``, acceptance
    included) if measured, else :func:`measure_draft_seconds`, then kept there (and saved with the tune)."""
    tune = model.tune
    key = signature + (SAMPLED if sampled else "")
    if key not in tune.draft_ms or key + FIRST not in tune.draft_ms:
        first, further = measure_draft_seconds(model, drafter, builder, sampled=sampled)
        tune.draft_ms[key], tune.draft_ms[key + FIRST] = round(further * 1e3, 6), round(first * 1e3, 6)
        from ..runtime import tune as tune_module
        tune_module.save(tune)
    return tune.draft_ms[key + FIRST] / 1e3, tune.draft_ms[key] / 1e3


def measure_draft_seconds(model, drafter, builder: TreeBuilder, tokens: int = CALIBRATION_TOKENS,
                          repeats: int = 3, budget: float = CALIBRATION_SECONDS,
                          sampled: bool = False) -> tuple[float, float]:
    """Time ``drafter``'s draft calls as they run in decoding, between the target's verifications: generations of
    ``tokens`` tokens that draft every round (``--speculation always``) from a prompt of a 24-token random pattern
    said twice (so that prompt lookup finds continuations; EOS ignored), greedy, or with ``sampled`` at temperature
    1 (seed 7), a warm-up of ``tokens // 4`` tokens and then up to ``repeats``, fewer once the timed ones took
    ``budget`` seconds (at least one).  Returns ``(first, further)``: seconds in ``draft`` per round's first draft
    forward and per further one (both per drafted depth for a drafter without forwards, prompt lookup), with
    ``sampled`` each plus the rounds' acceptance time beyond an ``ar`` round's one draw (the residual
    distributions) per draft call; each the least of the repeats (the figure least disturbed by other work) [s];
    ``(0, 0)`` if nothing drafted.  ~1 s for SmolLM2-135M on 2 cores in ``w4a8``."""
    from ..sampling import SamplingConfig
    from .generator import GenerationConfig, SpeculativeGenerator
    from .stats import GenerationStats
    vocab = model.config.vocab_size
    pattern = torch.randint(vocab, (24,), generator=torch.Generator().manual_seed(7)).tolist()
    gen = SpeculativeGenerator(model, drafter, builder)
    sampling = SamplingConfig(temperature=1.0, seed=7) if sampled else SamplingConfig()
    draw = draw_seconds(vocab, sampling) if sampled else 0.0       # an ar round's acceptance: one draw
    best, best_first, spent = float("inf"), float("inf"), 0.0
    for rep in range(repeats + 1):
        stats = GenerationStats()
        config = GenerationConfig(max_new_tokens=tokens if rep else max(1, tokens // 4), ignore_eos=True,
                                  sampling=sampling)
        t0 = time.perf_counter()
        for _ in gen.generate_blocks(pattern * 2, config, stats):
            pass
        calls = stats.draft_forwards or sum(stats.drafted_at_depth)
        if rep and calls:                                            # the first is a warm-up
            extra = max(stats.accept_seconds - stats.rounds * draw, 0.0) / calls if sampled else 0.0
            firsts = (stats.drafted_at_depth or [0])[0] if stats.draft_forwards and stats.first_draft_seconds else 0
            if firsts and calls > firsts:
                best_first = min(best_first, stats.first_draft_seconds / firsts + extra)
                best = min(best, (stats.draft_seconds - stats.first_draft_seconds) / (calls - firsts) + extra)
            else:
                best = best_first = min(best, stats.draft_seconds / calls + extra)
        spent += (time.perf_counter() - t0) if rep else 0.0
        if spent >= budget:
            break
    return (best_first, best) if best < float("inf") else (0.0, 0.0)


def draw_seconds(vocab: int, sampling, repeats: int = 5) -> float:
    """Seconds of an ``ar`` round's acceptance: one draw from fp32 logits ``[vocab]`` under ``sampling``, the least
    of ``repeats`` [s]."""
    from .rounds import pick_token
    logits, generator = torch.randn(vocab), sampling.generator()
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        pick_token(logits, sampling, generator)
        best = min(best, time.perf_counter() - t0)
    return best


def cost_table(model, drafter, builder: TreeBuilder | None, signature: str, sampled: bool = False) -> CostTable | None:
    """The :class:`CostTable` of ``drafter`` on ``model`` (:func:`forward_seconds`, :func:`draft_seconds`; ``sampled``:
    the figure for generations at a temperature), or ``None`` where the model has no tune (or nothing drafts)."""
    if builder is None or drafter is None:
        return None
    forward = forward_seconds(model)
    if forward is None:
        return None
    first, further = draft_seconds(model, drafter, builder, signature, sampled)
    return CostTable(forward, further, first)


class RoundSizer:
    """One generation's round sizing: a :class:`~speculant.engine.goodput.SequenceSpeculation` from ``costs`` and
    the builder's tree shape per round context (the drafter's :meth:`~speculant.drafters.base.Drafter.round_context`,
    e.g. the size of the n-gram prompt lookup matched: each context keeps its own acceptance per depth and probes;
    the loss budget is the generation's, shared; one context for a drafter without one).  A context met after others
    starts from the generation's acceptance at depth 1 so far, pooled over its contexts (the running mean of a
    :class:`~speculant.engine.goodput.DepthAcceptance`), not from certainty (prompt lookup meets new n-gram sizes
    all along, and at temperature 1 drafted by choice in each at an acceptance that does not pay: BENCHMARKS.md
    BA.2).  Counts of the generation's own tokens only: deterministic given them.  :meth:`depth` before a round's drafting (and, for a
    drafter with draft confidence, ``state.draft_stop`` set), :meth:`observe` after its acceptance."""

    def __init__(self, costs: CostTable, builder: TreeBuilder, confidence: bool, costs_of=None, extra_of=None):
        self.costs_of = costs_of or (lambda context: costs)     # a context's own table (Drafter.round_costs)
        self.extra_of = extra_of                                # the round's extra seconds (round_extra_seconds)
        self.extra = 0.0
        self.contexts: dict = {}
        self.nodes = nodes_at_depth(builder)
        self.confidence = confidence
        from .goodput import DepthAcceptance
        self.pooled = DepthAcceptance()             # depth 1 over all contexts: a new context's prior
        self.speculation = self._of(None)

    def _of(self, context):
        from .goodput import Ledger, SequenceSpeculation
        if context not in self.contexts:
            if not self.contexts:
                self.ledger = Ledger()
            self.contexts[context] = SequenceSpeculation(self.costs_of(context), ledger=self.ledger,
                                                         prior=self.pooled.alpha(1))
        return self.contexts[context]

    def depth(self, state, max_depth: int, context=None) -> int:
        """The round's depth bound in ``0 .. max_depth`` (0: an ``ar`` round) in round context ``context``; sets
        ``state.draft_stop``."""
        self.speculation = self._of(context)
        self.extra = self.extra_of(context) if self.extra_of is not None else 0.0
        d = self.speculation.depth(max_depth, self.nodes) if max_depth > 0 else 0
        state.draft_stop = self.speculation.stop_rule(self.nodes) if d and self.confidence else None
        return d

    def observe(self, drafted_depth: int, accepted: int, nodes: int, calls: int) -> None:
        """The round (sized by the last :meth:`depth`) had ``drafted_depth`` depths and ``nodes`` nodes, drafted in
        ``calls`` draft calls, and ``accepted`` tokens of it were accepted."""
        self.speculation.observe(drafted_depth, accepted, nodes, calls, self.extra if calls else 0.0)
        if drafted_depth:
            self.pooled.observe(1, accepted)


def timed(fn, *args):
    """``(fn(*args), seconds it took)``."""
    t0 = time.perf_counter()
    out = fn(*args)
    return out, time.perf_counter() - t0
