"""The device runbook: on a rented accelerator with this repository and no network, turn a few minutes into drafters.

``python -m speculant.training.runbook --model M --out DIR --device cuda --minutes 8.5`` runs, under one deadline:

1. **data**: ``speculant make-data --engine transformers`` (:mod:`.hf_sample`): prompts the target writes itself
   (Magpie) and the built-in ones, one response each (a quarter of the batches greedy), held-out split 2 %;
2. **training, in parallel** on the same device, each its own ``speculant train --device`` process with its own
   feature cache: the EAGLE draft head (``draft-head``, the shipped recipe; and with ``--unroll 2``), the EAGLE-3 head
   (``eagle3``, draft vocabulary 8192 so that it stays under 20 MB) and a short LayerSkip LoRA run (``layerskip``);
3. **bundle**: the trained artefacts without checkpoints or merged models (heads, LoRA weights, metrics, cards,
   logs, the held-out records, and the whole corpus gzip-compressed where that is at most :data:`CORPUS_BACK_MIB`) in
   ``DIR/bundle.tar``, cut into parts of at most ``--part-mib`` MiB (``bundle.tar.part000..``; ``cat`` them back
   together) for transports that limit a file's size.

A stage that fails is logged and recorded in ``DIR/summary.json``; the others go on.  ``--preset toy`` runs the same
stages at toy scale (a test runs it on a CPU with a tiny model).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tarfile
import time
from pathlib import Path

PRESETS = {
    # sized for one H200 and ~8.5 minutes: ~3 of sampling, ~4 of training (feature caching included)
    "h200": {"self_instruct": 40000, "head_tokens": 6_000_000, "e3_tokens": 4_000_000, "batch": 1024, "max_new": 256, "data_minutes": 3.0, "train_minutes": 3.2,
             "head_steps": 4000, "head_batch": 32, "e3_steps": 2500, "ls_steps": 400, "ls_batch": 16,
             "ls_seq": 256, "eval_every": 500, "eval_tokens": 20000, "train_margin": 1.5},
    "toy": {"self_instruct": 6, "head_tokens": 10 ** 6, "e3_tokens": 10 ** 6, "batch": 4, "max_new": 12, "data_minutes": 2.0, "train_minutes": 2.0,
            "head_steps": 6, "head_batch": 2, "e3_steps": 4, "ls_steps": 3, "ls_batch": 2, "ls_seq": 8,
            "eval_every": 3, "eval_tokens": 50, "train_margin": 0.3},
}
CORPUS_BACK_MIB = 16
"""The compressed corpus joins the bundle up to this size [MiB] (a device's transport caps what comes back)."""
KEEP = (".safetensors", ".json", ".jsonl", ".gz", ".md", ".png", ".log")
"""Files of the work folder the bundle keeps (never ``checkpoint.pt`` or a merged model's folder)."""


def _cli(*args: str) -> list[str]:
    return [sys.executable, "-m", "speculant.cli", *args]


def stage_commands(model: str, work: Path, device: str, p: dict, minutes: float) -> dict[str, list[str]]:
    """The training stages' command lines (name -> argv), all reading ``work/corpus.jsonl``; ``minutes``: each
    training loop's limit (``--max-minutes``)."""
    corpus = str(work / "corpus.jsonl")
    common = ["--model", model, "--corpus", corpus, "--device", device, "--no-progress",
              "--max-minutes", f"{minutes:.2f}", "--eval-every", str(p["eval_every"]),
              "--checkpoint-every", str(10 ** 6), "--eval-tokens", str(p["eval_tokens"])]
    head = ["--head-batch", str(p["head_batch"]), "--head-seq-len", "256", "--topk", "32", "--hard-weight", "0.5"]
    return {
        "draft-head": _cli("train", "--recipe", "draft-head", *common, *head, "--out", str(work / "draft-head"),
                           "--cache-dir", str(work / "cache-dh"), "--steps", str(p["head_steps"]),
                           "--max-train-tokens", str(p["head_tokens"]),
                           "--draft-vocab", "16384", "--feature-noise", "0.2"),
        "draft-head-unroll2": _cli("train", "--recipe", "draft-head", *common, *head, "--out",
                                   str(work / "draft-head-unroll2"), "--cache-dir", str(work / "cache-dh2"),
                                   "--max-train-tokens", str(p["head_tokens"]),
                                   "--steps", str(p["head_steps"]), "--draft-vocab", "16384", "--feature-noise",
                                   "0.2", "--unroll", "2"),
        "eagle3": _cli("train", "--recipe", "eagle3", *common, *head, "--out", str(work / "eagle3"),
                       "--cache-dir", str(work / "cache-e3"), "--steps", str(p["e3_steps"]), "--draft-vocab", "8192",
                       "--max-train-tokens", str(p["e3_tokens"]),
                       "--ttt-steps", "3"),
        "layerskip": _cli("train", "--recipe", "layerskip", "--model", model, "--corpus", corpus, "--device", device,
                          "--no-progress", "--max-minutes", f"{minutes:.2f}", "--out", str(work / "layerskip"),
                          "--steps", str(p["ls_steps"]), "--batch", str(p["ls_batch"]), "--seq-len",
                          str(p["ls_seq"]), "--lora-rank", "8", "--checkpoint-every", str(10 ** 6),
                          "--eval-tokens", str(p["eval_tokens"] // 4)),
    }


def run_stages(commands: dict[str, list[str]], logs: Path, deadline: float, env: dict) -> dict:
    """Run ``commands`` in parallel (stdout and stderr to ``logs/<name>.log``); a process still running at
    ``deadline`` (``time.monotonic()`` seconds) is asked to stop (SIGTERM), then killed 10 s later.  Returns
    ``{name: {"rc", "seconds", "last_line"}}`` (``rc`` non-zero for a stopped one)."""
    procs, out = {}, {}
    for name, argv in commands.items():
        log = (logs / f"{name}.log").open("w")
        procs[name] = (subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, env=env), time.monotonic(), log)
    while procs:
        for name in list(procs):
            proc, t0, log = procs[name]
            rc = proc.poll()
            if rc is None and time.monotonic() > deadline:
                proc.terminate()
                try:
                    rc = proc.wait(10)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    rc = proc.wait()
            if rc is not None:
                log.close()
                lines = (logs / f"{name}.log").read_text(errors="replace").strip().splitlines()
                out[name] = {"rc": rc, "seconds": round(time.monotonic() - t0, 1),
                             "last_line": lines[-1][:2000] if lines else ""}
                del procs[name]
        time.sleep(0.5)
    return out


def bundle(work: Path, out: Path, part_mib: float, failed: set[str] = frozenset()) -> list[str]:
    """``out/bundle.tar`` of ``work``'s kept files (:data:`KEEP`, not under a ``cache-*`` or ``model`` folder, nor
    under the folder of a stage in ``failed``: what it left may be half-written; its log still goes), cut into parts
    of at most ``part_mib`` MiB (any earlier bundle in ``out`` removed first); returns the part names (the tar itself
    when it fits in one)."""
    for old in out.glob("bundle.tar*"):
        old.unlink()
    tar_path = out / "bundle.tar"
    with tarfile.open(tar_path, "w") as tar:
        for f in sorted(work.rglob("*")):
            rel = f.relative_to(work)
            skip = any(p.startswith("cache-") or p == "model" for p in rel.parts[:-1]) or rel.parts[0] in failed
            if f.is_file() and f.suffix in KEEP and f.name != "corpus.jsonl" and not skip:
                tar.add(f, arcname=str(rel))
    data, size = tar_path.read_bytes(), int(part_mib * 2 ** 20)
    if len(data) <= size:
        return [tar_path.name]
    names = []
    for k in range(0, len(data), size):
        name = f"bundle.tar.part{k // size:03d}"
        (out / name).write_bytes(data[k:k + size])
        names.append(name)
    tar_path.unlink()
    return names


def compressed_corpus(corpus: Path, dest: Path) -> int:
    """``corpus`` gzip-compressed to ``dest`` (the whole self-distillation corpus travels back, ~4x smaller, for
    training or evaluating further on a CPU); returns the bytes written."""
    import gzip
    import shutil
    with corpus.open("rb") as src, gzip.open(dest, "wb", compresslevel=6) as out:
        shutil.copyfileobj(src, out)
    return dest.stat().st_size


def whole_records(corpus: Path) -> int:
    """Rewrite ``corpus`` keeping only its lines that are whole JSON records (a data stage stopped mid-write leaves a
    cut last line); returns how many."""
    lines = []
    for line in corpus.read_text(errors="replace").splitlines():
        try:
            json.loads(line)
        except ValueError:
            continue
        lines.append(line)
    corpus.write_text("\n".join(lines) + ("\n" if lines else ""))
    return len(lines)


def heldout_records(corpus: Path, dest: Path) -> int:
    """Copy the held-out records of ``corpus`` to ``dest`` (what CPU-side evaluation reads); returns how many."""
    lines = [ln for ln in corpus.read_text().splitlines() if '"split": "heldout"' in ln]
    dest.write_text("\n".join(lines) + ("\n" if lines else ""))
    return len(lines)


STAGES = ("draft-head", "draft-head-unroll2", "eagle3", "layerskip")
"""The training stages (:func:`stage_commands`), in the order ``--stages`` lists them by default."""
BUNDLE_SECONDS = 20
"""Seconds of ``--minutes`` kept for the bundle."""
PART_MIB = (0.01, 2.0 ** 20)
"""The ``--part-mib`` range [MiB]: parts of at least ~10 KB (a part count a transport can carry), at most 1 TiB."""


def parser() -> argparse.ArgumentParser:
    """The runbook's flags; a usage error (an unknown flag, a value that is not a number) is one line, as in
    ``speculant`` itself."""
    from ..arguments import OneLineParser
    ap = OneLineParser(prog="python -m speculant.training.runbook", description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="smollm2-135m",
                    help="the target: a known model name, a GGUF file or an HF-format directory (default: %(default)s)")
    ap.add_argument("--out", required=True,
                    help="folder for the work (corpus, logs, trained artefacts), summary.json and the bundle parts")
    ap.add_argument("--device", default="cuda",
                    help="torch device every stage runs on: cpu, cuda or cuda:N (default: %(default)s)")
    ap.add_argument("--minutes", type=float, default=8.5,
                    help=f"deadline for every stage together, the last {BUNDLE_SECONDS} s kept for the bundle; at "
                         "least 1 (default: %(default)s)")
    ap.add_argument("--preset", default="h200", choices=sorted(PRESETS),
                    help="sizes of the stages: h200 (one H200 for ~8.5 minutes) or toy (a tiny model on a CPU in a "
                         "test) (default: %(default)s)")
    ap.add_argument("--part-mib", type=float, default=15.0,
                    help=f"largest bundle part [MiB], for transports that cap a file's size; {PART_MIB[0]} to "
                         f"{PART_MIB[1]:.0f} (default: %(default)s)")
    ap.add_argument("--stages", default=",".join(STAGES),
                    help=f"comma-separated training stages to run after the data stage; some of {', '.join(STAGES)} "
                         "(default: all)")
    return ap


def check_args(a) -> list[str]:
    """The stages ``--stages`` asks for, once every flag is checked: before any work and before any folder is made.

    Raises:
        SpeculantError: one line naming the flag, its value and what is allowed: unknown stages, ``--minutes`` under
            1 or not a number, ``--part-mib`` outside :data:`PART_MIB`, or a ``--device`` this machine lacks.
    """
    from ..errors import SpeculantError, check_range
    from .train import check_device
    wanted = [s for s in a.stages.split(",") if s]
    if not wanted or set(wanted) - set(STAGES):
        raise SpeculantError(f"--stages={a.stages!r} is not a list of stages; allowed: some of {', '.join(STAGES)}")
    check_range("--minutes", a.minutes, 1.0, float("inf"), high_open=True)
    check_range("--part-mib", a.part_mib, *PART_MIB)
    check_device(a.device)
    return wanted


def main(argv: list[str] | None = None) -> int:
    """Run the runbook; returns the exit code (0: every stage succeeded, 1: one failed, 2: bad input, one line
    ``speculant: error: ...`` on stderr and nothing done)."""
    from ..errors import SpeculantError
    try:
        a = parser().parse_args(argv)
    except SystemExit as e:            # a usage error (one line) or --help: its code
        return e.code if isinstance(e.code, int) else 2
    try:
        wanted = check_args(a)
    except SpeculantError as e:
        print(f"speculant: error: {e}", file=sys.stderr)
        return 2
    t0 = time.monotonic()
    deadline = t0 + a.minutes * 60 - BUNDLE_SECONDS      # time left to bundle
    p = PRESETS[a.preset]
    out = Path(a.out)
    work, logs = out / "work", out / "work" / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    env = dict(os.environ, OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "4"), PYTHONUNBUFFERED="1")
    summary = {"model": a.model, "device": a.device, "preset": a.preset, "minutes": a.minutes, "stages": {}}
    data = _cli("make-data", "--model", a.model, "--engine", "transformers", "--device", a.device, "--builtin",
                "--self-instruct", str(p["self_instruct"]), "--batch-size", str(p["batch"]), "--max-new-tokens",
                str(p["max_new"]), "--greedy-fraction", "0.25", "--heldout-fraction", "0.02", "--max-minutes",
                str(p["data_minutes"]), "--out", str(work / "corpus.jsonl"))
    summary["stages"].update(run_stages({"data": data}, logs, deadline, env))
    corpus = work / "corpus.jsonl"
    if summary["stages"]["data"]["rc"] and corpus.is_file():
        summary["records_kept"] = whole_records(corpus)
    held = heldout_records(corpus, work / "heldout.jsonl") if corpus.is_file() else 0
    if held and corpus.stat().st_size:          # a data stage stopped early still leaves whole records to train on
        summary["heldout_records"] = held
        gz = work / "corpus.jsonl.gz"
        summary["corpus_gz_bytes"] = compressed_corpus(work / "corpus.jsonl", gz)
        if summary["corpus_gz_bytes"] > CORPUS_BACK_MIB * 2 ** 20:
            gz.unlink()                               # too big to travel: the held-out records still do
        minutes = min(p["train_minutes"], (deadline - time.monotonic()) / 60 - p["train_margin"])
        summary["train_minutes"] = round(minutes, 2)
        commands = {k: v for k, v in stage_commands(a.model, work, a.device, p, max(minutes, 0.05)).items()
                    if k in wanted}
        summary["stages"].update(run_stages(commands, logs, deadline, env))
    summary["seconds"] = round(time.monotonic() - t0, 1)
    (work / "summary.json").write_text(json.dumps(summary, indent=2))
    summary["bundle"] = bundle(work, out, a.part_mib, {k for k, v in summary["stages"].items() if v["rc"]})
    (out / "summary.json").write_text(json.dumps(summary, indent=2))
    print(json.dumps(summary, indent=2))
    return 0 if all(s["rc"] == 0 for s in summary["stages"].values()) else 1


if __name__ == "__main__":
    sys.exit(main())
