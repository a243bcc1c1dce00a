"""A small PNG of the report: mismatched elements by layer (rows) and op (columns), log scale."""

from __future__ import annotations

import math
from pathlib import Path

from tonpolicy.align.compare import AlignReport
from tonpolicy.align.names import ALL_OPS


def save_png(report: AlignReport, path: str | Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")  # headless: no display on the build machine or the workers
    import matplotlib.pyplot as plt
    import numpy as np

    table = report.table()
    rows = list(table)
    ops = [op for op in ALL_OPS if any(op in table[r] for r in rows)]
    grid = np.full((len(rows), len(ops)), np.nan)
    for i, r in enumerate(rows):
        for j, op in enumerate(ops):
            if op in table[r]:
                grid[i, j] = math.log10(1 + table[r][op])
    fig, ax = plt.subplots(figsize=(max(4.0, 0.35 * len(ops) + 1.5), max(2.0, 0.3 * len(rows) + 1.2)), dpi=80)
    cmap = plt.get_cmap("Reds").with_extremes(bad="#dddddd")  # grey: no such checkpoint at that layer
    im = ax.imshow(
        np.ma.masked_invalid(grid), cmap=cmap, vmin=0, vmax=max(1.0, float(np.nanmax(grid, initial=0))), aspect="auto"
    )
    ax.set_xticks(range(len(ops)), ops, rotation=70, fontsize=7)
    ax.set_yticks(range(len(rows)), rows, fontsize=7)
    f = report.first
    title = "match" if report.match else (f"first: {f.name} @ pos {f.position}" if f else "no divergence found")
    ax.set_title(title, fontsize=8)
    if f is not None and report.layer_label(f.layer) in rows and f.op in ops:
        ax.add_patch(
            plt.Rectangle(
                (ops.index(f.op) - 0.5, rows.index(report.layer_label(f.layer)) - 0.5),
                1,
                1,
                fill=False,
                edgecolor="blue",
                linewidth=1.5,
            )
        )
    fig.colorbar(im, ax=ax, label="log10(1 + mismatched)", shrink=0.8)
    fig.tight_layout()
    path = Path(path)
    fig.savefig(path)
    plt.close(fig)
    return path
