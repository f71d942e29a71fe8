"""First-load and later-load time to the first token, and peak RSS, of ``speculant generate``.

Each measurement is a fresh process ``speculant generate --max-new-tokens 1 P``: the time from starting it to the
first byte of generated text on its stdout (imports, loading, compiling, prefill and the first token included),
and to its exit.  *Cold* runs get an empty
``$SPECULANT_CACHE`` (GGUF conversion, packing, kernel tuning and compilation all happen); *warm* runs reuse
the cache the first cold run filled.  Peak RSS is the child's ``ru_maxrss`` from ``os.wait4``.

Usage::

    python benchmarks/load_time.py --cold 1 --warm 3 [--model smollm2-135m] [--weights auto] [--keep DIR]
    python benchmarks/load_time.py --cold 0 --warm 4 --cache DIR [--model M]   # later loads on a kept cache

Prints a Markdown table (seconds, MiB) with the CPU model; raises SystemExit if a run fails.
"""
from __future__ import annotations

import argparse
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time


def cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def one_run(cmd: list[str], cache: str) -> tuple[float, float, float]:
    """Seconds to the first stdout byte, seconds to exit, and peak RSS [MiB] of one run with ``SPECULANT_CACHE=cache``."""
    env = dict(os.environ, SPECULANT_CACHE=cache)
    with tempfile.TemporaryFile() as err_file:
        t0 = time.perf_counter()
        proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=err_file)
        proc.stdout.read(1)
        first = time.perf_counter() - t0
        proc.stdout.read()
        _, status, usage = os.wait4(proc.pid, 0)
        wall = time.perf_counter() - t0
        err_file.seek(0)
        err = err_file.read().decode(errors="replace")
    proc.returncode = os.waitstatus_to_exitcode(status)
    if proc.returncode != 0:
        raise SystemExit(f"{' '.join(cmd)} failed (exit {proc.returncode}):\n{err[-2000:]}")
    return first, wall, usage.ru_maxrss / 1024.0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--weights", default="auto")
    ap.add_argument("--prompt", default="Name three colours.")
    ap.add_argument("--cold", type=int, default=1, help="runs with an empty cache (each its own)")
    ap.add_argument("--warm", type=int, default=3, help="runs reusing the first cold run's cache")
    ap.add_argument("--keep", default=None, help="use this directory as the first cold cache and keep it")
    ap.add_argument("--cache", default=None,
                    help="warm runs only, on this already filled cache (with --cold 0); kept as it is")
    args = ap.parse_args(argv)
    if args.cold < (0 if args.cache else 1) or args.warm < 0 or (args.cache and args.cold):
        ap.error(f"--cold {args.cold} / --warm {args.warm}: allowed --cold >= 1, --warm >= 0; with --cache: "
                 "--cold 0")
    cmd = [sys.executable, "-m", "speculant.cli", "generate", "--model", args.model, "--weights", args.weights,
           "--max-new-tokens", "1", args.prompt]
    rows, caches = [], []
    warm_cache = args.cache
    try:
        for i in range(args.cold):
            if i == 0 and args.keep:
                if os.path.exists(args.keep) and os.listdir(args.keep):
                    raise SystemExit(f"--keep {args.keep!r} is not empty; allowed: a new or empty directory")
                os.makedirs(args.keep, exist_ok=True)
                cache = args.keep
            else:
                cache = tempfile.mkdtemp(prefix="speculant-cold-")
                caches.append(cache)
            rows.append(("cold", i + 1, *one_run(cmd, cache)))
            if i == 0:
                warm_cache = cache
        for i in range(args.warm):
            rows.append(("warm", i + 1, *one_run(cmd, warm_cache)))
    finally:
        for c in caches:
            shutil.rmtree(c, ignore_errors=True)
    load = open("/proc/loadavg").read().split()[:3] if os.path.exists("/proc/loadavg") else ["?"] * 3
    print(f"CPU: {cpu_model()}, {os.cpu_count()} logical CPUs; load average at end {' '.join(load)}")
    print(f"command: SPECULANT_CACHE=<dir> {' '.join(cmd[1:])}\n")
    print("| run | # | to the first token [s] | to exit [s] | peak RSS [MiB] |\n|---|---|---|---|---|")
    for kind, i, first, wall, rss in rows:
        print(f"| {kind} | {i} | {first:.2f} | {wall:.2f} | {rss:.0f} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
