"""Aggregate benchmark records and write ``report.md``.

``results.json`` schema (``schema_version`` 1):

* ``meta``: model, dataset, dtype, num_layers, max_new_tokens, temperature, repeats, seed,
  methods (label, name, params, spec, cost_ratio), machine, started/finished, interrupted.
* ``prompts``: id, category, subcategory, prompt_tokens.
* ``records``: one per (prompt, method): prompt_id, category, method (label), token_ids, text,
  new_tokens, seconds (every repeat) [s], seconds_median, seconds_min [s], tokens_per_second
  (median time), tokens_per_second_best (min time) [tokens/s], stats (engine counters; for
  transformers' methods new_tokens, target_forwards, draft_forwards, block_efficiency),
  equal_to_ar / equal_to_hf_ar (greedy only; else null).
* ``summary``: ``{category: {method: row}}`` with the category ``all`` over every prompt; a row has
  n_prompts, new_tokens, tokens_per_second, tokens_per_second_best, speedup_vs_ar,
  speedup_vs_hf_ar (and ``*_best``), acceptance_rate, mean_accepted_length,
  block_efficiency, draft_forwards_per_block, mbsu, acceptance_by_position,
  mismatches_vs_ar, mismatches_vs_hf_ar (null when not compared).

Speed-up follows Spec-Bench (Xia et al. 2024, ``evaluation/speed.py``): the mean over prompts of
each prompt's tokens/s, divided by the same mean of the baseline over the same prompts.
"""

from __future__ import annotations

from pathlib import Path

from ..sampling.processors import is_greedy
from .mbsu import mbsu

ALL = "all"


def _mean(xs):
    return sum(xs) / len(xs) if xs else 0.0


def _row(recs: list[dict], cost_ratio: float, greedy: bool) -> dict:
    st = [r["stats"] for r in recs]
    new = sum(s.get("new_tokens", 0) for s in st)
    tf = sum(s.get("target_forwards", 0) for s in st)
    df = sum(s.get("draft_forwards", 0) or 0 for s in st)
    rounds = sum(s.get("rounds", 0) for s in st)
    has_acc = all("drafted_tokens" in s for s in st)          # transformers' methods do not count drafts
    drafted = sum(s.get("drafted_tokens", 0) for s in st)
    accepted = sum(s.get("accepted_tokens", 0) for s in st)
    tau = new / tf if tf else 0.0
    # blocks = verification calls: ours count the prefill in target_forwards, transformers' do not prefill apart
    blocks = rounds if has_acc else tf
    depth = df / blocks if blocks else 0.0
    by_pos = None
    if has_acc:
        n = max((len(s.get("drafted_at_depth", [])) for s in st), default=0)
        a = [sum(s["accepted_at_depth"][d] for s in st if d < len(s["accepted_at_depth"])) for d in range(n)]
        b = [sum(s["drafted_at_depth"][d] for s in st if d < len(s["drafted_at_depth"])) for d in range(n)]
        by_pos = [x / y if y else 0.0 for x, y in zip(a, b)]

    def mism(key):
        if not greedy or any(r.get(key) is None for r in recs):
            return None
        return sum(1 for r in recs if r[key] is False)

    return {
        "n_prompts": len(recs), "new_tokens": new,
        "tokens_per_second": _mean([r["tokens_per_second"] for r in recs]),
        "tokens_per_second_best": _mean([r["tokens_per_second_best"] for r in recs]),
        "acceptance_rate": accepted / drafted if has_acc and drafted else None,   # None: nothing drafted
        "mean_accepted_length": (accepted / rounds if rounds else 0.0) if has_acc else None,
        "block_efficiency": tau, "draft_forwards_per_block": depth, "cost_ratio": cost_ratio,
        "mbsu": mbsu(tau, cost_ratio, depth) if tf else None,
        "acceptance_by_position": by_pos,
        "mismatches_vs_ar": mism("equal_to_ar"), "mismatches_vs_hf_ar": mism("equal_to_hf_ar"),
        "repeat_outputs_differ": sum(1 for r in recs if r.get("repeat_outputs_differ")),
    }


def summarize(results: dict) -> dict:
    """``{category: {method_label: row}}`` (see the module docstring); ``all`` covers every prompt.

    Speed-ups are computed over the prompts both the method and the baseline finished.
    """
    meta = results["meta"]
    greedy = is_greedy(meta["temperature"])
    costs = {m["label"]: m.get("cost_ratio", 0.0) for m in meta["methods"]}
    labels = [m["label"] for m in meta["methods"]]
    recs = results["records"]
    cats = [ALL] + list(dict.fromkeys(r["category"] for r in recs))
    out: dict[str, dict] = {}
    for cat in cats:
        in_cat = [r for r in recs if cat == ALL or r["category"] == cat]
        rows = {}
        for label in labels:
            mine = [r for r in in_cat if r["method"] == label]
            if mine:
                rows[label] = _row(mine, costs.get(label, 0.0), greedy)
        for label, row in rows.items():
            for base, key in (("ar", "speedup_vs_ar"), ("hf-ar", "speedup_vs_hf_ar")):
                base_recs = {r["prompt_id"]: r for r in in_cat if r["method"] == base}
                mine = [r for r in in_cat if r["method"] == label and r["prompt_id"] in base_recs]
                for suffix, field in (("", "tokens_per_second"), ("_best", "tokens_per_second_best")):
                    b = _mean([base_recs[r["prompt_id"]][field] for r in mine])
                    row[key + suffix] = _mean([r[field] for r in mine]) / b if mine and b > 0 else None
        out[cat] = rows
    return out


def _f(x, fmt="{:.2f}"):
    return "–" if x is None else fmt.format(x)


def _mm(x):
    return "–" if x is None else str(x)


def report_markdown(results: dict, plots: list[str] | None = None) -> str:
    """The markdown report: settings, an overall table, speed-up per category, acceptance by position."""
    meta, summ = results["meta"], results["summary"] or summarize(results)
    mc = meta["machine"]
    n_prompts = len({r["prompt_id"] for r in results["records"]})
    lines = [f"# speculant bench: {meta['model']} on {meta['dataset']}", "",
             f"- prompts: {n_prompts} finished of {len(results['prompts'])}"
             + (" (**interrupted**)" if meta.get("interrupted") else ""),
             f"- max_new_tokens={meta['max_new_tokens']}, temperature={meta['temperature']}, repeats={meta['repeats']}, "
             f"seed={meta['seed']}, dtype={meta['dtype']}",
             f"- weights={meta.get('weights', '?')} (weight format of our methods unless a method names its own "
             f"`rt=`), compiled={meta.get('compiled', '?')}, fused={meta.get('fused', '?')}",
             f"- machine: {mc['cpu']}, {mc['cores']} cores, torch threads {mc['torch_threads']}, "
             f"torch {mc['torch']}, transformers {mc['transformers']}",
             f"- started {meta['started']}, finished {meta.get('finished')}",
             "- tok/s: mean over prompts of new tokens / median wall time; speed-up = ratio of those means "
             "(Spec-Bench); τ = tokens per target call; MBSU = τ / (1 + c·D) (Jeon et al. 2024); "
             "≠ar / ≠hf-ar: greedy outputs that differ from the AR output (– = not compared).", ""]
    head = "| method | tok/s | best tok/s | × hf-ar | × ar | accept | τ | D | c | MBSU | ≠ar | ≠hf-ar |"
    for cat, rows in summ.items():
        lines += [f"## {cat}", "", head, "|" + "---|" * 12]
        for label, r in rows.items():
            lines.append(f"| `{label}` | {_f(r['tokens_per_second'])} | {_f(r['tokens_per_second_best'])} | "
                         f"{_f(r.get('speedup_vs_hf_ar'))} | {_f(r.get('speedup_vs_ar'))} | "
                         f"{_f(r['acceptance_rate'], '{:.3f}')} | {_f(r['block_efficiency'])} | "
                         f"{_f(r['draft_forwards_per_block'], '{:.1f}')} | {_f(r['cost_ratio'], '{:.3f}')} | "
                         f"{_f(r['mbsu'])} | {_mm(r['mismatches_vs_ar'])} | {_mm(r['mismatches_vs_hf_ar'])} |")
        lines.append("")
    all_rows = summ.get(ALL, {})
    pos = {k: v["acceptance_by_position"] for k, v in all_rows.items() if v.get("acceptance_by_position")}
    if pos:
        depth = max(len(v) for v in pos.values())
        lines += ["## acceptance by draft position (all prompts)", "",
                  "| method | " + " | ".join(str(d + 1) for d in range(depth)) + " |", "|---|" + "---|" * depth]
        for k, v in pos.items():
            cells = [_f(x, "{:.3f}") for x in v] + ["–"] * (depth - len(v))
            lines.append(f"| `{k}` | " + " | ".join(cells) + " |")
        lines.append("")
    bad = [r for r in results["records"] if r.get("equal_to_ar") is False or r.get("equal_to_hf_ar") is False]
    if bad:
        lines += ["## greedy mismatches", "", "| prompt | method | ≠ar | ≠hf-ar | first differing position |",
                  "|---|---|---|---|---|"]
        ref = {(r["prompt_id"], r["method"]): r["token_ids"] for r in results["records"]}
        for r in bad:
            base = ref.get((r["prompt_id"], "ar")) or ref.get((r["prompt_id"], "hf-ar")) or []
            first = next((i for i, (a, b) in enumerate(zip(r["token_ids"], base)) if a != b),
                         min(len(r["token_ids"]), len(base)))
            lines.append(f"| {r['prompt_id']} | `{r['method']}` | {r.get('equal_to_ar') is False} | "
                         f"{r.get('equal_to_hf_ar') is False} | {first} |")
        lines.append("")
    for p in plots or []:
        lines += [f"![{p}]({p})", ""]
    return "\n".join(lines)


def write_report(results: dict, out_dir: str | Path) -> Path:
    """Write ``report.md`` and the PNGs (see :mod:`speculant.bench.plots`) into ``out_dir``; returns the report path."""
    from .plots import plot_acceptance_by_position, plot_speedup
    out = Path(out_dir)
    plots = []
    for fn, name in ((plot_speedup, "speedup.png"), (plot_acceptance_by_position, "acceptance_by_position.png")):
        if fn(results, out / name):
            plots.append(name)
    path = out / "report.md"
    path.write_text(report_markdown(results, plots))
    return path
