"""Flags of ``speculant train`` and ``speculant exit-eval``, apart from the trainers so that the command line is
parsed without torch."""

from __future__ import annotations

from .curricula import CURRICULA

RECIPES = ("layerskip", "exit-adapter", "draft-head", "eagle3")
TIME_CURRICULA = ("constant", "exp")
"""Layer-dropout schedules over training time (:func:`speculant.training.schedules.layer_dropout_rates`)."""


def add_train_args(p) -> None:
    """Flags of ``speculant train``."""
    p.add_argument("--recipe", required=True, help=f"one of: {', '.join(RECIPES)}")
    p.add_argument("--corpus", required=True, help="JSONL from `speculant make-data` (train + heldout splits); "
                   "draft-head takes several, comma-separated")
    p.add_argument("--out", required=True, help="output directory (checkpoint, metrics, trained weights)")
    p.add_argument("--steps", type=int, default=1000)
    p.add_argument("--lr", type=float, default=None, help="peak learning rate (default 1e-3 adapter, 1e-4 layerskip)")
    p.add_argument("--warmup", type=float, default=0.05, help="warm-up fraction of --steps")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--max-minutes", type=float, default=None, help="stop (and checkpoint) after this wall time")
    p.add_argument("--resume", action="store_true", help="continue from --out/checkpoint.pt")
    p.add_argument("--stop-at", type=int, default=None,
                   help="stop (and checkpoint) after this step; the schedule still spans --steps (then --resume)")
    p.add_argument("--checkpoint-every", type=int, default=200)
    p.add_argument("--eval-every", type=int, default=200)
    p.add_argument("--eval-tokens", type=int, default=4000, help="held-out positions used for evaluation")
    p.add_argument("--no-progress", action="store_true")
    p.add_argument("--device", default="cpu",
                   help="where the target and the trained weights run: cpu, cuda, cuda:N (torch device names)")
    a = p.add_argument_group("exit-adapter and draft-head")
    a.add_argument("--exit-layer", type=int, default=6, help="exit layer E (hidden leaving layer E-1)")
    a.add_argument("--blocks", type=int, default=2, help="residual SwiGLU blocks (init from layers E, E+1, ...)")
    a.add_argument("--draft-vocab", type=int, default=8192, help="reduced draft vocabulary size (0 = full)")
    a.add_argument("--topk", type=int, default=32, help="teacher top-k log-probs cached per position")
    a.add_argument("--batch-tokens", type=int, default=512)
    a.add_argument("--hard-weight", type=float, default=0.5, help="extra CE weight on the teacher's argmax")
    a.add_argument("--positions", default="all", help="train on 'all' positions or 'response' positions only")
    a.add_argument("--cache-dir", default=None,
                   help="feature cache (default: --out/cache; draft-head: $SPECULANT_CACHE/features)")
    a.add_argument("--max-train-tokens", type=int, default=None)
    a.add_argument("--cache-exits", default="", help="extra exit layers to cache in the same pass, e.g. 6,8,10")
    h = p.add_argument_group("draft-head")
    h.add_argument("--feature", default="post-norm", help="target feature the head reads: post-norm or pre-norm")
    h.add_argument("--init", default="random", help="head init: random (as EAGLE) or last-layer (copy of the target's)")
    h.add_argument("--head-batch", type=int, default=8, help="windows (of one sequence each) per step")
    h.add_argument("--head-seq-len", type=int, default=256, help="positions per window")
    h.add_argument("--v-weight", type=float, default=1.0, help="weight of the feature regression (SmoothL1)")
    h.add_argument("--p-weight", type=float, default=1.0, help="weight of the distribution loss (KL + hard CE)")
    h.add_argument("--feature-noise", type=float, default=0.0,
                   help="uniform input-feature noise, width in units of the features' RMS (EAGLE's augmentation)")
    h.add_argument("--unroll", type=int, default=1,
                   help="2 = also train on the head's own predicted features (two-step training-time test)")
    e3 = p.add_argument_group("eagle3 (also reads --head-batch, --head-seq-len, --draft-vocab, --topk, --hard-weight)")
    e3.add_argument("--aux-layers", default="", help="the 3 target hidden-state boundaries the head reads, e.g. "
                    "2,15,27 (k: entering layer k, as vLLM counts; default: 2, L//2, L-3)")
    e3.add_argument("--ttt-steps", type=int, default=3, help="training-time-test steps (1: no self-fed steps)")
    e3.add_argument("--ttt-decay", type=float, default=0.8, help="loss weight decay^s of TTT step s")
    ls = p.add_argument_group("layerskip")
    ls.add_argument("--lora-rank", type=int, default=8, help="LoRA rank (0 = full fine-tune)")
    ls.add_argument("--lora-alpha", type=float, default=16.0)
    ls.add_argument("--p-max", type=float, default=0.1, help="layer dropout at the last layer")
    ls.add_argument("--dropout-curriculum", default="constant", help=f"one of: {', '.join(TIME_CURRICULA)}")
    ls.add_argument("--exit-curriculum", default="rotational", help=f"one of: {', '.join(CURRICULA)}")
    ls.add_argument("--rotation", type=int, default=4, help="R of the rotational curriculum")
    ls.add_argument("--e-scale", type=float, default=1.0)
    ls.add_argument("--seq-len", type=int, default=128)
    ls.add_argument("--batch", type=int, default=4)
    ls.add_argument("--eval-exit", type=int, default=8, help="exit layer whose agreement is reported")


# ----------------------------------------------------------------------------- exit adapter


def add_eval_args(p) -> None:
    """Flags of ``speculant exit-eval``."""
    p.add_argument("--corpus", required=True, help="JSONL from `speculant make-data`")
    p.add_argument("--split", default="heldout", help="train or heldout (default)")
    p.add_argument("--exit-adapter", default=None, help="adapter name or directory to evaluate too")
    p.add_argument("--max-tokens", type=int, default=2000, help="positions for the agreement table")
    p.add_argument("--png", default=None, help="write the agreement plot here")
    p.add_argument("--out", default=None, help="write the JSON result here")
    p.add_argument("--speed-prompts", type=int, default=0, help="held-out prompts for the AR vs early-exit run")
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--num-speculations", default="4")
    p.add_argument("--exit-layer", type=int, default=None)
