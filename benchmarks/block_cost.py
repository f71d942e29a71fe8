"""Cost of one forward over T new tokens (a verification block) relative to one decoding step, per weight format.

Not a test.  SmolLM2-135M in our runtime, KV cache holding ``--context`` tokens, full forward (all layers,
final norm, LM head over every row) over T = 1..16 new tokens, best of ``--repeats`` runs, formats
interleaved, each in the format's runtime (compiled unless ``--no-compile``).  Speculative decoding
assumes the T-token forward costs about one 1-token step (Leviathan et al. 2023, Sec. 3); on a CPU the
quantized kernels become compute-bound after a few rows, which this table shows.

    python benchmarks/block_cost.py --weights fp32,bf16,int8,int4

The C kernels' variant (``$SPECULANT_KERNEL_ISA``, :mod:`speculant.kernels.build`) is printed with the table.
"""

from __future__ import annotations

import argparse
import time

import torch

from speculant.kernels import build
from speculant.runtime.loader import load_model


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--weights", default="fp32,bf16,int8,int4")
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--context", type=int, default=300)
    ap.add_argument("--repeats", type=int, default=9)
    ap.add_argument("--rows", default="1,2,3,4,5,6,8,12,16")
    ap.add_argument("--no-compile", action="store_true")
    ap.add_argument("--kv-cache", default="auto", help="KV cache dtype (load_model's kv_cache)")
    args = ap.parse_args()
    rows_list = [int(r) for r in args.rows.split(",")]
    models = {w: load_model(weights=w, compile=not args.no_compile, threads=args.threads, kv_cache=args.kv_cache)
              for w in args.weights.split(",")}
    ctx = args.context
    g = torch.Generator().manual_seed(0)
    prompt = torch.randint(0, 49152, (1, ctx), generator=g)
    caches = {}
    with torch.inference_mode():
        for w, m in models.items():
            caches[w] = m.executor.new_cache(ctx + max(rows_list))
            m.executor(prompt, None, None, caches[w], 0)
        times = {w: {r: [] for r in rows_list} for w in models}
        for rep in range(args.repeats + 1):
            for rows in rows_list:
                ids = torch.randint(0, 49152, (1, rows), generator=g)
                for w, m in models.items():
                    t0 = time.perf_counter()
                    m.executor(ids, None, None, caches[w], ctx)
                    if rep:
                        times[w][rows].append(time.perf_counter() - t0)
    runtime = ", ".join(f"{w}: " + ("fused step" if m.fused else "compiled" if m.compiled else "eager")
                        + f", {str(m.executor.kv_dtype).removeprefix('torch.')} KV cache" for w, m in models.items())
    print(f"threads {torch.get_num_threads()}, context {ctx}, runtime ({runtime}), kernels {build.loaded_isa()}; "
          "cost of a T-token forward in one-token steps of the same format\n")
    print("| weights | one step [ms] | " + " | ".join(f"T={r}" for r in rows_list) + " |")
    print("|---|---|" + "---|" * len(rows_list))
    for w in models:
        best = {r: min(v) for r, v in times[w].items()}
        step = best[rows_list[0]]
        print(f"| {w} | {step * 1e3:.2f} | " + " | ".join(f"{best[r] / step:.2f}" for r in rows_list) + " |")


if __name__ == "__main__":
    main()
