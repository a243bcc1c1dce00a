"""Hydra callback: after a multirun, summarise every job's summary.json into a table and a chart."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

from hydra.experimental.callback import Callback
from omegaconf import DictConfig

from tonpolicy.launch.curves import reward_overlay
from tonpolicy.launch.records import markdown_table


def collect(sweep_dir: Path) -> list[dict[str, Any]]:
    rows = []

    def job_number(path: Path) -> tuple[int, str]:
        head = path.parent.name.split("_", 1)[0]
        return (int(head) if head.isdigit() else 1 << 30, path.parent.name)

    for path in sorted(sweep_dir.glob("*/summary.json"), key=job_number):
        data = json.loads(path.read_text())
        data["job_dir"] = path.parent.name
        rows.append(data)
    return rows


def write_summary(sweep_dir: Path) -> Path | None:
    rows = collect(sweep_dir)
    if not rows:
        return None
    headers = [
        "job",
        "layout",
        "rollout",
        "dtype",
        "contract",
        "status",
        "steps",
        "tokens",
        "mismatched",
        "max|Δlogp|",
        "grad_norm (last)",
        "wall_s",
    ]
    table = [
        [
            r["job_dir"],
            r.get("layout", "?"),
            r.get("rollout", "?"),
            r.get("dtype", "?"),
            r.get("contract", "?"),
            r.get("status", "?"),
            str(r.get("steps_completed", "-")),
            str(r.get("tokens_scored", "-")),
            str(r.get("mismatched_tokens", "-")),
            f"{r.get('max_abs_logprob_diff') or 0.0:.3e}",
            "n/a" if r.get("last_grad_norm") is None else f"{r['last_grad_norm']:.6g}",  # 0.0 is a value
            f"{r.get('wall_s') or 0.0:.1f}",
        ]
        for r in rows
    ]
    md = sweep_dir / "sweep_summary.md"
    md.write_text("# tonpolicy sweep\n\n" + markdown_table(headers, table) + "\n")
    _chart(rows, sweep_dir / "sweep_summary.png")
    print(f"sweep summary: {md}")
    return md


def _chart(rows: list[dict[str, Any]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    contracts = {r.get("contract") for r in rows}
    # Label each bar by the layout plus whatever else varies across the sweep.
    varying = [k for k in ("rollout", "dtype", "contract") if len({r.get(k) for r in rows}) > 1]
    labels = ["\n".join(str(r.get(k)) for k in ("layout", *varying)) for r in rows]
    mismatched = [r.get("mismatched_tokens", 0) for r in rows]
    grad_norms = [r.get("last_grad_norm") or 0.0 for r in rows]
    fig, (ax1, ax2, ax3) = plt.subplots(1, 3, figsize=(max(12, 2.1 * len(rows)), 4))
    reward_overlay(ax3, rows, labels)
    ax1.bar(labels, mismatched, color="tab:red")
    ax1.set_title("mismatched tokens (exact parity = 0)")
    ax1.set_ylim(0, max(1, *mismatched) * 1.15)
    ax2.bar(labels, grad_norms, color="tab:blue")
    ax2.set_title("grad_norm (last step)")
    for ax, values, fmt in ((ax1, mismatched, "{}"), (ax2, grad_norms, "{:.4g}")):
        for i, v in enumerate(values):
            ax.annotate(fmt.format(v), (i, v), ha="center", va="bottom", fontsize=7)
        ax.tick_params(axis="x", labelsize=7, labelrotation=30)
    if len(contracts) == 1:
        fig.suptitle(f"contract {contracts.pop()}", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)


class SweepSummary(Callback):
    def on_multirun_end(self, config: DictConfig, **kwargs: Any) -> None:
        sweep_dir = Path(config.hydra.sweep.dir)
        write_summary(sweep_dir)
        failed = [r["job_dir"] for r in collect(sweep_dir) if r.get("status") != "ok"]
        if failed:
            print(f"tonpolicy: sweep finished with failed jobs: {', '.join(failed)}", file=sys.stderr)
            sys.exit(1)
