"""The scheduler: one background thread runs every target forward; the asyncio side talks to it through queues.

Requests wait in a bounded FIFO queue (``max_queue``; a full queue refuses with :class:`QueueFull`).
Before each round the thread admits waiting requests while fewer than ``max_batch`` sequences run
(their prompts prefilled together where the runtime allows, :meth:`BatchedGenerator.start_many`, each with its
first token, from the longest prefix the batch's prefix cache holds), drops sequences whose client went away
(:meth:`Submission.cancel`), then runs one batched round (:meth:`BatchedGenerator.step`) over all running
sequences; a sequence that ends is released (:meth:`BatchedGenerator.release`: its KV may go to the prefix
cache).  That is continuous batching: a request that arrives while others run joins at the next round,
and a finished one leaves at once, freeing its slot (Yu et al. 2022, "Orca", iteration-level scheduling).

Per request the thread also runs the text layer (:class:`~speculant.engine.text.StopStringText`:
incremental detokenization, stop strings), so a stop string ends the sequence at that round, and hands
text pieces to the requests' ``asyncio.Queue`` objects, a round's events in one ``loop.call_soon_threadsafe``.

Shutdown (:meth:`Scheduler.begin_shutdown`): no new request is accepted (:class:`ShuttingDown`), waiting
ones are refused, running ones go on until they finish or ``drain_timeout`` seconds pass (then they end with
OpenAI's ``finish_reason='length'``: the output was cut short, as by a token limit; the metrics count them as
``abort``, vLLM's label); then the thread exits.
"""

from __future__ import annotations

import asyncio
import bisect
import collections
import itertools
import logging
import threading
import time
import traceback
from dataclasses import dataclass, field

from ..engine.batch import BatchedGenerator, Sequence
from ..engine.generator import GenerationConfig
from ..engine.text import StopStringText
from ..errors import SpeculantError
from .metrics import ServerMetrics

log = logging.getLogger("speculant.serving")


def _deliver_soon(loop: asyncio.AbstractEventLoop, items: list) -> None:
    """Put each ``(submission, event)`` of ``items`` into its queue, in ``loop``'s thread (thread-safe)."""
    def deliver():
        for sub, event in items:
            sub.events.put_nowait(event)
    try:
        loop.call_soon_threadsafe(deliver)
    except RuntimeError:          # the event loop is closed: nobody is listening any more
        pass


class QueueFull(Exception):
    """The waiting queue holds ``max_queue`` requests (HTTP 429)."""


class ShuttingDown(Exception):
    """The server is draining and takes no new request (HTTP 503)."""


@dataclass
class Event:
    """What the thread tells a request.

    Attributes:
        kind: ``'text'`` (a new piece), ``'done'`` (finished: ``finish_reason`` and usage set) or ``'error'``.
        text: the new text (may be empty).
        finish_reason: one of OpenAI's: ``'stop'`` (EOS or a stop string), ``'length'`` (max_tokens, the context,
            or cut by the drain timeout at shutdown).
        completion_tokens: tokens generated so far (cut at a stop string) [tokens].
        error: the message of an ``'error'`` event; ``status`` its HTTP status.
        stats: with ``'done'``: the request's speculative counters (rounds, drafted and accepted tokens,
            acceptance rate, target forwards), returned as the response's ``speculant`` field.
        index: the choice it belongs to (``0 .. n - 1``).
        logprobs: when the request asked for them, one entry per token newly shown (:func:`token_entries`).
    """

    kind: str
    text: str = ""
    finish_reason: str | None = None
    completion_tokens: int = 0
    error: str = ""
    status: int = 500
    stats: dict | None = None
    index: int = 0
    logprobs: list[dict] | None = None


def token_entries(tokenizer, logprobs: list, ends: list[int], first: int) -> list[dict]:
    """The log-probabilities of tokens ``first, first + 1, ...`` of an output as plain entries: ``token`` (its
    text), ``bytes`` (the UTF-8 bytes of that text), ``logprob`` [nats], ``offset`` (where its text starts in
    the output's text [characters]: from the text layer's ``ends``, the end of its text less its own decoded
    length, never before the previous token's end) and ``top``: ``(token text, bytes, logprob)`` of the
    alternatives, most likely first.  A token that ends inside a multi-byte character decodes alone to
    U+FFFD (its text and bytes are those of the decode, as vLLM gives them)."""
    def text(tok: int) -> str:
        return tokenizer.decode([tok])

    out = []
    for j, lp in enumerate(logprobs, start=first):
        t = text(lp.token_id)
        out.append({"token": t, "bytes": list(t.encode("utf-8")), "logprob": lp.logprob,
                    "offset": max(ends[j - 1] if j > 0 else 0, ends[j] - len(t)),
                    "top": [(text(a), list(text(a).encode("utf-8")), v) for a, v in lp.top]})
    return out


@dataclass
class Submission:
    """One request handed to the scheduler (created on the event loop, read by the thread); ``n`` independent
    samples of its prompt run as ``n`` sequences (:meth:`BatchedGenerator.start_n`, one shared prefill)."""

    prompt_ids: list[int]
    config: GenerationConfig
    loop: asyncio.AbstractEventLoop
    events: asyncio.Queue
    n: int = 1
    id: int = field(default_factory=itertools.count().__next__)
    arrival: float = field(default_factory=time.perf_counter)
    cancelled: threading.Event = field(default_factory=threading.Event)

    def cancel(self) -> None:
        """The client went away: the thread drops the sequence before its next round (thread-safe)."""
        self.cancelled.set()


@dataclass
class _Running:
    sub: Submission
    seq: Sequence
    text: StopStringText
    first_token_at: float
    last_emit_at: float
    index: int = 0
    logprobs_sent: int = 0


class Scheduler:
    """Owns the :class:`BatchedGenerator` and the thread that drives it.

    Args:
        batched: the batched generator (model, drafter, tree builder).
        tokenizer: for the text layer.
        metrics: where counters and latencies go.
        max_batch: most sequences in one round (>= 1).
        max_queue: most requests waiting to start (>= 0).
        drain_timeout: seconds running requests get after :meth:`begin_shutdown` [s].
    """

    def __init__(self, batched: BatchedGenerator, tokenizer, metrics: ServerMetrics, max_batch: int, max_queue: int,
                 drain_timeout: float = 30.0):
        self.batched = batched
        self.tokenizer = tokenizer
        self.metrics = metrics
        self.max_batch = max_batch
        self.max_queue = max_queue
        self.drain_timeout = drain_timeout
        self._waiting: collections.deque[Submission] = collections.deque()
        self._running: list[_Running] = []
        self._cond = threading.Condition()
        self._draining_since: float | None = None
        self._stopped = False
        self._abort_all = False
        self._thread: threading.Thread | None = None
        self._outbox: list[tuple[Submission, Event]] = []      # the current round's events (compute thread)

    # ---------------------------------------------------------------- event-loop side (any thread)
    @property
    def draining(self) -> bool:
        return self._draining_since is not None

    def start(self) -> None:
        """Start the compute thread."""
        self._thread = threading.Thread(target=self._run, name="speculant-scheduler", daemon=True)
        self._thread.start()

    def run_here(self) -> None:
        """Run the compute loop in the calling thread until :meth:`stop` (instead of :meth:`start`'s own thread).

        For a caller that loaded the model in that same thread: torch's OpenMP thread pool belongs to the thread
        that first runs a parallel op, and with a second pool (model warmed up in one thread, rounds run in
        another) libgomp manages more threads than there are cores and stops spinning between parallel regions;
        every parallel op then waits for a futex wake-up (measured on 2 cores: a round twice as long).
        """
        self._thread = threading.current_thread()
        self._run()

    def submit(self, sub: Submission) -> None:
        """Queue ``sub``.

        Raises:
            ShuttingDown: :meth:`begin_shutdown` was called.
            QueueFull: ``max_queue`` requests are already waiting.
        """
        with self._cond:
            if self.draining or self._stopped:
                raise ShuttingDown("the server is shutting down")
            if len(self._waiting) >= self.max_queue:
                raise QueueFull(f"the queue is full ({self.max_queue} requests waiting, {len(self._running)} running); "
                                "retry later")
            self._waiting.append(sub)
            self.metrics.labels(self.metrics.waiting).set(len(self._waiting))
            self._cond.notify()

    def begin_shutdown(self) -> None:
        """Refuse new and waiting requests; let running ones finish within ``drain_timeout`` seconds."""
        with self._cond:
            if self._draining_since is None:
                self._draining_since = time.perf_counter()
            refused = list(self._waiting)
            self._waiting.clear()
            self.metrics.labels(self.metrics.waiting).set(0)
            self._cond.notify()
        for sub in refused:
            self._send(sub, Event("error", error="the server is shutting down", status=503))

    def stop(self, timeout: float = 10.0) -> None:
        """Stop the thread after the drain (or at once when :meth:`begin_shutdown` was not called)."""
        self.begin_shutdown()
        with self._cond:
            self._abort_all = True
            self._cond.notify()
        if self._thread is not None:
            self._thread.join(timeout)

    def snapshot(self) -> dict:
        """Running and waiting counts (for ``/health``)."""
        with self._cond:
            return {"running": len(self._running), "waiting": len(self._waiting), "draining": self.draining}

    # ---------------------------------------------------------------- compute thread
    def _send(self, sub: Submission, event: Event) -> None:
        """Hand ``event`` to ``sub``'s event loop now (any thread)."""
        _deliver_soon(sub.loop, [(sub, event)])

    def _post(self, sub: Submission, event: Event) -> None:
        """Queue ``event`` for ``sub`` (compute thread): :meth:`_flush` hands a round's events over together,
        one event-loop wake-up per round instead of one per sequence (the HTTP side shares the cores)."""
        self._outbox.append((sub, event))

    def _flush(self) -> None:
        by_loop: dict = {}
        for sub, event in self._outbox:
            by_loop.setdefault(sub.loop, []).append((sub, event))
        self._outbox = []
        for loop, items in by_loop.items():
            _deliver_soon(loop, items)

    def _run(self) -> None:
        while True:
            with self._cond:
                while not self._waiting and not self._running and not self.draining:
                    self._cond.wait(timeout=1.0)
                if self.draining and not self._running:
                    self._stopped = True
                    return
                admitted, slots = [], len(self._running)
                while self._waiting and (slots + self._waiting[0].n <= self.max_batch or slots == 0):
                    slots += self._waiting[0].n       # n samples are n sequences (admitted alone if n > max_batch)
                    admitted.append(self._waiting.popleft())
                self.metrics.labels(self.metrics.waiting).set(len(self._waiting))
            try:
                self._iteration(admitted)
                self._flush()
            except Exception as e:       # a bug: fail the requests involved, keep serving the others
                log.error("scheduler round failed: %s", traceback.format_exc())
                for item in list(self._running):
                    self._finish(item, None, error=f"internal error: {type(e).__name__}: {e}")
                for sub in admitted:
                    if not any(r.sub is sub for r in self._running):
                        self._post(sub, Event("error", error=f"internal error: {type(e).__name__}: {e}"))
                self._running = []
                self._flush()

    def _iteration(self, admitted: list[Submission]) -> None:
        starting = []
        for sub in admitted:
            if sub.cancelled.is_set():
                self.metrics.labels(self.metrics.request_success, finished_reason="abort").inc()
            else:
                starting.append(sub)
        forwards, pc = self.batched.target_forwards, self.batched.prefix_cache
        queries, hits = (pc.queries, pc.hits) if pc is not None else (0, 0)
        single = [sub for sub in starting if sub.n == 1]
        started = dict(zip(map(id, single), self.batched.start_many([(sub.prompt_ids, sub.config) for sub in single])
                           if single else []))
        for sub in starting:
            if sub.n > 1:
                try:
                    started[id(sub)] = self.batched.start_n(sub.prompt_ids, sub.config, sub.n)
                except SpeculantError as e:
                    started[id(sub)] = e
        self.metrics.labels(self.metrics.target_forwards).inc(self.batched.target_forwards - forwards)
        if pc is not None:
            self.metrics.labels(self.metrics.prefix_cache_queries).inc(pc.queries - queries)
            self.metrics.labels(self.metrics.prefix_cache_hits).inc(pc.hits - hits)
        for sub in starting:
            seqs = started[id(sub)]
            if isinstance(seqs, SpeculantError):  # checked before submission; kept as a guard for this request only
                self._post(sub, Event("error", error=str(seqs), status=400))
                continue
            now = time.perf_counter()
            self.metrics.labels(self.metrics.prompt_tokens).inc(len(sub.prompt_ids))
            self.metrics.labels(self.metrics.ttft).observe(now - sub.arrival)
            for index, seq in enumerate(seqs if isinstance(seqs, list) else [seqs]):
                item = _Running(sub, seq, StopStringText(self.tokenizer, seq.config.stop), now, now, index)
                self._running.append(item)
                self._emit(item, seq.last_block, first=True)
        self._flush()                 # first tokens now, not after the round
        overdue = self.draining and (self._abort_all or time.perf_counter() - self._draining_since > self.drain_timeout)
        for item in list(self._running):
            if item.sub.cancelled.is_set():
                self._finish(item, "abort")              # nobody listens any more
            elif overdue:
                self._finish(item, "length", aborted=True)
        self.metrics.labels(self.metrics.running).set(len(self._running))
        if not self._running:
            return
        seqs = [item.seq for item in self._running]
        before = [(s.stats.drafted_tokens, s.stats.accepted_tokens) for s in seqs]
        policy = self.batched.policy
        skipped = policy.rounds_skipped if policy is not None else 0
        self.batched.step(seqs)
        if policy is not None and policy.rounds_skipped > skipped:
            self.metrics.labels(self.metrics.rounds_without_drafts).inc()
        self.metrics.record_round(len(seqs), [s.stats.drafted_tokens - d for s, (d, _) in zip(seqs, before)],
                                  [s.stats.accepted_tokens - a for s, (_, a) in zip(seqs, before)],
                                  [len(s.last_block) for s in seqs])
        for item in list(self._running):
            self._emit(item, item.seq.last_block, first=False)
        self.metrics.labels(self.metrics.running).set(len(self._running))

    def _emit(self, item: _Running, block: list[int], first: bool) -> None:
        """Run a block through the request's text layer; send the text; finish the request when it ends."""
        now = time.perf_counter()
        if not first:
            self.metrics.labels(self.metrics.itl).observe(now - item.last_emit_at)
        item.last_emit_at = now
        piece = item.text.add(block)
        reason = "stop" if item.text.stopped or item.seq.finished == "eos" else \
            ("length" if item.seq.finished == "length" else None)
        if reason is None:
            if piece:
                self._post(item.sub, Event("text", piece, completion_tokens=len(item.text.token_ids), index=item.index,
                                           logprobs=self._logprobs(item, final=False)))
            return
        self._finish(item, reason, piece)

    def _logprobs(self, item: _Running, final: bool) -> list[dict] | None:
        """The log-probability entries of ``item``'s tokens shown since the last event (``final``: all the
        output's tokens not sent yet); ``None`` when the request did not ask for them."""
        logprobs = item.seq.logprobs
        if logprobs is None:
            return None
        ends = item.text.detok.ends
        upto = len(item.text.token_ids) if final else bisect.bisect_right(ends, item.text.shown)
        first, item.logprobs_sent = item.logprobs_sent, max(item.logprobs_sent, upto)
        return token_entries(self.tokenizer, logprobs[first:item.logprobs_sent], ends, first)

    def _finish(self, item: _Running, reason: str | None, piece: str = "", error: str = "",
                aborted: bool = False) -> None:
        """End ``item``: ``reason`` is what the client reads (``'abort'``: the client went away, nothing is sent);
        ``aborted`` counts a drain-timeout cut as ``abort`` in the metrics."""
        if item in self._running:
            self._running.remove(item)
            if not error:                # after a failed round its caches may be half-written
                self.batched.release(item.seq)
        m, seq, now = self.metrics, item.seq, time.perf_counter()
        if error:
            self._post(item.sub, Event("error", error=error, index=item.index))
            return
        if reason != "abort":
            piece += item.text.finish()
            if item.text.stopped:        # a stop string completed by the final flush
                reason = "stop"
        tokens = len(item.text.token_ids)
        m.labels(m.request_success, finished_reason="abort" if aborted else reason).inc()
        m.labels(m.generation_tokens).inc(tokens)
        m.labels(m.e2e).observe(now - item.sub.arrival)
        if tokens > 1:
            m.labels(m.tpot).observe((now - item.first_token_at) / (tokens - 1))
        stats = seq.stats
        counters = {"rounds": stats.rounds, "drafted_tokens": stats.drafted_tokens,
                    "accepted_tokens": stats.accepted_tokens, "acceptance_rate": stats.acceptance_rate,
                    "target_forwards": stats.target_forwards}
        self._post(item.sub, Event("done", piece, finish_reason=reason, completion_tokens=tokens, index=item.index,
                                   logprobs=self._logprobs(item, final=True), stats=counters))
