"""Teacher-forced held-out metrics of draft heads, all on the same positions.

Not a test.  For the held-out split of the given ``make-data`` corpora (prompts never trained on), computes each
head's first-drafted-token metrics (:func:`speculant.training.head.evaluate_head`: top-1 agreement with the
target = greedy acceptance, and the T=1 acceptance bound) over every held-out response position.

    python benchmarks/draft_head_eval.py --corpus a.jsonl,b.jsonl default /path/to/other_head
"""
from __future__ import annotations

import argparse
import json

import torch

from speculant.drafters.draft_head import load_head
from speculant.models.loading import read_checkpoint
from speculant.training.head import default_cache_dir, evaluate_head, head_inputs, load_split, sequences


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("heads", nargs="+", help="head names or directories")
    ap.add_argument("--corpus", required=True, help="comma-separated make-data corpora")
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--topk", type=int, default=32)
    args = ap.parse_args()
    model = read_checkpoint(args.model, torch.float32)       # the float32 model the heads were trained against
    held = load_split(model, args.corpus.split(","), "heldout", args.topk, default_cache_dir(), None, True)
    for name in args.heads:
        head = load_head(name, model)
        feats = head_inputs(model, held, head.feature)
        m = evaluate_head(head, feats, held["ids"], held["t_idx"], held["t_logp"], held["response"],
                          sequences(held["seq"]), 10 ** 12)
        print(name, json.dumps(m), flush=True)


if __name__ == "__main__":
    main()
