"""The best exit layer and speculation length stored for a model: the lookup side of ``speculant sweep``.

``speculant sweep`` (:mod:`speculant.bench.sweep`) measures the E x K grid and stores its best point under
``$SPECULANT_CACHE/sweeps/``; ``--exit-layer auto`` reads it back here (this machine's, else the one shipped for
the model under ``speculant/artifacts/sweeps``).
"""

from __future__ import annotations

import json
import re
from pathlib import Path

from ..errors import SpeculantError
from ..paths import cache_root


def _safe(name: str) -> str:
    return re.sub(r"[^A-Za-z0-9._+-]+", "_", name).strip("_") or "model"


def sweep_path(model_name: str, exit_adapter: str | None = None) -> Path:
    """Where the sweep of ``model_name`` (with ``exit_adapter``, if any) is stored."""
    name = _safe(model_name) + (f"+{_safe(Path(exit_adapter).name)}" if exit_adapter else "")
    return cache_root() / "sweeps" / f"{name}.json"


SHIPPED = Path(__file__).resolve().parent.parent / "artifacts" / "sweeps"
"""Sweeps shipped with the package (``<model>.json``): measured defaults for ``--exit-layer auto``."""


def best_config(model_name: str, exit_adapter: str | None = None, num_layers: int | None = None) -> dict:
    """The best ``{"exit_layer": int, "num_speculations": int}`` for ``model_name`` (``num_layers``: its layer
    count, so that the command a missing sweep's message suggests sweeps exit layers the model has).

    This machine's stored sweep (:func:`sweep_path`, written by ``speculant sweep``) comes first; without
    one (and without ``exit_adapter``), the sweep shipped for the model under ``speculant/artifacts/sweeps``.

    Raises:
        SpeculantError: neither exists (the message gives the command that makes one), or a corrupt file.
    """
    path = sweep_path(model_name, exit_adapter)
    if not path.is_file() and exit_adapter is None and (SHIPPED / f"{_safe(model_name)}.json").is_file():
        path = SHIPPED / f"{_safe(model_name)}.json"
    if not path.is_file():
        adapter = f" --exit-adapter {exit_adapter}" if exit_adapter else ""
        layers = [e for e in (4, 8, 12, 16, 20, 24) if num_layers is None or e < num_layers] or [1]
        raise SpeculantError(
            f"no sweep stored for model {model_name!r} ({path} is missing); run e.g. "
            f"`speculant sweep --model {model_name}{adapter} --exit-layers {','.join(map(str, layers))} "
            "--num-speculations 2,3,4,6 "
            f"--dataset builtin --limit 1` first, or give --exit-layer/--num-speculations as integers")
    try:
        best = json.loads(path.read_text())["best"]
        return {"exit_layer": int(best["exit_layer"]), "num_speculations": int(best["num_speculations"])}
    except (json.JSONDecodeError, KeyError, TypeError, ValueError) as e:
        raise SpeculantError(f"sweep file {path} is corrupt ({e}); rerun `speculant sweep`") from None
