"""Usage: python benchmarks/lookup_acceptance.py DATASET [--categories C1,C2] [--prompts N]

Prompt lookup's acceptance by the size of the n-gram it matched (BENCHMARKS.md AW.1): SmolLM2 greedy, drafting
K = 8 every round (``speculation="always"``) with n-grams up to 6, 128 new tokens per prompt; prints per matched size
the rounds and alpha_d = P(depth d accepted | depth d - 1 was), d = 1..8.  Not a test."""
import argparse
import collections
import json

from speculant import GenerationConfig, build_generator, load_model
from speculant.engine.generator import SpeculativeGenerator

ap = argparse.ArgumentParser()
ap.add_argument("dataset")
ap.add_argument("--categories", default="summarization,rag,extraction,translation")
ap.add_argument("--prompts", type=int, default=40, help="the first N dev rows of those categories")
args = ap.parse_args()
rows = [json.loads(line) for line in open(args.dataset)]
rows = [r for r in rows if r["category"] in args.categories.split(",")][:args.prompts]
gen = build_generator(load_model("smollm2-135m"), method="prompt-lookup", num_speculations=8, max_ngram=6,
                      speculation="always")
per = collections.defaultdict(list)                 # matched size -> [(drafted, accepted)] per round
round_ = SpeculativeGenerator._round


def counted(self, state, builder, budget, remaining, generator, eos, stats, sizer=None):
    n = self.drafter.round_context(state)
    accepted, drafted = stats.accepted_tokens, stats.drafted_tokens
    block = round_(self, state, builder, budget, remaining, generator, eos, stats, sizer)
    if n:
        per[n].append((stats.drafted_tokens - drafted, stats.accepted_tokens - accepted))
    return block


SpeculativeGenerator._round = counted
for r in rows:
    gen.generate([{"role": "user", "content": r["turns"][0]}], GenerationConfig(max_new_tokens=128))
print("| matched size | rounds | alpha_1 .. alpha_8 |")
for n in sorted(per):
    alphas = []
    for d in range(1, 9):
        reach = sum(1 for drafted, acc in per[n] if acc >= d - 1 and drafted >= d)
        ok = sum(1 for drafted, acc in per[n] if acc >= d and drafted >= d)
        alphas.append(f"{ok / reach:.2f}" if reach else "-")
    print(f"| {n} | {len(per[n])} | {' '.join(alphas)} |")
