"""Jobs of tests/test_distributed_training.py, run on every rank under torchrun (``python -m torch.distributed.run
--nproc_per_node 2 --standalone tests/distributed_worker.py JOBS.json``) or in the test's own process (a world of
one, :func:`run_job`).  A job is a dict: ``kind`` (``exit-adapter``, ``draft-head``, ``eagle3``, ``layerskip``,
``layerskip-lora``, ``make-data``, ``cli``: ``speculant`` with ``argv``), ``out``, ``corpus`` and, for training, ``steps``, ``stop_at``, ``resume``."""

from __future__ import annotations

import json
import os
import sys

sys.path.insert(0, os.path.dirname(__file__))
os.environ.setdefault("SPECULANT_COMPILE", "0")

import torch  # noqa: E402

from helpers import tiny_model  # noqa: E402

STEPS = 6
"""Steps of every training job (the schedule's length; ``stop_at`` cuts a run short)."""


def make_data_prompts():
    from speculant.training.data import Prompt
    return [Prompt(f"p{i}", "t", " ".join(f"t{(5 * i + j) % 60 + 2}" for j in range(3 + i % 4))) for i in range(9)]


def _train(job: dict, dist):
    from speculant.training.head import DraftHeadConfig, train_draft_head
    from speculant.training.train import (ExitAdapterConfig, LayerSkipConfig, train_exit_adapter,
                                          train_layerskip)
    common = dict(steps=STEPS, stop_at=job.get("stop_at"), resume=job.get("resume", False), eval_every=1,
                  checkpoint_every=100, eval_tokens=60, warmup=0.3, progress=False)
    kind, out, corpus = job["kind"], job["out"], job["corpus"]
    if kind == "exit-adapter":       # 63 positions a step: shares of 31 and 32 rows
        cfg = ExitAdapterConfig(exit_layer=1, blocks=1, draft_vocab=48, topk=8, lr=3e-3, batch_tokens=63,
                                cache_dir=out + "-cache", **common)
        return train_exit_adapter(tiny_model(layers=4, scale=2.0), corpus, out, cfg, dist=dist)
    if kind == "draft-head":         # 3 windows a step (shares of 1 and 2), feature noise, the self-fed pass
        cfg = DraftHeadConfig(lr=1e-2, batch_seqs=3, seq_len=12, draft_vocab=48, topk=8, noise=0.2, unroll=2,
                              cache_dir=out + "-cache", **common)
        return train_draft_head(tiny_model(seed=11, scale=2.5, layers=4), [corpus], out, cfg, dist=dist)
    if kind == "eagle3":             # 3 windows a step (shares of 1 and 2), 3 training-time-test steps
        from speculant.training.eagle3 import Eagle3Config, train_eagle3
        # lr 1e-3: AdamW turns the gradients' float noise (2e-7 of their size between batch splits) into weight
        # differences of about lr * 5e-3 (9e-6 after 6 steps at lr 2e-3), which _same's 1e-5 must stay above
        cfg = Eagle3Config(lr=1e-3, batch_seqs=3, seq_len=12, draft_vocab=48, topk=8, ttt_steps=3,
                           cache_dir=out + "-cache", **common)
        return train_eagle3(tiny_model(seed=11, scale=2.5, layers=4), [corpus], out, cfg, dist=dist)
    lora = 4 if kind == "layerskip-lora" else 0      # full fine-tune: FSDP; LoRA: DDP
    cfg = LayerSkipConfig(lr=1e-2 if lora else 3e-3, lora_rank=lora, p_max=0.6, exit_curriculum="rotational",
                          rotation=2, seq_len=16, batch=3 if lora else 4, eval_exit=2, **common)
    return train_layerskip(tiny_model(layers=4), corpus, out, cfg, dist=dist)


def _cli(job: dict, dist) -> dict:
    """``speculant ARGV`` on this rank (last job of a launch: the CLI leaves the process group), its stdout and
    stderr kept in ``out/stdout.rank<r>`` and ``out/stderr.rank<r>``."""
    import contextlib
    import io
    from pathlib import Path

    from speculant.cli import main as cli
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = cli(job["argv"])
    folder = Path(job["out"])
    folder.mkdir(parents=True, exist_ok=True)
    (folder / f"stdout.rank{dist.rank}").write_text(out.getvalue())
    (folder / f"stderr.rank{dist.rank}").write_text(err.getvalue())
    return {"code": code}


def _sgd(dist) -> dict:
    """Two plain SGD steps of ``optimize`` on a linear model under DDP (gradient norms below the clipping): the
    weights move by exactly the learning rate times the global batch's gradient, so a wrong scale would show
    (AdamW and clipping hide one)."""
    from speculant.training.distributed import wrap_ddp
    from speculant.training.run import RunConfig, optimize
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 1)
    net = wrap_ddp(model, dist)
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(5, 4, generator=g) * 0.1, torch.randn(5, 1, generator=g) * 0.1    # 5 rows: shares 2 and 3
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    mine = dist.share(5)

    def batch_loss(step):
        return (net(x[mine]) - y[mine]).pow(2).sum() / 5, 5

    optimize(RunConfig(steps=2, warmup=0.0, progress=False), opt, list(model.parameters()), 0, "sgd", batch_loss,
             lambda done, loss: None, lambda done: None, dist=dist)
    return {k: v.tolist() for k, v in model.state_dict().items()}


def run_job(job: dict, dist=None):
    """Run ``job`` on this process (``dist``: its :class:`~speculant.training.distributed.Dist`; ``None``: one)."""
    from speculant.training.distributed import SINGLE
    dist = dist or SINGLE
    if job["kind"] == "cli":
        return _cli(job, dist)
    if job["kind"] == "sgd":
        return _sgd(dist)
    if job["kind"] == "make-data":
        from speculant.training.data import MakeDataConfig, make_data
        model = tiny_model(seed=11, scale=2.5, vocab=64, layers=3, eos=7)
        cfg = MakeDataConfig(temperature=0.9, max_new_tokens=12, batch_size=job.get("batch_size", 1), seed=3,
                             progress=False)
        return make_data(model, make_data_prompts(), job["out"], cfg, dist)
    return _train(job, dist)


def main() -> None:
    from speculant.training.distributed import close, from_env
    torch.set_num_threads(1)
    jobs = json.loads(open(sys.argv[1]).read())
    dist = from_env()
    results = [run_job(job, dist) for job in jobs]
    if dist.main:
        with open(sys.argv[2], "w") as f:
            json.dump({"world": dist.world, "backend": dist.backend, "results": results}, f, default=str)
    close(dist)


if __name__ == "__main__":
    main()
