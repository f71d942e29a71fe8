"""A/B of two builds of our kernels in one process: the same SmolLM2 w4a8 forward, libraries alternated per repeat.

Not a test.  Builds the kernels of ``--baseline`` (a checkout of another commit, e.g. ``git worktree add /tmp/base
HEAD~1``) with that checkout's own build script, loads both shared libraries, and times the decoder forward over
T = 1 and 5 new tokens (``--context`` cached tokens) with the fused step calling one library, then the other,
``--repeats`` times: the machine's drift hits both alike, which separate runs on a shared VM do not give.  Valid
while the two builds share ``spec_decode_layers``'s argument and struct layout (checkouts from the commit that runs
GGUF K-quants on our kernels on: its projection struct gained ``scale_bytes``, ``group`` and stacked ``parts``; before
that, from 69cf18e on: the layer struct gained the q/k norm weights).

    python benchmarks/step_ab.py --baseline /tmp/base [--context 300] [--repeats 60]
    python benchmarks/step_ab.py --variant avx2        # this checkout's kernels in another ISA variant
                                                       # (speculant.kernels.build.ISA_VARIANTS) as the baseline
    python benchmarks/step_ab.py --weight-prefetch 0   # this build with another weight prefetch distance [bytes]
                                                       # as the baseline (this build: the tuned one)
    python benchmarks/step_ab.py --pair-rows 1         # this build with 512-bit pairs at every row count as the
                                                       # baseline (this build: its measured pair threshold)
    python benchmarks/step_ab.py --folded-scales Q4_K --model gemma3-270m
                                                       # a GGUF's Q4_K / Q6_K projections as stored (this build)
                                                       # against the same codes with float32 scales folded per
                                                       # sub-block (W4A8Linear / W8A8Linear: the same bits);
                                                       # Q5_0: its 5-bit layout against the codes in bytes
"""

from __future__ import annotations

import argparse
import ctypes
import os
import statistics
import subprocess
import sys
import time

import torch

from speculant.errors import SpeculantError
from speculant.kernels import build
from speculant.runtime.loader import load_model
from speculant.runtime.tune import cpu_description


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    which = ap.add_mutually_exclusive_group(required=True)
    which.add_argument("--baseline", help="a checkout of the other commit")
    which.add_argument("--variant", choices=list(build.ISA_VARIANTS),
                       help="this checkout's kernels built in another variant")
    which.add_argument("--weight-prefetch", type=int, metavar="BYTES",
                       help="this build with the products' weight prefetch at BYTES ahead (0: none)")
    which.add_argument("--pair-rows", type=int, metavar="ROWS",
                       help="this build with 512-bit pairs from ROWS rows on (1: always; this build: the measured "
                            "threshold, build.measure_pair_rows)")
    which.add_argument("--folded-scales", choices=("Q4_K", "Q6_K", "both", "Q4_0", "Q5_0"),
                       help="baseline: that type's projections with their scales folded into float32")
    ap.add_argument("--model", default="smollm2-135m", help="a known model's name or a model path")
    ap.add_argument("--context", type=int, default=300)
    ap.add_argument("--repeats", type=int, default=60)
    args = ap.parse_args()
    here = build.load()
    if here is None:
        raise SystemExit(f"our kernels do not run here: {build.unavailable_reason()}")
    model = load_model(args.model, weights="w4a8")      # its executor passes the tuned weight prefetch
    prefetch = {"this build": model.executor.weight_prefetch or 0, "baseline": args.weight_prefetch}
    runs = {"this build": model.executor, "baseline": model.executor}
    other = here
    if args.folded_scales:
        folded = _folded(model.decoder, args.folded_scales)
        if folded is None:
            raise SystemExit(f"step_ab: {args.model} has no {args.folded_scales} projection stored with integer scales")
        runs["baseline"] = model.executor.like(folded)
        runs["this build"] = model.executor.like(_folded(model.decoder, None))   # a copy too: memory alike
    elif args.weight_prefetch is not None:
        try:
            build.check_weight_prefetch(args.weight_prefetch)
        except ValueError as e:
            raise SystemExit(f"step_ab: {e}") from None
        runs["baseline"] = model.executor.replace(weight_prefetch=args.weight_prefetch)
    elif args.pair_rows is not None:
        if args.pair_rows < 1:
            raise SystemExit(f"step_ab: --pair-rows {args.pair_rows}: allowed: 1 or more")
    elif args.variant:
        try:
            other = build.load_variant(args.variant)
        except SpeculantError as e:
            raise SystemExit(f"step_ab: {e}") from None
    else:
        code = ("import sys; sys.path.insert(0, sys.argv[1]); from speculant.kernels import build; "
                "print(build._build(build._compiler()))")
        path = subprocess.run([sys.executable, "-c", code, args.baseline], capture_output=True, text=True,
                              check=True).stdout.strip().splitlines()[-1]
        other = ctypes.CDLL(path)
        if not hasattr(other, "spec_decode_layers"):
            raise SystemExit("step_ab: the baseline's kernels have no spec_decode_layers (the one-sequence entry the "
                             "fused step calls since d7a8b18): compare with a checkout from d7a8b18 on")
        for entry in ("spec_run_layers", "spec_decode_layers", "spec_rms_norm"):     # the entries the step calls
            if hasattr(other, entry):
                getattr(other, entry).argtypes = getattr(here, entry).argtypes
                getattr(other, entry).restype = getattr(here, entry).restype
    if other is not here and hasattr(other, "spec_set_weight_prefetch"):   # a build from before the distance was
        other.spec_set_weight_prefetch(prefetch["this build"])              # an argument: the same distance
    ctx = args.context                                # the runtime's route: the fused step
    g = torch.Generator().manual_seed(0)
    times = {(name, t): [] for name in ("baseline", "this build") for t in (1, 5)}
    with torch.inference_mode():
        cache = model.executor.new_cache(ctx + 16)
        prompt = torch.randint(0, model.config.vocab_size, (1, ctx), generator=g)
        for dec in {id(d): d for d in runs.values()}.values():     # each decoder's RoPE rows (same K/V bits)
            dec.decoder.ensure_rope(ctx + 16)
            dec(prompt, None, None, cache, 0)
        tuned_rows = here.spec_pair_rows()
        pair_rows = {"baseline": args.pair_rows or tuned_rows, "this build": tuned_rows}
        for _ in range(args.repeats):
            for name, lib in (("baseline", other), ("this build", here)):
                dec = runs[name]
                dec.fused_layers().lib, dec.fused_layers().lib_many = lib, None     # one library at every row count
                if hasattr(lib, "spec_set_pair_rows"):      # one library's setting: the LM head's kernel too
                    lib.spec_set_pair_rows(pair_rows[name])
                if args.variant:                    # the LM head too (a baseline checkout's covers the layers)
                    build._LIB, build._LIB_MANY = lib, None
                for t in (1, 5):
                    ids = torch.randint(0, model.config.vocab_size, (1, t), generator=g)
                    t0 = time.perf_counter()
                    dec(ids, None, None, cache, ctx)
                    times[name, t].append(time.perf_counter() - t0)
    for dec in runs.values():
        dec.fused_layers().lib = here
    here.spec_set_pair_rows(tuned_rows)
    build._LIB = here                   # (this build at one library: build.many_rows() is not used in this A/B)
    print(f"CPU: {cpu_description()}, {torch.get_num_threads()} threads, load {os.getloadavg()[0]:.2f}; "
          f"context {ctx}, {args.repeats} alternated repeats; this build: kernels {build.loaded_isa()}; baseline: "
          f"{args.baseline or ('kernels ' + args.variant if args.variant else '') or (f'{args.folded_scales} scales folded into float32' if args.folded_scales else '') or (f'512-bit pairs from {args.pair_rows} rows' if args.pair_rows else '')}; pairs from [rows]: this build {tuned_rows}; weight prefetch [bytes]: this build "
          f"{prefetch['this build']}, baseline {prefetch['baseline'] if prefetch['baseline'] is not None else prefetch['this build']}\n")
    print("| build | T=1 min / median [ms] | T=5 min / median [ms] | T=5 / T=1 (min) |")
    print("|---|---|---|---|")
    for name in ("baseline", "this build"):
        one, five = times[name, 1], times[name, 5]
        print(f"| {name} | {min(one) * 1e3:.2f} / {statistics.median(one) * 1e3:.2f} | "
              f"{min(five) * 1e3:.2f} / {statistics.median(five) * 1e3:.2f} | {min(five) / min(one):.2f} |")


def _folded(decoder, kind: str | None):
    """A copy of ``decoder`` whose projections stored more compactly than their float scales are rebuilt with those
    scales (the same bits): ``kind`` Q4_K (or both) W4A8KLinear -> W4A8Linear with float32 scales and offsets, Q6_K
    (or both) W6A8Linear -> W8A8Linear, Q5_0 W5A8Linear -> W8A8Linear (codes in bytes), Q4_0 W4A8Linear without offsets -> with fp16 offsets ``-8 d`` (a stack's
    parts too); ``None`` where none is (``kind`` None: a plain copy)."""
    import copy

    from speculant.runtime.formats import W4A8KLinear, W4A8Linear, W5A8Linear, W6A8Linear, W8A8Linear
    out, changed = copy.deepcopy(decoder), 0
    if kind is None:
        return out

    def swap(module):
        nonlocal changed
        t = type(module)
        if (t is W4A8KLinear and kind in ("Q4_K", "both") or t is W6A8Linear and kind in ("Q6_K", "both")
                or t is W5A8Linear and kind == "Q5_0"):
            lin = {W4A8KLinear: W4A8Linear, W6A8Linear: W8A8Linear, W5A8Linear: W8A8Linear}[t](module.group_quantized(),
                                                                                             module.bias)
        elif t is W4A8Linear and kind == "Q4_0" and not hasattr(module, "offsets"):
            buffers = {"codes": module.codes, "scales": module.scales, "offsets": (-8.0 * module.scales.float()).half()}
            if module.bias is not None:
                buffers["bias"] = module.bias
            lin = W4A8Linear.empty(module.in_features, module.out_features, buffers)
        else:
            return module
        changed += 1
        lin.prefetch = module.prefetch
        return lin

    for parent in list(out.modules()):             # a stack's parts too (children of its ModuleList)
        for name, child in list(parent.named_children()):
            setattr(parent, name, swap(child))
    return out if changed else None


if __name__ == "__main__":
    main()
