"""Microseconds per attention call of our attention kernel (one layer of a decoding step, a block or a batched round).

Not a test.  SmolLM2-135M's attention shape (9 query heads, 3 key/value heads, head size 64), a float32 or float16 (``--kv``)
KV cache holding ``--contexts`` tokens, T new query rows attending causally (``--rows``), best of ``--repeats`` timings of
``--calls`` calls of the kernel's C entry point ``spec_attention`` (the code the fused step runs per layer, without
the torch op's wrapper).  Multiply by 30 layers for a step's attention time.

    python benchmarks/attention_cost.py [--contexts 100,300,1000] [--rows 1,5,8] [--repeats 7] [--kv float16]
"""

from __future__ import annotations

import argparse
import os

import torch

from speculant.bench.costs import timings
from speculant.kernels import attention, build
from speculant.runtime.tune import cpu_description


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--contexts", default="100,300,1000")
    ap.add_argument("--rows", default="1,5,8")
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--calls", type=int, default=30)
    ap.add_argument("--kv", choices=("float32", "float16"), default="float32", help="KV cache dtype")
    args = ap.parse_args()
    if not attention.supports(64):
        raise SystemExit("needs our kernels (x86-64 with AVX2 and FMA, a C compiler)")
    heads, kv_heads, dim = 9, 3, 64
    contexts, rows = [int(c) for c in args.contexts.split(",")], [int(t) for t in args.rows.split(",")]
    g = torch.Generator().manual_seed(0)
    kv_dtype = getattr(torch, args.kv)
    table = {}
    for ctx in contexts:
        keys = torch.randn(1, kv_heads, ctx + max(rows), dim, generator=g).to(kv_dtype)
        values = torch.randn(1, kv_heads, ctx + max(rows), dim, generator=g).to(kv_dtype)
        for t in rows:
            q = torch.randn(t, heads, dim, generator=g)
            mask = (torch.arange(ctx + t)[None, :] <= torch.arange(t)[:, None] + ctx).to(torch.uint8)
            out = torch.empty(t, heads, dim)
            ptrs = (q.data_ptr(), keys.data_ptr(), values.data_ptr(), keys.shape[2], mask.data_ptr(), t, heads,
                    kv_heads, dim, ctx + t, dim ** -0.5, attention.kv_bytes(kv_dtype), out.data_ptr())

            def calls():
                for _ in range(args.calls):
                    build._LIB.spec_attention(*ptrs)
            table[ctx, t] = min(timings(calls, args.repeats)) / args.calls * 1e6
    print(f"CPU: {cpu_description()}, {torch.get_num_threads()} threads, load {os.getloadavg()[0]:.2f}; "
          f"{args.kv} KV cache; microseconds per call (one layer), best of {args.repeats}\n")
    print("| cached tokens | " + " | ".join(f"T={t}" for t in rows) + " |")
    print("|---|" + "---|" * len(rows))
    for ctx in contexts:
        print(f"| {ctx} | " + " | ".join(f"{table[ctx, t]:.1f}" for t in rows) + " |")


if __name__ == "__main__":
    main()
