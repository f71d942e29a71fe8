"""Each method's decode against `ar`'s with their rounds interleaved one by one, and what its rounds cost against
what its cost table says.

Not a test.  For each prompt, a generation of the method and one of `ar` run side by side, a round of one, then a
round of the other (same prompt, EOS ignored, prefill left out): the machine's drift over seconds (a shared VM's
pace moved a run's ratios by 5-10 %, BENCHMARKS.md BL) falls on both alike.  Reports per method: its decode time
against `ar`'s (``ar / method``: above 1 the method is faster), what its rounds without drafts cost against the
neighbouring `ar` rounds (its per-round overhead), and its drafting rounds by (draft calls, nodes): how many, what
they took in neighbouring `ar` rounds (median) and what the policy's cost table said (mean, in one-row forwards at
the round's context, with the round-timing correction where it applies).

    python benchmarks/interleaved_rounds.py --dataset ../shared/data/spec_bench/dev.jsonl --limit 1 \
        --methods early-exit,rsd-c,eagle,prompt-lookup [--temperature 0] [--timing]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections import defaultdict

import torch

from speculant import GenerationConfig, SamplingConfig
from speculant.bench.datasets import load_prompts
from speculant.bench.runner import encode_prompts
from speculant.bench.specs import parse_methods
from speculant.engine.goodput import GoodputPolicy
from speculant.engine.methods import build_generator
from speculant.engine.stats import GenerationStats
from speculant.runtime.loader import load_model


def recorded(gen, records: list):
    """``gen``'s round sizer, wrapped to append each round's ``[modeled seconds, one-row seconds, nodes, calls]``."""
    make = gen.round_sizer

    def sizer(state, builder, costs):
        s = make(state, builder, costs)
        if s is None:
            raise SystemExit(f"{gen.drafter.name}: no cost-aware rounds (no tune, or --speculation always)")
        observe = s.observe

        def observed(drafted_depth, accepted, nodes, calls):
            c = s.speculation.costs
            cost = GoodputPolicy(c.forward_seconds).cost
            records.append([cost(1 + nodes) + c.drafting_seconds(calls) + (s.extra if calls else 0.0), cost(1),
                            nodes, calls])
            return observe(drafted_depth, accepted, nodes, calls)
        s.observe = observed
        return s
    return sizer


def interleaved(gen, ar_gen, ids: list[int], config: GenerationConfig) -> tuple[list[float], list[float]]:
    """Seconds of each round of ``gen`` and of ``ar_gen`` on ``ids``, their rounds run in turn (`ar`'s first)."""
    times: tuple[list[float], list[float]] = ([], [])
    runs = [ar_gen.generate_blocks(ids, config, GenerationStats()), gen.generate_blocks(ids, config, GenerationStats())]
    for blocks in runs:
        next(blocks)                                                   # the prefill's token
    live = [True, True]
    while any(live):
        for i, blocks in enumerate(runs):
            if live[i]:
                t0 = time.perf_counter()
                done = next(blocks, None) is None
                if done:
                    live[i] = False
                else:
                    times[i].append(time.perf_counter() - t0)
    return times[1], times[0]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--dataset", required=True)
    ap.add_argument("--limit", type=int, default=1, help="prompts per category")
    ap.add_argument("--methods", default="early-exit,rsd-c,eagle,prompt-lookup")
    ap.add_argument("--temperature", type=float, default=0.0)
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--timing", action="store_true", help="greedy rounds with the round-timing correction")
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    model = load_model(a.model)
    prompts = load_prompts(a.dataset, None, a.limit)
    ids = encode_prompts(model, prompts)
    config = GenerationConfig(max_new_tokens=a.max_new_tokens, ignore_eos=True,
                              sampling=SamplingConfig(a.temperature, seed=0))
    ar_gen = build_generator(model, parse_methods("ar")[0].spec)
    print("| method | decode `ar` / method | rounds without drafts × `ar` round (median, mean) | drafting rounds "
          "(calls, nodes): count, × `ar` round measured (median) / modeled (mean) |")
    print("|---|---|---|---|")
    for method in parse_methods(a.methods):
        gen = build_generator(model, method.spec, round_timing=a.timing)
        for _ in gen.generate_blocks(ids[0], config, GenerationStats()):      # untimed: the one-off measurements
            pass
        groups: dict = defaultdict(list)
        spent = [0.0, 0.0]
        for x in ids:
            records: list = []
            gen.round_sizer = recorded(gen, records)
            mine, ar = interleaved(gen, ar_gen, x, config)
            del gen.round_sizer
            spent[0], spent[1] = spent[0] + sum(mine), spent[1] + sum(ar)
            for i, (seconds, (modeled, step, nodes, calls)) in enumerate(zip(mine, records)):
                near = ar[i:i + 2] or ar[-1:]                        # the ar rounds run beside it
                groups[(calls, nodes)].append((seconds / statistics.fmean(near), modeled / step))
        plain = groups.pop((0, 0), [(1.0, 1.0)])
        drafting = "; ".join(f"({c}, {n}): {len(v)}, {statistics.median(r for r, _ in v):.2f} / "
                             f"{statistics.fmean(m for _, m in v):.2f}" for (c, n), v in sorted(groups.items()))
        print(f"| `{method.label}` | **{spent[1] / spent[0]:.3f}** | {statistics.median(r for r, _ in plain):.3f}, "
              f"{statistics.fmean(r for r, _ in plain):.3f} ({len(plain)}) | {drafting or '-'} |", flush=True)
    print(f"(prompts: {len(ids)}; temperature {a.temperature}; round timing {'on' if a.timing else 'off'})",
          file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
