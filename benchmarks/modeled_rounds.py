"""Cost-aware speculation valued on the cost table: each method's rounds against `ar`'s, deterministic.

Not a test.  Runs every method's generations as `speculant bench` does (one generator per method over the prompts
in order, so a greedy generation starts from the generator's history; EOS ignored), records the rounds its
cost-aware policy sized, and values them on the tune's forward tables at each round's context (``--tables``: the
forward over the round's rows, linear in the context between the tables at 256 and 1024 cached tokens and beyond,
plus its draft calls at the cost table's figures and the drafter's share of the growth) plus ``--loop-ms`` per
round, against `ar` at the one-row forward at each token's context plus ``--loop-ms`` a token.  Timing noise does not enter the figures
(only the tune's tables, measured once), so two commits compare by their rounds alone: a change to the policy shows
here even where a measured run's ±5 % hides it (BENCHMARKS.md BK).  Prefill is not counted (the same for every
method).

    python benchmarks/modeled_rounds.py --dataset ../shared/data/spec_bench/dev.jsonl --limit 4 \
        --methods prompt-lookup,eagle,eagle-lookup,early-exit,rsd-c --temperature 0 [--max-new-tokens 128] [--measure]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from collections import defaultdict
from pathlib import Path

import torch

from speculant import GenerationConfig, SamplingConfig
from speculant.bench.datasets import load_prompts
from speculant.bench.runner import encode_prompts
from speculant.bench.specs import parse_methods
from speculant.engine.methods import build_generator
from speculant.engine.stats import GenerationStats
from speculant.runtime.loader import load_model


class Valuation:
    """Seconds of a forward over ``rows`` rows after ``n`` cached tokens, from a tune's two tables (``forward_ms``
    at 256 cached tokens, ``forward_context_ms`` further on; linear in the context beyond 256, in the rows between
    the table's), and of a drafter's draft calls (its cost table's figures, plus its share of the one-row growth).
    Its own code, not the policy's, so that a commit without context tables is valued the same way."""

    def __init__(self, tune: dict, config):
        self.short = min(256, config.context_length - 16)        # tune.forward_contexts (absent in older commits)
        self.base = {int(t): v / 1e3 for t, v in tune["forward_ms"].items()}
        if len(tune.get("forward_context_ms") or {}) != 1:
            raise SystemExit("the tune has no forward table at a second context (a model of <= 272 positions, or a "
                             "tune older than FORWARD_VERSION 4): give --tables a tune JSON that has one")
        (c, longer), = tune["forward_context_ms"].items()
        self.growth = {int(t): max(0.0, (v / 1e3 - self.base[int(t)]) / (int(c) - self.short))
                       for t, v in longer.items()}
        self.layers = config.num_hidden_layers

    def forward(self, rows: int, n: int) -> float:
        table = sorted((t, s + self.growth[t] * max(0, n - self.short)) for t, s in self.base.items())
        for (r0, s0), (r1, s1) in zip(table, table[1:]):
            if rows <= r1:
                return s0 + (s1 - s0) * (rows - r0) / (r1 - r0) if rows > r0 else s0
        (r0, s0), (r1, s1) = table[-2:]
        return s1 + (s1 - s0) * (rows - r1) / (r1 - r0)

    def share(self, drafter, config) -> float:
        """The drafter's ``cache_share`` where it has one (this commit's policy), else the same rule: early exit
        E / L, a head one layer of L, a draft model none (older commits), a copy none."""
        if hasattr(drafter, "cache_share"):
            return drafter.cache_share(config)
        e = getattr(drafter, "exit_layer", None)
        if e is not None:
            return e / self.layers
        return 1 / self.layers if hasattr(drafter, "head") else 0.0


def modeled(gen, ids: list[int], config: GenerationConfig, loop: float, value: Valuation):
    """``(method seconds, ar seconds, rounds, speculated rounds, measured decode seconds)`` of one generation, the
    first two valued by ``value``, the last timed (prefill left out) [s, s, count, count, s]."""
    rounds = []
    make, share = gen.round_sizer, value.share(gen.drafter, gen.model.config)

    def capture(state, builder, costs):
        sizer = make(state, builder, costs)
        if sizer is None:
            raise SystemExit(f"{gen.drafter.name}: no cost-aware rounds (no tune, or --speculation always)")
        depth, observe = sizer.depth, sizer.observe

        def sized(st, *a, **k):
            context = a[1] if len(a) > 1 else k.get("context")
            copies = isinstance(context, tuple) and context[:1] == ("lookup",)        # eagle-lookup's copy rounds
            rounds.append([len(st.tokens) - 1, sizer.costs_of(context), 0.0 if copies else share])
            return depth(st, *a, **k)

        def observed(drafted_depth, accepted, nodes, calls):
            rounds[-1] += [nodes, calls, sizer.extra if calls else 0.0]
            return observe(drafted_depth, accepted, nodes, calls)
        sizer.depth, sizer.observe = sized, observed
        return sizer
    gen.round_sizer = capture
    stats = GenerationStats()
    try:
        blocks = list(gen.generate_blocks(ids, config, stats))
    finally:
        del gen.round_sizer
    mine = 0.0
    for n, costs, reads, nodes, calls, extra in rounds:
        growth = reads * value.growth[1] * max(0, n - value.short)
        mine += value.forward(1 + nodes, n) + costs.drafting_seconds(calls) + growth * calls + extra + loop
    emitted = sum(map(len, blocks[1:]))
    ar = sum(value.forward(1, n) + loop for n in range(len(ids), len(ids) + emitted))
    return mine, ar, len(rounds), stats.speculated_rounds, stats.seconds - stats.time_to_first_token_s


def decode_seconds(gen, ids: list[int], config: GenerationConfig) -> float:
    """Measured seconds of a generation after its first token (prefill left out) [s]."""
    stats = GenerationStats()
    for _ in gen.generate_blocks(ids, config, stats):
        pass
    return stats.seconds - stats.time_to_first_token_s


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--dataset", required=True)
    ap.add_argument("--limit", type=int, default=4, help="prompts per category")
    ap.add_argument("--methods", default="prompt-lookup,eagle,eagle-lookup,early-exit,rsd-c")
    ap.add_argument("--temperature", type=float, default=0.0)
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--loop-ms", type=float, default=0.12, help="Python loop per round or ar token [ms]")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--measure", action="store_true",
                    help="also time each generation's decode (prefill left out) against `ar`'s, alternated per prompt")
    ap.add_argument("--tables", help="a tune JSON whose forward tables value the rounds (default: the model's tune)")
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    model = load_model(a.model)
    prompts = load_prompts(a.dataset, None, a.limit)
    ids = encode_prompts(model, prompts)
    value = Valuation(json.loads(Path(a.tables).read_text()) if a.tables else vars(model.tune), model.config)
    config = GenerationConfig(max_new_tokens=a.max_new_tokens, ignore_eos=True,
                              sampling=SamplingConfig(a.temperature, seed=0))
    measured = " | measured decode × `ar` | measured / modeled seconds: method, `ar`" if a.measure else ""
    cats = list(dict.fromkeys(p.category for p in prompts))
    print(f"| method | modeled × `ar` (all) | {' | '.join(cats)} | speculated rounds{measured} |")
    print("|---|---|" + "---|" * len(cats) + "---|" + ("---|---|" if a.measure else ""))
    ar_gen = build_generator(model, parse_methods("ar")[0].spec) if a.measure else None
    for method in parse_methods(a.methods):
        gen = build_generator(model, method.spec)
        if ar_gen is not None:          # untimed: the one-off calibrations and acceptance prior (kept with the tune)
            modeled(gen, ids[0], config, a.loop_ms / 1e3, value)
            gen = build_generator(model, method.spec)            # ... and a generator without that history
        by_cat: dict[str, list[float]] = defaultdict(lambda: [0.0, 0.0])
        rounds = speculated = 0
        timed = [0.0, 0.0]
        for p, x in zip(prompts, ids):
            mine, ar, r, s, seconds = modeled(gen, x, config, a.loop_ms / 1e3, value)
            by_cat[p.category][0] += mine
            by_cat[p.category][1] += ar
            rounds, speculated = rounds + r, speculated + s
            if ar_gen is not None:
                timed[0] += seconds
                timed[1] += decode_seconds(ar_gen, x, config)
        total = [sum(v[0] for v in by_cat.values()), sum(v[1] for v in by_cat.values())]
        row = " | ".join(f"{by_cat[c][1] / by_cat[c][0]:.3f}" for c in cats)
        if ar_gen is not None:
            row += (f" | {speculated} of {rounds} | {timed[1] / timed[0]:.3f} | {timed[0] / total[0]:.2f}, "
                    f"{timed[1] / total[1]:.2f}")
        else:
            row += f" | {speculated} of {rounds}"
        print(f"| `{method.label}` | **{total[1] / total[0]:.3f}** | {row} |", flush=True)
    print(f"(prompt tokens: median {statistics.median(map(len, ids))}, max {max(map(len, ids))})", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
