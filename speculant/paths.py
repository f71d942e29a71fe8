"""Where speculant keeps what it makes on this machine: ``$SPECULANT_CACHE`` (default ``~/.cache/speculant``).

Converted weights, packed copies, built kernels, compiled graphs, tune results and sweeps live under it.  Below
everything: imports nothing of speculant.
"""

from __future__ import annotations

import os
from pathlib import Path


def cache_root() -> Path:
    """The cache directory: ``$SPECULANT_CACHE`` or ``~/.cache/speculant`` (read at each call)."""
    return Path(os.environ.get("SPECULANT_CACHE") or Path.home() / ".cache" / "speculant")
