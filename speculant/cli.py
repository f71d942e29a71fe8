"""Command line: ``speculant generate | models | tune | serve`` (and ``bench | sweep | train | make-data``).

Bad input prints one line ``speculant: error: ...`` and exits with code 2.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys

from .errors import SpeculantError, check_range

EXIT_BAD_INPUT = 2


def _add_method_args(p: argparse.ArgumentParser) -> None:
    from .engine.methods import METHODS
    g = p.add_argument_group("method (a parameter the method does not use is an error)")
    g.add_argument("--method", default="ar", help=f"one of: {', '.join(METHODS)} (default: ar)")
    g.add_argument("--exit-layer", default=None,
                   help="exit layer E of the early-exit drafter: an int, or 'auto' = the best E (and K, unless "
                        "--num-speculations is given) of this machine's stored sweep, else the measured defaults "
                        "shipped for the model (default: the shipped exit adapter's layer, else min(8, layers/2))")
    g.add_argument("--num-speculations", default=None,
                   help="speculation length K: an int (default 4) or 'auto' = adaptive length (stops drafting "
                        "when the draft's confidence is low)")
    g.add_argument("--draft-model", default=None, help="draft model name, HF directory, or truncated:E")
    g.add_argument("--exit-adapter", default=None, help="trained exit adapter: a name ('default') or a directory")
    g.add_argument("--draft-head", default=None,
                   help="trained draft head (EAGLE): a name ('default') or a directory; drafts for eagle "
                        "(default: the shipped 'default') and, when given, for rsd-c/rsd-s/specinfer")
    g.add_argument("--max-ngram", type=int, default=None, help="prompt lookup: longest n-gram (tokens, default 3)")
    g.add_argument("--min-ngram", type=int, default=None, help="prompt lookup: shortest n-gram (tokens, default 1)")
    g.add_argument("--branching", default=None,
                   help="rsd-c/specinfer: children per node at each depth, e.g. 3,2,1 (default 2,2,2)")
    g.add_argument("--beam-width", type=int, default=None, help="rsd-s: beam width W (default 4)")
    g.add_argument("--draft-length", type=int, default=None, help="rsd-s: draft depth L (default 4)")


def _add_model_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default="smollm2-135m", help="known model name or HF-format directory")
    p.add_argument("--weights", default="auto",
                   help="weight format of the projections: auto (default: the fastest batch-invariant format "
                        "measured on this machine), fp32, bf16, int8, int4 (the GGUF's own 4-bit codes), "
                        "w4a8 (the same codes on int8 activations, our AVX2 kernel)")
    p.add_argument("--no-compile", action="store_true",
                   help="run the decoder eagerly (no torch.compile); also SPECULANT_COMPILE=0")
    p.add_argument("--dtype", default="float32",
                   help="float32 (default), bfloat16 or float16: dtype of a --weights fp32 model (activations too)")
    p.add_argument("--kv-cache", default="auto", choices=("auto", "float32", "float16", "float64"),
                   help="KV cache dtype: auto (default: what the tuner measured faster here), float32, float64, or "
                        "float16 (half the cache bytes; our attention kernel only; exact within the choice)")


def compile_wanted(args) -> bool:
    """``--no-compile`` unset and ``$SPECULANT_COMPILE`` not ``0``."""
    return not args.no_compile and os.environ.get("SPECULANT_COMPILE", "1") != "0"


def load_for_decoding(args):
    """The model named by ``--model`` in ``--weights`` (tuned, compiled unless turned off)."""
    from .runtime.loader import load_model
    return load_model(args.model, weights=args.weights, compile=compile_wanted(args), dtype=args.dtype,
                      threads=getattr(args, "threads", None), blocks=getattr(args, "method", None) != "ar",
                      kv_cache=getattr(args, "kv_cache", "auto"))


def method_spec_from_args(args, model=None):
    """A :class:`MethodSpec` from parsed CLI arguments.

    ``--exit-layer auto`` takes the best exit layer of the stored sweep (:func:`speculant.bench.sweep.best_config`:
    this machine's, else the defaults shipped for the model), and its K when ``--num-speculations`` is not given
    and the method reads K; ``--num-speculations auto`` always means the adaptive length.  With ``model=None``
    only the flags are checked (before the model loads, so a bad combination fails at once): ``--exit-layer
    auto`` then stands for some exit layer.
    """
    from .engine.methods import MethodSpec, drafts_with_exit_layers
    exit_layer, k = args.exit_layer, args.num_speculations
    if exit_layer == "auto":
        if not drafts_with_exit_layers(args.method, args.draft_model):
            raise SpeculantError(f"--exit-layer auto is not used by --method {args.method}"
                                 + (" with --draft-model" if args.draft_model else "")
                                 + "; it applies to early-exit and to rsd-c/rsd-s/specinfer without --draft-model")
    if exit_layer == "auto" and model is None:
        exit_layer = 1
    elif exit_layer == "auto":
        from .bench.sweep import best_config
        best = best_config(model.name, args.exit_adapter if args.exit_adapter != "none" else None)
        exit_layer = best["exit_layer"]
        if k is None and args.method == "early-exit":
            k = best["num_speculations"]
    if exit_layer is not None:
        try:
            exit_layer = int(exit_layer)
        except ValueError:
            raise SpeculantError(f"--exit-layer={exit_layer!r} is invalid; allowed: an integer or 'auto'") from None
    return MethodSpec(method=args.method, exit_layer=exit_layer, num_speculations=k, draft_model=args.draft_model,
                      max_ngram=args.max_ngram, min_ngram=args.min_ngram, branching=args.branching,
                      beam_width=args.beam_width, draft_length=args.draft_length, exit_adapter=args.exit_adapter,
                      draft_head=args.draft_head, verification=getattr(args, "verification", "token"))


def cmd_generate(args) -> int:
    from .engine.generator import GenerationConfig
    from .engine.methods import build_generator
    from .sampling.processors import SamplingConfig

    sampling = SamplingConfig(temperature=args.temperature, top_k=args.top_k, top_p=args.top_p, seed=args.seed)
    config = GenerationConfig(max_new_tokens=args.max_new_tokens, sampling=sampling, stop=tuple(args.stop or ()),
                              chat=not args.raw)
    if not args.prompt or not args.prompt.strip():
        raise SpeculantError("prompt is empty; allowed: a non-empty string")
    method_spec_from_args(args)                 # bad flag combinations fail before the model loads
    model = load_for_decoding(args)
    gen = build_generator(model, method_spec_from_args(args, model))
    if args.json:
        result = gen.generate(args.prompt, config)
        out = result.to_dict()
        out["method"] = args.method
        out["weights"], out["compiled"], out["fused"] = model.weights, model.compiled, model.fused
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


def cmd_tune(args) -> int:
    from dataclasses import asdict

    from .models.loading import load_model
    from .runtime import tune
    if args.threads is not None:
        check_range("--threads", args.threads, 1)
    model = load_model(args.model)
    result = tune.load_or_measure(model.decoder, args.threads, force=True)
    del model
    if result.weights == "w4a8":             # the prompt route is timed on the model in that format (fused step)
        from .runtime.loader import load_model as load_for_runtime
        load_for_runtime(args.model, threads=args.threads)
        result = tune.load(result.key) or result
    path = tune.cache_path(result.key)
    print(json.dumps(asdict(result), indent=1) if args.json else tune.format_table(result) + f"\n\ncached in {path}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="speculant", description="Exact speculative decoding for Llama-family models.")
    sub = parser.add_subparsers(dest="command", required=True)

    g = sub.add_parser("generate", help="generate text from a prompt (streams to stdout)")
    g.add_argument("prompt")
    _add_model_args(g)
    g.add_argument("--max-new-tokens", type=int, default=128)
    g.add_argument("--temperature", type=float, default=0.0,
                   help="sampling temperature; below 1e-5 (0 included, the default) greedy decoding")
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--top-k", type=int, default=0)
    g.add_argument("--seed", type=int, default=0)
    g.add_argument("--stop", action="append", help="stop string (repeatable); output is cut just before it")
    g.add_argument("--raw", action="store_true",
                   help="do not apply the chat template (the tokenizer's special tokens, e.g. BOS, are still added)")
    g.add_argument("--json", action="store_true", help="print one JSON object with text, token_ids and stats")
    g.add_argument("--verification", default="token", choices=("token", "block", "traversal"),
                   help="acceptance rule when sampling: token (recursive rejection sampling, default), block "
                        "(chains, Sun et al. 2025) or traversal (chains, rsd-c, specinfer; Weng et al. 2025); "
                        "greedy decoding always matches the argmax")
    _add_method_args(g)
    g.set_defaults(func=cmd_generate)

    m = sub.add_parser("models", help="list known models and what is cached")
    m.add_argument("--json", action="store_true")
    m.set_defaults(func=cmd_models)

    t = sub.add_parser("tune", help="measure the kernels on this machine again, cache and print the table")
    t.add_argument("--model", default="smollm2-135m", help="known model name or HF-format directory")
    t.add_argument("--threads", type=int, default=None, help="torch threads to tune for (default: torch's)")
    t.add_argument("--json", action="store_true", help="print the measurement as JSON")
    t.set_defaults(func=cmd_tune)

    for register in _extensions():
        register(sub, _add_model_args, _add_method_args)
    return parser


def _extensions():
    """Sub-commands that live with their packages (bench, sweep, training, serve)."""
    regs = []
    for mod in ("speculant.bench.cli", "speculant.training.cli", "speculant.serving.server"):
        try:
            module = __import__(mod, fromlist=["register"])
        except ModuleNotFoundError as e:
            if e.name != mod:
                raise
            continue
        regs.append(module.register)
    return regs


def main(argv=None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        import torch
        from .runtime.loader import user_threads
        threads = user_threads()        # $SPECULANT_NUM_THREADS; otherwise the tuned count (runtime.tune)
        if threads is not None:
            torch.set_num_threads(threads)
        return args.func(args)
    except SpeculantError as e:
        print(f"speculant: error: {e}", file=sys.stderr)
        return EXIT_BAD_INPUT
    except KeyboardInterrupt:
        return 130
    except BrokenPipeError:
        # the reader of stdout went away (`speculant ... | head`): stop quietly, as Unix tools do, with nothing left
        # for the interpreter to flush into the closed pipe at exit
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 128 + signal.SIGPIPE


if __name__ == "__main__":
    sys.exit(main())
