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


def measure_head_routes(head, evict, repeats: int = ROUTE_REPEATS) -> dict[str, float]:
    """Milliseconds of one draft call of an EAGLE draft head (:class:`~speculant.drafters.draft_head.DraftHead`,
    one row after 16 cached entries, logits of that row) through each route: ``fused`` (one C call,
    :mod:`speculant.kernels.draft_head_step`) and ``torch`` (its modules), each call after ``evict()`` (the target's
    LM head on one row: in decoding a target step runs between draft calls), routes alternated, best of ``repeats``.
    ``head.use_fused`` is restored."""
    import time
    d, vocab = head.config["hidden_size"], head.embed_weight.shape[0]
    g = torch.Generator().manual_seed(3)
    before, best = head.use_fused, {"fused": float("inf"), "torch": float("inf")}
    feature, token, position = torch.randn(1, d, generator=g), torch.randint(vocab, (1,), generator=g), torch.tensor([16])
    try:
        with torch.inference_mode():
            cache = head.new_cache(32)
            head.step(torch.randn(16, d, generator=g), torch.randint(vocab, (16,), generator=g), torch.arange(16), None,
                      cache, 0)
            for rep in range(repeats + 1):
                for route in ("fused", "torch") if rep % 2 == 0 else ("torch", "fused"):
                    head.use_fused = route == "fused"
                    evict()
                    t = time.perf_counter()
                    head.step(feature.to(head.dtype), token, position, None, cache, 16, 1)
                    if rep:
                        best[route] = min(best[route], time.perf_counter() - t)
    finally:
        head.use_fused = before
    return {route: round(s * 1e3, 4) for route, s in best.items()}


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
