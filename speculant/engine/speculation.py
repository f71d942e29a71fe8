"""Cost-aware speculation for one sequence: each round drafts the depth (zero included) that maximizes its expected
tokens per second (``--speculation cost``, the default; ``always`` drafts every round as deep as the method says).

The decision is :meth:`speculant.engine.goodput.GoodputPolicy.draft_depth` at ``batch = 1`` (the server's goodput
policy calls the same function with its batch size), through
:class:`~speculant.engine.goodput.SequenceSpeculation`, from:

* ``cost(T)``: seconds of the target's forward over ``T`` new tokens, measured once per machine and model by the
  tuner (:func:`speculant.runtime.tune.measure_forward_rows`, ``T`` from 1 to 16 on the fused step after 256 and
  1024 cached tokens, ratios to ``T = 1`` paired within each sweep; other formats: the tuner's pass over all
  projections at 1, 2, 4, 5, 8 and 16 rows), linear in between, and at the sequence's context
  (:func:`forward_growth`, :meth:`~speculant.engine.goodput.CostTable.at`: linear in the cached tokens beyond 256);
* ``c``: what one draft call (one depth of drafting) adds to a round, measured once per machine, model and drafter
  by :func:`measure_draft_seconds` and kept with the tune: rounds drafting no depth, one depth and every depth
  timed in one run, each against the forward table, so that a depth-``d`` round costs what such rounds took beside
  this drafter's ``ar`` rounds (the round's first call apart, ``c_1``, which also holds what a drafting round pays
  beyond its forward: the tree's bookkeeping, the acceptance of more rows and, for sampled generations, measured
  again at temperature 1, recursive rejection sampling's residual distributions);
* ``alpha_d``: the sequence's running acceptance per depth (:class:`~speculant.engine.goodput.DepthAcceptance`,
  counts only), started from the drafter's acceptance measured once on fixed prompts (:func:`acceptance_prior`,
  greedy or at temperature 1) and, for greedy generations, from the generator's earlier greedy generations
  (:data:`HISTORY_WEIGHT`; a sampled one starts from a copy of the sampled prior, so that a seeded output does not
  depend on what ran before); a depth-1 round that is not expected to pay is still drafted where one accepted draft would make drafting
  pay over the tokens left (:meth:`~speculant.engine.goodput.SequenceSpeculation.explores`);
* where the drafter declares ``draft_confidence``: the draft probability of the top token at each depth, times that
  of the path above it, which stops drafting once another depth is expected to lower the round's tokens per second
  (:meth:`~speculant.engine.goodput.SequenceSpeculation.stop_rule`; EAGLE-2's dynamic depth, llama.cpp's
  ``--draft-p-min``).

A round with zero drafts is an ``ar`` round: the target's token from one row, so greedy outputs are token-identical
and sampled outputs keep the target's law (a zero-draft round samples from the target itself).  A sampled
generation's every input is fixed before it or a count of its own tokens, so a seeded output does not depend on
timing noise; with ``round_timing``, a greedy generation's (whose output no round size changes) also takes what its
generator's rounds took beside its ``ar`` rounds (:class:`RoundTiming`, off by default: the one-off calibration of
``c`` moved by a tenth of a step from one minute to the next on a shared VM, but correcting it did not pay end to
end, BENCHMARKS.md BM).
A model without a tune (built in memory, or loaded in a dtype other than float32) has no measured costs: its
generator drafts as ``always`` does unless given a :class:`~speculant.engine.goodput.CostTable`.
"""

from __future__ import annotations

import math
import statistics
import sys
import time
from collections import deque

import torch

from ..errors import SpeculantError
from ..trees.builders import (ChainBuilder, ConstantBranchingBuilder, IIDTreeBuilder, StochasticBeamBuilder,
                              TreeBuilder)
from .goodput import CostTable, DepthAcceptance, GoodputPolicy, Ledger, SequenceSpeculation

SPECULATION = ("cost", "always")
"""``--speculation`` choices."""
CALIBRATION_TOKENS = 128
"""New tokens of each timed calibration generation of :func:`measure_draft_seconds` [tokens] (the warm-up makes a
quarter)."""
CALIBRATION_CONTEXT = 192
"""Random tokens before the calibration prompt's pattern [tokens]: the rounds run over a context of about the size
the target's forward table is measured at (:data:`speculant.runtime.tune.FORWARD_CONTEXT`), as a generation's
would."""
SAMPLED_TEMPERATURES = (1.0, 0.25)
"""Temperatures of the sampled calibration of :func:`measure_draft_seconds`, tried in turn until rounds draft: a
round's sampled acceptance costs the same at any temperature, and at 1 a drafter that copies (prompt lookup) finds
nothing to copy once the sampled text leaves the prompt's pattern."""
CALIBRATION_SECONDS = 2.0
"""What the timed calibration generations of one figure take at most, warm-up included [s]
(:func:`calibration_turns`)."""


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


def forward_growth(model, forward: dict[int, float]) -> tuple[int, dict[int, float]] | None:
    """``(c, {T: seconds per cached token})``: what each cached token beyond ``c`` (the context ``forward`` was
    measured after) adds to the forward over ``T`` new tokens, from the tune's table at a longer context
    (``forward_context_ms``, timed in the same sweeps): the slope between the two tables, at least 0 and never
    less at more rows than at fewer (attention over the cache does no less work for more rows, so a slope below a
    smaller ``T``'s is noise; lifting it sizes rounds as if extra rows cost more, the side on which drafting does not
    lose); ``None`` without that table."""
    from ..runtime.tune import forward_contexts
    tune = getattr(model, "tune", None)
    if tune is None or not tune.forward_ms or not tune.forward_context_ms:
        return None
    short = forward_contexts(model.config.context_length)[0]
    context = max(tune.forward_context_ms, key=int)
    extra = int(context) - short
    if extra <= 0:
        return None
    longer = {int(t): ms / 1e3 for t, ms in tune.forward_context_ms[context].items()}
    growth, most = {}, 0.0
    for t in sorted(forward):
        if t in longer:
            most = max(most, (longer[t] - forward[t]) / extra)
            growth[t] = most
    return short, growth


def monotone(table: dict[int, float]) -> dict[int, float]:
    """``table`` with each cost replaced by the least cost measured at as many rows or more: a forward over fewer
    rows never needs more time than one over more (it could run padded), so a larger figure is another process's
    interference on a shared machine (timing is a minimum over repeats for the same reason)."""
    out, best = {}, float("inf")
    for rows in sorted(table, reverse=True):
        best = min(best, table[rows])
        out[rows] = best
    return dict(sorted(out.items()))


HISTORY_WEIGHT = 8
"""Observations a generation's starting estimate from earlier generations counts as (:class:`RoundSizer`)."""
HISTORY_SMOOTHING = 0.02
"""Weight of a new observation in the long-run acceptance kept across generations (:class:`RoundSizer`)."""
SAMPLED = " sampled"
"""Suffix of a drafter signature in ``draft_ms`` for the figure measured at temperature 1 (:func:`draft_seconds`)."""
FIRST = " first"
"""Suffix (after :data:`SAMPLED`, if any) of the key of a round's first draft call in ``draft_ms``."""


def draft_seconds(model, drafter, builder: TreeBuilder, signature: str, sampled: bool = False) -> tuple[float, float]:
    """What a round's first draft call adds to it (with all a drafting round pays beyond its forward) and what each
    further one adds, for ``drafter`` on ``model`` [s]: ``model.tune.draft_ms[signature + FIRST]`` and ``[signature]``
    (``sampled``: ``signature + SAMPLED``, measured at temperature) if measured, else :func:`measure_draft_seconds`,
    then kept there (and saved with the tune).  A measurement that timed nothing is not kept: the sampled figures
    are then the greedy ones, and greedy ones a target step per call (drafting never pays; a kept ``(0, 0)`` made
    every draft look free: RSD-C at T = 1 drafted in 42 % of its rounds and ran at 0.84-0.91 of ``ar``,
    BENCHMARKS.md BJ)."""
    tune = model.tune
    key = signature + (SAMPLED if sampled else "")
    if key not in tune.draft_ms or key + FIRST not in tune.draft_ms:
        print(f"speculant: timing the draft calls of {signature}{' (sampled)' if sampled else ''} on this machine "
              "(once; kept with the tune) ...", file=sys.stderr, flush=True)
        start = time.perf_counter()
        figures = measure_draft_seconds(model, drafter, builder, sampled=sampled)
        print(f"speculant: draft calls timed in {time.perf_counter() - start:.1f} s", file=sys.stderr, flush=True)
        if figures is None:         # nothing timed as asked (e.g. a loaded machine's budget ran out): not kept
            if sampled:
                return draft_seconds(model, drafter, builder, signature)
            step = (forward_seconds(model) or {1: 0.0})[1]
            return step, step       # a draft call at a target step's cost: drafting never pays until measured
        first, further = figures
        tune.draft_ms[key], tune.draft_ms[key + FIRST] = round(further * 1e3, 6), round(first * 1e3, 6)
        from ..runtime import tune as tune_module
        tune_module.save(tune)
    return tune.draft_ms[key + FIRST] / 1e3, tune.draft_ms[key] / 1e3


def measure_draft_seconds(model, drafter, builder: TreeBuilder, tokens: int = CALIBRATION_TOKENS,
                          repeats: int = 3, budget: float = CALIBRATION_SECONDS,
                          sampled: bool = False, forward: dict[int, float] | None = None,
                          context: int = CALIBRATION_CONTEXT) -> tuple[float, float] | None:
    """What a round's drafting costs in decoding, on the scale of the target's forward table ``forward``
    (default :func:`forward_seconds`): generations of ``tokens`` tokens (EOS ignored) from a prompt of ``context``
    random tokens and a 24-token random pattern said twice (so that prompt lookup finds continuations), greedy, or
    with ``sampled`` at temperature 1 (seed 7; :data:`SAMPLED_TEMPERATURES`), whose rounds draft in turn no depth
    (this drafter's ``ar`` round, time ``A``), one depth (``R_1``, ``n_1`` nodes) and as deep as ``builder``
    allows (``R_K``, ``n_K`` nodes in ``c_K`` draft calls) (:class:`CyclingDepth`).  Each ratio ``R / A`` is taken
    within one turn of three adjacent rounds (a shared VM's speed drifts between generations: figures from separate
    generations moved by a tenth of a step from one measurement to the next, BENCHMARKS.md BB), averaged over all
    turns of up to ``repeats`` generations after a warm-up, within ``budget`` seconds (:func:`calibration_turns`),
    the tenth of the turns on each side left out (the first catch-up over a prompt, another process's work; not a
    median: a sampled round's time has two modes, its draft accepted or not).  With ``u = forward(1)``:

    * ``first = R_1 / A * u - forward(1 + n_1)``: what a round's first draft call costs, with all a drafting round
      pays beyond its verification forward (the tree's bookkeeping, the acceptance of more rows, under sampling the
      residual distributions);
    * ``further = (R_K / A * u - forward(1 + n_K) - first) / (c_K - 1)``: each further call (``first`` where the
      builder drafts one depth).

    A depth-``d`` round of the cost model then costs what such rounds took beside this drafter's ``ar`` rounds (a
    draft call timed alone, against a kept table, predicted a depth-1 round at 1.19 ``ar`` rounds where it took
    1.39-1.50, BENCHMARKS.md BB).  Returns ``(first, further)`` [s], each at least 0; ``None`` if no turn drafted
    as asked or without a forward table.  ~2 s for SmolLM2-135M on 2 cores in ``w4a8``."""
    from ..sampling import SamplingConfig
    forward = forward or forward_seconds(model)
    if not forward:
        return None
    cost = GoodputPolicy(forward).cost
    vocab = model.config.vocab_size
    context = max(0, min(context, model.config.context_length - 48 - tokens - builder.budget() - 2))
    g = torch.Generator().manual_seed(7)
    pattern = torch.randint(vocab, (24,), generator=g).tolist()
    prompt = torch.randint(vocab, (context,), generator=g).tolist() + pattern * 2
    depths = (0, 1, builder.max_depth) if builder.max_depth > 1 else (0, 1)
    for temperature in (SAMPLED_TEMPERATURES if sampled else (0.0,)):
        turns = calibration_turns(model, drafter, builder, depths, prompt, tokens, repeats, budget,
                                  SamplingConfig(temperature=temperature, seed=7))
        if turns:
            break
    else:
        return None
    u = cost(1)

    def figure(k: int) -> tuple[float, float, float]:
        """(mean ratio of the turns' k-th round to their ar round, the tenth on each side left out; mean nodes;
        mean draft calls)."""
        ratios = sorted(t[k][0] / t[0][0] for t in turns)
        cut = len(ratios) // 10
        return (statistics.fmean(ratios[cut:len(ratios) - cut]), statistics.fmean(t[k][1] for t in turns),
                statistics.fmean(t[k][2] for t in turns))
    r1, n1, _ = figure(1)
    first = max(r1 * u - cost(1 + n1), 0.0)
    if len(depths) < 3:
        return first, first
    rk, nk, ck = figure(2)
    further = (rk * u - cost(1 + nk) - first) / (ck - 1) if ck > 1 else first
    return first, max(further, 0.0)


def calibration_turns(model, drafter, builder: TreeBuilder, depths: tuple[int, ...], prompt: list[int], tokens: int,
                      repeats: int, budget: float, sampling) -> list[list[tuple[float, int, int]]]:
    """The turns of :func:`measure_draft_seconds`: :func:`timed_rounds` of a warm-up generation of ``tokens // 4``
    tokens and then of up to ``repeats`` of ``tokens``, within ``budget`` seconds (the warm-up within a quarter of
    it, the timed generations within the rest from the warm-up's end, whatever it took; a generation stops at the round that ends past its
    deadline: a slow weight format, e.g. eager float32, is timed over fewer rounds), cut into turns of
    ``len(depths)`` rounds; only the turns whose every round drafted as asked (an ``ar`` round, then rounds that
    drafted)."""
    turns = []
    start = time.perf_counter()
    for rep in range(repeats + 1):                                    # the first is a warm-up
        if rep == 1:
            start = time.perf_counter()                               # the timed ones: the rest, from here
        deadline = start + (budget * 3 / 4 if rep else budget / 4)
        rounds = timed_rounds(model, drafter, builder, depths, prompt, tokens if rep else max(1, tokens // 4),
                              sampling, deadline)
        if rep:
            turns += [rounds[i:i + len(depths)] for i in range(0, len(rounds) - len(depths) + 1, len(depths))]
            if time.perf_counter() >= deadline:
                break
    return [t for t in turns if t[0][1] == 0 and all(r[1] > 0 for r in t[1:])]


PRIOR_TOKENS = 64
"""New tokens of each prompt's generation in :func:`measure_acceptance` [tokens]."""
PRIOR_PROMPTS = (
    "Write a short poem about the sea at night.",
    "Explain in three sentences why the sky is blue.",
    "Summarize: The library will close for two weeks in March while the roof is repaired. Books can be returned at "
    "the town hall, and the reading room will move to the school next door until the work is done.",
    "Translate to German: I would like a cup of coffee and a glass of water, please.",
    "Tom has 12 apples and gives a third of them to Anna. How many apples does he have left? Explain.",
    "Write a Python function that checks whether a string is a palindrome.",
)
"""The prompts :func:`measure_acceptance` generates from (chat template; writing, QA, summarization, translation,
math and code, none of them a benchmark's)."""


def acceptance_prior(model, drafter, builder: TreeBuilder, signature: str, sampled: bool = False,
                     verification: str = "token") -> dict | None:
    """``{round context: DepthAcceptance}``: ``drafter``'s acceptance per depth on ``model``, greedy or (``sampled``)
    at temperature 1 (sampled, with acceptance rule ``verification``), from
    ``model.tune.acceptance[signature + tree_shape(builder) (+ ",verification=..." unless "token") (+ SAMPLED)]`` if
    measured, else
    :func:`measure_acceptance`, then kept there (and saved with the tune); ``None`` for a model without a tune or a
    tokenizer.  What a generator's rounds start from before any of its own generations
    (:class:`RoundSizer`'s history): a draft head is accepted at ~0.4 on SmolLM2, and from the uninformed prior
    (certainty, then plain means) a run of early rejections took a sampled generation's estimate below the
    break-even for most of its answer (BENCHMARKS.md BK).  Counts of tokens on fixed prompts: the same on every
    machine running the same kernels, never a timing, so a seeded output does not depend on noise."""
    tune = getattr(model, "tune", None)
    if tune is None or getattr(model, "tokenizer", None) is None:
        return None
    key = (signature + tree_shape(builder) + ("" if verification == "token" else f",verification={verification}")
           + (SAMPLED if sampled else ""))
    if key not in tune.acceptance:
        print(f"speculant: measuring the acceptance of {signature}{' (sampled)' if sampled else ''} on "
              f"{len(PRIOR_PROMPTS)} fixed prompts (once; kept with the tune) ...", file=sys.stderr, flush=True)
        prior = measure_acceptance(model, drafter, builder, sampled, verification=verification)
        tune.acceptance[key] = [[_json_context(c), a.alphas, a.counts] for c, a in prior.items()]
        from ..runtime import tune as tune_module
        tune_module.save(tune)
    out = {}
    for context, alphas, counts in tune.acceptance[key]:
        acceptance = DepthAcceptance(HISTORY_SMOOTHING)
        acceptance.fast, acceptance.slow, acceptance.counts = list(alphas), list(alphas), list(counts)
        out[tuple(context) if isinstance(context, list) else context] = acceptance
    return out


def tree_shape(builder: TreeBuilder) -> str:
    """What of ``builder``'s shape the acceptance per depth depends on, as a key suffix: ``""`` for a chain (a depth's
    acceptance given its path does not depend on the chain's length), the branching of an RSD-C/SpecInfer tree
    (``",b=2x1"``, and ``",iid"`` for SpecInfer's), the beam width of RSD-S (``",W=2"``)."""
    if isinstance(builder, ConstantBranchingBuilder):
        return ",b=" + "x".join(map(str, builder.branching)) + (",iid" if isinstance(builder, IIDTreeBuilder) else "")
    if isinstance(builder, StochasticBeamBuilder):
        return f",W={builder.beam_width}"
    return ""


def _json_context(context):
    """A round context as JSON keeps it (tuples as lists; :func:`acceptance_prior` turns them back)."""
    return list(context) if isinstance(context, tuple) else context


def measure_acceptance(model, drafter, builder: TreeBuilder, sampled: bool = False,
                       tokens: int = PRIOR_TOKENS, verification: str = "token") -> dict:
    """``{round context: DepthAcceptance}`` (exponential means of weight :data:`HISTORY_SMOOTHING`, a history as
    :class:`RoundSizer` keeps one) of ``drafter`` with ``builder`` on ``model`` over generations of ``tokens`` tokens
    from each of :data:`PRIOR_PROMPTS` (chat template), greedy or (``sampled``) at
    temperature 1 (seed 7; sampled rounds verified by ``verification``), every round drafting as deep as the builder
    allows (:class:`AlwaysDrafting`)."""
    from ..sampling import SamplingConfig
    from .generator import GenerationConfig, SpeculativeGenerator
    from .prompts import encode_prompt
    from .stats import GenerationStats
    history: dict = {}
    gen = SpeculativeGenerator(model, drafter, builder, verification=verification)
    gen.round_sizer = lambda state, builder, costs: AlwaysDrafting(history)
    config = GenerationConfig(max_new_tokens=tokens, sampling=SamplingConfig(1.0 if sampled else 0.0, seed=7))
    for prompt in PRIOR_PROMPTS:
        for _ in gen.generate_blocks(encode_prompt(model.tokenizer, prompt), config, GenerationStats()):
            pass
    return history


class CyclingDepth:
    """The calibration's round sizer (:func:`measure_draft_seconds`): the rounds draft ``depths`` in turn (0: an
    ``ar`` round of the drafter's generator), as deep as each allows; :class:`RoundSizer`'s interface, no policy."""

    def __init__(self, depths: tuple[int, ...]):
        self.depths, self.asked = depths, 0

    def depth(self, state, max_depth: int, context=None, free: bool = False, horizon: float = math.inf) -> int:
        d = min(self.depths[self.asked % len(self.depths)], max_depth)
        self.asked += 1
        state.draft_stop = None
        return d

    def observe(self, drafted_depth: int, accepted: int, nodes: int, calls: int) -> None:
        """Nothing to learn."""

    def shadow(self, context, chain, start: int) -> None:
        """Nothing to learn."""

    def resolve_shadow(self, tokens: list[int]) -> None:
        """Nothing to learn."""

    def drop_shadow(self) -> None:
        """Nothing to learn."""

    def timed(self, seconds: float) -> None:
        """Nothing to learn."""


class AlwaysDrafting(CyclingDepth):
    """:func:`measure_acceptance`'s round sizer: every round drafts as deep as it may, and its acceptance is kept
    per round context in ``history``."""

    def __init__(self, history: dict):
        super().__init__((sys.maxsize,))
        self.history, self.context = history, None

    def depth(self, state, max_depth: int, context=None, free: bool = False, horizon: float = math.inf) -> int:
        self.context = context
        return super().depth(state, max_depth, context, free, horizon)

    def observe(self, drafted_depth: int, accepted: int, nodes: int, calls: int) -> None:
        if drafted_depth:
            self.history.setdefault(self.context, DepthAcceptance(HISTORY_SMOOTHING)).observe(drafted_depth,
                                                                                             accepted)


def timed_rounds(model, drafter, builder: TreeBuilder, depths: tuple[int, ...], prompt_ids: list[int], tokens: int,
                 sampling, deadline: float | None = None) -> list[tuple[float, int, int]]:
    """One generation of ``tokens`` tokens (EOS ignored) by ``drafter`` and ``builder`` on ``model`` whose rounds
    draft ``depths`` in turn (:class:`CyclingDepth`), stopped after the round that ends past ``deadline`` (a
    ``time.perf_counter()`` value) if given: ``(seconds [s], nodes [tokens], draft calls)`` of each round in order
    (a round drafts less than asked only where the drafter has nothing to draft or the remaining tokens end it)."""
    from .generator import GenerationConfig, SpeculativeGenerator
    from .stats import GenerationStats
    gen = SpeculativeGenerator(model, drafter, builder)
    gen.round_sizer = lambda state, builder, costs: CyclingDepth(depths)
    stats = GenerationStats()
    config = GenerationConfig(max_new_tokens=tokens, ignore_eos=True, sampling=sampling)
    out = []
    blocks = gen.generate_blocks(prompt_ids, config, stats)
    next(blocks)                                                       # the prefill's token
    while True:
        nodes, calls, depth = stats.drafted_tokens, stats.draft_forwards, sum(stats.drafted_at_depth)
        t0 = time.perf_counter()
        if next(blocks, None) is None:
            return out
        t1 = time.perf_counter()
        out.append((t1 - t0, stats.drafted_tokens - nodes,
                    max(stats.draft_forwards - calls, sum(stats.drafted_at_depth) - depth)))
        if deadline is not None and t1 > deadline:
            blocks.close()
            return out


def cost_table(model, drafter, builder: TreeBuilder | None, signature: str, sampled: bool = False) -> CostTable | None:
    """The :class:`CostTable` of ``drafter`` on ``model`` (:func:`forward_seconds`, :func:`draft_seconds`; ``sampled``:
    the figure for generations at a temperature), or ``None`` where the model has no tune (or nothing drafts)."""
    if builder is None or drafter is None:
        return None
    forward = forward_seconds(model)
    if forward is None:
        return None
    first, further = draft_seconds(model, drafter, builder, signature, sampled)
    growth = forward_growth(model, forward)
    if growth is None:
        return CostTable(forward, further, first)
    context, per_token = growth
    share = drafter.cache_share(model.config)
    return CostTable(forward, further, first, context, per_token, share * per_token.get(1, 0.0))


TIMING_WINDOW = 64
"""Rounds of each kind whose median :class:`RoundTiming` takes [count]: medians, not means (a mean of excesses clipped
at two steps above and one below still rose with every preempted round, and a correction that high stopped a draft
head that paid: `eagle` 1.01-1.02x `ar` with it, 1.08-1.09 without, BENCHMARKS.md BM)."""
TIMING_ROUNDS = 8
"""Drafting rounds :class:`RoundTiming` times before its correction applies [count]."""
TIMING_REFERENCE = 32
"""Drafting rounds in a row after which :class:`RoundTiming` asks for an ``ar`` round to time [count]: a drafter that
drafts every round would otherwise never show what its rounds cost beside one without drafts."""
TIMING_QUANTUM = 0.01
""":meth:`RoundTiming.correction` in steps of this share of a one-row forward (a sizing is recomputed only when it
moves by one)."""


class RoundTiming:
    """What a generator's greedy rounds took against what the cost table says they take, and the correction of a
    drafting round's cost that follows (kept across the generator's greedy generations, as its acceptance history).

    The draft figures of the cost table are measured once, in a couple of seconds, on a random prompt whose rounds
    draft in a fixed cycle; inside real generations drafting rounds took more than they say: on SmolLM2 (2 cores,
    greedy, Spec-Bench, each method's rounds interleaved one by one with `ar`'s) an early-exit depth-1 round 1.58-1.74
    `ar` rounds where the table said 1.52-1.58, an RSD-C one 1.61-1.95 against 1.50, a draft head's 1.30-1.36 against
    1.18, and one drafter's calibration gave 1.16-1.36 `ar` rounds a few minutes apart (BENCHMARKS.md BM).  Each
    round is timed whole, its sizing included: ``speed``, the median of ``measured / modeled`` over the last
    :data:`TIMING_WINDOW` ``ar`` rounds, is the machine's pace against the table now; the excess, per kind of draft
    figures, the median over its last :data:`TIMING_WINDOW` drafting rounds of ``measured / speed - modeled`` (a
    round with one-off work, a head's catch-up over the prompt, left out), what a drafting round costs beyond its
    model in the table's seconds (medians: a preempted round is not a cost).  The correction adds it to the round's
    first draft call (:meth:`~speculant.engine.goodput.SequenceSpeculation.at_context`); a drafter it stopped is
    still probed (whether drafting could pay is judged without it), so the excess stays measured.  Timing moves the
    rounds of greedy generations only, whose output does not depend on them (verification decides every token); a
    sampled generation's rounds stay a function of its tokens, so that a seeded output does not depend on timing
    noise.
    """

    def __init__(self, window: int = TIMING_WINDOW, rounds: int = TIMING_ROUNDS):
        self.window, self.rounds = window, rounds
        self.ratios: deque[float] = deque(maxlen=window)     # measured / modeled seconds of the last ar rounds
        self.speed: float | None = None      # their median
        self.since_ar = 0                    # drafting rounds since the last timed ar round
        self.excess: dict = {}               # kind -> the last drafting rounds' unmodeled seconds (table s)
        self.median: dict = {}               # kind -> their median [s]
        self.counts: dict = {}               # kind -> drafting rounds timed

    def observe(self, seconds: float, modeled: float, drafted: bool, step: float, kind=None) -> None:
        """A round took ``seconds`` where the table says ``modeled`` [s]; ``drafted``: it drafted (``kind``: which
        of the drafter's cost tables sized it, e.g. eagle-lookup's copying rounds apart from its head's); ``step``:
        the table's one-row forward at its context [s]."""
        if not seconds > 0.0 or not modeled > 0.0:
            return
        if not drafted:
            self.since_ar = 0
            self.ratios.append(seconds / modeled)
            self.speed = statistics.median(self.ratios)
            return
        self.since_ar += 1
        if self.speed is not None:
            values = self.excess.setdefault(kind, deque(maxlen=self.window))
            values.append(min(max(seconds / self.speed - modeled, -step), 2.0 * step))
            self.median[kind] = statistics.median(values)
            self.counts[kind] = self.counts.get(kind, 0) + 1

    @property
    def wants_reference(self) -> bool:
        """Whether the next round should be an ``ar`` round, to be timed: none was in the last
        :data:`TIMING_REFERENCE` rounds (the machine's pace drifts; each such round costs what drafting would have
        saved in it, about ``1 / TIMING_REFERENCE`` of the gain)."""
        return self.since_ar >= TIMING_REFERENCE

    def correction(self, step: float, kind=None) -> float:
        """Seconds to add to a drafting round's modeled cost [s]: the median excess of ``kind``'s last rounds in steps
        of :data:`TIMING_QUANTUM` of ``step`` (the one-row forward [s]), 0 before :attr:`rounds` of them were
        timed."""
        if self.counts.get(kind, 0) < self.rounds or not step > 0.0:
            return 0.0
        quantum = TIMING_QUANTUM * step
        return round(self.median[kind] / quantum) * quantum


class RoundSizer:
    """One generation's round sizing: a :class:`~speculant.engine.goodput.SequenceSpeculation` from ``costs`` and
    the builder's tree shape per round context (the drafter's :meth:`~speculant.drafters.base.Drafter.round_context`,
    e.g. the size of the n-gram prompt lookup matched: each context keeps its own acceptance per depth and probes;
    the loss budget is the generation's, shared; one context for a drafter without one).  A context met after others
    starts from the generation's acceptance at depth 1 so far, pooled over its contexts (the running mean of a
    :class:`~speculant.engine.goodput.DepthAcceptance`), not from certainty (prompt lookup meets new n-gram sizes
    all along, and at temperature 1 drafted by choice in each at an acceptance that does not pay: BENCHMARKS.md
    BA.2).  ``history`` (``{context: DepthAcceptance}``; :meth:`~speculant.engine.generator.SpeculativeGenerator.
    history_for`: for greedy generations the generator's, seeded from the greedy acceptance prior; for a sampled one
    a fresh copy of the sampled prior): each context's long-run acceptance (exponential, weight
    :data:`HISTORY_SMOOTHING`), which a context starts from, counted as :data:`HISTORY_WEIGHT` observations, and
    which this generation's observations update.  Counts of tokens only (and, with ``timing``, a greedy
    generation's :class:`RoundTiming` correction): deterministic given them (and, with a greedy history, the earlier
    greedy generations').
    :meth:`depth` before a round's drafting (and, for a drafter with draft confidence, ``state.draft_stop`` set),
    :meth:`observe` after its acceptance."""

    def __init__(self, costs: CostTable, builder: TreeBuilder, confidence: bool, costs_of=None, extra_of=None,
                 history: dict | None = None, timing: RoundTiming | None = None, one_off_of=None):
        self.history = history                                  # {context: DepthAcceptance} of earlier generations
        self.timing = timing                                    # greedy rounds' times against the table, or None
        self.one_off_of = one_off_of                            # () -> the round has one-off work (Drafter.one_off_work)
        self.one_off = False
        self.modeled: tuple | None = None   # the last observed round's (seconds, drafted, step, kind)
        self.context = None                                     # the last depth()'s round context
        self.costs_of = costs_of or (lambda context: costs)     # a context's own table (Drafter.round_costs)
        self.extra_of = extra_of                                # the round's extra seconds (round_extra_seconds)
        self.extra = 0.0
        self.contexts: dict = {}
        self.nodes = nodes_at_depth(builder)
        self.confidence = confidence
        self.pooled = DepthAcceptance()             # depth 1 over all contexts: a new context's prior
        self.speculation = self._of(None)
        self.pending_shadow: tuple | None = None    # (context, chain, index in the tokens of its first token)

    def _of(self, context):
        if context not in self.contexts:
            if not self.contexts:
                self.ledger = Ledger()
            past = self.history.get(context) if self.history is not None else None
            start = DepthAcceptance.from_history(past, HISTORY_WEIGHT) if past is not None and past.fast else None
            self.contexts[context] = SequenceSpeculation(self.costs_of(context), ledger=self.ledger,
                                                         prior=self.pooled.alpha(1), acceptance=start)
        return self.contexts[context]

    def _past(self, context) -> DepthAcceptance | None:
        """``context``'s long-run acceptance kept for later generations (made at its first observation), or
        ``None`` without a history."""
        if self.history is None:
            return None
        return self.history.setdefault(context, DepthAcceptance(HISTORY_SMOOTHING))

    def depth(self, state, max_depth: int, context=None, free: bool = False, horizon: float = math.inf) -> int:
        """The round's depth bound in ``0 .. max_depth`` (0: an ``ar`` round) in round context ``context``; sets
        ``state.draft_stop``.  ``free``: the drafter's chain is known without drafting (its acceptance is learnt
        from :meth:`shadow` chains).  ``horizon``: tokens the sequence may still emit."""
        self.speculation, self.context = self._of(context), context
        timing = self.timing
        if timing is not None:
            self.one_off = self.one_off_of is not None and self.one_off_of()
            step = self.speculation.policy.cost(1)                 # at the last round's context: a scale only
            self.speculation.at_context(len(state.tokens) - 1, timing.correction(step, self._kind()))
        else:
            self.speculation.at_context(len(state.tokens) - 1)
        self.extra = self.extra_of(context) if self.extra_of is not None else 0.0
        if timing is not None and timing.wants_reference:
            max_depth = 0                           # an ar round to time, as the reference (no sizing asked)
        d = self.speculation.depth(max_depth, self.nodes, free, horizon)       # 0 at once for max_depth 0
        state.draft_stop = self.speculation.stop_rule(self.nodes) if d and self.confidence else None
        return d

    def shadow(self, context, chain: list[int] | None, start: int) -> None:
        """A round of ``context`` drafted nothing where the drafter's chain ``chain`` was free to know
        (:meth:`~speculant.drafters.base.Drafter.free_draft`): it is checked against the tokens emitted from index
        ``start`` on (:meth:`resolve_shadow`), one chain at a time (the chains of consecutive rounds overlap)."""
        if chain and self.pending_shadow is None:
            self.pending_shadow = (context, list(chain), start, 0)

    def drop_shadow(self) -> None:
        """Forget the pending chain (a round drafted: its own acceptance is observed)."""
        self.pending_shadow = None

    def resolve_shadow(self, tokens: list[int]) -> None:
        """Check the pending :meth:`shadow` chain against ``tokens`` (the generation's, grown since): each drafted
        position the tokens now reach, its path above matched, is one observation of its depth's acceptance in the
        chain's context (:meth:`~speculant.engine.goodput.SequenceSpeculation.observe_shadow`); the chain is done at
        its first token that differs or its last."""
        if self.pending_shadow is None:
            return
        context, chain, start, checked = self.pending_shadow
        speculation = self._of(context)
        end = min(len(chain), len(tokens) - start)
        for i in range(checked, end):
            accepted = tokens[start + i] == chain[i]
            speculation.observe_shadow(i + 1, accepted)
            if (past := self._past(context)) is not None:
                past.observe_at(i + 1, accepted)
            if i == 0:
                self.pooled.observe_at(1, accepted)
            if not accepted:
                self.pending_shadow = None
                return
        self.pending_shadow = None if end == len(chain) else (context, chain, start, end)

    def observe(self, drafted_depth: int, accepted: int, nodes: int, calls: int) -> None:
        """The round (sized by the last :meth:`depth`) had ``drafted_depth`` depths and ``nodes`` nodes, drafted in
        ``calls`` draft calls, and ``accepted`` tokens of it were accepted."""
        self.speculation.observe(drafted_depth, accepted, nodes, calls, self.extra if calls else 0.0)
        if self.timing is not None:
            spec = self.speculation
            cost = spec.policy.cost
            drafted = bool(calls or nodes)
            modeled = cost(1 + nodes) + spec.costs.drafting_seconds(calls) - (spec.applied if calls else 0.0)
            self.modeled = (modeled + (self.extra if calls else 0.0), drafted, cost(1), self._kind())
        if drafted_depth:
            self.pooled.observe(1, accepted)
            if (past := self._past(self.context)) is not None:
                past.observe(drafted_depth, accepted)

    def _kind(self):
        """Which draft figures size this round (:class:`RoundTiming` keeps each kind's excess apart)."""
        table = self.speculation.table_costs
        return table.first_draft_seconds, table.draft_seconds

    def timed(self, seconds: float) -> None:
        """The round last observed took ``seconds`` [s] (:class:`RoundTiming`; nothing without one).  A round that
        drafted and, as ``one_off_of`` said when it was sized, also did work done once a generation
        (:meth:`~speculant.drafters.base.Drafter.one_off_work`) is not counted: that is not what a drafting round
        costs."""
        if self.timing is not None and self.modeled is not None:
            modeled, drafted, step, kind = self.modeled
            if not (self.one_off and drafted):
                self.timing.observe(seconds, modeled, drafted, step, kind)
            self.modeled = None


def timed(fn, *args):
    """``(fn(*args), seconds it took)``."""
    t0 = time.perf_counter()
    out = fn(*args)
    return out, time.perf_counter() - t0
