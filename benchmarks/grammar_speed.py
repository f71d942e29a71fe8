"""Structured output under speculation (issue 27): tokens/s of ``ar`` and speculative methods on SmolLM2 with the
same JSON schema, greedy, the methods alternated prompt by prompt (and with the schema off, for the grammar's cost).

    python benchmarks/grammar_speed.py [--methods ar,prompt-lookup,eagle] [--repeats 2] [--max-new-tokens 64]
                                       [--profile METHOD] [--out FILE.json]

Each prompt asks for a JSON record of facts stated in the prompt (an extraction task, where prompt lookup's
drafts can be accepted).  Greedy decoding: every method's output is checked token-identical to ``ar``'s with
the same grammar.  ``--profile METHOD`` runs cProfile over that method's grammar runs and prints the top
functions (where the time goes).
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import pstats
import time

from speculant import GenerationConfig, SamplingConfig, build_generator, load_model
from speculant.sampling.grammar import compile_grammar

SCHEMA = {"type": "object", "properties": {
    "name": {"type": "string"}, "city": {"type": "string"}, "age": {"type": "integer"},
    "languages": {"type": "array", "items": {"type": "string"}}},
    "required": ["name", "city", "age", "languages"], "additionalProperties": False}
PEOPLE = [("Maria Lopez", "Valencia", 34, ["Spanish", "English", "French"]),
          ("Kenji Watanabe", "Osaka", 51, ["Japanese", "English"]),
          ("Amara Okafor", "Lagos", 27, ["Igbo", "Yoruba", "English"]),
          ("Lars Eriksson", "Uppsala", 45, ["Swedish", "German"])]
METHODS = {"ar": dict(method="ar"), "prompt-lookup": dict(method="prompt-lookup", num_speculations=3),
           "eagle": dict(method="eagle", num_speculations=3)}


def prompts() -> list[str]:
    return [f"{name} lives in {city}. {name} is {age} years old and speaks {', '.join(langs)}. "
            f"Give {name}'s record as JSON with the fields name, city, age and languages."
            for name, city, age, langs in PEOPLE]


def run(gen, prompt: str, config: GenerationConfig) -> tuple[list[int], int, float]:
    t0 = time.perf_counter()
    r = gen.generate(prompt, config)
    return r.token_ids, len(r.token_ids), time.perf_counter() - t0


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--methods", default="ar,prompt-lookup,eagle")
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--profile", default=None)
    p.add_argument("--out", default=None)
    args = p.parse_args()
    model = load_model("smollm2-135m")
    grammar = compile_grammar("json_schema", SCHEMA, model.tokenizer, vocab_size=model.config.vocab_size,
                              eos_token_ids=model.eos_token_ids)
    names = args.methods.split(",")
    gens = {m: build_generator(model, **METHODS[m]) for m in names}
    configs = {"grammar": GenerationConfig(args.max_new_tokens, SamplingConfig(), grammar=grammar),
               "none": GenerationConfig(args.max_new_tokens, SamplingConfig())}
    for m in names:                                            # warm-up (compiled graphs, kernels, head)
        run(gens[m], prompts()[0], configs["grammar"])
    totals = {(m, c): [0, 0.0] for m in names for c in configs}
    outputs: dict = {}
    prof = cProfile.Profile()
    for rep in range(args.repeats):
        for i, prompt in enumerate(prompts()):
            order = names if (rep + i) % 2 == 0 else names[::-1]   # alternate who goes first
            for c in configs:
                for m in order:
                    if m == args.profile and c == "grammar":
                        prof.enable()
                    ids, n, s = run(gens[m], prompt, configs[c])
                    prof.disable()
                    totals[(m, c)][0] += n
                    totals[(m, c)][1] += s
                    outputs.setdefault((i, c), {})[m] = ids
    same = all(len({tuple(v) for v in per.values()}) == 1 for per in outputs.values())
    rows = []
    for (m, c), (n, s) in totals.items():
        ar_n, ar_s = totals[("ar", c)] if "ar" in names else (n, s)
        rows.append({"method": m, "grammar": c == "grammar", "tokens": n, "seconds": round(s, 3),
                     "tokens_per_second": round(n / s, 2), "x_ar_same_grammar": round((n / s) / (ar_n / ar_s), 3)})
        print(f"{m:<14} grammar={c:<8} {n:>5} tokens {s:8.2f} s {n / s:8.2f} tok/s  x ar {rows[-1]['x_ar_same_grammar']}")
    print(f"outputs identical to ar's (greedy): {same}")
    sample = model.tokenizer.decode(outputs[(0, "grammar")][names[0]], skip_special_tokens=True)
    print(f"sample output: {sample}")
    if args.profile:
        buf = io.StringIO()
        pstats.Stats(prof, stream=buf).sort_stats("tottime").print_stats(20)
        print(buf.getvalue())
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"rows": rows, "identical": same, "sample": sample}, f, indent=1)


if __name__ == "__main__":
    main()
