"""Command line: ``speculant generate | models | tune | export | serve`` (and ``bench | sweep | train | make-data``).

Bad input prints one line ``speculant: error: ...`` and exits with code 2.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
from pathlib import Path

from .arguments import OneLineParser, add_control_args, config_from_args
from .arguments import add_method_args as _add_method_args
from .arguments import add_model_args as _add_model_args
from .arguments import compile_wanted, load_for_decoding, method_spec_from_args  # noqa: F401  (used by tests)
from .errors import SpeculantError, check_range

EXIT_BAD_INPUT = 2
SEED_MAX = 2**63 - 1
"""Largest ``--seed`` (the server's ``seed`` too): a ``torch.Generator`` seed is a 64-bit integer."""


def cmd_generate(args) -> int:
    check_range("--seed", args.seed, 0, SEED_MAX)
    if not args.prompt or not args.prompt.strip():        # before the control checks, which import torch
        raise SpeculantError("prompt is empty; allowed: a non-empty string")
    config_from_args(args)                      # bad control values fail before the model loads
    method_spec_from_args(args)                 # bad flag combinations fail before the model loads
    from .engine.methods import build_generator
    model = load_for_decoding(args)
    config = config_from_args(args, model)
    gen = build_generator(model, method_spec_from_args(args, model))
    if args.json:
        results = gen.generate_n(args.prompt, config, args.n) if args.n > 1 else [gen.generate(args.prompt, config)]
        out = results[0].to_dict() if args.n == 1 else {"choices": [r.to_dict() for r in results]}
        out["method"] = args.method
        out["weights"], out["compiled"], out["fused"] = model.weights, model.compiled, model.fused
        print(json.dumps(out))
    elif args.n > 1:
        for i, r in enumerate(gen.generate_n(args.prompt, config, args.n)):
            sys.stdout.write(f"--- sample {i} (seed {config.sampling.seed + i}) ---\n{r.text}\n")
    else:
        for piece in gen.stream(args.prompt, config):
            sys.stdout.write(piece)
            sys.stdout.flush()
        sys.stdout.write("\n")
    return 0


def cmd_models(args) -> int:
    from .drafters.artifacts import shipped_names
    from .models.loading import list_models
    rows = list_models()
    for r in rows:     # what the methods that need a per-model artefact can use (eagle, rsd-* with a head, ...)
        name = Path(r["cache_dir"]).name if "exists" not in r else None
        r["draft_heads"] = shipped_names("draft_heads", name) if name else []
        r["exit_adapters"] = shipped_names("exit_adapters", name) if name else []
    if args.json:
        print(json.dumps(rows, indent=2))
        return 0
    for r in rows:
        state = "cached" if r["cached"] else ("installed" if r["package_installed"] else f"not installed ({r['install']})")
        if r.get("exists") is False:
            state = "file gone"
        print(f"{r['name']:<16} {state}")
        print(f"{'':<16} {r['description']}")
        print(f"{'':<16} cache: {r['cache_dir']}")
        heads, adapters = ", ".join(r["draft_heads"]) or "none", ", ".join(r["exit_adapters"]) or "none"
        print(f"{'':<16} draft heads: {heads}; exit adapters: {adapters}"
              + ("" if r["draft_heads"] else " (eagle and rsd-*/specinfer with a head need a draft head: "
                 "`speculant train --recipe draft-head`)")
              + ("" if r["exit_adapters"] else " (early exit runs without an exit adapter, better with one: "
                 "`speculant train --recipe exit-adapter`)"))
    return 0


def cmd_tune(args) -> int:
    from dataclasses import asdict

    from .models.loading import read_checkpoint
    from .runtime import tune
    if args.threads is not None:
        check_range("--threads", args.threads, 1)
    model = read_checkpoint(args.model)
    result = tune.load_or_measure(model.decoder, args.threads, log=sys.stderr, force=True, model=args.model)
    del model
    if result.weights == "w4a8":             # the prompt route is timed on the model in that format (fused step)
        from .runtime.loader import load_model as load_for_runtime
        load_for_runtime(args.model, threads=args.threads)
        result = tune.load(result.key) or result
    path = tune.cache_path(result.key)
    print(json.dumps(asdict(result), indent=1) if args.json else tune.format_table(result) + f"\n\ncached in {path}")
    return 0


def cmd_export(args) -> int:
    from .drafters.artifacts import resolve_dir
    from .drafters.export import export_head
    src = resolve_dir("draft_heads", "draft head", args.draft_head, args.model)
    out = Path(args.out)
    if out.exists() and any(out.iterdir()) and out.resolve() != src.resolve():
        raise SpeculantError(f"--out {str(out)!r} is not empty; allowed: a new or empty directory")
    if args.gguf:
        from .drafters.export_gguf import check_llama_cpp_source
        check_llama_cpp_source(args.llama_cpp)
    created = not out.exists()
    summary = export_head(src, out)
    if args.gguf:
        from .drafters.export_gguf import export_gguf
        from .runtime.loader import load_model
        try:
            target = load_model(args.model, compile=False, log=sys.stderr)
            summary["gguf"] = str(export_gguf(Path(summary["out"]), Path(target.path), args.llama_cpp))
        except SpeculantError:
            if created:                     # nothing half-written: the export goes with the GGUF it was for
                import shutil
                shutil.rmtree(out, ignore_errors=True)
            raise
    print(json.dumps(summary))
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = OneLineParser(prog="speculant", description="Exact speculative decoding for Llama-family models.")
    sub = parser.add_subparsers(dest="command", required=True)

    g = sub.add_parser("generate", help="generate text from a prompt (streams to stdout)")
    g.add_argument("prompt")
    _add_model_args(g)
    g.add_argument("--max-new-tokens", type=int, default=128)
    g.add_argument("--temperature", type=float, default=0.0,
                   help="sampling temperature; below 1e-5 (0 included, the default) greedy decoding")
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--top-k", type=int, default=0)
    g.add_argument("--seed", type=int, default=0, help=f"random seed, 0 to {SEED_MAX} (default: 0)")
    g.add_argument("--stop", action="append", help="stop string (repeatable); output is cut just before it")
    g.add_argument("--raw", action="store_true",
                   help="do not apply the chat template (the tokenizer's special tokens, e.g. BOS, are still added)")
    g.add_argument("--json", action="store_true", help="print one JSON object with text, token_ids and stats")
    g.add_argument("--verification", default="token", choices=("token", "block", "traversal"),
                   help="acceptance rule when sampling: token (recursive rejection sampling, default), block "
                        "(chains, Sun et al. 2025) or traversal (chains, rsd-c, specinfer; Weng et al. 2025); "
                        "greedy decoding always matches the argmax")
    g.add_argument("--speculation", default="cost", choices=("cost", "always"),
                   help="cost (default): each round drafts the depth (zero: an ar round) that maximizes the expected "
                        "tokens per second from this machine's measured costs and the running acceptance; always: "
                        "every round drafts the method's full depth")
    add_control_args(g)
    _add_method_args(g)
    g.set_defaults(func=cmd_generate)

    m = sub.add_parser("models", help="list known models and what is cached")
    m.add_argument("--json", action="store_true")
    m.set_defaults(func=cmd_models)

    t = sub.add_parser("tune", help="measure the kernels on this machine again, cache and print the table")
    t.add_argument("--model", default="smollm2-135m", help="known model name, GGUF file (PATH.gguf) or HF-format directory")
    t.add_argument("--threads", type=int, default=None, help="torch threads to tune for (default: torch's)")
    t.add_argument("--json", action="store_true", help="print the measurement as JSON")
    t.set_defaults(func=cmd_tune)

    x = sub.add_parser("export", help="write a draft head in the layout vLLM and SGLang load (EAGLE-3: "
                                      "LlamaForCausalLMEagle3; our EAGLE-1-style head: EagleLlamaForCausalLM)")
    x.add_argument("--draft-head", required=True, help="a shipped head name (for --model) or a head directory")
    x.add_argument("--model", default="smollm2-135m", help="the model whose shipped heads NAME is looked up in")
    x.add_argument("--out", required=True, help="output directory (new or empty)")
    x.add_argument("--gguf", action="store_true",
                   help="also write OUT/eagle3-head.gguf with llama.cpp's converter (EAGLE-3 heads; the target is "
                        "--model): llama-server -m TARGET.gguf -md OUT/eagle3-head.gguf --spec-type draft-eagle3")
    x.add_argument("--llama-cpp", default=os.environ.get("SPECULANT_LLAMA_CPP_SRC"),
                   help="llama.cpp source tree holding convert_hf_to_gguf.py and gguf-py/ (default: "
                        "$SPECULANT_LLAMA_CPP_SRC)")
    x.set_defaults(func=cmd_export)

    for register in _extensions():
        register(sub, _add_model_args, _add_method_args)
    return parser


def _extensions():
    """Sub-commands that live with their packages (bench, sweep, training, serve)."""
    regs = []
    for mod in ("speculant.bench.cli", "speculant.training.cli", "speculant.serving.cli"):
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
    try:
        args = parser.parse_args(argv)
    except SystemExit as e:             # a usage error (one line, OneLineParser.error) or --help: its code, returned
        return e.code if isinstance(e.code, int) else EXIT_BAD_INPUT
    try:
        if os.environ.get("SPECULANT_NUM_THREADS"):     # else the tuned count (runtime.tune); torch not imported
            import torch                                 # for a command that fails on its arguments
            from .runtime.loader import user_threads
            torch.set_num_threads(user_threads())
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
