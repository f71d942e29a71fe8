"""Where a decoding step's time goes: the decoder layers and the LM head of one forward, fused step vs compiled layers.

Not a test.  SmolLM2-135M in ``w4a8`` with a KV cache holding ``--context`` tokens; for T = 1 and 5 new tokens, the
best of ``--repeats`` timings of: the whole forward (``executor(ids, ..., cache, context)``), the 30 decoder layers
alone (``executor.run_layers``) and the final norm + LM head alone, in two runtimes of the same packed weights, interleaved:

* ``fused``: every layer of the forward in one C call (:mod:`speculant.kernels.decode_step`, the default);
* ``compiled``: the fused step turned off (``executor.use_fused = False``) and the layer step compiled with
  ``torch.compile`` (:mod:`speculant.runtime.compiled`), the runtime before the fused step.

    python benchmarks/step_breakdown.py [--context 300] [--repeats 30]
"""

from __future__ import annotations

import argparse
import os

import torch

from speculant.bench.costs import timings
from speculant.runtime.compiled import enable_compile
from speculant.runtime.loader import load_model
from speculant.runtime.tune import cpu_description


def best_ms(fn, repeats: int) -> float:
    return min(timings(fn, repeats)) * 1e3


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--context", type=int, default=300)
    ap.add_argument("--repeats", type=int, default=30)
    args = ap.parse_args()
    fused = load_model(weights="w4a8")
    compiled = load_model(weights="w4a8")
    compiled.executor.use_fused = False
    if not fused.fused or not enable_compile(compiled.executor):
        raise SystemExit("needs the fused step (our kernels) and a C++ compiler for torch.compile")
    ctx = args.context
    g = torch.Generator().manual_seed(0)
    prompt = torch.randint(0, fused.config.vocab_size, (1, ctx), generator=g)
    rows = {}
    with torch.inference_mode():
        caches = {}
        for name, m in (("fused", fused), ("compiled", compiled)):
            caches[name] = m.executor.new_cache(ctx + 16)
            m.executor(prompt, None, None, caches[name], 0)
        for t in (1, 5):
            ids = torch.randint(0, fused.config.vocab_size, (1, t), generator=g)
            pos = torch.arange(ctx, ctx + t)
            hidden = torch.randn(1, t, fused.config.hidden_size, generator=g)
            for name, m in (("fused", fused), ("compiled", compiled)):
                d, c = m.executor, caches[name]
                h = d.embed(ids)
                rows[(name, t)] = (best_ms(lambda: d(ids, None, None, c, ctx), args.repeats),
                                   best_ms(lambda: d.run_layers(h, 0, d.num_layers, pos, None, c, ctx), args.repeats),
                                   best_ms(lambda: d.lm_head(d.final_norm(hidden)), args.repeats))
    cpu = cpu_description()
    print(f"CPU: {cpu['model']} ({', '.join(cpu['isa'])}), {torch.get_num_threads()} threads, load {os.getloadavg()[0]:.2f}; SmolLM2 w4a8, "
          f"context {ctx} tokens, best of {args.repeats} [ms]\n")
    print("| runtime | T | whole forward | 30 layers | final norm + LM head | rest |\n|---|---|---|---|---|---|")
    for (name, t), (whole, layers, head) in rows.items():
        print(f"| {name} | {t} | {whole:.2f} | {layers:.2f} | {head:.2f} | {whole - layers - head:.2f} |")


if __name__ == "__main__":
    main()
