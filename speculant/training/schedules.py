"""Layer-dropout schedules of LayerSkip (Elhoushi et al. 2024, arXiv 2404.16710, Sec. 4.1).

Layer ``l`` (0-based, of ``L``) is skipped during training with probability

    p_{l,t} = S(l) * D(t) * p_max,     S(l) = exp(l * ln 2 / (L - 1)) - 1            (Eq. 1)

so the first layer is never dropped and the last is dropped with ``p_max``.  The
time curriculum ``D(t)`` is ``1`` ("constant") or ``exp(t * ln 2 / (T - 1)) - 1``
("exp": dropout rises from 0 to its full value over ``T`` steps).
"""

from __future__ import annotations

import math

import torch

from ..errors import SpeculantError, check_range
from .arguments import TIME_CURRICULA


def depth_scale(layer: int, num_layers: int) -> float:
    """``S(l) = e^{l ln2/(L-1)} - 1`` in [0, 1]; ``S(0) = 0``, ``S(L-1) = 1`` (Eq. 1). ``L = 1`` gives 0."""
    if num_layers <= 1:
        return 0.0
    return math.exp(layer * math.log(2) / (num_layers - 1)) - 1.0


def time_scale(step: int, total_steps: int, kind: str = "constant") -> float:
    """``D(t)``: 1 for ``constant``; ``e^{t ln2/(T-1)} - 1`` for ``exp`` (0 at step 0, 1 at step T-1).

    Raises:
        SpeculantError: unknown ``kind``.
    """
    if kind not in TIME_CURRICULA:
        raise SpeculantError(f"dropout time curriculum={kind!r} is unknown; allowed: {', '.join(TIME_CURRICULA)}")
    if kind == "constant" or total_steps <= 1:
        return 1.0
    t = min(max(step, 0), total_steps - 1)
    return math.exp(t * math.log(2) / (total_steps - 1)) - 1.0


def layer_dropout_rates(num_layers: int, p_max: float, step: int = 0, total_steps: int = 1,
                        time_curriculum: str = "constant") -> list[float]:
    """Per-layer skip probabilities ``[L]`` at ``step`` (Eq. 1).

    Raises:
        SpeculantError: ``p_max`` outside [0, 1] or ``num_layers < 1``.
    """
    check_range("p_max", p_max, 0.0, 1.0)
    check_range("num_layers", num_layers, 1)
    d = time_scale(step, total_steps, time_curriculum)
    return [depth_scale(layer, num_layers) * d * p_max for layer in range(num_layers)]


def sample_keep_mask(rates: list[float], batch: int, generator: torch.Generator | None = None) -> torch.Tensor:
    """Bool ``[L, B]``: True where layer ``l`` runs for sequence ``b`` (per-sample dropout, Sec. 4.1)."""
    r = torch.tensor(rates, dtype=torch.float32)[:, None].expand(len(rates), batch)
    return torch.rand(r.shape, generator=generator) >= r
