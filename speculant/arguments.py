"""What the entry points share: the model and method options and what they load (``speculant generate``, ``serve``,
``bench``, ``train``...).  The CLI module itself (:mod:`speculant.cli`) is the program and nothing imports it.
"""

from __future__ import annotations

import argparse
import os

from .errors import SpeculantError, check_range


class OneLineParser(argparse.ArgumentParser):
    """argparse's parser whose usage errors (a missing argument, a value outside its choices, an unknown flag) are
    one line, as every other bad input: ``speculant: error: <message> (see `<prog> --help`)`` on stderr.

    Raises:
        SystemExit: code 2, from :meth:`error` (the entry point returns the code).
    """

    def error(self, message: str):
        self.exit(2, f"speculant: error: {message} (see `{self.prog} --help`)\n")


def add_method_args(p: argparse.ArgumentParser) -> None:
    from .engine.names import METHODS
    g = p.add_argument_group("method (a parameter the method does not use is an error)")
    g.add_argument("--method", default="ar", help=f"one of: {', '.join(METHODS)} (default: ar)")
    g.add_argument("--exit-layer", default=None,
                   help="exit layer E of the early-exit drafter: an int, or 'auto' = the best E (and K, unless "
                        "--num-speculations is given) of this machine's stored sweep, else the measured defaults "
                        "shipped for the model (default: the shipped exit adapter's layer, else min(8, layers/2))")
    g.add_argument("--num-speculations", default=None,
                   help="speculation length K: an int (default 4; prompt-lookup and eagle-lookup with cost-aware rounds: 8) or 'auto' "
                        "= adaptive length (stops drafting when the draft's confidence is low)")
    g.add_argument("--draft-model", default=None, help="draft model name, GGUF file, HF directory, or truncated:E")
    g.add_argument("--exit-adapter", default=None, help="trained exit adapter: a name ('default') or a directory")
    g.add_argument("--draft-head", default=None,
                   help="trained draft head (EAGLE): a name ('default') or a directory; drafts for eagle and "
                        "eagle-lookup (default: the shipped 'default') and, when given, for rsd-c/rsd-s/specinfer")
    g.add_argument("--max-ngram", type=int, default=None,
                   help="prompt-lookup / eagle-lookup: longest n-gram matched (tokens; default 5 with cost-aware "
                        "rounds, else 3)")
    g.add_argument("--min-ngram", type=int, default=None,
                   help="prompt-lookup / eagle-lookup: shortest n-gram matched (tokens; default 1, eagle-lookup 2: "
                        "shorter matches leave the round to the head)")
    g.add_argument("--branching", default=None,
                   help="rsd-c/specinfer: children per node at each depth, e.g. 3,2,1 (default 2,2,2)")
    g.add_argument("--beam-width", type=int, default=None, help="rsd-s: beam width W (default 4)")
    g.add_argument("--draft-length", type=int, default=None, help="rsd-s: draft depth L (default 4)")


def add_model_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default="smollm2-135m", help="known model name, GGUF file (PATH.gguf) or HF-format directory")
    p.add_argument("--weights", default="auto",
                   help="weight format of the projections: auto (default: w4a8 where our kernels run, unless "
                        "another batch-invariant format is measured faster here by more than the noise), fp32, bf16, int8, int4 (the GGUF's own 4-bit codes), "
                        "w4a8 (the same codes on int8 activations, our AVX2 kernel)")
    p.add_argument("--no-compile", action="store_true",
                   help="run the decoder eagerly (no torch.compile); also SPECULANT_COMPILE=0")
    p.add_argument("--dtype", default="float32",
                   help="float32 (default), bfloat16 or float16: dtype of a --weights fp32 model (activations too)")
    p.add_argument("--threads", type=int, default=None,
                   help="CPU threads (default: $SPECULANT_NUM_THREADS, else the count the tuner measured fastest, "
                        "lowered while other processes keep cores busy); a number fixes the count")
    p.add_argument("--kv-cache", default="auto", choices=("auto", "float32", "float16", "float64"),
                   help="KV cache dtype: auto (default: what the tuner measured faster here), float32, float64, or "
                        "float16 (half the cache bytes; our attention kernel only; exact within the choice)")


def compile_wanted(args) -> bool:
    """``--no-compile`` unset and ``$SPECULANT_COMPILE`` not ``0``."""
    return not args.no_compile and os.environ.get("SPECULANT_COMPILE", "1") != "0"


def load_for_decoding(args):
    """The model named by ``--model`` in ``--weights`` (tuned, compiled unless turned off)."""
    from .runtime.loader import load_model
    if getattr(args, "threads", None) is not None:
        check_range("--threads", args.threads, 1)
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
    from .engine.methods import MethodSpec, draft_head_name, drafts_with_exit_layers
    exit_layer, k = args.exit_layer, args.num_speculations
    if model is None and getattr(args, "model", None):          # a head the method needs and lacks: before the load
        from .models.loading import known_name
        draft_head_name(args.method, getattr(args, "draft_head", None), known_name(args.model))
    if exit_layer == "auto":
        if not drafts_with_exit_layers(args.method, args.draft_model):
            raise SpeculantError(f"--exit-layer auto is not used by --method {args.method}"
                                 + (" with --draft-model" if args.draft_model else "")
                                 + "; it applies to early-exit and to rsd-c/rsd-s/specinfer without --draft-model")
    if exit_layer == "auto" and model is None:
        exit_layer = 1
    elif exit_layer == "auto":
        from .engine.sweeps import best_config
        best = best_config(model.name, args.exit_adapter if args.exit_adapter != "none" else None,
                           model.config.num_hidden_layers)
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


# ---------------------------------------------------------------- sampling controls, logprobs, n, structured output
GRAMMAR_FLAGS = {"json_schema": "--json-schema", "regex": "--regex", "ebnf": "--grammar", "json_object": "--json-object"}


def add_control_args(p: argparse.ArgumentParser) -> None:
    """``speculant generate``'s per-position controls (issue 27): penalties, min-p, logit bias, logprobs, ``n``,
    a grammar, ``min_tokens``, ``ignore_eos``, stop token ids."""
    g = p.add_argument_group("controls (every method stays exact with them)")
    g.add_argument("--repetition-penalty", type=float, default=1.0,
                   help="Hugging Face's repetition penalty over prompt and output, > 0 (default 1 = off)")
    g.add_argument("--frequency-penalty", type=float, default=0.0,
                   help="OpenAI's frequency penalty over the output, in [-2, 2] (default 0)")
    g.add_argument("--presence-penalty", type=float, default=0.0,
                   help="OpenAI's presence penalty over the output, in [-2, 2] (default 0)")
    g.add_argument("--min-p", type=float, default=0.0, help="min-p filtering, in [0, 1] (default 0 = off)")
    g.add_argument("--logit-bias", action="append", metavar="TOKEN=BIAS",
                   help="add BIAS (in [-100, 100]) to token id TOKEN's logit (repeatable)")
    g.add_argument("--logprobs", type=int, default=None, metavar="K",
                   help="with --json: each token's raw log-probability and the K (0..20) most likely alternatives")
    g.add_argument("--n", type=int, default=1, help="independent samples (seed + i), one shared prefill (default 1)")
    g.add_argument("--json-schema", default=None, metavar="FILE|JSON", help="the output follows this JSON schema")
    g.add_argument("--json-object", action="store_true", help="the output is a JSON object")
    g.add_argument("--regex", default=None, help="the output matches this regular expression (Rust regex syntax)")
    g.add_argument("--grammar", default=None, metavar="FILE|TEXT", help="the output follows this Lark or GBNF grammar")
    g.add_argument("--min-tokens", type=int, default=0, help="EOS and stop tokens are masked until this many tokens")
    g.add_argument("--ignore-eos", action="store_true", help="EOS does not end the output")
    g.add_argument("--stop-token-id", type=int, action="append", help="a token id that ends the output (repeatable)")


def logit_bias_from_args(values) -> dict[int, float] | None:
    """``--logit-bias TOKEN=BIAS`` values as ``{token id: bias}``.  Raises :class:`SpeculantError` for a malformed
    one (its range is checked by :class:`~speculant.sampling.processors.SamplingConfig`)."""
    out = {}
    for v in values or ():
        tok, sep, bias = v.partition("=")
        try:
            out[int(tok)] = float(bias)
        except ValueError:
            raise SpeculantError(f"--logit-bias={v!r} is invalid; allowed: TOKEN=BIAS with an integer token id and "
                                 "a number in [-100, 100]") from None
        if not sep:
            raise SpeculantError(f"--logit-bias={v!r} is invalid; allowed: TOKEN=BIAS")
    return out or None


def grammar_spec_from_args(args) -> tuple[str, object] | None:
    """``(kind, spec)`` of the one grammar flag given (``None``: none), read and parsed before the model loads: a
    ``--json-schema`` or ``--grammar`` naming an existing file is read from it.

    Raises:
        SpeculantError: two grammar flags, a JSON schema that does not parse, an empty regex or grammar.
    """
    import json
    from pathlib import Path
    given = {k: v for k, v in (("json_schema", args.json_schema), ("regex", args.regex), ("ebnf", args.grammar),
                               ("json_object", True if args.json_object else None)) if v is not None}
    if len(given) > 1:
        raise SpeculantError(f"{' and '.join(GRAMMAR_FLAGS[k] for k in given)} both constrain the output; "
                             "allowed: one of them")
    if not given:
        return None
    kind, spec = next(iter(given.items()))
    if kind in ("json_schema", "ebnf") and not spec.lstrip().startswith("{") and Path(spec).is_file():
        spec = Path(spec).read_text()
    if kind == "json_schema":
        try:
            spec = json.loads(spec)
        except json.JSONDecodeError as e:
            raise SpeculantError(f"--json-schema is not valid JSON ({e}); allowed: a JSON schema or a file holding "
                                 "one") from None
    elif kind != "json_object" and not spec:
        raise SpeculantError(f"{GRAMMAR_FLAGS[kind]} is empty; allowed: a non-empty {kind}")
    return kind, spec


def config_from_args(args, model=None):
    """The :class:`~speculant.engine.generator.GenerationConfig` of ``speculant generate``'s flags (with ``model``
    the grammar is compiled for its tokenizer; without, only the flags are checked, before the model loads).

    Raises:
        SpeculantError: a value out of range or malformed (named, with what is allowed).
    """
    from .engine.generator import GenerationConfig
    from .engine.multi import MAX_N
    from .sampling.processors import SamplingConfig
    if isinstance(args.n, bool) or not 1 <= args.n <= MAX_N:
        raise SpeculantError(f"--n={args.n} is out of range; allowed: an integer in [1, {MAX_N}]")
    if args.logprobs is not None and not args.json:
        raise SpeculantError("--logprobs needs --json (the log-probabilities are part of the JSON output)")
    sampling = SamplingConfig(temperature=args.temperature, top_k=args.top_k, top_p=args.top_p, seed=args.seed,
                              repetition_penalty=args.repetition_penalty, frequency_penalty=args.frequency_penalty,
                              presence_penalty=args.presence_penalty, min_p=args.min_p,
                              logit_bias=logit_bias_from_args(args.logit_bias))
    grammar = grammar_spec_from_args(args)
    if grammar is not None and model is not None:
        from .sampling.grammar import compile_grammar
        grammar = compile_grammar(*grammar, model.tokenizer, vocab_size=model.config.vocab_size,
                                  eos_token_ids=model.eos_token_ids)
    return GenerationConfig(max_new_tokens=args.max_new_tokens, sampling=sampling, stop=tuple(args.stop or ()),
                            chat=not args.raw, logprobs=args.logprobs,
                            grammar=grammar if model is not None else None, min_tokens=args.min_tokens,
                            ignore_eos=args.ignore_eos, stop_token_ids=tuple(args.stop_token_id or ()))
