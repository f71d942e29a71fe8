"""Cost of a T-row forward in one-token steps, per kernel library, the libraries alternated in one process.

Not a test.  One ``w4a8`` model (SmolLM2-135M from the cache, or a random-weight model of a larger shape,
``benchmarks/shaped_model.py``), KV cache holding ``--context`` tokens, the fused step's full forward (all
layers, final norm, LM head over every row) over T new tokens; for each repeat, each library in turn runs
every T (the machine's drift hits them alike).  Libraries: this checkout's kernels in the ISA variants
``--variants`` (``auto``: the pick in use, one variant per row count: ``build.for_rows``) and, with ``--baseline DIR``, another checkout's in the same variants (built with that
checkout's own build script).  Prints the best time of one step per library and each T's best time over it.

    python benchmarks/rows_cost.py --variants auto,avx2,avx512-vnni-ymm,avx512-vnni [--baseline /tmp/base]
        [--model smollm2|llama-3.2-1b] [--rows 1,2,3,4,5,6,8,12,16] [--repeats 20] [--context 300]

Valid while the builds share ``spec_decode_layers``'s argument and struct layout (checkouts from the commit that runs
GGUF K-quants on our kernels on: its projection struct gained ``scale_bytes``, ``group`` and stacked ``parts``).
"""

from __future__ import annotations

import argparse
import ctypes
import os
import subprocess
import sys
import time
from pathlib import Path

import torch

from speculant.kernels import build
from speculant.runtime.executor import Executor
from speculant.runtime.tune import cpu_description

sys.path.insert(0, str(Path(__file__).parent))


def _model(name: str, threads: int | None, kv_cache: str) -> Executor:
    """The model's executor (float16 or float32 KV cache as asked; ``auto``: the tuned one for SmolLM2, float16
    else)."""
    if name == "smollm2":
        from speculant.runtime.loader import load_model
        return load_model(weights="w4a8", threads=threads, kv_cache=kv_cache).executor
    from shaped_model import shaped_decoder
    if threads:
        torch.set_num_threads(threads)
    return Executor(shaped_decoder(name), torch.float32 if kv_cache == "float32" else torch.float16)


def _baseline_lib(checkout: str, isa: str, here: ctypes.CDLL) -> ctypes.CDLL:
    code = ("import sys; sys.path.insert(0, sys.argv[1]); from speculant.kernels import build; "
            "print(build._build(build._compiler(), sys.argv[2]))")
    path = subprocess.run([sys.executable, "-c", code, checkout, isa], capture_output=True, text=True,
                          check=True).stdout.strip().splitlines()[-1]
    lib = ctypes.CDLL(path)
    for entry in ("spec_decode_layers", "spec_rms_norm", "spec_w8a8_f32", "spec_w4a8_f32"):
        getattr(lib, entry).argtypes = getattr(here, entry).argtypes
        getattr(lib, entry).restype = getattr(here, entry).restype
    return lib


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--variants", default="avx2")
    ap.add_argument("--baseline", help="a checkout of another commit: its kernels too, in the same variants")
    ap.add_argument("--model", default="smollm2", choices=["smollm2", "llama-3.2-1b"])
    ap.add_argument("--rows", default="1,2,3,4,5,6,8,12,16")
    ap.add_argument("--repeats", type=int, default=20)
    ap.add_argument("--context", type=int, default=300)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--kv-cache", default="auto", choices=["auto", "float16", "float32"])
    ap.add_argument("--clock", default="wall", choices=["wall", "cpu"],
                    help="wall: elapsed time; cpu: the process's CPU time (all threads; steadier on a loaded machine)")
    args = ap.parse_args()
    rows = [int(r) for r in args.rows.split(",")]
    clock = time.perf_counter if args.clock == "wall" else time.process_time
    load0 = os.getloadavg()
    here = build.load()
    dec = _model(args.model, args.threads, args.kv_cache)
    libs = {}
    many = (build._LIB_MANY, build._MANY_ISA, build._MANY_ROWS)    # the pick in use (build.for_rows)
    for isa in args.variants.split(","):
        if isa == "auto":
            libs[f"auto ({build.describe()})"] = None
            continue
        libs[f"{isa}"] = build.load_variant(isa)
        if args.baseline:
            try:
                libs[f"{isa} (baseline)"] = _baseline_lib(args.baseline, isa, here)
            except subprocess.CalledProcessError:       # a variant the other checkout does not have
                print(f"rows_cost: the baseline has no variant {isa}", file=sys.stderr)
    fused = dec.fused_layers()
    assert fused is not None, "the model does not run as the fused step"
    for lib in libs.values():
        if hasattr(lib, "spec_set_weight_prefetch"):    # a baseline from before the distance was an argument
            lib.spec_set_weight_prefetch(fused.weight_prefetch)
    ctx, vocab = args.context, dec.config.vocab_size
    g = torch.Generator().manual_seed(0)
    times = {(name, t): float("inf") for name in libs for t in rows}
    with torch.inference_mode():
        cache = dec.new_cache(ctx + max(rows))
        dec(torch.randint(0, vocab, (1, ctx), generator=g), None, None, cache, 0)
        for rep in range(args.repeats + 1):
            for name, lib in libs.items():
                if lib is None:                                  # the pick in use: one library per row count
                    fused.lib = build._LIB = here
                    fused.lib_many, _, fused.many_from = build._LIB_MANY, build._MANY_ISA, build._MANY_ROWS = many
                else:
                    fused.lib = build._LIB = lib
                    fused.lib_many = build._LIB_MANY = None      # this library at every row count
                for t in rows:
                    ids = torch.randint(0, vocab, (1, t), generator=g)
                    t0 = clock()
                    dec(ids, None, None, cache, ctx)
                    if rep:
                        times[name, t] = min(times[name, t], clock() - t0)
    fused.lib = build._LIB = here
    fused.lib_many, _, fused.many_from = build._LIB_MANY, build._MANY_ISA, build._MANY_ROWS = many
    print(f"CPU: {cpu_description()['model']}, {torch.get_num_threads()} threads, load average "
          f"{load0[0]:.2f} -> {os.getloadavg()[0]:.2f}; model {args.model}, context {ctx}, "
          f"{str(dec.kv_dtype).removeprefix('torch.')} KV cache, weight prefetch {fused.weight_prefetch} B, "
          f"{args.repeats} alternated repeats (best, {args.clock} clock)\n")
    print("| kernels | one step [ms] | " + " | ".join(f"T={t}" for t in rows) + " |")
    print("|---|---|" + "---|" * len(rows))
    for name in libs:
        step = times[name, rows[0]]
        print(f"| {name} | {step * 1e3:.2f} | " + " | ".join(f"{times[name, t] / step:.2f}" for t in rows) + " |")


if __name__ == "__main__":
    main()
