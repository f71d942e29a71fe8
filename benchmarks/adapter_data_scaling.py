"""How does an exit adapter's held-out agreement grow with distillation data?

Not a test.  Uses the feature cache written by ``speculant train --recipe exit-adapter`` (hidden
states at the exit + teacher top-k of the frozen model) and trains a fresh adapter (the recipe of
``speculant.training.train.train_exit_adapter``: same module, draft vocabulary, loss and schedule) on
the first 1/8, 1/4, 1/2 and all of the training *sequences*, with the same number of steps each, then
reports top-1 agreement with the final layer on the held-out response positions.  The slope per
doubling says how much data a target agreement would take.

    python benchmarks/adapter_data_scaling.py --cache-dir /tmp/s5/cache --exit-layer 8 --steps 300
"""

from __future__ import annotations

import argparse
import glob

import torch

from speculant.models.loading import read_checkpoint
from speculant.training.adapter import new_adapter
from speculant.training.losses import topk_distill_loss
from speculant.training.train import _eval_subset, evaluate_adapter, lr_at, remap, select_vocab


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--cache-dir", required=True)
    ap.add_argument("--exit-layer", type=int, default=8)
    ap.add_argument("--blocks", type=int, default=2)
    ap.add_argument("--draft-vocab", type=int, default=8192)
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--batch-tokens", type=int, default=256)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--fractions", default="0.125,0.25,0.5,1")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    model = read_checkpoint()
    V = model.config.vocab_size
    E = args.exit_layer
    tr = torch.load(glob.glob(f"{args.cache_dir}/features-train-*.pt")[0])
    ho = torch.load(glob.glob(f"{args.cache_dir}/features-heldout-*.pt")[0])
    eh, ei, el = _eval_subset(ho, E, 10**9)
    vocab_ids = select_vocab(tr["t_idx"], tr["t_logp"], args.draft_vocab, V, model.eos_token_ids)
    n_seq = int(tr["seq"].max()) + 1
    print(f"exit {E}, {n_seq} training sequences, {tr['seq'].numel()} positions, held-out {eh.shape[0]}\n")
    print("| fraction of sequences | training positions | held-out top-1 agreement |")
    print("|---|---|---|")
    for frac in (float(f) for f in args.fractions.split(",")):
        keep = (tr["seq"] < max(1, round(frac * n_seq))).nonzero().squeeze(1)
        H, T_map, T_logp = tr[f"hidden/{E}"][keep], remap(tr["t_idx"][keep], vocab_ids, V), tr["t_logp"][keep]
        torch.manual_seed(args.seed)
        gen = torch.Generator().manual_seed(args.seed)
        adapter = new_adapter(model, E, args.blocks, vocab_ids)
        params = [p for p in adapter.parameters() if p.requires_grad]
        opt = torch.optim.AdamW(params, lr=args.lr, weight_decay=0.0)
        adapter.train()
        for step in range(args.steps):
            for g in opt.param_groups:
                g["lr"] = args.lr * lr_at(step, args.steps, 0.05)
            idx = torch.randint(H.shape[0], (args.batch_tokens,), generator=gen)
            loss = topk_distill_loss(adapter(H[idx].float()), T_map[idx], T_logp[idx], 0.5)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(params, 1.0)
            opt.step()
        top1 = evaluate_adapter(adapter, eh, ei, el, V)["top1"]
        print(f"| {frac:g} | {H.shape[0]} | {top1:.3f} |", flush=True)


if __name__ == "__main__":
    main()
