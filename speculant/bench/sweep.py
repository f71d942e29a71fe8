"""Grid search of the early-exit self-drafter: exit layer E x speculation length K.

``run_sweep`` benchmarks ``early-exit:E=..,K=..`` for every grid point next to ``ar``
(interleaved per prompt, see :mod:`speculant.bench.runner`), records acceptance rate,
block efficiency, tokens/s and the speed-up over AR, draws heatmaps and stores the
result as JSON under ``cache_root()/sweeps/<model>.json``; :func:`best_config` reads
the best point back (``--exit-layer auto``), falling back to the sweep shipped for the model.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

from ..errors import SpeculantError
from ..engine.sweeps import SHIPPED, _safe, best_config, sweep_path  # noqa: F401  (the lookup side lives there)
from ..models.loading import LoadedModel
from .datasets import Prompt
from .runner import BenchConfig, run_benchmark
from .specs import parse_methods


def parse_int_list(name: str, text: str, low: int = 1, high: int | None = None) -> list[int]:
    """``"4,6,8"`` -> ``[4, 6, 8]``; SpeculantError naming ``name`` for anything else or values outside [low, high]."""
    try:
        vals = [int(x) for x in str(text).split(",") if x.strip()]
    except ValueError:
        raise SpeculantError(f"{name}={text!r} is invalid; allowed: comma-separated integers, e.g. 4,6,8") from None
    bad = [v for v in vals if v < low or (high is not None and v > high)]
    if not vals or bad:
        raise SpeculantError(f"{name}={text!r} is invalid; allowed: integers in [{low}, {high if high else 'inf'}]")
    return vals


def run_sweep(model: LoadedModel, prompts: list[Prompt], exit_layers: list[int], num_speculations: list[int],
              cfg: BenchConfig, out_dir: str | Path | None = None, exit_adapter: str | None = None,
              dataset: str = "", store: bool = True, progress: bool = True) -> dict:
    """Benchmark the E x K grid and store the best point (highest speed-up over AR in tokens/s).

    Returns:
        ``{"model", "exit_adapter", "dataset", "grid": [{exit_layer, num_speculations, acceptance_rate,
        block_efficiency, tokens_per_second, speedup_vs_ar, mbsu}], "best": {...}, "path"}``.
    Raises:
        SpeculantError: an exit layer outside ``[1, L-1]``.
    """
    n = model.decoder.num_layers
    bad = [e for e in exit_layers if not 1 <= e < n]
    if bad:
        raise SpeculantError(f"exit layers {bad} are out of range; allowed: 1..{n - 1}")
    text = "ar," + ",".join(f"early-exit:E={e},K={k}" for e in exit_layers for k in num_speculations)
    methods = parse_methods(text, exit_adapter)
    res = run_benchmark(model, prompts, methods, cfg, out_dir, dataset=dataset, progress=progress)
    rows = res["summary"]["all"]
    grid = []
    for e in exit_layers:
        for k in num_speculations:
            r = rows.get(f"early-exit:E={e},K={k}")
            if r is None:
                continue
            grid.append({"exit_layer": e, "num_speculations": k, "acceptance_rate": r["acceptance_rate"],
                         "block_efficiency": r["block_efficiency"], "tokens_per_second": r["tokens_per_second"],
                         "speedup_vs_ar": r["speedup_vs_ar"], "mbsu": r["mbsu"]})
    if not grid:
        raise SpeculantError("the sweep finished no grid point")
    best = max(grid, key=lambda g: (g["speedup_vs_ar"] or 0.0, g["acceptance_rate"] or 0.0))
    out = {"model": model.name, "exit_adapter": exit_adapter, "dataset": dataset, "prompts": len(prompts),
           "max_new_tokens": cfg.max_new_tokens, "temperature": cfg.temperature,
           "ar_tokens_per_second": rows["ar"]["tokens_per_second"], "criterion": "speedup_vs_ar",
           "measured": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "machine": res["meta"]["machine"],
           "grid": grid, "best": {"exit_layer": best["exit_layer"], "num_speculations": best["num_speculations"]}}
    if out_dir is not None:
        from .plots import plot_heatmap
        d = Path(out_dir)
        for key, title in (("acceptance_rate", "acceptance rate"), ("speedup_vs_ar", "speed-up over AR (tokens/s)"),
                           ("tokens_per_second", "tokens/s")):
            cell = {(g["exit_layer"], g["num_speculations"]): g[key] for g in grid}
            plot_heatmap([[cell.get((e, k)) for k in num_speculations] for e in exit_layers], exit_layers,
                         num_speculations, d / f"sweep_{key}.png", f"{model.name}: {title}")
        (d / "sweep.json").write_text(json.dumps(out, indent=1))
    if store:
        path = sweep_path(model.name, exit_adapter)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(out, indent=1))
        out["path"] = str(path)
    return out
