"""Command line: ``speculant generate | models`` (and ``bench | sweep | train | make-data`` when installed).

Bad input prints one line ``speculant: error: ...`` and exits with code 2.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

from .errors import SpeculantError, check_range

EXIT_BAD_INPUT = 2


def _add_method_args(p: argparse.ArgumentParser) -> None:
    from .engine.methods import METHODS
    g = p.add_argument_group("method")
    g.add_argument("--method", default="ar", help=f"one of: {', '.join(METHODS)} (default: ar)")
    g.add_argument("--exit-layer", default=None,
                   help="exit layer E of the early-exit drafter (int, or 'auto' = the stored sweep's best)")
    g.add_argument("--num-speculations", default="4", help="speculation length K (int) or 'auto' (adaptive)")
    g.add_argument("--draft-model", default=None, help="draft model name, HF directory, or truncated:E")
    g.add_argument("--exit-adapter", default=None, help="trained exit adapter: a name ('default') or a directory")
    g.add_argument("--draft-head", default=None,
                   help="trained draft head (EAGLE): a name ('default') or a directory; drafts for eagle "
                        "(default: the shipped 'default') and, when given, for rsd-c/rsd-s/specinfer")
    g.add_argument("--max-ngram", type=int, default=3, help="prompt lookup: longest n-gram (tokens)")
    g.add_argument("--min-ngram", type=int, default=1, help="prompt lookup: shortest n-gram (tokens)")
    g.add_argument("--branching", default="2,2,2", help="rsd-c/specinfer: children per node at each depth, e.g. 3,2,1")
    g.add_argument("--beam-width", type=int, default=4, help="rsd-s: beam width W")
    g.add_argument("--draft-length", type=int, default=4, help="rsd-s: draft depth L")


def _add_model_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default="smollm2-135m", help="known model name or HF-format directory")
    p.add_argument("--dtype", default="float32", help="float32 (default), bfloat16 or float16")


def method_spec_from_args(args, model):
    """A :class:`MethodSpec` from parsed CLI arguments (resolves ``auto`` settings)."""
    from .engine.methods import MethodSpec
    exit_layer, k = args.exit_layer, args.num_speculations
    if exit_layer == "auto" or (k == "auto" and args.method == "early-exit" and exit_layer is None):
        from .bench.sweep import best_config
        best = best_config(model.name)
        if exit_layer in (None, "auto"):
            exit_layer = best["exit_layer"]
        if k == "auto":
            k = best["num_speculations"]
    if exit_layer is not None:
        try:
            exit_layer = int(exit_layer)
        except ValueError:
            raise SpeculantError(f"--exit-layer={exit_layer!r} is invalid; allowed: an integer or 'auto'") from None
    return MethodSpec(method=args.method, exit_layer=exit_layer, num_speculations=k, draft_model=args.draft_model,
                      max_ngram=args.max_ngram, min_ngram=args.min_ngram, branching=args.branching,
                      beam_width=args.beam_width, draft_length=args.draft_length, exit_adapter=args.exit_adapter,
                      draft_head=args.draft_head)


def cmd_generate(args) -> int:
    from .engine.generator import GenerationConfig
    from .engine.methods import build_generator
    from .models.loading import load_model
    from .sampling.processors import SamplingConfig

    sampling = SamplingConfig(temperature=args.temperature, top_k=args.top_k, top_p=args.top_p, seed=args.seed)
    config = GenerationConfig(max_new_tokens=args.max_new_tokens, sampling=sampling, stop=tuple(args.stop or ()),
                              chat=not args.raw)
    if not args.prompt or not args.prompt.strip():
        raise SpeculantError("prompt is empty; allowed: a non-empty string")
    model = load_model(args.model, args.dtype)
    gen = build_generator(model, method_spec_from_args(args, model))
    if args.json:
        result = gen.generate(args.prompt, config)
        out = result.to_dict()
        out["method"] = args.method
        print(json.dumps(out))
    else:
        for piece in gen.stream(args.prompt, config):
            sys.stdout.write(piece)
            sys.stdout.flush()
        sys.stdout.write("\n")
    return 0


def cmd_models(args) -> int:
    from .models.loading import list_models
    rows = list_models()
    if args.json:
        print(json.dumps(rows, indent=2))
        return 0
    for r in rows:
        state = "cached" if r["cached"] else ("installed" if r["package_installed"] else f"not installed ({r['install']})")
        print(f"{r['name']:<16} {state:<12} {r['description']}")
        print(f"{'':<16} cache: {r['cache_dir']}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="speculant", description="Exact speculative decoding for Llama-family models.")
    sub = parser.add_subparsers(dest="command", required=True)

    g = sub.add_parser("generate", help="generate text from a prompt (streams to stdout)")
    g.add_argument("prompt")
    _add_model_args(g)
    g.add_argument("--max-new-tokens", type=int, default=128)
    g.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--top-k", type=int, default=0)
    g.add_argument("--seed", type=int, default=0)
    g.add_argument("--stop", action="append", help="stop string (repeatable); output is cut just before it")
    g.add_argument("--raw", action="store_true", help="do not apply the chat template")
    g.add_argument("--json", action="store_true", help="print one JSON object with text, token_ids and stats")
    _add_method_args(g)
    g.set_defaults(func=cmd_generate)

    m = sub.add_parser("models", help="list known models and what is cached")
    m.add_argument("--json", action="store_true")
    m.set_defaults(func=cmd_models)

    for register in _extensions():
        register(sub, _add_model_args, _add_method_args)
    return parser


def _extensions():
    """Sub-commands that live with their packages (bench, sweep, training)."""
    regs = []
    for mod in ("speculant.bench.cli", "speculant.training.cli"):
        try:
            module = __import__(mod, fromlist=["register"])
        except ModuleNotFoundError as e:
            if e.name != mod:
                raise
            continue
        regs.append(module.register)
    return regs


def default_threads() -> int | None:
    """Torch CPU threads for the CLI: ``$SPECULANT_NUM_THREADS``, else ``None`` (torch's default).

    Sub-commands with their own ``--threads`` flag override this.  Since verification blocks use
    :func:`~speculant.models.linear.small_batch_linear`, a second thread helps on the 2-core
    reference machine (BENCHMARKS.md "Small-batch projections"); with MKL's own small-M ``sgemm``
    it had made 2..16-row blocks ~6x slower, which is why this used to default to 1.

    Raises:
        SpeculantError: the variable is not a positive integer.
    """
    raw = os.environ.get("SPECULANT_NUM_THREADS")
    if raw is None:
        return None
    try:
        n = int(raw)
    except ValueError:
        raise SpeculantError(f"SPECULANT_NUM_THREADS={raw!r} is invalid; allowed: a positive integer") from None
    return check_range("SPECULANT_NUM_THREADS", n, 1)


def main(argv=None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        import torch
        threads = default_threads()
        if threads is not None:
            torch.set_num_threads(threads)
        return args.func(args)
    except SpeculantError as e:
        print(f"speculant: error: {e}", file=sys.stderr)
        return EXIT_BAD_INPUT
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
