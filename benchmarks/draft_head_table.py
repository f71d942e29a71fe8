"""Markdown table of a `speculant bench` run with the first drafted token's acceptance per method.

    python benchmarks/draft_head_table.py DIR

Columns: tok/s (mean over prompts), speed-up over our `ar` and transformers' `hf-ar` (same run), tau (emitted
tokens per target call), first-token acceptance (rounds whose first drafted token -- for trees: some depth-1
node -- was accepted, over rounds with a draft), acceptance per drafted token, nodes per tree (budget), and greedy
mismatches with `ar`.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path


def main(d: str) -> int:
    res = json.loads((Path(d) / "results.json").read_text())
    summ = res["summary"]["all"]
    print("| method | tok/s | × ar | × hf-ar | τ | 1st-token acc. | acc./node | nodes/tree | ≠ar |")
    print("|---|---|---|---|---|---|---|---|---|")
    for label, s in summ.items():
        recs = [r for r in res["records"] if r["method"] == label]
        st = [r["stats"] for r in recs]
        first = sum((x.get("accepted_at_depth") or [0])[0] for x in st)
        rounds = sum(x.get("rounds", 0) for x in st if x.get("drafted_tokens"))
        nodes = sum(x.get("drafted_tokens", 0) for x in st) / max(sum(x.get("rounds", 0) for x in st), 1)
        acc = s.get("acceptance_rate")
        def f(x, fmt="{:.2f}"):
            return "–" if x is None else fmt.format(x)
        print(f"| {label} | {s['tokens_per_second']:.2f} | {f(s.get('speedup_vs_ar'))} | {f(s.get('speedup_vs_hf_ar'))} "
              f"| {f(s['block_efficiency'] or None)} | {f(first / rounds if rounds else None)} | {f(acc)} "
              f"| {f(nodes if rounds else None, '{:.1f}')} | {f(s.get('mismatches_vs_ar'), '{}')} |")
    m = res["meta"]
    fmt = f"{m.get('weights', m['dtype'])}{' compiled' if m.get('compiled') else ''}"
    print(f"\n<sub>{m['model']} {fmt}, {len(res['prompts'])} prompts, max_new_tokens={m['max_new_tokens']}, "
          f"T={m['temperature']}, torch threads={m['machine']['torch_threads']}, {m['machine']['cpu']}, "
          f"load average at start {m['machine']['load_average_1min']:.1f}, {m['started']}</sub>")
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1]))
