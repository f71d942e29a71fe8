"""Training and make-data on two processes, launched by torchrun (gloo on CPU), against one process (issue 28, 4).

One torchrun launch runs every two-process job (tests/distributed_worker.py); the one-process jobs run here.  Each
recipe (exit adapter, draft head and EAGLE-3 head under DDP, full-model LayerSkip under FSDP2, LayerSkip LoRA under DDP) must
give, per step, the one-process losses with the same global batch, and a run stopped at step 3 and resumed on the
other world size (1 -> 2 and 2 -> 1) must continue the same trajectory.  make-data on two processes must write
the one-process file.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from distributed_worker import STEPS, run_job
from helpers import pattern_corpus, tiny_model
from speculant.models.loading import save_hf_dir

KINDS = ("exit-adapter", "draft-head", "eagle3", "layerskip", "layerskip-lora")
STOP = 3
WORKER = Path(__file__).with_name("distributed_worker.py")
ROOT = Path(__file__).resolve().parents[1]


def _launch(jobs: list[dict], folder: Path) -> dict:
    """The jobs on two processes through torchrun's launcher; returns rank 0's report."""
    (folder / "jobs.json").write_text(json.dumps(jobs))
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
               OMP_NUM_THREADS="1")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--standalone", str(WORKER),
           str(folder / "jobs.json"), str(folder / "report.json")]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads((folder / "report.json").read_text())


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    d = tmp_path_factory.mktemp("ddp")
    corpus = str(pattern_corpus(d / "c.jsonl"))

    def job(kind, name, **kw):
        return {"kind": kind, "out": str(d / f"{kind}-{name}"), "corpus": corpus, **kw}

    stops = {k: run_job(job(k, "w1-stopped", stop_at=STOP)) for k in KINDS}   # one process stops at step 3;
    t0 = time.perf_counter()                                                    # two processes resume it
    jobs = [j for k in KINDS for j in (job(k, "w2"), job(k, "w2-stopped", stop_at=STOP),
                                       job(k, "w1-stopped", resume=True))]
    tiny = save_hf_dir(tiny_model(layers=4, scale=2.0), d / "tiny")
    cli = {"kind": "cli", "out": str(d / "cli"),
           "argv": ["train", "--recipe", "eagle3", "--model", str(tiny), "--corpus", corpus, "--out", str(d / "cli"),
                    "--steps", "2", "--draft-vocab", "48", "--topk", "8", "--head-batch", "2", "--head-seq-len", "8",
                    "--ttt-steps", "2", "--eval-tokens", "40", "--cache-dir", str(d / "cli-cache")]}
    report = _launch(jobs + [{"kind": "sgd"}, {"kind": "make-data", "out": str(d / "data-w2.jsonl")}, cli], d)
    print(f"torchrun launch: {time.perf_counter() - t0:.1f} s")
    results = {(j["kind"], Path(j["out"]).name.removeprefix(j["kind"] + "-")): r
               for j, r in zip(jobs, report["results"])}
    results.update({(k, "w1-stopped-at"): r for k, r in stops.items()})
    for k in KINDS:                                  # the reference, and the resumption of the 2-process stop
        results[k, "w1"] = run_job(job(k, "w1"))
        results[k, "w2-stopped-resumed"] = run_job(job(k, "w2-stopped", resume=True))
    results["make-data", "w1"] = run_job({"kind": "make-data", "out": str(d / "data-w1.jsonl")})
    results["sgd", "w2"] = report["results"][-3]
    results["sgd", "w1"] = run_job({"kind": "sgd"})
    results["make-data", "w2"] = report["results"][-2]
    results["cli", "w2"] = report["results"][-1]
    return d, report, results


def _checkpoint(d: Path, kind: str, name: str) -> tuple[list[float], dict]:
    """The per-step training losses and the trained weights a run's last checkpoint holds."""
    st = torch.load(d / f"{kind}-{name}" / "checkpoint.pt", weights_only=False)
    losses = st.get("losses") or [h["loss"] for h in st["history"] if "loss" in h]
    return losses, st.get("adapter") or st.get("head") or st["trainable"]


def _same(a: dict, b: dict) -> None:
    assert set(a) == set(b) and a
    for k in a:
        torch.testing.assert_close(a[k].float(), b[k].float(), rtol=1e-4, atol=1e-5, msg=k)


@pytest.mark.parametrize("kind", KINDS)
def test_two_processes_follow_the_one_process_trajectory(runs, kind):
    d, report, results = runs
    assert (report["world"], report["backend"]) == (2, "gloo")
    one, w1 = _checkpoint(d, kind, "w1")
    two, w2 = _checkpoint(d, kind, "w2")
    assert len(one) == len(two) == STEPS and len(set(one)) == STEPS        # the loss moves every step
    assert two == pytest.approx(one, rel=1e-5, abs=1e-5)
    _same(w2, w1)
    if kind.startswith("layerskip"):    # rank 0's model after training (FSDP: gathered), evaluated and written
        assert results[kind, "w2"]["heldout_after"]["nll"] == pytest.approx(results[kind, "w1"]["heldout_after"]["nll"],
                                                                            rel=1e-5)
        assert results[kind, "w2"]["processes"] == 2
        assert (d / f"{kind}-w2" / "model" / "model.safetensors").is_file()


def test_the_gradient_of_two_processes_is_the_global_batchs(runs):
    """Under SGD without clipping the weights move by the gradient itself: two processes (uneven shares of 2 and 3
    rows) move them as one process does, so the shares' scaling (by the world size, as DDP averages) is right."""
    _, _, results = runs
    one, two = results["sgd", "w1"], results["sgd", "w2"]
    torch.manual_seed(0)
    start = torch.nn.Linear(4, 1).state_dict()
    assert any(not torch.allclose(torch.tensor(one[k]), start[k]) for k in start)          # the weights moved
    for k in one:
        torch.testing.assert_close(torch.tensor(two[k]), torch.tensor(one[k]), rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("kind", KINDS)
def test_a_stopped_run_resumes_the_same_trajectory_on_the_other_world_size(runs, kind):
    d, _, results = runs
    one, w1 = _checkpoint(d, kind, "w1")
    for name, resumed in (("w1-stopped", "w1-stopped"), ("w2-stopped", "w2-stopped-resumed")):   # by 2 / by 1
        assert results[kind, name + "-at" if name == "w1-stopped" else name]["steps_done"] == STOP
        assert results[kind, resumed]["steps_done"] == STEPS
        losses, weights = _checkpoint(d, kind, name)
        assert losses == pytest.approx(one, rel=1e-5, abs=1e-5), name
        _same(weights, w1)


def test_make_data_on_two_processes_writes_the_one_process_file(runs):
    d, _, results = runs
    one, two = d / "data-w1.jsonl", d / "data-w2.jsonl"
    records = [json.loads(line) for line in one.read_text().splitlines()]
    assert len(records) == 9 and len({r["id"] for r in records}) == 9
    assert two.read_text() == one.read_text()
    assert not list(d.glob("data-w2.jsonl.rank*"))                         # the shards were merged and removed
    w1, w2 = results["make-data", "w1"], results["make-data", "w2"]
    assert (w2["records"], w2["tokens"], w2["processes"]) == (w1["records"], w1["tokens"], 2)


def test_speculant_train_under_torchrun_reports_and_writes_from_rank_0(runs):
    """`speculant train` itself under torchrun (the eagle3 recipe, which once refused it): both ranks train (the
    command exits 0 on each), rank 0 alone prints the metrics and shows the progress bar, and writes the head and its
    checkpoint."""
    d, _, results = runs
    assert results["cli", "w2"]["code"] == 0
    out = d / "cli"
    metrics = json.loads((out / "stdout.rank0").read_text())
    assert metrics["recipe"] == "eagle3" and metrics["steps_done"] == 2
    assert (out / "stdout.rank1").read_text() == ""
    assert "train eagle3" in (out / "stderr.rank0").read_text()
    assert "train eagle3" not in (out / "stderr.rank1").read_text()
    assert (out / "model.safetensors").is_file() and (out / "checkpoint.pt").is_file()


def test_an_eagle3_checkpoint_of_either_format_resumes(tmp_path):
    """The eagle3 recipe writes its AdamW state by parameter name (any world size reads it); a checkpoint of the
    earlier one-process format (state by index) still resumes with the same state."""
    from speculant.drafters.eagle3_head import new_eagle3
    from speculant.training.eagle3 import Eagle3Config, _resume
    from speculant.training.distributed import full_states
    model, cfg, aux = tiny_model(layers=4), Eagle3Config(draft_vocab=0), [1, 2, 3]

    def head_and_opt(seed):
        head = new_eagle3(model, aux, seed=seed)
        named = [(n, p) for n, p in head.named_parameters() if p.requires_grad]
        return head, named, torch.optim.AdamW([p for _, p in named], lr=1e-2)

    head, named, opt = head_and_opt(0)
    sum(p.square().sum() for _, p in named).backward()
    opt.step()
    common = {"recipe": "eagle3", "settings": cfg.settings(aux), "head": head.state_dict(),
              "gen": torch.Generator().get_state(), "step": 1, "history": [], "seen": 8}
    for name, st in (("by-name", {**common, "format": "full-state", "opt": full_states(named, opt)[1]}),
                     ("by-index", {**common, "opt": opt.state_dict()})):
        torch.save(st, tmp_path / f"{name}.pt")
        other, other_named, other_opt = head_and_opt(1)
        assert _resume(tmp_path / f"{name}.pt", cfg, aux, other, other_named, other_opt, torch.Generator()) == \
            (1, [], 8)
        for (n, p), (_, q) in zip(named, other_named):
            assert torch.equal(p, q), (name, n)
            for k, v in opt.state[p].items():
                assert torch.equal(other_opt.state[q][k], v), (name, n, k)


def test_shares_cover_the_global_batch_and_bad_settings_are_one_line_errors(monkeypatch):
    from speculant.errors import SpeculantError
    from speculant.training.distributed import SINGLE, Dist, check_batch, from_env
    for world in (1, 2, 3):
        rows = [list(range(7))[Dist(r, world).share(7)] for r in range(world)]
        assert sum(rows, []) == list(range(7)) and max(map(len, rows)) - min(map(len, rows)) <= 1
    check_batch("batch", 2, Dist(1, 2))
    with pytest.raises(SpeculantError, match=r"^batch=1 is smaller than the 2 processes; allowed: >= 2"):
        check_batch("batch", 1, Dist(1, 2))
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    assert from_env() is SINGLE                                  # no torchrun: no process group
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "2")
    with pytest.raises(SpeculantError, match=r"RANK=2 is out of range; allowed: 0..1"):
        from_env()
    monkeypatch.setenv("WORLD_SIZE", "two")
    with pytest.raises(SpeculantError, match="WORLD_SIZE='two' is invalid"):
        from_env()
    assert not torch.distributed.is_initialized()
