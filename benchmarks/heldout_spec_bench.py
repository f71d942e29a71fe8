"""Write the held-out Spec-Bench questions of a make-data corpus as a Spec-Bench JSONL for `speculant bench`.

    python benchmarks/heldout_spec_bench.py CORPUS.jsonl SPEC_BENCH.jsonl OUT.jsonl

A corpus record ``specbench-<question_id>`` with ``split == "heldout"`` was never trained on; benchmarking
a trained drafter on exactly those questions keeps training prompts out of the measurement.
"""

from __future__ import annotations

import json
import sys


def main(corpus: str, spec_bench: str, out: str) -> int:
    held = {r["id"] for r in map(json.loads, open(corpus)) if r["split"] == "heldout"}
    n = 0
    with open(out, "w") as f:
        for line in open(spec_bench):
            if line.strip() and f"specbench-{json.loads(line)['question_id']}" in held:
                f.write(line if line.endswith("\n") else line + "\n")
                n += 1
    print(f"{n} held-out Spec-Bench questions -> {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main(*sys.argv[1:4]))
