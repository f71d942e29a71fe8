"""Cost of one draft-head step against one target step: the head in float32, in int8 and in w8a8 through the torch
modules, and in w8a8 as one C call (the fused head, speculant/kernels/draft_head_step.py).

Not a test.  Loads the model for decoding (default weights, compiled), fills a KV cache of ``--context``
tokens for the target and the head, then times one target step (30 layers + final norm + LM head, one token)
and one head draft as the drafter runs it (``DraftHead.step``: ``fc`` + its layer + the draft-vocabulary LM-head
rows, one row; then the greedy draft distribution, the softmax over the draft vocabulary placed in a ``[V]`` row,
and its argmax), median of ``--repeats``.  ``--interleave``: a target step before each head step, so the head's
weights are read from memory as in decoding (the target's stream flushes the caches) rather than from cache.

    python benchmarks/draft_head_cost.py [--head default] [--context 300] [--repeats 200] [--interleave] [--threads N]
"""
from __future__ import annotations

import argparse
import time

import torch

from speculant.drafters.draft_head import fused_head_why_not, load_head
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
    ap.add_argument("--interleave", action="store_true")
    ap.add_argument("--threads", type=int, default=0, help="threads (0: the tuned count)")
    args = ap.parse_args()
    model = load_model(args.model)
    if args.threads:
        torch.set_num_threads(args.threads)
    dec, n, d = model.executor, args.context, model.config.hidden_size      # the runtime's route
    cache = dec.new_cache(n + 8)
    dec.run_layers(torch.randn(1, n, d), 0, dec.num_layers, torch.arange(n), None, cache, 0)
    x = torch.randn(1, 1, d)

    def target_step():
        return dec.lm_head(dec.final_norm(dec.run_layers(x, 0, dec.num_layers, torch.arange(n, n + 1), None, cache, n)))

    print(f"weights {model.weights}, compiled {model.compiled}, context {n}, threads {torch.get_num_threads()}, "
          f"interleaved {args.interleave}\n")
    print("| head projections | route | target step [ms] | head draft [ms] | head / target | head weight bytes [MB] |")
    print("|---|---|---|---|---|---|")
    vocab = model.config.vocab_size
    for fmt, fused in (("fp32", False), ("int8", False), ("w8a8", False), ("w8a8", True)):
        head = load_head(args.head, model, weights=fmt)
        head.use_fused = fused
        if fused and head.fused(torch.float32) is None:
            print(f"| {fmt} | fused: {fused_head_why_not(head, torch.float32)} |")
            continue
        hc = head.new_cache(n + 8)
        head.step(torch.randn(n, d), torch.zeros(n, dtype=torch.long), torch.arange(n), None, hc, 0, 1)
        f1, t1, p1 = torch.randn(1, d), torch.zeros(1, dtype=torch.long), torch.arange(n, n + 1)

        def head_draft():
            _, logits = head.step(f1, t1, p1, None, hc, n)
            q = logits.new_zeros(1, vocab)
            q.index_copy_(1, head.vocab_ids, torch.softmax(logits, -1))
            return q.argmax(-1).tolist()

        def both():
            target_step()
            t0 = time.perf_counter()
            head_draft()
            return time.perf_counter() - t0

        for _ in range(20):
            target_step()
            head_draft()
        a = median_ms(target_step, args.repeats)
        if args.interleave:
            times = sorted(both() for _ in range(args.repeats))
            b = times[len(times) // 2] * 1e3
        else:
            b = median_ms(head_draft, args.repeats)
        route = "fused (one C call)" if fused else "torch modules"
        print(f"| {fmt} | {route} | {a:.2f} | {b:.3f} | {b / a:.3f} | {head.weight_bytes() / 1e6:.1f} |")

if __name__ == "__main__":
    main()
