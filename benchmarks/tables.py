"""Print the markdown tables of BENCHMARKS.md from ``speculant bench`` output directories.

    python benchmarks/tables.py methods DIR          # one row per method (overall)
    python benchmarks/tables.py rsd DIR [DIR...]     # budgets, τ, MBSU, tok/s per tree method
    python benchmarks/tables.py categories DIR       # speed-up over ar per category
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from speculant.bench.specs import parse_methods
from speculant.engine.methods import _builder


def _load(d):
    return json.loads((Path(d) / "results.json").read_text())


def _f(x, fmt="{:.2f}"):
    return "–" if x is None else fmt.format(x)


def _header(res):
    m = res["meta"]
    n = len({r["prompt_id"] for r in res["records"]})
    return (f"<sub>{m['model']} {m.get('weights', m['dtype'])}{' compiled' if m.get('compiled') else ''}, {n} prompt(s) from {Path(m['dataset']).name}, "
            f"max_new_tokens={m['max_new_tokens']}, T={m['temperature']}, repeats={m['repeats']}; "
            f"{m['machine']['cpu']}, {m['machine']['cores']} cores, torch threads {m['machine']['torch_threads']}, "
            f"load average at start {_f(m['machine'].get('load_average_1min'))}; "
            f"measured {m['started']}</sub>")


def methods(d):
    res = _load(d)
    rows = res["summary"]["all"]
    print("| method | tok/s | × hf-ar | × ar | acceptance | τ (tokens/call) | MBSU | ≠ar (greedy) | ≠hf-ar (greedy) |")
    print("|---|---|---|---|---|---|---|---|---|")
    for k, r in rows.items():
        print(f"| `{k}` | {_f(r['tokens_per_second'])} | {_f(r['speedup_vs_hf_ar'])} | {_f(r['speedup_vs_ar'])} | "
              f"{_f(r['acceptance_rate'], '{:.3f}')} | {_f(r['block_efficiency'])} | {_f(r['mbsu'])} | "
              f"{_f(r['mismatches_vs_ar'], '{}')} | {_f(r['mismatches_vs_hf_ar'], '{}')} |")
    print("\n" + _header(res) + "\n")


def rsd(*dirs):
    print("| T | drafter | budget B | method | τ | MBSU | tok/s | × ar | acceptance | ≠ar |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for d in dirs:
        res = _load(d)
        rows = res["summary"]["all"]
        specs = {m.label: m for m in parse_methods(",".join(x["label"] for x in res["meta"]["methods"]))}
        for k, r in rows.items():
            m = specs[k]
            if m.is_hf:
                continue
            b = _builder(m.spec).budget() if m.spec and m.name != "ar" else 0
            drafter = "–" if m.name == "ar" else ("truncated" if (m.spec.draft_model or m.name == "draft-model")
                                                  else "early-exit")
            print(f"| {res['meta']['temperature']} | {drafter} | {b or '–'} | `{k}` | {_f(r['block_efficiency'])} | "
                  f"{_f(r['mbsu'])} | {_f(r['tokens_per_second'])} | {_f(r['speedup_vs_ar'])} | "
                  f"{_f(r['acceptance_rate'], '{:.3f}')} | {_f(r['mismatches_vs_ar'], '{}')} |")
    for d in dirs:
        print("\n" + _header(_load(d)))
    print()


def categories(d):
    res = _load(d)
    summ = res["summary"]
    cats = [c for c in summ if c != "all"] + ["all"]
    print("| method | " + " | ".join(f"{c} × ar" for c in cats) + " | all tok/s | all τ | ≠ar |")
    print("|---|" + "---|" * (len(cats) + 3))
    for k in summ["all"]:
        cells = [_f(summ[c].get(k, {}).get("speedup_vs_ar")) for c in cats]
        a = summ["all"][k]
        print(f"| `{k}` | " + " | ".join(cells) + f" | {_f(a['tokens_per_second'])} | {_f(a['block_efficiency'])} | "
              f"{_f(a['mismatches_vs_ar'], '{}')} |")
    print("\n" + _header(res) + "\n")


if __name__ == "__main__":
    {"methods": methods, "rsd": rsd, "categories": categories}[sys.argv[1]](*sys.argv[2:])
