"""Usage: python benchmarks/q4k_in_cache.py ROWSxCOLS [...]

Q4_K products called 200 times in a row on one matrix (so it sits in cache), through the C entry points without torch:
int8 scales (W4A8KLinear, spec_w4a8q4k_f32) against float32 ones (W4A8Linear, spec_w4a8k_f32), 1 and 5 rows, 15
alternated batches, best and median microseconds a call (BENCHMARKS.md AU.1).  Not a test."""
import sys
import time
import statistics
import numpy as np
import torch
sys.path.insert(0, str(__import__("pathlib").Path(__file__).resolve().parents[1] / "tests"))
from gguf_helpers import k_quant_blocks
from speculant.models.gguf_codes import decode_blocks
from speculant.runtime.formats import W4A8KLinear, W4A8Linear
from speculant.kernels import build
lib = build.load()
torch.set_num_threads(2)
for rows, cols in [tuple(map(int, a.split("x"))) for a in sys.argv[1:]]:
    gq = decode_blocks("Q4_K", k_quant_blocks(rows, cols, "Q4_K", np.random.default_rng(0)).reshape(rows, -1))
    a, b = W4A8KLinear(gq), W4A8Linear(gq)
    for m in (1, 5):
        x = torch.randn(m, cols)
        y = torch.empty(m, rows)
        calls = {"int8": (lib.spec_w4a8q4k_f32, a.codes, a.scales, a.supers), "f32": (lib.spec_w4a8k_f32, b.codes, b.scales, b.offsets)}
        T = {k: [] for k in calls}
        for _ in range(15):
            for k, (f, c, s1, s2) in calls.items():
                t0 = time.perf_counter()
                for _ in range(200):
                    f(x.data_ptr(), m, cols, c.data_ptr(), s1.data_ptr(), s2.data_ptr(), rows, y.data_ptr(), 0)
                T[k].append((time.perf_counter() - t0) / 200)
        print(rows, cols, m, {k: (round(min(v)*1e6, 1), round(statistics.median(v)*1e6, 1)) for k, v in T.items()}, flush=True)
