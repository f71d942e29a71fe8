"""What every training recipe shares: the run settings (:class:`RunConfig`), seeding, the learning-rate
schedule, resuming from a checkpoint and the optimisation loop (:func:`optimize`)."""

from __future__ import annotations

import math
import random
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch

from ..errors import SpeculantError, check_range
from .distributed import SINGLE, Dist


@dataclass(frozen=True)
class RunConfig:
    """Settings of a training run, common to the recipes (``speculant train`` flags of the same names).

    Attributes:
        steps: optimizer steps planned.
        lr: peak learning rate (each recipe's config sets its default).
        warmup: warm-up fraction of ``steps`` (:func:`lr_at`).
        seed: seed of Python's, torch's and the batch sampler's generators.
        max_minutes: stop (and checkpoint) after this wall time [minutes]; ``None``: no limit.
        resume: continue from ``out/checkpoint.pt``.
        checkpoint_every: steps between checkpoints (and one at the end).
        eval_every: steps between held-out evaluations (and one at the end).
        eval_tokens: held-out positions evaluated.
        progress: show a tqdm bar.
        stop_at: stop (and checkpoint) once this step is done, the schedule still planned for ``steps`` (a run in
            pieces: ``resume`` continues the same trajectory); ``None``: run to ``steps``.

    Raises:
        SpeculantError: a value out of range (one line naming it and what is allowed).
    """

    steps: int = 1000
    lr: float = 1e-3
    warmup: float = 0.05
    seed: int = 0
    max_minutes: float | None = None
    resume: bool = False
    checkpoint_every: int = 200
    eval_every: int = 200
    eval_tokens: int = 4000
    progress: bool = True
    stop_at: int | None = None

    def __post_init__(self):
        for name in ("steps", "checkpoint_every", "eval_every"):
            check_range(name, getattr(self, name), 1)
        if self.stop_at is not None:
            check_range("stop_at", self.stop_at, 1, self.steps)
        check_range("warmup", self.warmup, 0.0, 1.0)
        check_range("eval_tokens", self.eval_tokens, 0)
        if not self.lr > 0:
            raise SpeculantError(f"lr={self.lr} is out of range; allowed: > 0")

    @classmethod
    def naming_flags(cls, renames: dict[str, str] | None = None):
        """A context in which a bad value's error names ``speculant train``'s flag rather than this config's field
        (:func:`~speculant.errors.naming_flags`; ``renames``: the fields whose flag is named otherwise)."""
        from dataclasses import fields

        from ..errors import naming_flags
        return naming_flags({f.name for f in fields(cls)}, renames)

    @staticmethod
    def args_of(args, lr: float) -> dict:
        """The common fields from ``speculant train``'s parsed flags (``lr``: the recipe's default for ``--lr``)."""
        return dict(steps=args.steps, lr=args.lr or lr, warmup=args.warmup, seed=args.seed,
                    max_minutes=args.max_minutes, resume=args.resume, checkpoint_every=args.checkpoint_every,
                    eval_every=args.eval_every, eval_tokens=args.eval_tokens, progress=not args.no_progress,
                    stop_at=args.stop_at)


def lr_at(step: int, steps: int, warmup: float) -> float:
    """Linear warm-up then cosine decay to 10%: a multiplier of the peak learning rate."""
    w = max(1, int(steps * warmup))
    if step < w:
        return (step + 1) / w
    t = (step - w) / max(1, steps - w)
    return 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(t, 1.0)))


def check_positions(positions: str) -> None:
    """Raise :class:`SpeculantError` unless ``positions`` (which positions train) is ``all`` or ``response``."""
    if positions not in ("all", "response"):
        raise SpeculantError(f"positions={positions!r} is unknown; allowed: all, response")


def seeded(seed: int) -> torch.Generator:
    """Seed Python's and torch's global generators; returns a torch generator seeded ``seed`` (batch sampling)."""
    random.seed(seed)
    torch.manual_seed(seed)
    return torch.Generator().manual_seed(seed)


def read_checkpoint(path: Path) -> dict:
    """The checkpoint ``--resume`` continues from.

    Raises:
        SpeculantError: ``path`` does not exist.
    """
    if not path.is_file():
        raise SpeculantError(f"--resume given but {str(path)!r} does not exist; allowed: a previous --out")
    return torch.load(path, map_location="cpu", weights_only=False)   # saved on any device; loaded where it trains


def optimize(run: RunConfig, opt: torch.optim.Optimizer, params: list, start: int, desc: str,
             batch_loss: Callable[[int], tuple[torch.Tensor, int]], after_step: Callable[[int, torch.Tensor], None],
             checkpoint: Callable[[int], None], unit: str = "tok_s", dist: Dist = SINGLE) -> tuple[int, int, float]:
    """Steps ``start .. run.steps - 1`` of AdamW-style training: at each, the learning rate of :func:`lr_at`,
    ``loss, positions = batch_loss(step)``, backward, gradient norm clipped to 1, the optimizer step, then
    ``after_step(steps done, loss)``; ``checkpoint(steps done)`` every ``run.checkpoint_every`` steps.  Stops early
    after ``run.max_minutes`` (rank 0's clock decides, so every rank stops at the same step) or at ``run.stop_at``.

    On several processes (``dist``, :mod:`.distributed`) ``batch_loss`` returns this rank's share of the global
    batch's loss and the global batch's positions; the share is scaled by the world size before the backward
    (DistributedDataParallel and FSDP average the ranks' gradients, the shares must add up), and ``after_step``
    gets the global loss (the shares summed over the ranks).

    Returns:
        ``(steps done, positions trained on in this call, seconds)``.
    """
    from tqdm import tqdm

    t0 = time.perf_counter()
    done, seen = start, 0
    bar = tqdm(range(start, run.stop_at or run.steps), desc=desc, unit="step", disable=not run.progress)
    for step in bar:
        for g in opt.param_groups:
            g["lr"] = run.lr * lr_at(step, run.steps, run.warmup)
        loss, positions = batch_loss(step)
        opt.zero_grad(set_to_none=True)
        (loss * dist.world if dist.active else loss).backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        loss = dist.all_sum(loss)
        seen += positions
        done = step + 1
        bar.set_postfix(loss=f"{loss.item():.3f}", **{unit: f"{seen / (time.perf_counter() - t0 + 1e-9):.0f}"})
        after_step(done, loss)
        if done % run.checkpoint_every == 0:
            checkpoint(done)
        if run.max_minutes is not None and dist.broadcast_object(time.perf_counter() - t0 > run.max_minutes * 60):
            break
    return done, seen, time.perf_counter() - t0
