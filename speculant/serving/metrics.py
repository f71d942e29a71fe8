"""Prometheus metrics of the server, named after vLLM's (``vllm:`` -> ``speculant:``).

Speculative decoding (vLLM's ``spec_decode_*`` counters): a *draft* is one sequence's tree in one round;
its *draft tokens* are the tree's nodes; *accepted tokens* the drafted tokens the acceptance rule kept;
``accepted_tokens_per_pos{position=p}`` counts drafts whose accepted path reached depth ``p + 1``
(position 0 = the first drafted token); *emitted tokens* are the tokens rounds emit (accepted + the
target's own).  Acceptance rate = accepted / draft tokens; per position = per_pos[p] / drafts.
``target_forwards`` counts target forwards: one per batched verification round, one per prefill.
Prefix caching (vLLM's ``prefix_cache_queries`` / ``prefix_cache_hits``): prompt tokens looked up, and those whose
KV was reused instead of prefilled; hit rate = hits / queries.

Latencies [seconds]: time to first token (arrival to the first token), inter-token latency (between
consecutive emissions of a request; a speculative round emits several tokens at once, as in vLLM),
time per output token ((end - first token) / (tokens - 1)), end-to-end request latency.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

_LATENCY_BUCKETS = (0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 10.0,
                    20.0, 40.0, 80.0)
_REQUEST_BUCKETS = (0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 60.0, 120.0, 240.0, 480.0)


class ServerMetrics:
    """The server's metrics in their own registry (several servers may live in one process, e.g. tests)."""

    def __init__(self, model_name: str, max_positions: int = 32):
        self.registry = r = CollectorRegistry()
        self.model_name = model_name
        label = ["model_name"]
        self.num_drafts = Counter("speculant:spec_decode_num_drafts", "Drafts verified (one per sequence per round "
                                  "with at least one drafted token).", label, registry=r)
        self.num_draft_tokens = Counter("speculant:spec_decode_num_draft_tokens", "Drafted tokens (tree nodes) "
                                        "verified.", label, registry=r)
        self.num_accepted_tokens = Counter("speculant:spec_decode_num_accepted_tokens", "Drafted tokens accepted.",
                                           label, registry=r)
        self.accepted_per_pos = Counter("speculant:spec_decode_num_accepted_tokens_per_pos", "Drafts whose accepted "
                                        "path reached position p (0 = first drafted token).", label + ["position"],
                                        registry=r)
        self.num_emitted_tokens = Counter("speculant:spec_decode_num_emitted_tokens", "Tokens emitted by "
                                          "verification rounds (accepted + the target's token).", label, registry=r)
        self.target_forwards = Counter("speculant:target_forwards", "Target forwards (one per batched "
                                       "verification round, one per prefill).", label, registry=r)
        self.rounds_without_drafts = Counter("speculant:rounds_without_drafts", "Rounds whose greedy sequences did "
                                             "not draft (--speculation goodput: drafting would not pay at that "
                                             "batch size).", label, registry=r)
        self.prefix_cache_queries = Counter("speculant:prefix_cache_queries", "Prompt tokens looked up in the "
                                            "prefix cache.", label, registry=r)
        self.prefix_cache_hits = Counter("speculant:prefix_cache_hits", "Prompt tokens whose KV came from the "
                                         "prefix cache (not prefilled).", label, registry=r)
        self.prompt_tokens = Counter("speculant:prompt_tokens", "Prompt tokens prefilled.", label, registry=r)
        self.generation_tokens = Counter("speculant:generation_tokens", "Tokens generated (returned to clients).",
                                         label, registry=r)
        self.request_success = Counter("speculant:request_success", "Finished requests by finish reason "
                                       "(stop, length, abort).", label + ["finished_reason"], registry=r)
        self.running = Gauge("speculant:num_requests_running", "Sequences in the running batch.", label, registry=r)
        self.waiting = Gauge("speculant:num_requests_waiting", "Requests queued, not started.", label, registry=r)
        self.batch_size = Histogram("speculant:batch_size", "Sequences verified per target forward.", label,
                                    buckets=(1, 2, 4, 8, 16, 32, 64), registry=r)
        self.ttft = Histogram("speculant:time_to_first_token_seconds", "Time to first token [s].", label,
                              buckets=_LATENCY_BUCKETS, registry=r)
        self.itl = Histogram("speculant:inter_token_latency_seconds", "Time between consecutive emissions of a "
                             "request [s].", label, buckets=_LATENCY_BUCKETS, registry=r)
        self.tpot = Histogram("speculant:time_per_output_token_seconds", "Per request: (end - first token) / "
                              "(tokens - 1) [s].", label, buckets=_LATENCY_BUCKETS, registry=r)
        self.e2e = Histogram("speculant:e2e_request_latency_seconds", "Arrival to last token [s].", label,
                             buckets=_REQUEST_BUCKETS, registry=r)
        self.max_positions = max_positions
        self._children: dict = {}

    def labels(self, metric, **kw):
        """``metric``'s child for this model (and ``kw`` labels), looked up once."""
        key = (id(metric), tuple(sorted(kw.items())))
        child = self._children.get(key)
        if child is None:
            child = self._children[key] = metric.labels(model_name=self.model_name, **kw)
        return child

    def record_round(self, batch: int, drafted: list[int], accepted: list[int], emitted: list[int]) -> None:
        """One verification round over ``batch`` sequences: per sequence its tree size, accepted length and
        emitted tokens [tokens]."""
        self.labels(self.target_forwards).inc()
        self.labels(self.batch_size).observe(batch)
        for d, a, e in zip(drafted, accepted, emitted):
            self.labels(self.num_emitted_tokens).inc(e)
            if d:
                self.labels(self.num_drafts).inc()
                self.labels(self.num_draft_tokens).inc(d)
                self.labels(self.num_accepted_tokens).inc(a)
                for p in range(min(a, self.max_positions)):
                    self.labels(self.accepted_per_pos, position=str(p)).inc()

    def exposition(self) -> bytes:
        """The Prometheus text format of every metric."""
        return generate_latest(self.registry)
