"""Behaviour fixed across refactors: the greedy token ids of every method, in every weight format, on tiny models.

The ids in ``tests/data/golden_ids.json`` were written by this file (``python tests/test_golden_ids.py --write``)
before the runtime was restructured (issue 24); any change of the engine, the drafters or the runtime that changes
one of them changes what users get.  Prompts were kept only where ``ar``'s top-2 logit margin stays above
:data:`MIN_MARGIN` of the logit scale at every emitted position, so the ids do not hinge on a near tie that
another CPU's float summation order could flip.  Sampled decoding is fixed for ``ar`` (its draws do not depend on a
drafting policy).
"""

from __future__ import annotations

import copy
import json
import sys
from pathlib import Path

import pytest
import torch
from helpers import tiny_model

from speculant import GenerationConfig, SamplingConfig, build_generator
from speculant.engine.stats import GenerationStats
from speculant.runtime import formats
from speculant.runtime.formats import apply_weight_format, format_available

GOLDEN = Path(__file__).with_name("data") / "golden_ids.json"
MIN_MARGIN = 1e-3
MAX_NEW = 20
CANDIDATE_PROMPTS = ([3, 17, 42, 8, 25, 60, 1], [7, 8, 9, 10] * 4, [5], [11, 12, 13, 14, 15, 16, 11, 12, 13],
                     [90, 2, 33, 71, 48], [64, 64, 64, 20, 21, 64, 64, 64, 20], [1, 2, 3, 4, 5, 6, 7, 8],
                     [50, 40, 30, 20, 10], [77, 31, 77, 31, 77, 31], [9, 88, 9, 88, 23, 45, 67],
                     [2, 4, 8, 16, 32, 64], [19, 38, 57, 76, 95, 18],
                     # more candidates (added when the quantizers became gguf's, which moved the int4/w4a8 ties)
                     [33, 44, 55, 66], [81, 7, 81, 7, 81], [12, 24, 36, 48, 60, 72, 84], [94, 93, 92, 91],
                     [40, 41, 40, 41, 42], [6, 60, 6, 60, 16], [28, 57, 14, 85, 3], [70, 35, 17, 8, 4, 2],
                     [45], [63, 31, 15, 7, 3, 1], [22, 44, 22, 88], [58, 59, 60, 61, 62, 63, 64],
                     [13, 26, 39, 52], [87, 76, 65, 54, 43], [30, 30, 31, 31, 32, 32], [4, 44, 84, 24, 64])
SPECS = {
    "ar": dict(method="ar"),
    "early-exit": dict(method="early-exit", exit_layer=2, num_speculations=3),
    "early-exit-auto": dict(method="early-exit", exit_layer=2, num_speculations="auto"),
    "draft-model": dict(method="draft-model", draft_model="truncated:1", num_speculations=4),
    "prompt-lookup": dict(method="prompt-lookup", num_speculations=4),
    "rsd-c": dict(method="rsd-c", exit_layer=2, branching="2,2"),
    "rsd-s": dict(method="rsd-s", exit_layer=2, beam_width=3, draft_length=3),
    "specinfer": dict(method="specinfer", exit_layer=1, branching="2,2"),
    "eagle": dict(method="eagle", num_speculations=3, draft_head="HEAD"),
    "eagle-lookup": dict(method="eagle-lookup", num_speculations=3, draft_head="HEAD"),
    "rsd-s-head": dict(method="rsd-s", beam_width=2, draft_length=3, draft_head="HEAD"),
}


def _models(head_dir: Path) -> dict:
    """The tiny target in every weight format that runs here (and a random draft head saved at ``head_dir``)."""
    from speculant.drafters.draft_head import new_head, save_head
    float_model = tiny_model(seed=3, scale=2.5, vocab=96, hidden=64, heads=4, kv_heads=2, inter=128)
    torch.manual_seed(0)
    save_head(new_head(float_model, torch.arange(0, 96, 2)), head_dir)
    out = {}
    for fmt in formats.FORMATS:
        if format_available(fmt):
            m = copy.deepcopy(float_model)
            apply_weight_format(m.decoder, fmt)
            out[fmt] = m
    return out


def _ids(model, prompt, spec, head_dir, sampling=None) -> list[int]:
    spec = {k: (str(head_dir) if v == "HEAD" else v) for k, v in spec.items()}
    gen = build_generator(model, **spec)
    config = GenerationConfig(max_new_tokens=MAX_NEW, sampling=sampling or SamplingConfig())
    return [t for b in gen.generate_blocks(prompt, config, GenerationStats()) for t in b]


def _min_margin(model, prompt, ids) -> float:
    """The smallest top-2 logit gap, relative to the logit spread, over the positions that chose ``ids``."""
    with torch.inference_mode():
        logits = model.decoder(torch.tensor([prompt + ids]))[0, len(prompt) - 1:-1]
    top = logits.topk(2, dim=-1).values
    return float(((top[:, 0] - top[:, 1]) / (logits.max(-1).values - logits.min(-1).values)).min())


def _write(head_dir: Path) -> None:
    models = _models(head_dir)
    golden = {"max_new_tokens": MAX_NEW, "greedy": {}, "sampled_ar": {}}
    prompts = [p for p in CANDIDATE_PROMPTS
               if all(_min_margin(m, p, _ids(m, p, SPECS["ar"], head_dir)) > MIN_MARGIN for m in models.values())]
    golden["prompts"] = prompts
    for fmt, model in models.items():
        golden["greedy"][fmt] = {name: [_ids(model, p, spec, head_dir) for p in prompts]
                                 for name, spec in SPECS.items()}
        golden["sampled_ar"][fmt] = [_ids(model, p, SPECS["ar"], head_dir, SamplingConfig(temperature=1.0, seed=7))
                                     for p in prompts]
    GOLDEN.parent.mkdir(exist_ok=True)
    GOLDEN.write_text(json.dumps(golden, indent=1) + "\n")


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    head_dir = tmp_path_factory.mktemp("golden") / "head"
    return json.loads(GOLDEN.read_text()), _models(head_dir), head_dir


@pytest.mark.parametrize("fmt", [f for f in formats.FORMATS if format_available(f)])
def test_greedy_ids_of_every_method_are_unchanged(setup, fmt):
    golden, models, head_dir = setup
    assert fmt in golden["greedy"], f"no golden ids recorded for format {fmt}"
    assert len(golden["prompts"]) >= 3, "too few prompts were far from a tie"
    for name, spec in SPECS.items():
        want = golden["greedy"][fmt].get(name, golden["greedy"][fmt]["ar"])   # a method added since: ar's ids
        got = [_ids(models[fmt], p, spec, head_dir) for p in golden["prompts"]]
        assert got == want, (fmt, name)
        assert want == golden["greedy"][fmt]["ar"], (fmt, name)      # and every method is ar's output


@pytest.mark.parametrize("fmt", [f for f in formats.FORMATS if format_available(f)])
def test_sampled_ar_ids_are_unchanged(setup, fmt):
    golden, models, head_dir = setup
    got = [_ids(models[fmt], p, SPECS["ar"], head_dir, SamplingConfig(temperature=1.0, seed=7))
           for p in golden["prompts"]]
    assert got == golden["sampled_ar"][fmt], fmt


if __name__ == "__main__" and "--write" in sys.argv:
    import tempfile
    sys.path.insert(0, str(Path(__file__).parent))
    with tempfile.TemporaryDirectory() as d:
        _write(Path(d) / "head")
    print(f"wrote {GOLDEN}")
