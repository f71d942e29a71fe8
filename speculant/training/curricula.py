"""Early-exit curricula of LayerSkip (Elhoushi et al. 2024, arXiv 2404.16710, Sec. 4.2, "Early Exit Loss").

``C(t, l) = 1`` when the exit after layer ``l`` (0-based) contributes to the loss at step ``t``.
The last layer is always enabled.

* ``rotational`` (``C_rot,R``): one exit every ``R`` layers, the set rotated by one layer each step,
  i.e. exit ``l`` is on when ``(l + t) % R == R - 1``; ``ceil(L / R)`` exits per step.
* ``gradual`` (``C_grad``): exits are switched on from the last layer backwards, one more layer
  every ``T / (2L)`` steps, so every exit is on after ``T / 2`` steps.
* ``all``: every exit on; ``none``: only the last layer (plain fine-tuning).
"""

from __future__ import annotations

import math

from ..errors import SpeculantError

CURRICULA = ("rotational", "gradual", "all", "none")


def enabled_exits(kind: str, step: int, num_layers: int, rotation: int = 2, total_steps: int = 1) -> list[int]:
    """Sorted 0-based layers whose exits are on at ``step``.

    Args:
        kind: one of :data:`CURRICULA`.
        rotation: ``R`` of the rotational curriculum (>= 1).
        total_steps: ``T`` of the gradual curriculum (>= 1).
    Raises:
        SpeculantError: unknown ``kind``, ``rotation < 1`` or ``total_steps < 1``.
    """
    if kind not in CURRICULA:
        raise SpeculantError(f"early-exit curriculum={kind!r} is unknown; allowed: {', '.join(CURRICULA)}")
    last = num_layers - 1
    if kind == "none":
        return [last]
    if kind == "all":
        return list(range(num_layers))
    if kind == "rotational":
        if rotation < 1:
            raise SpeculantError(f"rotation={rotation} is out of range; allowed: >= 1")
        return sorted({layer for layer in range(num_layers) if (layer + step) % rotation == rotation - 1} | {last})
    if total_steps < 1:
        raise SpeculantError(f"total_steps={total_steps} is out of range; allowed: >= 1")
    interval = total_steps / (2 * num_layers)
    n_on = 1 + int(math.floor(step / interval)) if interval > 0 else num_layers
    first = max(0, num_layers - n_on)
    return list(range(first, num_layers))
