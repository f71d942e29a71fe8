"""Cost of one draft-head step against one target step, with the head in float32 and in int8.

Not a test.  Loads the model for decoding (default weights, compiled), fills a KV cache of ``--context``
tokens for the target and the head, then times one target step (30 layers + final norm + LM head, one token)
and one head step (``fc`` + its layer + the draft-vocabulary LM-head rows, one token), median of ``--repeats``.

    python benchmarks/draft_head_cost.py [--head default] [--context 300] [--repeats 200]
"""
from __future__ import annotations

import argparse
import time

import torch

from speculant.drafters.draft_head import load_head
from speculant.runtime.loader import load_model


def median_ms(fn, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return sorted(times)[len(times) // 2] * 1e3


@torch.inference_mode()
def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--head", default="default")
    ap.add_argument("--context", type=int, default=300)
    ap.add_argument("--repeats", type=int, default=200)
    args = ap.parse_args()
    model = load_model(args.model)
    dec, n, d = model.executor, args.context, model.config.hidden_size      # the runtime's route
    cache = dec.new_cache(n + 8)
    dec.run_layers(torch.randn(1, n, d), 0, dec.num_layers, torch.arange(n), None, cache, 0)
    x = torch.randn(1, 1, d)

    def target_step():
        return dec.lm_head(dec.final_norm(dec.run_layers(x, 0, dec.num_layers, torch.arange(n, n + 1), None, cache, n)))

    print(f"weights {model.weights}, compiled {model.compiled}, context {n}, threads {torch.get_num_threads()}\n")
    print("| head projections | target step [ms] | head step [ms] | head / target | head weight bytes [MB] |")
    print("|---|---|---|---|---|")
    for fmt in ("fp32", "int8"):
        head = load_head(args.head, model, weights=fmt)
        hc = head.new_cache(n + 8)
        head(torch.randn(1, n, d), torch.zeros(1, n, dtype=torch.long), torch.arange(n), None, hc, 0)
        f1, t1 = torch.randn(1, 1, d), torch.zeros(1, 1, dtype=torch.long)

        def head_step():
            return head.logits(head(f1, t1, torch.arange(n, n + 1), None, hc, n))

        for _ in range(20):
            target_step()
            head_step()
        a, b = median_ms(target_step, args.repeats), median_ms(head_step, args.repeats)
        print(f"| {fmt} | {a:.2f} | {b:.2f} | {b / a:.3f} | {head.weight_bytes() / 1e6:.1f} |")


if __name__ == "__main__":
    main()
