"""Write the held-out Spec-Bench questions of a make-data split as a Spec-Bench JSONL for `speculant bench`.

    python benchmarks/heldout_spec_bench.py SPEC_BENCH.jsonl OUT.jsonl [--humaneval] [--seed 0] [--heldout-fraction 0.1]

`speculant make-data` splits prompts into train / held-out with a seeded shuffle per source
(`speculant.training.data.split_prompts`); give the same sources (``--humaneval`` when make-data had it),
seed and fraction, and OUT holds exactly the Spec-Bench questions no trained artefact has seen.
"""

from __future__ import annotations

import argparse
import json

from speculant.training.data import humaneval_prompts, spec_bench_prompts, split_prompts


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("spec_bench")
    ap.add_argument("out")
    ap.add_argument("--humaneval", action="store_true", help="make-data also had --humaneval")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--heldout-fraction", type=float, default=0.1)
    a = ap.parse_args()
    prompts = spec_bench_prompts(a.spec_bench) + (humaneval_prompts() if a.humaneval else [])
    split = split_prompts(prompts, a.heldout_fraction, a.seed)
    n = 0
    with open(a.out, "w") as f:
        for line in open(a.spec_bench):
            if line.strip() and split[f"specbench-{json.loads(line)['question_id']}"] == "heldout":
                f.write(line if line.endswith("\n") else line + "\n")
                n += 1
    print(f"{n} held-out Spec-Bench questions -> {a.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
