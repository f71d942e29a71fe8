"""Which acceptance rate would early-exit self-speculation need on this machine?

Not a test.  Times the steps of self-speculative decoding on SmolLM2-135M in our runtime
(``speculant.bench.costs.measure_step_costs``): one AR step, one draft step at each exit
layer E (shared LM head, and a 2-block exit adapter with an 8192-token draft vocabulary,
which costs the same trained or not), and one verification of K drafted tokens.  Prints,
per E, the costs in AR steps, the best K, the acceptance rate needed for ``--target``
(Leviathan et al. 2023, Eq. 1 / Theorem 3.8) and, with ``--agreement`` (an ``exit-eval``
JSON), the speed-up the measured top-1 agreement would give.

    python benchmarks/early_exit_cost.py --exit-layers 2,4,6,8,12,16,20,24 --ks 1,2,3,4,6 \
        --agreement /path/to/exit-eval.json --target 1.6
"""

from __future__ import annotations

import argparse
import json

import torch

from speculant.bench.costs import expected_speedup, measure_step_costs, required_acceptance
from speculant.models.loading import read_checkpoint
from speculant.runtime.loader import load_model
from speculant.drafters.exit_adapter import ExitHead
from speculant.training.adapter import new_adapter


@torch.inference_mode()
def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--exit-layers", default="2,4,6,8,12,16,20,24")
    ap.add_argument("--ks", default="1,2,3,4,6")
    ap.add_argument("--context", type=int, default=256)
    ap.add_argument("--repeats", type=int, default=9)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--target", type=float, default=1.6, help="speed-up over AR to solve for")
    ap.add_argument("--draft-vocab", type=int, default=8192)
    ap.add_argument("--agreement", default=None, help="exit-eval JSON with per-layer top-1 agreement")
    ap.add_argument("--weights", default="auto", help="weight format of the runtime (default: the tuned one)")
    ap.add_argument("--no-compile", action="store_true")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    exits = [int(x) for x in args.exit_layers.split(",")]
    ks = [int(x) for x in args.ks.split(",")]
    model = load_model(weights=args.weights, compile=not args.no_compile, threads=args.threads)
    dec = model.executor                   # the runtime's route (fused step or compiled layers)
    vocab_ids = torch.arange(args.draft_vocab)

    float_model = read_checkpoint()       # adapters are trained (and initialised) on the float32 model

    def adapter_head(e: int):
        return ExitHead(new_adapter(float_model, e, num_blocks=2, vocab_ids=vocab_ids), dec.config.vocab_size)

    shared = measure_step_costs(dec, exits, ks, args.context, args.repeats)
    adapted = measure_step_costs(dec, exits, ks[:1], args.context, args.repeats, exit_head_for=adapter_head)
    agree = {}
    if args.agreement:
        agree = {int(k): v for k, v in json.loads(open(args.agreement).read())["layers"].items()}
    print(f"weights {model.weights}, compiled {model.compiled}, fused {model.fused}; AR step {shared.ar_step_s * 1e3:.1f} ms "
          f"(context {args.context}, threads {shared.threads})\n")
    print("| E | c_draft shared head | c_draft adapter head | " + " | ".join(f"c_verify K={k}" for k in ks)
          + f" | best K | alpha needed for {args.target}x | agreement (shared head) | expected speed-up at it |")
    print("|" + "---|" * (6 + len(ks)))
    for e in exits:
        cd = adapted.c_draft(e)
        cv = {k: shared.c_verify(e, k) for k in ks}
        need = {k: required_acceptance(args.target, k, cd, cv[k]) for k in ks}
        feasible = {k: a for k, a in need.items() if a is not None}
        best_k = min(feasible, key=feasible.get) if feasible else None
        a = agree.get(e)
        best_at = max(expected_speedup(a, k, cd, cv[k]) for k in ks) if a is not None else None
        cells = [str(e), f"{shared.c_draft(e):.3f}", f"{cd:.3f}", *(f"{cv[k]:.2f}" for k in ks)]
        cells += [str(best_k), f"{feasible[best_k]:.3f}"] if best_k else ["–", "unreachable"]
        cells += [f"{a:.3f}", f"{best_at:.2f}x"] if a is not None else ["–", "–"]
        print("| " + " | ".join(cells) + " |")

if __name__ == "__main__":
    main()
