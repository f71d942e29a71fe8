"""Matplotlib figures of a benchmark (Agg backend, PNG files).

Each function returns the path written, or ``None`` when there was nothing to plot.
"""

from __future__ import annotations

from pathlib import Path


def _plt():
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    return plt


def plot_speedup(results: dict, path: str | Path) -> Path | None:
    """Grouped bars: speed-up per category (x) per method (bars) over ``hf-ar`` if it ran, else over ``ar``."""
    summ = results["summary"]
    cats = [c for c in summ if c != "all"] + ["all"]
    base = "hf_ar" if any("hf-ar" in rows for rows in summ.values()) else "ar"
    key = f"speedup_vs_{base}"
    labels = [m["label"] for m in results["meta"]["methods"]]
    if not any(summ.get(c, {}).get(m, {}).get(key) for c in cats for m in labels):
        return None
    plt = _plt()
    fig, ax = plt.subplots(figsize=(max(6, 1.2 * len(cats) * max(1, len(labels)) / 3), 4))
    width = 0.8 / len(labels)
    for i, m in enumerate(labels):
        ys = [(summ.get(c, {}).get(m, {}) or {}).get(key) or 0.0 for c in cats]
        ax.bar([x + i * width for x in range(len(cats))], ys, width, label=m, color=plt.cm.tab20(i % 20))
    ax.axhline(1.0, color="k", lw=0.8, ls="--")
    ax.set_xticks([x + 0.4 - width / 2 for x in range(len(cats))], cats, rotation=20)
    ax.set_ylabel(f"speed-up over {base.replace('_', '-')} (tokens/s ratio)")
    meta = results["meta"]
    ax.set_title(f"{meta['model']}  T={meta['temperature']}  {meta['max_new_tokens']} new tokens")
    ax.legend(fontsize=7, ncol=2)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return Path(path)


def plot_acceptance_by_position(results: dict, path: str | Path) -> Path | None:
    """Lines: fraction of blocks that accepted the draft token at depth d, given the tree reached d."""
    rows = results["summary"].get("all", {})
    series = {k: v["acceptance_by_position"] for k, v in rows.items() if v.get("acceptance_by_position")}
    if not series:
        return None
    plt = _plt()
    fig, ax = plt.subplots(figsize=(6, 4))
    for i, (k, v) in enumerate(series.items()):
        ax.plot(range(1, len(v) + 1), v, marker="o", label=k, color=plt.cm.tab20(i % 20))
    ax.set_xlabel("draft position (tree depth)")
    ax.set_ylabel("acceptance rate at position")
    ax.set_ylim(0, 1)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return Path(path)


def plot_heatmap(grid: list[list[float | None]], rows: list[int], cols: list[int], path: str | Path,
                 title: str, row_label: str = "exit layer E", col_label: str = "speculations K") -> Path:
    """A heatmap of ``grid[i][j]`` (row ``rows[i]``, column ``cols[j]``) with the values printed in the cells."""
    import numpy as np
    plt = _plt()
    a = np.array([[np.nan if v is None else v for v in r] for r in grid], dtype=float)
    fig, ax = plt.subplots(figsize=(1 + 1.1 * len(cols), 1 + 0.6 * len(rows)))
    im = ax.imshow(a, cmap="viridis", aspect="auto")
    ax.set_xticks(range(len(cols)), [str(c) for c in cols])
    ax.set_yticks(range(len(rows)), [str(r) for r in rows])
    ax.set_xlabel(col_label)
    ax.set_ylabel(row_label)
    for i in range(len(rows)):
        for j in range(len(cols)):
            if not np.isnan(a[i, j]):
                ax.text(j, i, f"{a[i, j]:.2f}", ha="center", va="center", color="w", fontsize=8)
    fig.colorbar(im, ax=ax)
    ax.set_title(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return Path(path)
