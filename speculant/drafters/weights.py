"""The weight format a drafter's own projections run in, measured on the machine at hand.

A drafter's projections (an exit adapter's MLPs and head rows, a draft head's ``fc`` and layer) are read once per
draft call, from DRAM: the target's weight stream evicts them between calls.  Which kernel reads them fastest
for one row depends on the CPU (torch's int8 weight-only kernel, our int8-activation ``w8a8`` kernel,
``speculant/kernels/qgemm.c``, or float32), so it is timed at the first load of a drafter of those shapes and kept
with the machine's tune (:attr:`~speculant.runtime.tune.TuneResult.drafter_weights`).  Exactness does not depend
on it: the acceptance rules take whatever draft distribution the drafter gives (Leviathan et al. 2023, Sec. 2.3);
the draft distribution moves by the format's rounding.
"""

from __future__ import annotations

import time

import torch

from ..errors import SpeculantError

DRAFTER_FORMATS = ("fp32", "int8", "w8a8")
"""Weight formats a drafter's projections can be packed in (``w8a8``: Q8_0 codes on int8 activations, where our
kernels run)."""


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


def _packed(fmt: str, projections):
    from ..models.linear import small_batch_linear
    from ..runtime.formats import pack_linear
    if fmt == "fp32":          # the float32 route the drafters' float projections take (DecodeLinear)
        return [lambda x, w=w, b=b: small_batch_linear(x, w, b) for w, b in projections]
    return [pack_linear(fmt, w, b) for w, b in projections]


def measure(projections: list[tuple[torch.Tensor, torch.Tensor | None]], evict, candidates=None,
            repeats: int = 7) -> dict[str, float]:
    """One-row pass over ``projections`` (``(weight [O, I] float32, bias [O] or None)``) packed in each of
    ``candidates`` (default: :data:`DRAFTER_FORMATS` that run here), each timed pass after ``evict()`` (something
    that streams the target's weights, as a decoding step does), formats alternated, best of ``repeats``
    after a warm-up [milliseconds]."""
    from ..kernels import qgemm
    candidates = candidates or [f for f in DRAFTER_FORMATS if f != "w8a8" or qgemm.available()]
    mods = {f: _packed(f, projections) for f in candidates}
    g = torch.Generator().manual_seed(5)
    inputs = {w.shape[1]: torch.randn(1, w.shape[1], generator=g) for w, _ in projections}
    best = {f: float("inf") for f in candidates}
    with torch.inference_mode():
        for rep in range(repeats + 1):
            for f in candidates:
                evict()
                t = time.perf_counter()
                for (w, _), m in zip(projections, mods[f]):
                    m(inputs[w.shape[1]])
                if rep:
                    best[f] = min(best[f], time.perf_counter() - t)
    return {f: round(v * 1e3, 3) for f, v in best.items()}


def drafter_weight_format(model, kind: str, projections: list[tuple[torch.Tensor, torch.Tensor | None]]) -> str:
    """The format a drafter of ``kind`` (e.g. ``"exit-adapter"``) with these float32 ``projections`` runs in for
    ``model`` (a :class:`~speculant.models.loading.LoadedModel`): ``fp32`` for a float32 target (whose own
    kernels are float); for a quantized target, the fastest of :func:`measure` (the target's LM head as the
    eviction between timings), measured once per machine and drafter shape and kept in ``model.tune``
    (saved) when the model has one."""
    decoder = model.decoder
    if getattr(decoder, "weight_format", "fp32") == "fp32":
        return "fp32"
    key = kind + ":" + ",".join(f"{w.shape[1]}x{w.shape[0]}" for w, _ in projections)
    result = getattr(model, "tune", None)
    known = result.drafter_weights.get(key) if result is not None else None
    if known is not None:
        return known["weights"]
    row = torch.zeros(1, decoder.config.hidden_size)
    ms = measure(projections, lambda: decoder.lm_head(row))
    choice = min(ms, key=ms.get)
    if result is not None:
        from ..runtime import tune
        result.drafter_weights[key] = {"weights": choice, "ms": ms}
        tune.save(result)
    return choice
