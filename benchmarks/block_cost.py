"""Cost of one forward over T new tokens (a verification block) relative to one decoding step.

Not a test.  SmolLM2-135M in our runtime, KV cache holding ``--context`` tokens, full forward
(30 layers + final norm + LM head) over T = 1..16 new tokens, median of ``--repeats`` runs, for the
two routes of ``speculant.models.linear.small_batch_linear``: MKL's ``F.linear`` (``x @ W^T``) and
the transposed product ``(W @ x^T)^T`` used for 2..16 rows.  Speculative decoding assumes the
T-token forward costs about one 1-token step (Leviathan et al. 2023, Sec. 3).

    python benchmarks/block_cost.py --threads 2
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

import speculant.models.linear as linear
from speculant.models.loading import load_model


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--context", type=int, default=300)
    ap.add_argument("--repeats", type=int, default=9)
    ap.add_argument("--rows", default="1,2,3,4,5,6,8,12,16")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    rows_list = [int(r) for r in args.rows.split(",")]
    dec = load_model().decoder
    L, ctx = dec.num_layers, args.context
    cache = dec.new_cache(ctx + max(rows_list))
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        dec.run_layers(dec.embed(torch.randint(0, dec.config.vocab_size, (1, ctx), generator=g)), 0, L,
                       torch.arange(ctx), None, cache, 0)

    def timed(fn) -> float:
        fn()
        times = []
        for _ in range(args.repeats):
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
        return statistics.median(times)

    results = {}
    default_max = linear.SMALL_BATCH_MAX_ROWS
    for route, max_rows in (("F.linear (x @ W^T)", 1), ("speculant (W @ x^T)^T", default_max)):
        linear.SMALL_BATCH_MAX_ROWS = max_rows
        out = []
        for rows in rows_list:
            x = torch.randn(1, rows, dec.config.hidden_size, generator=g)
            pos = torch.arange(ctx, ctx + rows)
            with torch.no_grad():
                out.append(timed(lambda: dec.lm_head(dec.final_norm(dec.run_layers(x, 0, L, pos, None, cache, ctx)))))
        results[route] = out
    linear.SMALL_BATCH_MAX_ROWS = default_max
    step = results["F.linear (x @ W^T)"][0]
    print(f"threads {torch.get_num_threads()}, context {ctx}, one decoding step {step * 1e3:.1f} ms\n")
    print("| route | " + " | ".join(f"T={r}" for r in rows_list) + " |")
    print("|---|" + "---|" * len(rows_list))
    for route, out in results.items():
        print(f"| {route} | " + " | ".join(f"{t / step:.2f}" for t in out) + " |")


if __name__ == "__main__":
    main()
