"""Our autoregressive decoding vs transformers' ``generate`` on the same weights and prompts.

Not a test.  One process: the model is loaded once, transformers' ``LlamaForCausalLM`` is built
from our weights (``ours_to_hf_state``), both decode the same chat-templated prompt ids greedily,
interleaved per prompt (the order alternates), after one untimed warm-up each.  Prints tokens/s of
both (mean over prompts of tokens / median wall time, as Spec-Bench), their ratio, whether the
outputs are identical, and the memory-bandwidth floor:

    floor [s/token] = weight bytes read per token / copy bandwidth

where the weight bytes are every decoder layer + final norm + LM head (the embedding lookup reads
one row), and the copy bandwidth is measured as (bytes read + bytes written) / time of
``dst.copy_(src)`` on a tensor much larger than the caches (STREAM "copy" convention).

    python benchmarks/ar_vs_hf.py --limit 1 --max-new-tokens 64 --repeats 3
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

import torch


def copy_bandwidth(mib: int = 512, trials: int = 5) -> float:
    """Best of ``trials`` copies of a ``mib`` MiB fp32 tensor: (read + written bytes) / s."""
    n = mib * 2**20 // 4
    src, dst = torch.randn(n), torch.empty(n)
    dst.copy_(src)
    best = float("inf")
    for _ in range(trials):
        t0 = time.perf_counter()
        dst.copy_(src)
        best = min(best, time.perf_counter() - t0)
    return 2 * n * 4 / best


def main(argv=None) -> int:
    from transformers.utils import logging as hf_logging

    from speculant.bench.datasets import load_prompts
    from speculant.bench.hf_baselines import HFMethod
    from speculant.bench.mbsu import weight_bytes
    from speculant.bench.runner import machine_info
    from speculant.engine.generator import GenerationConfig, SpeculativeGenerator
    from speculant.engine.stats import GenerationStats
    from speculant.models.loading import read_checkpoint

    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--dataset", default="builtin")
    p.add_argument("--categories", default=None, help="comma-separated categories to keep")
    p.add_argument("--limit", type=int, default=1, help="prompts per category")
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--json", default=None, help="also write the results here")
    args = p.parse_args(argv)
    hf_logging.set_verbosity_error()

    model = read_checkpoint(args.model, args.dtype)
    cats = args.categories.split(",") if args.categories else None
    prompts = load_prompts(args.dataset, cats, limit=args.limit)
    ours = SpeculativeGenerator(model)
    hf = HFMethod(model, "hf-ar")
    cfg = GenerationConfig(max_new_tokens=args.max_new_tokens)

    def run_ours(ids, n=None):
        c = cfg if n is None else GenerationConfig(max_new_tokens=n)
        out, t0 = [], time.perf_counter()
        for block in ours.generate_blocks(ids, c, GenerationStats()):
            out.extend(block)
        return out, time.perf_counter() - t0

    def run_hf(ids, n=None):
        r = hf.run(ids, n or args.max_new_tokens)
        return r.token_ids, r.seconds

    ids_all = [ours.encode(pr.text) for pr in prompts]
    run_ours(ids_all[0], 8), run_hf(ids_all[0], 8)            # warm-up, untimed
    rows = []
    for i, (pr, ids) in enumerate(zip(prompts, ids_all)):
        times = {"ours": [], "hf": []}
        outs = {}
        for _ in range(args.repeats):
            order = [("ours", run_ours), ("hf", run_hf)]
            for name, fn in (order if i % 2 == 0 else order[::-1]):
                toks, sec = fn(ids)
                times[name].append(sec)
                outs[name] = toks
        rows.append({"prompt": pr.id, "category": pr.category, "prompt_tokens": len(ids),
                     "ours_tokens": len(outs["ours"]), "hf_tokens": len(outs["hf"]),
                     "ours_tps": len(outs["ours"]) / statistics.median(times["ours"]),
                     "hf_tps": len(outs["hf"]) / statistics.median(times["hf"]),
                     "identical": outs["ours"] == outs["hf"], "seconds": times})
        print(f"{pr.id:<16} ours {rows[-1]['ours_tps']:6.2f} tok/s  hf {rows[-1]['hf_tps']:6.2f} tok/s  "
              f"identical={rows[-1]['identical']}", file=sys.stderr)
    bw = copy_bandwidth()
    wb = weight_bytes(model.decoder)
    ours_tps = statistics.mean(r["ours_tps"] for r in rows)
    hf_tps = statistics.mean(r["hf_tps"] for r in rows)
    res = {"model": model.name, "dtype": args.dtype, "prompts": len(rows), "max_new_tokens": args.max_new_tokens,
           "repeats": args.repeats, "ours_tokens_per_second": ours_tps, "hf_tokens_per_second": hf_tps,
           "ratio_ours_over_hf": ours_tps / hf_tps, "identical_outputs": sum(r["identical"] for r in rows),
           "weight_bytes_per_token": wb, "copy_bandwidth_bytes_per_s": bw,
           "bandwidth_floor_s_per_token": wb / bw, "bandwidth_ceiling_tokens_per_s": bw / wb,
           "machine": machine_info(), "measured": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "rows": rows}
    print(f"ours {ours_tps:.2f} tok/s | transformers {hf_tps:.2f} tok/s | ratio {ours_tps / hf_tps:.2f} | "
          f"identical {res['identical_outputs']}/{len(rows)} | weights {wb / 2**20:.1f} MiB/token, "
          f"copy bandwidth {bw / 2**30:.2f} GiB/s -> floor {1000 * wb / bw:.1f} ms/token "
          f"({bw / wb:.1f} tok/s ceiling)")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(res, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
