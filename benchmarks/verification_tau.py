"""Block efficiency tau of the exact verification rules: token-level RRS against block / traversal verification.

    nice -n 19 python benchmarks/verification_tau.py --dataset SPEC_BENCH.jsonl --limit 1 --seeds 4 \\
        --temperatures 1.0 --max-new-tokens 64 --out tau.jsonl \\
        --methods early-exit,early-exit:verif=block,eagle,eagle:verif=block,rsd-c,rsd-c:verif=traversal

Every method (``speculant bench --methods`` syntax, :mod:`speculant.bench.specs`; ``verif=`` picks the rule)
runs on every prompt with the same seeds ``0 .. --seeds-1`` and ``speculation='always'`` by default (every
round drafts the method's full depth: tau then depends on the rule only, not on the machine's load, which
``cost`` speculation follows).  One JSON line per generation goes to ``--out``; the table printed at the end
gives, per temperature and method:

* ``tau``: emitted tokens / target forwards (prefill included, as ``speculant bench``'s ``block_efficiency``),
  the mean over generations of each generation's ratio, +- its standard error;
* ``tau/round``: (emitted - 1) / verification rounds (the prefill's token left out: Leviathan et al.'s
  block efficiency);
* ``acc``: accepted / drafted tokens over all generations (for trees per node);
* ``gain``: for a ``verif=block|traversal`` row, the mean over prompts x seeds of its tau minus the tau of the
  same method with ``verif=token`` on the same prompt and seed, +- the standard error of those differences
  (the rules draw different random numbers, so a pair shares its prompt and seed, not its draws).

With ``--same-draft-repeats R`` (give token-rule methods) the generation runs as usual, and every round's
draft and target rows are also verified ``R`` times by each rule with a separate generator (token and block on
chains, token and traversal on trees); the second table gives the mean accepted drafted tokens per round of
each rule *on identical drafts* (the quantity Sun et al.'s Theorem 2 orders), and the gain +- its standard error
over rounds: no trajectory noise, so small gains show.

Sources: Sun et al., "Block Verification Accelerates Speculative Decoding", ICLR 2025; Weng et al., "Traversal
Verification for Speculative Tree Decoding", NeurIPS 2025; :mod:`speculant.verification.sequence`.
"""

from __future__ import annotations

import argparse
import json
import math
import re
import sys
import time

import torch

import speculant.engine.rounds as engine_rounds
from speculant.bench.datasets import load_prompts
from speculant.bench.runner import encode_prompts
from speculant.bench.specs import parse_methods
from speculant.engine.generator import GenerationConfig
from speculant.engine.methods import build_generator
from speculant.engine.stats import GenerationStats
from speculant.runtime.loader import load_model
from speculant.sampling.processors import SamplingConfig


def _args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--weights", default="auto")
    ap.add_argument("--dataset", required=True, help="a Spec-Bench question.jsonl, 'builtin' or 'humaneval'")
    ap.add_argument("--categories", default=None, help="comma-separated; default: all")
    ap.add_argument("--limit", type=int, default=1, help="prompts per category")
    ap.add_argument("--seeds", type=int, default=4, help="seeds F..F+N-1 per prompt and method (F: --first-seed)")
    ap.add_argument("--first-seed", type=int, default=0)
    ap.add_argument("--temperatures", default="1.0", help="comma-separated, each > 0")
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--speculation", default="always", choices=("always", "cost"))
    ap.add_argument("--methods", default="early-exit,early-exit:verif=block,eagle,eagle:verif=block,"
                                         "rsd-c,rsd-c:verif=traversal,specinfer,specinfer:verif=traversal")
    ap.add_argument("--same-draft-repeats", type=int, default=0,
                    help="R > 0: also verify every round's draft R times by each rule (token and block on chains, "
                         "token and traversal on trees) and record the mean accepted per rule (see module docstring)")
    ap.add_argument("--out", required=True, help="JSON lines, one per generation (appended)")
    ap.add_argument("--summarize-only", action="store_true", help="print the table of --out, run nothing")
    return ap.parse_args(argv)


def run(a) -> None:
    """Every temperature x seed x prompt x method, one JSON line each to ``a.out``."""
    model = load_model(a.model, weights=a.weights)
    cats = a.categories.split(",") if a.categories else None
    prompts = load_prompts(a.dataset, cats, a.limit)
    ids = encode_prompts(model, prompts)
    methods = parse_methods(a.methods, speculation=a.speculation)
    gens = {m.label: build_generator(model, m.spec) for m in methods}
    temps = [float(t) for t in a.temperatures.split(",")]
    total, done, t0 = len(temps) * len(prompts) * a.seeds * len(methods), 0, time.time()
    same = SameDraft(a.same_draft_repeats) if a.same_draft_repeats else None
    if same is not None:
        engine_rounds.sampling_accept = same
    with open(a.out, "a") as f:
        for temp in temps:
            for seed in range(a.first_seed, a.first_seed + a.seeds):   # outermost: a cut run covers every prompt
                for p, pid in zip(prompts, ids):
                    for m in methods:
                        cfg = GenerationConfig(max_new_tokens=a.max_new_tokens,
                                               sampling=SamplingConfig(temp, seed=seed))
                        st = GenerationStats()
                        for _ in gens[m.label].generate_blocks(list(pid), cfg, st):
                            pass
                        rec = {"model": a.model, "weights": model.weights,
                               "temperature": temp, "method": m.label, "verification": m.spec.verification,
                               "prompt": p.id, "category": p.category, "seed": seed,
                               "max_new_tokens": a.max_new_tokens, "new_tokens": st.new_tokens,
                               "target_forwards": st.target_forwards, "rounds": st.rounds,
                               "drafted_tokens": st.drafted_tokens, "accepted_tokens": st.accepted_tokens}
                        if same is not None:
                            rec["same_draft_rounds"] = same.take()
                        f.write(json.dumps(rec) + "\n")
                        f.flush()
                        done += 1
                    print(f"[{done}/{total}] T={temp} seed {seed} prompt {p.id} {time.time() - t0:.0f}s",
                          file=sys.stderr, flush=True)


class SameDraft:
    """Wraps the engine's ``sampling_accept``: each round's draft is also verified ``repeats`` times by each rule."""

    def __init__(self, repeats: int, seed: int = 12345):
        self.repeats, self.g, self.rounds = repeats, torch.Generator().manual_seed(seed), []
        self.real = engine_rounds.sampling_accept

    def __call__(self, tree, p, generator, without_replacement, verification="token"):
        if len(tree):
            rows = p(torch.arange(len(tree) + 1)) if callable(p) else p
            rules = ("token", "block") if tree.is_chain else ("token", "traversal")
            self.rounds.append({r: sum(len(self.real(tree, rows, self.g, without_replacement, r)[0])
                                       for _ in range(self.repeats)) / self.repeats for r in rules})
        return self.real(tree, p, generator, without_replacement, verification)

    def take(self) -> list[dict]:
        out, self.rounds = self.rounds, []
        return out


def _mean_se(xs: list[float]) -> tuple[float, float]:
    n = len(xs)
    m = sum(xs) / n
    return m, (math.sqrt(sum((x - m) ** 2 for x in xs) / (n - 1) / n) if n > 1 else float("nan"))


def _base(label: str) -> str:
    """The label of the same method with token-level verification (``verif=...`` removed)."""
    name, _, params = label.partition(":")
    kept = [kv for kv in params.split(",") if kv and not re.fullmatch(r"verif=\w+", kv)]
    return name + (":" + ",".join(kept) if kept else "")


def summarize(path: str) -> str:
    """The markdown table of the generations in ``path`` (columns in the module docstring)."""
    recs = [json.loads(line) for line in open(path) if line.strip()]
    tau = {}
    for r in recs:
        tau[(r["temperature"], r["method"], r["prompt"], r["seed"])] = r["new_tokens"] / r["target_forwards"]
    rows = ["| T | method | rule | n | tau | tau/round | acc | gain vs token |", "|---|---|---|---|---|---|---|---|"]
    for temp, label in dict.fromkeys((r["temperature"], r["method"]) for r in recs):
        rs = [r for r in recs if r["temperature"] == temp and r["method"] == label]
        m, se = _mean_se([r["new_tokens"] / r["target_forwards"] for r in rs])
        per_round = sum(r["new_tokens"] - 1 for r in rs) / max(1, sum(r["rounds"] for r in rs))
        acc = sum(r["accepted_tokens"] for r in rs) / max(1, sum(r["drafted_tokens"] for r in rs))
        gain = ""
        if rs[0]["verification"] != "token":
            diffs = [tau[(temp, label, r["prompt"], r["seed"])] - tau[k] for r in rs
                     if (k := (temp, _base(label), r["prompt"], r["seed"])) in tau]
            if diffs:
                g, gse = _mean_se(diffs)
                base, _ = _mean_se([tau[(temp, _base(label), r["prompt"], r["seed"])] for r in rs])
                gain = f"{g:+.3f} +- {gse:.3f} ({100 * g / base:+.1f}%)"
        rows.append(f"| {temp} | {_base(label)} | {rs[0]['verification']} | {len(rs)} | {m:.3f} +- {se:.3f} "
                    f"| {per_round:.3f} | {acc:.3f} | {gain} |")
    return "\n".join(rows)


def summarize_same_draft(path: str) -> str:
    """The markdown table of the ``same_draft_rounds`` of ``path``: mean accepted drafted tokens per round."""
    recs = [json.loads(line) for line in open(path) if line.strip() and "same_draft_rounds" in line]
    rows = ["| T | method | rounds | accepted/round token | upgraded rule | accepted/round upgraded | gain |",
            "|---|---|---|---|---|---|---|"]
    for temp, label in dict.fromkeys((r["temperature"], r["method"]) for r in recs):
        rounds = [d for r in recs if r["temperature"] == temp and r["method"] == label for d in r["same_draft_rounds"]]
        for rule in dict.fromkeys(k for d in rounds for k in d if k != "token"):
            rs = [d for d in rounds if rule in d]
            tok, _ = _mean_se([d["token"] for d in rs])
            up, _ = _mean_se([d[rule] for d in rs])
            g, gse = _mean_se([d[rule] - d["token"] for d in rs])
            rows.append(f"| {temp} | {label} | {len(rs)} | {tok:.4f} | {rule} | {up:.4f} | {g:+.4f} +- {gse:.4f} "
                        f"({100 * g / tok if tok else 0:+.1f}%) |")
    return "\n".join(rows)


def main(argv=None) -> int:
    a = _args(argv)
    if not a.summarize_only:
        run(a)
    print(summarize(a.out))
    if any("same_draft_rounds" in line for line in open(a.out)):
        print()
        print(summarize_same_draft(a.out))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
