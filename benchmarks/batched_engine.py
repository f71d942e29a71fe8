"""The batched engine alone (no HTTP): prefill and rounds for 1 and 8 sequences, what `speculant serve` runs per round.

Not a test.  SmolLM2-135M (the default model and weights), the chat prompts of ``benchmarks/load_test.py``, greedy,
``--max-new-tokens`` each; for N = 1 and N = 8 sequences started together (:meth:`BatchedGenerator.start_many`: the
prompts on the fused step share ragged forwards) and decoded in batched rounds until all finish.  Reports the
prefill time, the time per round and tokens/s (prefill included, as a server pays it), best of ``--repeats``, and
checks that every sequence's tokens equal those it gets decoded alone.

    python benchmarks/batched_engine.py [--max-new-tokens 64] [--repeats 2]
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

import torch

from speculant.engine.batch import BatchedGenerator
from speculant.engine.generator import GenerationConfig
from speculant.runtime.loader import load_model
from speculant.runtime.tune import cpu_description

sys.path.insert(0, str(Path(__file__).parent))
from load_test import PROMPTS  # noqa: E402


def run(bg: BatchedGenerator, prompts: list[list[int]], cfg: GenerationConfig):
    t0 = time.perf_counter()
    seqs = bg.start_many([(p, cfg) for p in prompts])
    t1 = time.perf_counter()
    rounds = 0
    while any(s.finished is None for s in seqs):
        bg.step([s for s in seqs if s.finished is None])
        rounds += 1
    t2 = time.perf_counter()
    tokens = sum(len(s.state.tokens) - len(p) for s, p in zip(seqs, prompts))
    return t1 - t0, t2 - t1, rounds, tokens, [s.state.tokens for s in seqs]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=2)
    args = ap.parse_args()
    model = load_model()
    tok = model.tokenizer

    def ids(text: str) -> list[int]:
        x = tok.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True)
        return list(x if isinstance(x, list) else x["input_ids"])
    prompts = [ids(p) for p in PROMPTS[:8]]
    cfg = GenerationConfig(max_new_tokens=args.max_new_tokens)
    bg = BatchedGenerator(model)
    rows, outs = {}, {}
    with torch.inference_mode():
        run(bg, prompts[:1], cfg)                              # warm-up
        for _ in range(args.repeats):
            for n in (1, 8):
                pre, dec, rounds, tokens, outs[n] = run(bg, prompts[:n], cfg)
                best = rows.get(n)
                if best is None or pre + dec < best[0] + best[1]:
                    rows[n] = (pre, dec, rounds, tokens)
        alone = [run(bg, [p], cfg)[-1][0] for p in prompts]
    print(f"CPU: {cpu_description()}, {torch.get_num_threads()} threads, load {os.getloadavg()[0]:.2f}; "
          f"weights {model.weights}, prompts of {min(map(len, prompts))}-{max(map(len, prompts))} tokens, "
          f"{args.max_new_tokens} new tokens each, greedy, best of {args.repeats}\n")
    print("| sequences | prefill [ms] | rounds | per round [ms] | tokens/s (prefill included) | vs 1 |")
    print("|---|---|---|---|---|---|")
    base = rows[1][3] / (rows[1][0] + rows[1][1])
    for n, (pre, dec, rounds, tokens) in rows.items():
        tps = tokens / (pre + dec)
        print(f"| {n} | {pre * 1e3:.0f} | {rounds} | {dec / rounds * 1e3:.1f} | {tps:.1f} | {tps / base:.2f} |")
    print(f"\nevery sequence equals its decoding alone: {outs[8] == alone}")


if __name__ == "__main__":
    main()
