"""Microseconds per projection call: torch's weight-only kernels vs our W4A8/W8A8 kernel, per SmolLM2 shape and row count.

Not a test.  Random weights of each of SmolLM2-135M's projection shapes (fused q/k/v 576 -> 960, o 576 -> 576,
fused gate/up 576 -> 3072, down 1536 -> 576, LM head 576 -> 49152), each packed by
:func:`speculant.runtime.formats.pack_linear` in ``int4``/``int8`` (torch's ``_weight_int4pack_mm_for_cpu`` /
``_weight_int8pack_mm``) and ``w4a8``/``w8a8`` (ours, :mod:`speculant.kernels.qgemm`); best of ``--repeats``
timings of ``--calls`` calls each, formats interleaved, the call as the model makes it (module forward).

    python benchmarks/qgemm_cost.py [--rows 1,2,4,5,8,16,64,800] [--repeats 5] [--only w4a8]

``--only`` keeps the kernels whose name contains one of its comma-separated words (``--only w4a8,w8a8``: ours alone).

A last row times ``torch._int_mm`` (torch's int8 x int8 -> int32 product, the integer part alone) on the gate/up
shape for up to 8 rows: on CPU it is a reference loop, one reason for a kernel of our own.
"""

from __future__ import annotations

import argparse
import time

import torch

from speculant.runtime.formats import pack_linear
from speculant.runtime.tune import cpu_description

SHAPES = {"qkv": (960, 576), "o": (576, 576), "gate_up": (3072, 576), "down": (576, 1536), "lm_head": (49152, 576)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows", default="1,2,4,5,8,16,64,800")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--calls", type=int, default=20)
    ap.add_argument("--only", default="", help="comma-separated words; keep the kernels whose name contains one")
    args = ap.parse_args()
    rows = [int(r) for r in args.rows.split(",")]
    only = [w for w in args.only.split(",") if w]
    keep = lambda kernel: not only or any(w in kernel for w in only)      # noqa: E731
    g = torch.Generator().manual_seed(0)
    cpu = cpu_description()
    print(f"CPU: {cpu['model']} ({', '.join(cpu['isa'])}), torch {torch.__version__}, {torch.get_num_threads()} threads; "
          f"microseconds per call, best of {args.repeats}\n")
    print("| projection | kernel | " + " | ".join(f"{r} row{'s' if r > 1 else ''}" for r in rows) + " |")
    print("|---|---|" + "---|" * len(rows))
    with torch.inference_mode():
        for name, (o, i) in SHAPES.items():
            w = torch.randn(o, i, generator=g) * 0.02
            head = name == "lm_head"
            mods = {"torch int8" if head else "torch int4": pack_linear("int8" if head else "int4", w),
                    "ours w8a8" if head else "ours w4a8": pack_linear("w8a8" if head else "w4a8", w)}
            mods = {k: m for k, m in mods.items() if keep(k)}
            best = {k: {} for k in mods}
            for r in rows:
                x = torch.randn(r, i, generator=g)
                calls = max(1, args.calls if r <= 64 else args.calls // 10)
                for _ in range(args.repeats):
                    for k, m in mods.items():
                        m(x)
                        t = time.perf_counter()
                        for _ in range(calls):
                            m(x)
                        us = (time.perf_counter() - t) / calls * 1e6
                        best[k][r] = min(best[k].get(r, us), us)
            for k in mods:
                print(f"| {name} {i}->{o} | {k} | " + " | ".join(f"{best[k][r]:.0f}" for r in rows) + " |")
        if not keep("torch._int_mm"):
            return
        o, i = SHAPES["gate_up"]
        b = torch.randint(-127, 128, (o, i), dtype=torch.int8, generator=g).t()      # [I, O], column-major
        cells = []
        for r in rows:
            if r > 8:
                cells.append("–")
                continue
            a = torch.randint(-127, 128, (r, i), dtype=torch.int8, generator=g)
            torch._int_mm(a, b)
            t = time.perf_counter()
            for _ in range(5):
                torch._int_mm(a, b)
            cells.append(f"{(time.perf_counter() - t) / 5 * 1e6:.0f}")
        print(f"| gate_up {i}->{o} | torch._int_mm (int8 x int8 only) | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
