"""GB/s of our one-row weight products against what the machine streams, at a real model's shapes.

Not a test.  Decoding one token reads every weight once, so a one-row product is bound by memory bandwidth; this
prints (1) the machine's streaming read rate (``torch.sum`` over a 1 GiB int64 and float32 tensor, best of 5) and
(2) our kernels' rate on packed random weights that do not fit the caches: ``--copies`` [O, I] projections in ``w4a8``
called in turn (the layers' case) at each ``--prefetch`` distance (bytes ahead the kernel prefetches; ``none``:
the format's default), and one ``w8a8`` LM head [V, I]; best of 5 passes, after one warm-up.  Bytes are the packed
buffers' (codes and scales).

    python benchmarks/kernel_bandwidth.py [--shape 16384x2048] [--copies 6] [--head 128256x2048] [--threads 2]
"""
from __future__ import annotations

import argparse
import time

import torch

from speculant.runtime.formats import pack_linear
from speculant.runtime.tune import cpu_description


def best_seconds(fn, repeats: int = 5) -> float:
    fn()
    best = float("inf")
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t)
    return best


def stream_rate(dtype: torch.dtype) -> float:
    x = torch.ones(1 << 30, dtype=torch.uint8).view(dtype)
    return x.numel() * x.element_size() / best_seconds(lambda: x.sum()) / 1e9


def product_rate(fmt: str, out_features: int, in_features: int, copies: int, prefetch: int | None) -> tuple[float, float]:
    """(GB/s, ms per pass) of ``copies`` one-row products in ``fmt``."""
    mods = [pack_linear(fmt, torch.randn(out_features, in_features) * 0.02, None) for _ in range(copies)]
    if prefetch is not None:
        for m in mods:
            m.prefetch = prefetch
    nbytes = sum(t.numel() * t.element_size() for m in mods for t in m.buffers())
    x = torch.randn(1, in_features)

    def run():
        for m in mods:
            m(x)
    with torch.inference_mode():
        s = best_seconds(run)
    return nbytes / s / 1e9, s * 1e3


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shape", default="16384x2048", help="one projection's OUTxIN (default: Llama-3.2-1B gate/up)")
    ap.add_argument("--copies", type=int, default=6)
    ap.add_argument("--head", default="128256x2048", help="the LM head's VxIN (w8a8)")
    ap.add_argument("--prefetch", default="none,0,512,2048", help="comma-separated distances in bytes, or none")
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    o, i = (int(v) for v in args.shape.split("x"))
    v, hi = (int(x) for x in args.head.split("x"))
    cpu = cpu_description()
    print(f"CPU: {cpu['model']} ({', '.join(cpu['isa'])}), {args.threads} threads\n")
    print(f"| what | GB/s | ms |\n|---|---|---|\n| stream: sum over 1 GiB int64 | {stream_rate(torch.int64):.1f} | |")
    print(f"| stream: sum over 1 GiB float32 | {stream_rate(torch.float32):.1f} | |")
    for p in args.prefetch.split(","):
        rate, ms = product_rate("w4a8", o, i, args.copies, None if p == "none" else int(p))
        print(f"| w4a8 [{o}, {i}] x {args.copies}, prefetch {p} | {rate:.1f} | {ms:.2f} |")
    rate, ms = product_rate("w8a8", v, hi, 1, None)
    print(f"| w8a8 LM head [{v}, {hi}] | {rate:.1f} | {ms:.2f} |")


if __name__ == "__main__":
    main()
