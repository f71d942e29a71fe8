"""What the entry points share: the model and method options and what they load (``speculant generate``, ``serve``,
``bench``, ``train``...).  The CLI module itself (:mod:`speculant.cli`) is the program and nothing imports it.
"""

from __future__ import annotations

import argparse
import os

from .errors import SpeculantError


def add_method_args(p: argparse.ArgumentParser) -> None:
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


def add_model_args(p: argparse.ArgumentParser) -> None:
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

    ``--exit-layer auto`` takes the best exit layer of the stored sweep (:func:`speculant.engine.sweeps.best_config`:
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
        from .engine.sweeps import best_config
        best = best_config(model.name, args.exit_adapter if args.exit_adapter != "none" else None)
        exit_layer = best["exit_layer"]
        if k is None and args.method == "early-exit":
            k = best["num_speculations"]
    speculation = getattr(args, "speculation", "cost")
    if speculation not in ("cost", "always"):         # the server's goodput: its batched policy sizes the rounds
        speculation = "always"
    if exit_layer is not None:
        try:
            exit_layer = int(exit_layer)
        except ValueError:
            raise SpeculantError(f"--exit-layer={exit_layer!r} is invalid; allowed: an integer or 'auto'") from None
    return MethodSpec(method=args.method, exit_layer=exit_layer, num_speculations=k, draft_model=args.draft_model,
                      max_ngram=args.max_ngram, min_ngram=args.min_ngram, branching=args.branching,
                      beam_width=args.beam_width, draft_length=args.draft_length, exit_adapter=args.exit_adapter,
                      draft_head=args.draft_head, verification=getattr(args, "verification", "token"),
                      speculation=speculation)
