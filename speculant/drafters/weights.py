"""The weight format a drafter's own projections run in, measured on the machine at hand.

A drafter's projections (an exit adapter's MLPs and head rows, a draft head's ``fc`` and layer) are read once per
draft call, from DRAM: the target's weight stream evicts them between calls.  Which kernel reads them fastest
for one row depends on the CPU (torch's int8 weight-only kernel, our int8-activation ``w8a8`` kernel,
``speculant/kernels/qgemm.c``, or float32), so it is timed once per machine and drafter shape by an explicit tune step
(:func:`tune_drafter`, which the method factory :func:`speculant.engine.methods.build_generator` calls after loading
a drafter; :func:`speculant.runtime.tune.measure_drafter_weights` times) and kept with the machine's tune
(:attr:`~speculant.runtime.tune.TuneResult.drafter_weights`).  Loading an artefact only reads that choice.  Exactness does not depend
on it: the acceptance rules take whatever draft distribution the drafter gives (Leviathan et al. 2023, Sec. 2.3);
the draft distribution moves by the format's rounding.
"""

from __future__ import annotations

import torch

from ..errors import SpeculantError
from ..runtime.formats import DRAFTER_FORMATS



def check_drafter_format(fmt: str) -> str:
    """Return ``fmt`` if a drafter can run in it (:data:`DRAFTER_FORMATS`, plus ``bf16``).

    Raises:
        SpeculantError: any other value, or ``w8a8`` where our kernels do not run.
    """
    from ..kernels import qgemm
    allowed = DRAFTER_FORMATS + ("bf16",)
    if fmt not in allowed:
        raise SpeculantError(f"drafter weights={fmt!r} is not allowed; allowed: {', '.join(allowed)}")
    if fmt == "w8a8" and not qgemm.available():
        raise SpeculantError(f"drafter weights='w8a8' {qgemm.unavailable_reason()}; allowed here: fp32, int8, bf16")
    return fmt


def _key(kind: str, projections) -> str:
    return kind + ":" + ",".join(f"{w.shape[1]}x{w.shape[0]}" for w, _ in projections)


def drafter_weight_format(model, kind: str, projections: list[tuple[torch.Tensor, torch.Tensor | None]]) -> str:
    """The format a drafter of ``kind`` (e.g. ``"exit-adapter"``) with these float32 ``projections`` is loaded in for
    ``model`` (a :class:`~speculant.models.loading.LoadedModel`), measuring nothing: ``fp32`` for a float32 target
    (whose own kernels are float); for a quantized target the format :func:`tune_drafter` chose on this machine for
    these shapes (``model.tune``), else ``fp32`` (the default, until that step has run)."""
    if getattr(model.decoder, "weight_format", "fp32") == "fp32":
        return "fp32"
    result = getattr(model, "tune", None)
    known = result.drafter_weights.get(_key(kind, projections)) if result is not None else None
    return known["weights"] if known is not None else "fp32"


def tune_drafter(model, kind: str, module) -> str:
    """The tune step of a loaded drafter ``module`` (an exit adapter or a draft head, with ``float_projections()``
    and ``pack(fmt)``) of ``kind`` for ``model``: where the target is quantized and this machine has no choice stored
    for these shapes, time a one-row pass in each drafter format
    (:func:`speculant.runtime.tune.measure_drafter_weights`, the target's LM head as the eviction between timings),
    keep the fastest in ``model.tune`` (saved) and pack ``module`` in it.  Returns the format ``module`` runs in."""
    if module.weight_format != "fp32" or getattr(model.decoder, "weight_format", "fp32") == "fp32":
        return module.weight_format
    projections = module.float_projections()
    result = getattr(model, "tune", None)
    key = _key(kind, projections)
    if result is None or key in result.drafter_weights:   # no tune, or one whose choice the loader already applied
        return module.weight_format
    from ..runtime import tune
    row = torch.zeros(1, model.decoder.config.hidden_size)
    ms = tune.measure_drafter_weights(projections, lambda: model.decoder.lm_head(row))
    choice = min(ms, key=ms.get)
    result.drafter_weights[key] = {"weights": choice, "ms": ms}
    tune.save(result)
    module.pack(choice)
    return choice


ROUTE_REPEATS = 15
"""Timed head draft calls per route in :func:`measure_head_routes` (after one warm-up each)."""


def time_head_variants(head, evict, variants: dict, repeats: int = ROUTE_REPEATS) -> dict[str, float]:
    """Milliseconds of one draft call of an EAGLE draft head (:class:`~speculant.drafters.draft_head.DraftHead`, one
    row after 16 cached entries, logits of that row) in each variant of ``variants`` (name -> a function that puts
    ``head`` in it), each call after ``evict()`` (the target's LM head on one row: in decoding a target step runs
    between draft calls), variants alternated, best of ``repeats`` (after one warm-up each)."""
    import time
    d, vocab = head.config["hidden_size"], head.embed_weight.shape[0]
    g = torch.Generator().manual_seed(3)
    best = {name: float("inf") for name in variants}
    feature, token, position = torch.randn(1, d, generator=g), torch.randint(vocab, (1,), generator=g), torch.tensor([16])
    with torch.inference_mode():
        cache = head.new_cache(32)
        head.step(torch.randn(16, d, generator=g), torch.randint(vocab, (16,), generator=g), torch.arange(16), None,
                  cache, 0)
        for rep in range(repeats + 1):
            for name in best if rep % 2 == 0 else tuple(best)[::-1]:
                variants[name]()
                evict()
                t = time.perf_counter()
                head.step(feature.to(head.dtype), token, position, None, cache, 16, 1)
                if rep:
                    best[name] = min(best[name], time.perf_counter() - t)
    return {name: round(s * 1e3, 4) for name, s in best.items()}


def measure_head_routes(head, evict, repeats: int = ROUTE_REPEATS) -> dict[str, float]:
    """Milliseconds of one draft call of an EAGLE draft head through each route (:func:`time_head_variants`):
    ``fused`` (one C call, :mod:`speculant.kernels.draft_head_step`) and ``torch`` (its modules).
    ``head.use_fused`` is restored."""
    before = head.use_fused
    routes = {"fused": lambda: setattr(head, "use_fused", True), "torch": lambda: setattr(head, "use_fused", False)}
    try:
        return time_head_variants(head, evict, routes, repeats)
    finally:
        head.use_fused = before


def tune_head_route(model, head) -> bool:
    """The tune step of an EAGLE draft head's route: where the head can draft as one C call (``head.fused``), time
    both routes once per machine and head shape (:func:`measure_head_routes`), keep the result in ``model.tune``
    (``drafter_weights["draft-head-route:..."]``, saved) and set ``head.use_fused``: the fused call unless the torch
    modules were faster by more than the tuner's noise (:data:`speculant.runtime.tune.CHOICE_NOISE`); later loads
    read the kept choice.  Without a tune (a model built in memory) the fused call is kept, measuring nothing.
    Returns ``head.use_fused``."""
    from ..runtime import tune
    result = getattr(model, "tune", None)
    if result is None or head.fused(head.dtype) is None:
        return head.use_fused
    c = head.config
    key = f"draft-head-route:{c['hidden_size']}x{c['intermediate_size']}x{head._lm_head_rows[0].out_features}"
    if key not in result.drafter_weights:
        row = torch.zeros(1, model.decoder.config.hidden_size)
        ms = measure_head_routes(head, lambda: model.decoder.lm_head(row))
        fused = not ms["torch"] < ms["fused"] * (1 - tune.CHOICE_NOISE)
        result.drafter_weights[key] = {"fused": fused, "ms": ms}
        tune.save(result)
    head.use_fused = bool(result.drafter_weights[key]["fused"])
    return head.use_fused


LM_ROWS_TOKENS = 48
"""Greedy tokens the target writes after each fixed prompt for :func:`head_lm_rows_accuracy`."""
LM_ROWS_TOLERANCE = 0.01
"""Most the head's top-1 accuracy may drop with 4-bit LM-head rows for :func:`tune_head_lm_rows` to take them
(absolute, over ~300 drafts): a draft call with them cost ~30 % less of its ~0.13 of a step on SmolLM2 (BENCHMARKS.md
BN), ~3 % of a drafting round, which a drop of one accepted draft in a hundred does not undo."""


def greedy_features(model, head, prompts: list[list[int]], tokens: int = LM_ROWS_TOKENS
                    ) -> list[tuple[torch.Tensor, torch.Tensor, int]]:
    """For each prompt of ``prompts`` (token ids), the prompt followed by ``tokens`` greedy tokens of the target:
    ``(ids [T], features [T, D] as ``head`` reads them, index of the first generated token)``."""
    from .eagle import target_features
    dec, out = model.decoder, []
    with torch.inference_mode():
        for prompt in prompts:
            ids = list(prompt)
            n0 = len(ids)
            cache = dec.new_cache(n0 + tokens)
            h = dec.run_layers(dec.embed(torch.tensor([ids])), 0, dec.num_layers, torch.arange(n0), None, cache, 0)
            hidden = [h[0]]
            for _ in range(tokens):
                ids.append(int(dec.lm_head(dec.final_norm(hidden[-1][-1:])).argmax()))
                n = len(ids) - 1
                hidden.append(dec.run_layers(dec.embed(torch.tensor([ids[-1:]])), 0, dec.num_layers,
                                             torch.tensor([n]), None, cache, n)[0])
            out.append((torch.tensor(ids), target_features(dec, torch.cat(hidden), head.feature).float(), n0))
    return out


def head_lm_rows_accuracy(head, sequences) -> dict[str, float]:
    """The head's teacher-forced top-1 accuracy on the generated tokens of ``sequences`` (:func:`greedy_features`)
    with its LM-head rows in each format (:meth:`DraftHead.pack_lm_rows`): row ``i`` reads the target's feature
    at ``i`` and token ``i + 1`` and drafts token ``i + 2`` (EAGLE's training objective, Li et al. 2024), counted
    where that token was generated.  The rows' format changes the logits only: the head's predicted features are
    computed once and both formats' rows read them (:meth:`DraftHead.logits`), a paired comparison.  ``head`` is
    left reading the rows it read."""
    before, hits, total = head.lm_rows_format, {fmt: 0 for fmt in ("target", "w4a8")}, 0
    try:
        with torch.inference_mode():
            for ids, feats, n0 in sequences:
                rows = len(ids) - 2
                want = ids[2:]
                counted = torch.arange(rows) + 2 >= n0
                total += int(counted.sum())
                out, _ = head.step(feats[:rows].to(head.dtype), ids[1:rows + 1], torch.arange(rows), None,
                                   head.new_cache(rows), 0, 0)
                for fmt in hits:
                    top = head.pack_lm_rows(fmt).logits(out).argmax(-1)
                    drafted = top if head.vocab_ids is None else head.vocab_ids[top]
                    hits[fmt] += int(((drafted == want) & counted).sum())
    finally:
        head.pack_lm_rows(before)
    return {fmt: h / max(total, 1) for fmt, h in hits.items()}


def measure_head_lm_rows(head, evict, repeats: int = ROUTE_REPEATS) -> dict[str, float]:
    """Milliseconds of one draft call of ``head`` (its route as set; :func:`time_head_variants`) with its LM-head
    rows in each of ``target`` and ``w4a8`` (:meth:`DraftHead.pack_lm_rows`).  ``head`` is left reading the rows
    it read."""
    before = head.lm_rows_format
    try:
        return time_head_variants(head, evict, {fmt: (lambda f=fmt: head.pack_lm_rows(f)) for fmt in ("target", "w4a8")},
                                  repeats)
    finally:
        head.pack_lm_rows(before)


def tune_head_lm_rows(model, head, prompts=None) -> str:
    """The tune step of an EAGLE draft head's LM-head rows (:meth:`DraftHead.pack_lm_rows`): where the target is
    quantized and our kernels run, time a draft call with the target's rows and with 4-bit ones once per machine
    and head shape (:func:`measure_head_lm_rows`, the target's LM head as the eviction between calls) and compare
    the head's top-1 accuracy with each (:func:`head_lm_rows_accuracy` on :func:`greedy_features` of the token ids
    ``prompts()`` gives: the engine passes the acceptance prior's fixed prompts); keep the result
    in ``model.tune`` (``drafter_weights["draft-head-lm-rows:..."]``, saved) and pack ``head``'s rows: ``w4a8`` only
    if faster by more than the tuner's noise (:data:`speculant.runtime.tune.CHOICE_NOISE`) and at most
    :data:`LM_ROWS_TOLERANCE` less accurate; later loads read the kept choice.  Without a tune (a model built in
    memory), or with nothing kept and no ``prompts`` (or none), the target's rows are kept, measuring nothing.
    Returns the rows' format."""
    from ..kernels import qgemm
    from ..runtime import tune
    result = getattr(model, "tune", None)
    if (result is None or head.weight_format == "fp32" or not qgemm.available()
            or getattr(model.decoder, "weight_format", "fp32") == "fp32"):
        return head.lm_rows_format
    rows = head._lm_rows_by_format["target"]
    key = f"draft-head-lm-rows:{rows.in_features}x{rows.out_features}"
    if key not in result.drafter_weights:
        if prompts is None:
            return head.lm_rows_format
        import sys
        print("speculant: timing the draft head's LM-head rows, the target's and in 4 bits, on this machine (once; kept "
              "with the tune) ...", file=sys.stderr, flush=True)
        sequences = greedy_features(model, head, prompts())
        if not sequences:                                   # nothing to compare the drafts on: the target's rows
            return head.lm_rows_format
        row = torch.zeros(1, model.decoder.config.hidden_size)
        ms = measure_head_lm_rows(head, lambda: model.decoder.lm_head(row))
        accuracy = head_lm_rows_accuracy(head, sequences)
        faster = ms["w4a8"] < ms["target"] * (1 - tune.CHOICE_NOISE)
        choice = "w4a8" if faster and accuracy["w4a8"] >= accuracy["target"] - LM_ROWS_TOLERANCE else "target"
        result.drafter_weights[key] = {"format": choice, "ms": ms,
                                       "top1": {fmt: round(a, 4) for fmt, a in accuracy.items()}}
        tune.save(result)
    head.pack_lm_rows(result.drafter_weights[key]["format"])
    return head.lm_rows_format
