"""Whether a batched round should draft at all: speculation by goodput.

Speculative decoding turns idle compute into tokens; a batch of sequences leaves less compute idle.  At one
sequence a verification block of ``1 + k`` rows costs little more than one row (the weights are read once), at 8
sequences the round is compute-bound and ``8 (1 + k)`` rows cost several times ``8`` rows, so drafts whose
acceptance does not pay for their rows make the server slower than plain batched decoding.  vLLM switches
speculation off above a fixed batch size (``speculative_disable_by_batch_size``); SmartSpec (Liu et al. 2024,
"Optimizing Speculative Decoding for Serving Large Language Models Using Goodput", arXiv:2406.14066) decides from
the expected goodput, tokens per second of a round.  This policy does the latter, from measurements only:

* ``cost(R)``: seconds of one target forward over ``R`` rows (one sequence, ``R`` new tokens), measured on this
  machine at startup (:meth:`GoodputPolicy.measure`), linear in between;
* per sequence and speculative round, running means (exponential, weight ``smoothing``) of the tokens it emitted
  (block efficiency ``tau``), of the rows it added to the forward (``r = 1 +`` drafted tokens) and of the seconds
  its drafting took (``d``), observed in the rounds that drafted;
* per sequence and round, the running mean ``o`` of the time a round takes beyond its drafting and its forward's
  ``cost`` (acceptance, the text layer, handing tokens to HTTP, all between the starts of consecutive rounds),
  which a round pays whether it drafts or not, so that fewer, longer rounds save it.

A round of ``N`` sequences drafts when ``N * tau / (cost(N * r) + N * (d + o)) > N / (cost(N) + N * o)``, i.e.
when its expected tokens per second beat a round without drafts: :meth:`GoodputPolicy.draft_depth` at batch ``N``,
the function that sizes a single sequence's rounds at ``N = 1`` (:mod:`speculant.engine.speculation`,
``speculant generate --speculation cost``).  The means are learnt in the first ``warmup``
rounds, which all draft, and kept current by exploring: when ``explore_every`` rounds in a row went without
drafts, one sequence of the next round drafts (a drafter's acceptance changes with the text: prompt lookup finds
nothing to copy in one answer and whole sentences in the next), which costs a batch a few rows, not a round.

Exactness: a round without drafts is an ``ar`` round, so greedy outputs do not change.  A sampled sequence draws
its random numbers in a different order in such a round, so its seeded output would then depend on what runs
beside it; the engine applies the policy to greedy sequences only (sampled ones always draft).
"""

from __future__ import annotations

import itertools
import math
import time
from dataclasses import dataclass, replace

import torch

from ..errors import SpeculantError


class GoodputPolicy:
    """Decides per batched round whether its greedy sequences draft (see the module docstring).

    Args:
        forward_seconds: measured ``{rows: seconds}`` of one target forward (at least one entry, rows >= 1).
        smoothing: weight of a new observation in the running means (0 < smoothing <= 1).
        warmup: rounds that draft before the policy decides [count].
        explore_every: at most this many rounds in a row go without drafts [count, >= 1].

    Attributes:
        tokens_per_sequence: running block efficiency ``tau`` [tokens per sequence and round], ``None`` before
            the first observation.
        rows_per_sequence: running rows ``r`` a drafting sequence adds to the forward [tokens].
        draft_seconds_per_sequence: running drafting time ``d`` [s].
        overhead_seconds_per_sequence: running time ``o`` of a round beyond drafting and forward [s].
        rounds_drafted, rounds_skipped: rounds the policy let draft / kept without drafts [count].

    Raises:
        SpeculantError: an empty or non-positive cost table, or ``smoothing`` outside (0, 1].
    """

    def __init__(self, forward_seconds: dict[int, float], smoothing: float = 0.1, warmup: int = 16,
                 explore_every: int = 16):
        if not forward_seconds or any(r < 1 or s <= 0 for r, s in forward_seconds.items()):
            raise SpeculantError(f"forward_seconds={forward_seconds} is invalid; allowed: a non-empty "
                                 "{rows >= 1: seconds > 0}")
        if not 0.0 < smoothing <= 1.0:
            raise SpeculantError(f"smoothing={smoothing} is out of range; allowed: (0, 1]")
        if warmup < 0 or explore_every < 1:
            raise SpeculantError(f"warmup={warmup}, explore_every={explore_every} are out of range; allowed: "
                                 "warmup >= 0, explore_every >= 1")
        self.warmup, self.explore_every = warmup, explore_every
        self.observations = 0
        self._without = 0            # rounds in a row without drafts
        self.table = sorted(forward_seconds.items())
        self.smoothing = smoothing
        self.tokens_per_sequence: float | None = None
        self.rows_per_sequence = 1.0
        self.draft_seconds_per_sequence = 0.0
        self.overhead_seconds_per_sequence = 0.0
        self.rounds_drafted = 0
        self.rounds_skipped = 0

    @classmethod
    @torch.inference_mode()
    def measure(cls, decoder, max_rows: int, context: int = 64, repeats: int = 10, **kw) -> GoodputPolicy:
        """Time one forward of ``decoder`` over ``R`` new tokens after ``context`` cached ones, for ``R`` = 1, 2,
        4, ... up to ``max_rows`` (and ``max_rows`` itself), best of ``repeats`` [s] (on a shared VM a best of 3 may leave
        the multi-row figures high: :data:`speculant.runtime.tune.FORWARD_REPEATS`); about 1.5 s for
        SmolLM2-135M up to 64 rows on 2 cores.  Random tokens: the cost does not depend on them."""
        if max_rows < 1:
            raise SpeculantError(f"max_rows={max_rows} is out of range; allowed: >= 1")
        rows = sorted({min(1 << i, max_rows) for i in range(max_rows.bit_length() + 1)})
        g = torch.Generator().manual_seed(0)
        vocab = decoder.config.vocab_size
        cache = decoder.new_cache(context + max_rows)
        decoder(torch.randint(vocab, (1, context), generator=g), None, None, cache, 0)
        seconds = {}
        for r in rows:
            ids = torch.randint(vocab, (1, r), generator=g)
            best = float("inf")
            for _ in range(repeats + 1):                 # the first call of a shape may build or warm things
                t0 = time.perf_counter()
                decoder(ids, None, None, cache, context)
                best = min(best, time.perf_counter() - t0)
            seconds[r] = best
        return cls(seconds, **kw)

    def cost(self, rows: float) -> float:
        """Seconds of a forward over ``rows`` rows: the measured table, linear in between and beyond [s]."""
        table = self.table
        if len(table) == 1:
            r0, s0 = table[0]
            return s0 * max(rows, 1.0) / r0 if rows > r0 else s0
        if rows <= table[0][0]:
            return table[0][1]
        for (r0, s0), (r1, s1) in itertools.pairwise(table):
            if rows <= r1:
                return s0 + (s1 - s0) * (rows - r0) / (r1 - r0)
        (r0, s0), (r1, s1) = table[-2], table[-1]
        return s1 + (s1 - s0) * (rows - r1) / (r1 - r0)

    def pays(self, batch: int) -> bool:
        """Whether drafting is expected to pay in a round of ``batch`` sequences (``True`` before any
        observation)."""
        if self.tokens_per_sequence is None:
            return True
        # the one-sequence rule's function (:meth:`draft_depth`), on the batch's running means: one "depth" that
        # adds r - 1 rows per sequence, emits tau tokens and drafts for d seconds
        return self.draft_depth(batch, _Emitting(self.tokens_per_sequence), 1, lambda d: self.rows_per_sequence - 1,
                                self.draft_seconds_per_sequence, self.overhead_seconds_per_sequence) > 0

    def drafting(self, batch: int) -> int:
        """How many of a round's ``batch`` sequences draft: all (in the warm-up, or when it :meth:`pays`), one
        (exploring, after ``explore_every`` rounds in a row without drafts) or none.  Counts the decision."""
        if self.observations < self.warmup or self.pays(batch):
            self.rounds_drafted += 1
            self._without = 0
            return batch
        if self._without + 1 >= self.explore_every:
            self.rounds_drafted += 1
            self._without = 0
            return 1
        self.rounds_skipped += 1
        self._without += 1
        return 0

    def draft_depth(self, batch: int, acceptance: "DepthAcceptance", max_depth: int, nodes_at_depth,
                    draft_seconds_per_call: float, overhead_seconds: float = 0.0,
                    first_draft_seconds: float | None = None, seconds: list[float] | None = None) -> int:
        """The depth ``d`` in ``0 .. max_depth`` (0: an ``ar`` round) whose round of ``batch`` sequences has the most
        expected tokens per second: ``batch * E(d) / (cost(batch * (1 + nodes_at_depth(d))) + batch * (D(d) +
        overhead_seconds))``, ``E(d) = 1 + sum_j prod_{i<=j} alpha_i`` from the running acceptance per depth
        (Leviathan et al. 2023, Sec. 3.1, with a measured cost per row count instead of a constant ratio;
        SmartSpec's goodput), ``D(d) = first_draft_seconds + (d - 1) * draft_seconds_per_call`` the drafting
        (``first_draft_seconds`` defaults to ``draft_seconds_per_call``).  ``seconds``: the rounds' seconds
        :meth:`round_seconds` gives for these arguments, where the caller kept them (they do not depend on the
        acceptance).  Deterministic given its inputs."""
        if seconds is None:
            seconds = self.round_seconds(batch, max_depth, nodes_at_depth, draft_seconds_per_call, overhead_seconds,
                                         first_draft_seconds)
        best, best_rate = 0, batch / seconds[0]
        reach = 1.0
        expected = 1.0
        for d in range(1, max_depth + 1):
            reach *= acceptance.alpha(d)
            expected += reach
            if batch * expected / seconds[d] > best_rate:
                best, best_rate = d, batch * expected / seconds[d]
        return best

    def round_seconds(self, batch: int, max_depth: int, nodes_at_depth, draft_seconds_per_call: float,
                      overhead_seconds: float = 0.0, first_draft_seconds: float | None = None) -> list[float]:
        """Seconds of a round of ``batch`` sequences drafting depth ``d``, for ``d = 0 .. max_depth``:
        ``cost(batch * (1 + nodes_at_depth(d))) + batch * (D(d) + overhead_seconds)`` (:meth:`draft_depth`'s
        denominators, ``D(0) = 0``) [s]."""
        first = draft_seconds_per_call if first_draft_seconds is None else first_draft_seconds
        out = [self.cost(batch) + batch * overhead_seconds]
        for d in range(1, max_depth + 1):
            drafting = first + (d - 1) * draft_seconds_per_call
            out.append(self.cost(batch * (1 + nodes_at_depth(d))) + batch * (drafting + overhead_seconds))
        return out

    def observe(self, sequences: int, rows: int, emitted: int, draft_seconds: float) -> None:
        """A round's ``sequences`` drafting sequences added ``rows`` rows [tokens], emitted ``emitted`` tokens and
        drafted for ``draft_seconds`` seconds in all."""
        if sequences < 1:
            return
        a = self.smoothing
        self.observations += 1
        tau, r, d = emitted / sequences, rows / sequences, draft_seconds / sequences
        if self.tokens_per_sequence is None:
            self.tokens_per_sequence, self.rows_per_sequence, self.draft_seconds_per_sequence = tau, r, d
        else:
            self.tokens_per_sequence += a * (tau - self.tokens_per_sequence)
            self.rows_per_sequence += a * (r - self.rows_per_sequence)
            self.draft_seconds_per_sequence += a * (d - self.draft_seconds_per_sequence)

    def observe_period(self, sequences: int, rows: int, seconds: float, draft_seconds: float) -> None:
        """A round of ``sequences`` sequences and ``rows`` forward rows [tokens] began ``seconds`` before the next
        one did, and drafted for ``draft_seconds`` of them [s]: updates ``o``."""
        if sequences < 1:
            return
        o = max(0.0, seconds - draft_seconds - self.cost(rows)) / sequences
        self.overhead_seconds_per_sequence += self.smoothing * (o - self.overhead_seconds_per_sequence)


EXPLORE_AFTER = 8
"""Observations of the first depth's acceptance (a history's included) before :meth:`SequenceSpeculation.explores`
trusts its slow mean as a belief: from the uninformed prior (certainty, counted as one), two rejections leave a plain
mean of 1/3 that one acceptance would lift to 1/2, and exploring on it cost early exit and RSD-C 0.4-0.5 % of their
time at T = 1 (BENCHMARKS.md BK)."""
SLOW_SMOOTHING = 0.25
"""The slow running mean's weight, as a share of the fast one's (:class:`DepthAcceptance`)."""


class DepthAcceptance:
    """Running acceptance per depth of one generation: ``alpha_d`` = P(the depth-``d`` token is accepted | the
    path up to depth ``d - 1`` was), a mean over the rounds that drafted depth ``d`` with ``d - 1`` accepted,
    starting at ``prior`` counted as one observation: the ``n``-th observation weighs ``max(1 / (n + 1),
    smoothing)`` (the plain mean of the prior and the first observations, then an exponential mean of weight
    ``smoothing``: one rejection after a prior of certainty no longer leaves 0.8, which kept an early-exit draft
    that pays from ~0.4 drafting by choice for four rounds of every generation; BENCHMARKS.md BA.2).  A depth not
    observed yet takes the estimate of the deepest one observed (acceptance seldom rises with depth: a first depth
    seen to fail must not leave deeper drafts looking certain).  Two such means are kept per depth, of weights
    ``smoothing`` and ``smoothing * SLOW_SMOOTHING``, and the estimate is the larger: the fast one follows a drafter
    that starts being accepted (after failing probes, it recovers in a quarter of the rounds the slow one alone
    needs); the slow one does not drop below the break-even on a run of rejections (a draft head's fast estimate
    spread so far around an acceptance that pays that it stopped drafting in most rounds: BENCHMARKS.md BJ).
    Updated from accepted lengths only (no timing), so a choice made from it is the same whenever the tokens are;
    :meth:`observe_at` is its one update once in use (construction and :meth:`from_history` set the means first;
    :attr:`version` counts the updates: a sizing computed from the estimate is kept until it changes).
    (The bias-corrected mean without the floor, weight ``1 / (n + 1)`` all along, stopped prompt lookup's drafting
    after short runs of misses: τ 1.70 -> 1.57 on Spec-Bench, BENCHMARKS.md AJ.)

    Raises:
        SpeculantError: ``smoothing`` outside (0, 1] or ``prior`` outside [0, 1].
    """

    def __init__(self, smoothing: float = 0.2, prior: float = 1.0):
        if not 0.0 < smoothing <= 1.0:
            raise SpeculantError(f"smoothing={smoothing} is out of range; allowed: (0, 1]")
        if not 0.0 <= prior <= 1.0:
            raise SpeculantError(f"prior={prior} is out of range; allowed: [0, 1]")
        self.smoothing, self.prior = smoothing, prior
        self.slow_smoothing = smoothing * SLOW_SMOOTHING
        self.fast: list[float] = []          # the running means of weight ``smoothing`` per depth
        self.slow: list[float] = []          # ... and of weight ``smoothing * SLOW_SMOOTHING``
        self.counts: list[int] = []          # observations per depth, the prior counted as one
        self.version = 0                     # observations so far: what a sizing computed from it is keyed by

    @property
    def alphas(self) -> list[float]:
        """The estimate per observed depth: the larger of its fast and its slow running mean."""
        return [max(f, s) for f, s in zip(self.fast, self.slow)]

    def alpha(self, depth: int) -> float:
        """``alpha_depth`` (depth >= 1)."""
        d = min(depth, len(self.fast))
        return max(self.fast[d - 1], self.slow[d - 1]) if d else self.prior

    def observe(self, drafted_depth: int, accepted: int) -> None:
        """A round drafted a tree of ``drafted_depth`` depths and accepted ``accepted`` tokens of it."""
        for d in range(1, min(accepted + 1, drafted_depth) + 1):
            self.observe_at(d, d <= accepted)

    def observe_at(self, depth: int, accepted: bool) -> None:
        """One observation of ``alpha_depth``: a depth-``depth`` draft, its path above accepted, was ``accepted``."""
        while len(self.fast) < depth:
            d = len(self.fast)
            self.fast.append(self.fast[d - 1] if d else self.prior)
            self.slow.append(self.slow[d - 1] if d else self.prior)
            self.counts.append(1)
        self.counts[depth - 1] += 1
        self.version += 1
        n, x = self.counts[depth - 1], float(accepted)
        self.fast[depth - 1] += max(1.0 / n, self.smoothing) * (x - self.fast[depth - 1])
        self.slow[depth - 1] += max(1.0 / n, self.slow_smoothing) * (x - self.slow[depth - 1])

    @classmethod
    def from_history(cls, history: "DepthAcceptance", weight: int, smoothing: float = 0.2) -> "DepthAcceptance":
        """A generation's acceptance starting from ``history`` (the long-run estimate per depth of earlier
        generations, :class:`~speculant.engine.speculation.RoundSizer`), each depth's counted as ``weight``
        observations, or as many as the history made at that depth if fewer (its prior not counted): a few
        rejections at the start of an answer no longer take it below the break-even (five took a head accepted 40 %
        of the time from certainty to 1/6; from a history of 0.4 at weight 8 they leave 0.25), and a history of one
        observation weighs as one."""
        alphas = history.alphas or [history.prior]
        out = cls(smoothing, alphas[0])
        out.fast, out.slow = list(alphas), list(alphas)
        out.counts = [min(weight, c - 1) for c in history.counts] or [1]
        return out

    def slow_after(self, depth: int, accepted: bool) -> float:
        """The slow running mean of ``alpha_depth`` after one more observation ``accepted`` (nothing changed)."""
        d = min(depth, len(self.slow))
        slow, n = (self.slow[d - 1], self.counts[d - 1] + 1) if d else (self.prior, 2)
        return slow + max(1.0 / n, self.slow_smoothing) * (float(accepted) - slow)

    @property
    def informed(self) -> bool:
        """Whether anything was observed or the prior is below certainty (an estimate, not the default prior)."""
        return bool(self.fast) or self.prior < 1.0


@dataclass(frozen=True)
class CostTable:
    """The costs a one-sequence cost-aware policy decides from, measured once (:func:`measure_costs`) and then
    fixed, so that its choices, and with them a seeded sampled output, never depend on timing noise (a greedy
    generation's may be corrected by its rounds' timing: :meth:`SequenceSpeculation.at_context`).

    Attributes:
        forward_seconds: ``{rows: seconds}`` of one target forward over ``rows`` new tokens (rows >= 1) after
            ``context`` cached ones.
        draft_seconds: seconds of one draft call (one depth of drafting) after a round's first [s, >= 0].
        first_draft_seconds: seconds of a round's first draft call [s, >= 0]; ``None``: ``draft_seconds``.  A
            model drafter's first call also runs the entries committed since its last round (an EAGLE head's
            catch-up over the accepted tokens' features), so it may cost more than the deeper ones.
        context: the cached tokens ``forward_seconds`` (and the draft figures, about) were measured after [tokens].
        forward_growth: ``{rows: seconds per cached token}`` a forward over ``rows`` new tokens adds per cached
            token beyond ``context`` (attention reads the whole KV cache for every row), each >= 0; ``None``: the
            costs do not depend on the context (:meth:`at`).
        draft_growth: seconds per cached token beyond ``context`` a draft call adds (a drafter running target
            layers reads their KV cache) [s, >= 0].
    Raises:
        SpeculantError: an empty or non-positive ``forward_seconds``, a negative draft figure, context or growth.
    """

    forward_seconds: dict
    draft_seconds: float
    first_draft_seconds: float | None = None
    context: int = 0
    forward_growth: dict | None = None
    draft_growth: float = 0.0

    def drafting_seconds(self, calls: int) -> float:
        """Seconds of a round's ``calls`` draft calls [s] (0 for none)."""
        if calls < 1:
            return 0.0
        first = self.draft_seconds if self.first_draft_seconds is None else self.first_draft_seconds
        return first + (calls - 1) * self.draft_seconds

    def at(self, tokens: int) -> "CostTable":
        """The table after ``tokens`` cached tokens: each figure plus its growth times the tokens beyond
        ``context`` (linear: attention's work grows with the KV cache, the weights' reads do not); the table itself
        at ``context`` or fewer (the figures measured there bound the cost from above) and without growth."""
        extra = tokens - self.context
        if self.forward_growth is None or extra <= 0:
            return self
        forward = {r: s + self.forward_growth[r] * extra for r, s in self.forward_seconds.items()}
        more = self.draft_growth * extra
        first = None if self.first_draft_seconds is None else self.first_draft_seconds + more
        return replace(self, forward_seconds=forward, draft_seconds=self.draft_seconds + more,
                       first_draft_seconds=first, context=tokens, forward_growth=None)

    def __post_init__(self):
        fs = self.forward_seconds
        if (not isinstance(fs, dict) or not fs
                or any(isinstance(r, bool) or not isinstance(r, int) or r < 1 or not s > 0 for r, s in fs.items())):
            raise SpeculantError(f"forward_seconds={fs!r} is invalid; allowed: a non-empty {{rows >= 1: seconds > 0}}")
        growth = self.forward_growth
        if growth is not None and (not isinstance(growth, dict) or set(growth) != set(fs)
                                   or not all(_finite(g) for g in growth.values())):
            raise SpeculantError(f"forward_growth={growth!r} is invalid; allowed: None or {{each row count of "
                                 "forward_seconds: seconds per token >= 0}")
        for name in ("draft_seconds", "first_draft_seconds", "context", "draft_growth"):
            value = getattr(self, name)
            if value is None and name == "first_draft_seconds":
                continue
            if not _finite(value):
                raise SpeculantError(f"{name}={value!r} is invalid; allowed: a finite number >= 0")


def _finite(value) -> bool:
    """Whether ``value`` is a finite int or float >= 0 (not a bool)."""
    return not isinstance(value, bool) and isinstance(value, (int, float)) and 0 <= value < math.inf


@dataclass
class Ledger:
    """What a generation's drafting rounds saved against ``ar`` rounds and what all its rounds took, valued from the
    cost tables [s]: the loss budget of :class:`SequenceSpeculation`, shared by all of a generation's round contexts
    (so that probing in several contexts loses no more than probing in one); ``probed``: the part of ``saved``
    that probe rounds saved."""

    saved: float = 0.0
    spent: float = 0.0
    probed: float = 0.0


class SequenceSpeculation:
    """Cost-aware sizing of one sequence's rounds: the :class:`GoodputPolicy` choice at ``batch = 1`` from a fixed
    :class:`CostTable` and the sequence's own :class:`DepthAcceptance`; the round's depth is an upper bound that the
    drafter's own confidence may cut (:meth:`stop_rule`).

    The first round drafts depth 1 only where some depth could pay (no acceptance is known yet: one draft
    measures the first depth's, on which every deeper one rests, at the least cost).  Exploring keeps the
    acceptance current while no depth pays: after ``explore_every`` rounds in a row without drafts (fewer near the
    break-even, :meth:`probe_interval`) one round *probes* at depth 1 (the cheapest round that measures the first
    depth's acceptance, on which every deeper depth's value rests), unless no depth could pay even if every draft
    were accepted (:meth:`could_pay`).  Each probe after which drafting still does not pay (its draft rejected, or accepted
    without lifting the running acceptance to where some depth pays) doubles the interval, up to
    ``max_explore_every`` (exponential back-off: a drafter that keeps failing, or succeeds too seldom to pay, costs a
    vanishing share of the rounds); a round that drafts by choice (the probes' acceptance made drafting pay) resets
    it.

    A loss budget bounds what exploring can lose: every round is valued from the cost table, a drafting round by
    the time it saved against ``ar`` rounds emitting its tokens (``(1 + accepted) cost(1) - cost(1 + nodes) -
    drafting``, negative when its drafts did not pay), and no probe is made while the sum of the probes' values
    (plus that of the rounds drafted by choice where it is positive) is below ``-loss_budget`` times the table's time
    of all rounds so far: a drafter whose probes keep failing costs the generation about that share beyond what its
    rounds drafted by choice lost, and one that pays earns room to explore.  Rounds that draft by choice are not held
    back (gating them too stopped prompt lookup between its bursts of matches: τ 1.40 -> 1.22 on Spec-Bench).
    Counts and fixed costs only (plus, for a greedy generation, the timing correction given to :meth:`at_context`):
    deterministic given the tokens and the correction.

    ``prior``: the acceptance per depth assumed before any is observed (:class:`DepthAcceptance`'s);
    ``acceptance``: the estimate to start from instead (e.g. :meth:`DepthAcceptance.from_history`): the rounds are
    then sized from it from the first (no first-round draft).

    Raises:
        SpeculantError: ``explore_every < 1``, ``max_explore_every < explore_every`` or ``loss_budget`` outside
            [0, 1) (and see :class:`CostTable`, :class:`DepthAcceptance`).
    """

    def __init__(self, costs: CostTable, explore_every: int = 16, smoothing: float = 0.2,
                 max_explore_every: int = 256, loss_budget: float = 0.005, ledger: "Ledger | None" = None,
                 prior: float = 1.0, acceptance: DepthAcceptance | None = None):
        if explore_every < 1 or max_explore_every < explore_every:
            raise SpeculantError(f"explore_every={explore_every}, max_explore_every={max_explore_every} are out of "
                                 "range; allowed: 1 <= explore_every <= max_explore_every")
        if not 0.0 <= loss_budget < 1.0:
            raise SpeculantError(f"loss_budget={loss_budget} is out of range; allowed: [0, 1)")
        self.costs, self.explore_every, self.max_explore_every = costs, explore_every, max_explore_every
        self.table_costs = costs             # the table as given; :attr:`costs` is it at the sequence's context
        self._context = None                 # the cached tokens :attr:`costs` is at, in steps of CONTEXT_STEP
        self.correction = 0.0                # seconds asked to add to a drafting round's first call [s]
        self.applied = 0.0                   # ... and added (the call's figure stays >= 0) [s]
        self.uncorrected = costs             # :attr:`costs` without the correction
        self.policy = GoodputPolicy(costs.forward_seconds, warmup=0, explore_every=explore_every)
        self.acceptance = acceptance if acceptance is not None else DepthAcceptance(smoothing, prior)
        self.interval = explore_every        # rounds without drafts before the next probe [count]
        self.loss_budget = loss_budget
        self.ledger = ledger if ledger is not None else Ledger()    # shared by a generation's round contexts
        self._without = 0
        self._probing = False                # the last depth returned was a probe's
        self._first = acceptance is None     # no round sized yet (an estimate given: sized from it)
        self._sizing = None                  # the last depth()'s (max_depth, nodes_at_depth)
        self._memo_key, self._memo_values = None, {}
        self._seconds: dict = {}             # round seconds per depth at this context (_depth), per table and shape

    def at_context(self, tokens: int, correction: float = 0.0) -> None:
        """Size and value the next rounds after ``tokens`` cached tokens (the table's :meth:`CostTable.at`, taken
        in steps of :data:`CONTEXT_STEP` tokens): a step after 1024 cached tokens costs 1.4-1.6 steps after 256 on
        SmolLM2 (attention over the KV cache; BENCHMARKS.md BL) while a draft call grows only by its drafter's
        share, so what a round saves or loses against ``ar`` rounds moves with the context.  ``correction``: seconds
        added to a drafting round's first call beyond the table (:class:`~speculant.engine.speculation.RoundTiming`,
        greedy generations only; the call's figure stays >= 0) [s].  Without a correction, a function of the token
        count: deterministic.  :attr:`applied` is the correction as applied (after that floor) [s]; whether
        exploring could pay (:meth:`could_pay`) is judged on the table without it, so that a correction that stopped
        drafting is measured again by the probes."""
        step = tokens - tokens % CONTEXT_STEP
        if step != self._context or correction != self.correction:
            self._context, self.correction = step, correction
            costs = self.uncorrected = self.table_costs.at(step)
            first = costs.draft_seconds if costs.first_draft_seconds is None else costs.first_draft_seconds
            self.applied = max(0.0, first + correction) - first
            if self.applied:
                costs = replace(costs, first_draft_seconds=first + self.applied)
            self.costs = costs
            self.policy.table = sorted(self.costs.forward_seconds.items())
            self._seconds = {}

    def _memo(self, max_depth: int, nodes_at_depth) -> dict:
        """The sizing's figures that depend only on the costs at this context, the depth bound, the tree shape and
        the acceptance (its :attr:`~DepthAcceptance.version`), kept until one of them changes: an ``ar`` round in a
        run of them reads them instead of valuing every depth again (its sizing is Python time on every round,
        the ones that do not draft included)."""
        key = (self._context, self.correction, max_depth, nodes_at_depth, self.acceptance, self.acceptance.version)
        if key != self._memo_key:
            self._memo_key, self._memo_values = key, {}
        return self._memo_values

    def _depth(self, max_depth: int, nodes_at_depth, acceptance, costs: CostTable | None = None) -> int:
        c = costs or self.costs
        key = (id(c), max_depth, nodes_at_depth)        # the tables are replaced (and this cleared) at a new context
        seconds = self._seconds.get(key)
        if seconds is None:
            seconds = self._seconds[key] = self.policy.round_seconds(1, max_depth, nodes_at_depth, c.draft_seconds,
                                                                     first_draft_seconds=c.first_draft_seconds)
        return self.policy.draft_depth(1, acceptance, max_depth, nodes_at_depth, c.draft_seconds,
                                       first_draft_seconds=c.first_draft_seconds, seconds=seconds)

    def within_budget(self) -> bool:
        """Whether the probes have lost less than ``loss_budget`` of the rounds' time so far plus what the rounds
        that drafted by choice saved (their losses are not the probes': a head whose first rounds drafted on the
        prior and lost made no probe for the rest of the generation, in rounds that would have paid)."""
        by_choice = self.ledger.saved - self.ledger.probed
        return self.ledger.probed + max(by_choice, 0.0) + self.loss_budget * self.ledger.spent >= 0.0

    def depth(self, max_depth: int, nodes_at_depth, free: bool = False, horizon: float = math.inf) -> int:
        """The next round's depth bound (0: an ``ar`` round).  ``free``: the drafter's chain in this round is known
        without drafting (:meth:`observe_shadow` learns its acceptance from the tokens then emitted), so nothing is
        drafted to learn it: no first-round draft, and none while the estimate is the uninformed prior.
        ``horizon``: the tokens the sequence may still emit (:meth:`explores`)."""
        self._probing = False
        if max_depth < 1:
            return 0
        self._sizing = (max_depth, nodes_at_depth)
        if free and not self.acceptance.informed:
            self._first = False
            return 0
        if self._first:                      # (a later round context's first round: only within the budget)
            self._first = False
            if not free:
                return 1 if self.could_pay(max_depth, nodes_at_depth) and self.within_budget() else 0
        memo = self._memo(max_depth, nodes_at_depth)
        if "depth" not in memo:
            memo["depth"] = self._depth(max_depth, nodes_at_depth, self.acceptance)
        d = memo["depth"]
        if d == 0 and not free and self.explores(nodes_at_depth, horizon):
            return 1                         # for its information: the probes' back-off stays as it is
        if d == 0 and self.could_pay(max_depth, nodes_at_depth):
            self._without += 1
            if self._without >= self.probe_interval(nodes_at_depth) and self.within_budget():
                self._without = 0
                self._probing = True
                return 1
        elif d:
            self._without = 0
            self.interval = self.explore_every
        return d

    def explores(self, nodes_at_depth, horizon: float = math.inf) -> bool:
        """Whether a depth-1 round that is not expected to pay is worth its information (the knowledge gradient of
        one observation, Frazier et al. 2008, for a Bernoulli arm against the known ``ar`` arm): if its draft is
        accepted (probability ``alpha_1``), the slow running mean rises to ``up`` (:meth:`DepthAcceptance.slow_after`)
        and, where drafting then pays, each of the ``horizon / (1 + up)`` rounds left saves ``s(up)``; the round is
        drafted when ``alpha_1 * s(up) * horizon / (1 + up)`` exceeds what it is expected to lose now, ``-s(alpha_1)``,
        with ``s(a) = (1 + a) cost(1) - cost(1 + n_1) - c_1`` the seconds a depth-1 round saves against ``ar`` rounds
        [s].  The slow mean, not the fast one: a single acceptance lifts the fast mean by a fifth of the way to 1, which
        would keep a drafter accepted 10 % of the time drafting at a break-even of 20 %.  A draft head's first rounds
        of an answer are accepted less (33 % in the first 10 rounds against 43 % later, on SmolLM2) and five rejected
        in a row left its estimate below the break-even for the rest of the answer, its probes then held back by the
        loss budget (BENCHMARKS.md BK); once one acceptance no longer lifts the slow mean past the break-even, the
        probes of :meth:`depth` take over.  Deterministic given the tokens."""
        if not self.acceptance.slow or self.acceptance.counts[0] < EXPLORE_AFTER:
            return False
        memo = self._memo(self._sizing[0], nodes_at_depth) if self._sizing else {}
        if "explore" not in memo:
            alpha, up = self.acceptance.alpha(1), self.acceptance.slow_after(1, True)
            memo["explore"] = (alpha, up, self.depth_one_saving(up, nodes_at_depth),
                               -self.depth_one_saving(alpha, nodes_at_depth))
        alpha, up, gain, loss = memo["explore"]
        return gain > 0.0 and alpha * gain * horizon / (1.0 + up) > loss

    def depth_one_saving(self, alpha: float, nodes_at_depth) -> float:
        """``s(alpha) = (1 + alpha) cost(1) - cost(1 + n_1) - c_1``: what a depth-1 round whose drafts are accepted
        with probability ``alpha`` saves against the ``ar`` rounds emitting its tokens, from the cost table [s]
        (negative where it loses)."""
        cost = self.policy.cost
        return (1.0 + alpha) * cost(1) - cost(1 + nodes_at_depth(1)) - self.costs.drafting_seconds(1)

    def probe_interval(self, nodes_at_depth) -> int:
        """Rounds without drafts before the next probe: :attr:`interval` times what a depth-1 probe is expected to
        lose at the current estimate (``cost(1 + n_1) + c_1 - (1 + alpha_1) cost(1)``), over what it loses if
        rejected (``alpha_1 = 0``), at least 1 [rounds].  Near the break-even a probe costs next to nothing and the
        estimate, updated by drafting rounds only, is stale (it stopped drafting on a run of rejections, and the
        rounds it then leaves without drafts would have paid: BENCHMARKS.md BJ).  Far below it, the interval is
        the back-off's."""
        memo = self._memo(self._sizing[0], nodes_at_depth) if self._sizing else {}
        if "probe" not in memo:
            memo["probe"] = (-self.depth_one_saving(0.0, nodes_at_depth),
                             max(-self.depth_one_saving(self.acceptance.alpha(1), nodes_at_depth), 0.0))
        lose, expected = memo["probe"]
        if lose <= 0.0:
            return 1
        return max(1, math.ceil(self.interval * expected / lose))

    def could_pay(self, max_depth: int, nodes_at_depth) -> bool:
        """Whether some depth would pay if every drafted token were accepted (else exploring is useless: drafts
        that cost more than the target's rows they replace never pay, whatever their acceptance), by the table
        without a timing correction (:meth:`at_context`): a drafter whose timed rounds made drafting look hopeless
        is still probed, at the back-off's intervals and within the loss budget, so the correction follows it."""
        memo = self._memo(max_depth, nodes_at_depth)
        if "could_pay" not in memo:
            memo["could_pay"] = self._depth(max_depth, nodes_at_depth, _ALWAYS, self.uncorrected) > 0
        return memo["could_pay"]

    def stop_rule(self, nodes_at_depth):
        """``draft_stop(depth, confidence)`` for a drafter with draft confidence: refuse a depth when adding its
        nodes, valued at their path confidence, lowers the expected tokens per second of the round
        (EAGLE-2's dynamic depth; llama.cpp's ``--draft-p-min`` with the threshold from the costs).  Its
        ``refuses(depth, bound)`` is asked before the depth's draft call, so that a call is not made for a depth
        that could not pay for it (and its nodes) even at the best confidence it could have."""
        expected = [1.0]
        cost, drafting = self.policy.cost, self.costs.drafting_seconds

        def stop(depth: int, confidence: float) -> bool:
            spent = drafting(depth)
            before = expected[0] / (cost(1 + nodes_at_depth(depth - 1)) + spent)
            after = (expected[0] + confidence) / (cost(1 + nodes_at_depth(depth)) + spent)
            if after <= before:
                return True
            expected[0] += confidence
            return False

        def refuses(depth: int, bound: float) -> bool:
            """Before depth ``depth``'s draft call: whether that depth cannot pay for its call and its nodes even
            at confidence ``bound`` (the best path confidence so far, which its own can only lower)."""
            before = expected[0] / (cost(1 + nodes_at_depth(depth - 1)) + drafting(depth - 1))
            return (expected[0] + bound) / (cost(1 + nodes_at_depth(depth)) + drafting(depth)) <= before
        stop.refuses = refuses
        return stop

    def observe_shadow(self, depth: int, accepted: bool) -> None:
        """A point-mass draft at depth ``depth`` of a chain known without drafting (its path above matched) was
        ``accepted``: the target emitted it without it, which it does with the probability that a round drafting
        it would have accepted it, greedy or sampled.  The acceptance at that depth learns it, and no probe is due
        (one would tell no more, at a cost)."""
        self.acceptance.observe_at(depth, accepted)
        self._without = 0

    def observe(self, drafted_depth: int, accepted: int, nodes: int = 0, calls: int = 0,
                extra_seconds: float = 0.0) -> None:
        """The round drafted ``drafted_depth`` depths (``nodes`` tree nodes, in ``calls`` draft calls: a drafter
        with draft confidence may make one more call than the depths it kept) and accepted ``accepted`` tokens;
        ``extra_seconds``: what its drafting paid beyond the table (an EAGLE head's catch-up after ``ar`` rounds),
        counted in what the rounds lost (the loss budget) [s]."""
        if drafted_depth:
            self.acceptance.observe(drafted_depth, accepted)
        if self._probing and (not accepted or self._depth(*self._sizing, self.acceptance) == 0):
            self.interval = min(2 * self.interval, self.max_explore_every)
        cost = self.policy.cost
        seconds = cost(1 + nodes) + self.costs.drafting_seconds(calls) + extra_seconds
        self.ledger.spent += seconds
        if calls or nodes:
            value = (1 + accepted) * cost(1) - seconds
            self.ledger.saved += value
            if self._probing:
                self.ledger.probed += value


CONTEXT_STEP = 32
"""Cached tokens between the contexts :meth:`SequenceSpeculation.at_context` takes its costs at [tokens]."""

_ALWAYS = DepthAcceptance(prior=1.0)
"""Every drafted token accepted (never updated): the most any drafting could give."""


class _Emitting:
    """A one-depth acceptance whose round emits ``tau`` tokens (``alpha_1 = tau - 1``): :meth:`GoodputPolicy.pays`
    as a :meth:`GoodputPolicy.draft_depth` decision."""

    def __init__(self, tau: float):
        self.tau = tau

    def alpha(self, depth: int) -> float:
        return self.tau - 1.0
