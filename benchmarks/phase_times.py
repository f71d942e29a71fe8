"""Usage: python benchmarks/phase_times.py DATASET CATEGORIES METHODS [--prompts N] [--temperature T] [--idle]

Time to the first token (prefill) and of the decoding phase of each method, SmolLM2, 128 new tokens (EOS ignored),
the first N dev prompts of each category, mean of three runs after a warm-up (BENCHMARKS.md AW.1, AW.3).  METHODS
as ``speculant bench --methods`` takes them.  ``--idle``: each speculative method also as ``LABEL-idle``, run with
a cost table under which no drafting pays: its drafter's hooks without its drafts.  Not a test."""
import argparse
import json

from speculant import GenerationConfig, SamplingConfig, build_generator, load_model
from speculant.bench.specs import parse_methods
from speculant.engine.goodput import CostTable

ap = argparse.ArgumentParser()
ap.add_argument("dataset")
ap.add_argument("categories")
ap.add_argument("methods", help="as bench's --methods, e.g. ar,eagle:K=4,prompt-lookup")
ap.add_argument("--prompts", type=int, default=1)
ap.add_argument("--temperature", type=float, default=0.0)
ap.add_argument("--idle", action="store_true")
args = ap.parse_args()
rows = [json.loads(line) for line in open(args.dataset)]
model = load_model("smollm2-135m")
never = CostTable({1: 0.010, 2: 0.0105, 4: 0.0115, 8: 0.0135, 16: 0.0175}, 0.010)   # a draft call = a step
gens = {}
for m in parse_methods(args.methods):
    gens[m.label] = build_generator(model, m.spec)
    if args.idle and m.name != "ar":
        gens[m.label + "-idle"] = build_generator(model, m.spec, costs=never)
config = GenerationConfig(max_new_tokens=128, ignore_eos=True,
                          sampling=SamplingConfig(temperature=args.temperature, seed=0))
for cat in args.categories.split(","):
    for r in [r for r in rows if r["category"] == cat][:args.prompts]:
        msg = [{"role": "user", "content": r["turns"][0]}]
        for g in gens.values():
            g.generate(msg, config)
        total = {m: [0.0, 0.0] for m in gens}
        for _ in range(3):
            for m, g in gens.items():
                s = g.generate(msg, config).stats
                total[m][0] += s.time_to_first_token_s / 3
                total[m][1] += (s.seconds - s.time_to_first_token_s) / 3
        print(cat, r["question_id"], " | ".join(f"{m}: prefill {a * 1e3:.0f} ms, decoding {b * 1e3:.0f} ms"
                                                for m, (a, b) in total.items()))
