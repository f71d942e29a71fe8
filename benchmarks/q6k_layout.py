"""Usage: python benchmarks/q6k_layout.py [ROWS] [KIND]

One-row (and four-row) product through a Llama-3.2-1B-shaped matrix ``[ROWS, 2048]`` of random K-quant blocks, the
layout as stored against the folded one on the same codes, outputs checked equal, alternated 30 times each, 2
threads; prints MB read, best and median time.  KIND ``Q6_K`` (default; ROWS 128256, the LM head): the 6-bit layout
(``W6A8Linear``) against the 8-bit one (``W8A8Linear``), BENCHMARKS.md AT.1; ``Q4_K`` (ROWS e.g. 16384, gate|up):
integer scales and mins (``W4A8KLinear``) against float32 ones (``W4A8Linear``), BENCHMARKS.md AU."""
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))     # the tests' K-quant block maker
from gguf_helpers import k_quant_blocks  # noqa: E402

from speculant.models.gguf_codes import decode_blocks  # noqa: E402
from speculant.runtime.formats import W4A8KLinear, W4A8Linear, W6A8Linear, W8A8Linear  # noqa: E402

torch.set_num_threads(2)
rows, cols = int(sys.argv[1]) if len(sys.argv) > 1 else 128256, 2048
kind = sys.argv[2] if len(sys.argv) > 2 else "Q6_K"
gq = decode_blocks(kind, k_quant_blocks(rows, cols, kind, np.random.default_rng(0)).reshape(rows, -1))
layouts = ({"6-bit": W6A8Linear(gq), "8-bit": W8A8Linear(gq)} if kind == "Q6_K" else
           {"int8 scales": W4A8KLinear(gq), "float32 scales": W4A8Linear(gq)})
first, second = layouts
size = {k: sum(b.numel() * b.element_size() for b in lin.buffers()) / 1e6 for k, lin in layouts.items()}
for m in (1, 4):
    x = torch.randn(m, cols)
    assert torch.equal(layouts[first](x), layouts[second](x))
    times = {k: [] for k in layouts}
    for _ in range(30):
        for name, lin in layouts.items():
            t0 = time.perf_counter()
            lin(x)
            times[name].append(time.perf_counter() - t0)
    for name, v in times.items():
        print(f"M={m} {name}: {size[name]:.0f} MB, best {min(v) * 1e3:.2f} ms, median {statistics.median(v) * 1e3:.2f} ms, "
              f"{size[name] / 1e3 / min(v):.1f} GB/s at best")
