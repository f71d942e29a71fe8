"""A/B of the KV cache dtype (float32 vs float16) on one w4a8 model in one process.

Not a test.  Two measurements, the two cache dtypes alternated so the machine's drift hits both alike, each through
its own executor of the same decoder (a second model instance, as ``speculant bench``'s ``rt=w4a8-kv16`` rows load,
keeps its weights elsewhere in memory):

* ``step``: the forward in our runtime (the model's executor: the fused step) over T = 1 and 5 new tokens at each
  ``--contexts`` cached tokens (the same prompt in both caches), ``--repeats`` alternated repeats, min / median [ms];
* ``methods``: every method of :data:`METHODS` over the prompts of ``--dataset`` (Spec-Bench JSONL), 128 new
  tokens, greedy, the two dtypes alternated prompt by prompt (order flipped each prompt): tok/s and block
  efficiency (tokens per target forward) per dtype.

    python benchmarks/kv_cache_ab.py step --contexts 128,300,900 --repeats 60
    python benchmarks/kv_cache_ab.py methods --dataset held.jsonl
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import statistics
import time

import torch

from speculant import GenerationConfig, SamplingConfig, build_generator
from speculant.engine.methods import MethodSpec
from speculant.runtime.loader import load_model
from speculant.runtime.tune import cpu_description

DTYPES = {"float32": torch.float32, "float16": torch.float16}
METHODS = [dict(method="ar"), dict(method="prompt-lookup", num_speculations=3),
           dict(method="eagle", num_speculations="auto"), dict(method="early-exit", exit_layer=8, num_speculations=3),
           dict(method="rsd-s", beam_width=2, draft_length=3, exit_layer=8)]


def executors(model) -> dict:
    """Cache dtype name -> an executor of ``model``'s decoder (the same weights) with that KV cache dtype."""
    out = {}
    for name, dt in DTYPES.items():
        out[name] = model.executor.like(model.decoder)
        out[name].kv_dtype = dt
    return out


def step(model, contexts: list[int], repeats: int) -> None:
    runs, g = executors(model), torch.Generator().manual_seed(0)
    print("| cached tokens | KV cache | T=1 min / median [ms] | T=5 min / median [ms] |\n|---|---|---|---|")
    with torch.inference_mode():
        for ctx in contexts:
            prompt = torch.randint(0, model.config.vocab_size, (1, ctx), generator=g)
            caches = {}
            for name, ex in runs.items():
                caches[name] = ex.new_cache(ctx + 16)
                ex(prompt, None, None, caches[name], 0)
            times = {(name, t): [] for name in caches for t in (1, 5)}
            for _ in range(repeats):
                for name, cache in caches.items():
                    for t in (1, 5):
                        ids = torch.randint(0, model.config.vocab_size, (1, t), generator=g)
                        t0 = time.perf_counter()
                        runs[name](ids, None, None, cache, ctx)
                        times[name, t].append(time.perf_counter() - t0)
            for name in caches:
                one, five = times[name, 1], times[name, 5]
                print(f"| {ctx} | {name} | {min(one) * 1e3:.2f} / {statistics.median(one) * 1e3:.2f} | "
                      f"{min(five) * 1e3:.2f} / {statistics.median(five) * 1e3:.2f} |")


def methods(model, dataset: str) -> None:
    with open(dataset) as f:
        rows = [json.loads(line) for line in f if line.strip()]
    texts = [r["turns"][0] if "turns" in r else r["prompt"] for r in rows]
    cfg = GenerationConfig(max_new_tokens=128, sampling=SamplingConfig(temperature=0))
    print(f"{len(texts)} prompts\n\n| method | float32 tok/s | float16 tok/s | float16 / float32 | "
          "block efficiency float32 / float16 |\n|---|---|---|---|---|")
    models = {}
    for name, ex in executors(model).items():       # the same weights, one executor per cache dtype
        models[name] = copy.copy(model)
        models[name].executor = ex
    for spec in METHODS:
        gens = {name: build_generator(m, MethodSpec(**spec)) for name, m in models.items()}
        for gen in gens.values():
            gen.generate(texts[0], GenerationConfig(max_new_tokens=8))                    # warm-up
        seconds, tokens, forwards = ({name: 0.0 for name in DTYPES} for _ in range(3))
        for i, text in enumerate(texts):
            for name in (list(DTYPES) if i % 2 else list(DTYPES)[::-1]):
                t0 = time.perf_counter()
                out = gens[name].generate(text, cfg)
                seconds[name] += time.perf_counter() - t0
                tokens[name] += len(out.token_ids)
                forwards[name] += out.stats.target_forwards
        rate = {name: tokens[name] / seconds[name] for name in DTYPES}
        label = ",".join(f"{k}={v}" for k, v in spec.items())
        print(f"| {label} | {rate['float32']:.1f} | {rate['float16']:.1f} | {rate['float16'] / rate['float32']:.3f} | "
              f"{tokens['float32'] / forwards['float32']:.2f} / {tokens['float16'] / forwards['float16']:.2f} |",
              flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("what", choices=("step", "methods"))
    ap.add_argument("--contexts", default="128,300,900")
    ap.add_argument("--repeats", type=int, default=60)
    ap.add_argument("--dataset", help="Spec-Bench JSONL (methods)")
    args = ap.parse_args()
    if args.what == "methods" and not args.dataset:
        raise SystemExit("kv_cache_ab methods: --dataset is required (a Spec-Bench JSONL file)")
    model = load_model(weights="w4a8", kv_cache="float32")
    print(f"CPU: {cpu_description()}, {torch.get_num_threads()} threads, load {os.getloadavg()[0]:.2f}\n")
    if args.what == "step":
        step(model, [int(c) for c in args.contexts.split(",")], args.repeats)
    else:
        methods(model, args.dataset)


if __name__ == "__main__":
    main()
