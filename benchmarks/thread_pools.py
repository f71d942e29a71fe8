"""Why `speculant serve` decodes in the thread that loaded the model: torch ops in another thread.

Not a test.  Loads the model (default weights, compiled) in the main thread, then times, in the main thread and
in a second thread: one int4-packed projection (``[3072, 576]``, one row) and one batched decoding round
(``BatchedGenerator.step``) of 1 and of 8 sequences.  With a second thread running torch ops there are two
OpenMP thread pools; libgomp then manages more threads than cores and stops spinning between parallel regions.

    python benchmarks/thread_pools.py [--rounds 20]
"""
from __future__ import annotations

import argparse
import threading
import time

import torch

from speculant import GenerationConfig, build_generator
from speculant.engine.batch import BatchedGenerator
from speculant.runtime.formats import pack_linear
from speculant.runtime.loader import load_model


def measure(bg, ids, rounds: int, proj) -> dict:
    out = {}
    x = torch.randn(1, proj.in_features)
    for _ in range(50):
        proj(x)
    t0 = time.perf_counter()
    for _ in range(500):
        proj(x)
    out["projection [us]"] = (time.perf_counter() - t0) / 500 * 1e6
    for n in (1, 8):
        seqs = [bg.start(ids, GenerationConfig(max_new_tokens=rounds + 10)) for _ in range(n)]
        for _ in range(3):
            bg.step(seqs)
        t0 = time.perf_counter()
        for _ in range(rounds):
            bg.step(seqs)
        out[f"round, {n} seq [ms]"] = (time.perf_counter() - t0) / rounds * 1e3
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--rounds", type=int, default=20)
    args = ap.parse_args()
    model = load_model(args.model, blocks=False)
    bg = BatchedGenerator(model)
    ids = build_generator(model).encode("Write a long story about a dragon and a knight.")
    proj = pack_linear("int4", torch.randn(3072, 576))
    rows = {}
    with torch.inference_mode():
        rows["loading (main) thread"] = measure(bg, ids, args.rounds, proj)

    def other():
        with torch.inference_mode():
            rows["another thread"] = measure(bg, ids, args.rounds, proj)

    t = threading.Thread(target=other)
    t.start()
    t.join()
    cols = list(rows["loading (main) thread"])
    print(f"weights {model.weights}, compiled {model.compiled}, torch threads {torch.get_num_threads()}\n")
    print("| thread | " + " | ".join(cols) + " |\n|---|" + "---|" * len(cols))
    for name, r in rows.items():
        print(f"| {name} | " + " | ".join(f"{r[c]:.1f}" for c in cols) + " |")


if __name__ == "__main__":
    main()
