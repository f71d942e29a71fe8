"""What Qwen3's per-head q/k norms cost in the fused step, and what the fused step gains over the torch step on a
Qwen3 shape.  Not a test.  Random-weight ``w4a8`` Qwen3-0.6B-shaped decoder (``benchmarks/shaped_model.py``); one-token
forwards over ``--context`` cached tokens, alternated between: the fused step; the same decoder with its q/k norms
removed (a Llama of the same shape, fused); the torch layer step (``use_fused=False``).  Best of ``--repeats``.

    python benchmarks/qk_norm_cost.py [--context 256] [--repeats 20] [--threads 2]
"""

from __future__ import annotations

import argparse
import copy
import os
import sys
import time
from pathlib import Path

import torch

from speculant.runtime.executor import Executor
from speculant.runtime.tune import cpu_description

sys.path.insert(0, str(Path(__file__).parent))


def main() -> None:
    from shaped_model import shaped_decoder
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--context", type=int, default=256)
    ap.add_argument("--repeats", type=int, default=20)
    ap.add_argument("--threads", type=int, default=None)
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    load0 = os.getloadavg()
    dec = shaped_decoder("qwen3-0.6b")
    plain = copy.copy(dec)
    plain.layers = torch.nn.ModuleList(copy.copy(layer) for layer in dec.layers)
    for layer in plain.layers:
        layer.self_attn = copy.copy(layer.self_attn)
        layer.self_attn.q_norm = layer.self_attn.k_norm = None
    runs = {"fused, q/k norms": Executor(dec, torch.float32), "fused, no q/k norms": Executor(plain, torch.float32),
            "torch step, q/k norms": Executor(dec, torch.float32, use_fused=False)}
    assert runs["fused, q/k norms"].fused_layers() is not None
    g = torch.Generator().manual_seed(0)
    ctx, vocab = args.context, dec.config.vocab_size
    best = {name: float("inf") for name in runs}
    with torch.inference_mode():
        caches = {}
        for name, ex in runs.items():
            caches[name] = ex.new_cache(ctx + 1)
            ex(torch.randint(vocab, (1, ctx), generator=g), None, None, caches[name], 0)
        ids = torch.randint(vocab, (1, 1), generator=g)
        for rep in range(args.repeats + 1):
            for name, ex in runs.items():
                t = time.perf_counter()
                ex(ids, None, None, caches[name], ctx)
                if rep:
                    best[name] = min(best[name], time.perf_counter() - t)
    print(f"CPU: {cpu_description()['model']}, {torch.get_num_threads()} threads, load average {load0[0]:.2f} -> "
          f"{os.getloadavg()[0]:.2f}; Qwen3-0.6B shape, random w4a8 weights, float32 KV cache, context {ctx}, best of "
          f"{args.repeats} alternated one-token forwards\n")
    print("| route | one-token forward [ms] | tok/s |\n|---|---|---|")
    for name, v in best.items():
        print(f"| {name} | {v * 1e3:.2f} | {1 / v:.1f} |")


if __name__ == "__main__":
    main()
