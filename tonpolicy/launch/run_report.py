"""What the launcher tells the user besides the steps: a status line while servers and ranks come up,
and at the end (success too) where the results are: the run directory, the plot, the W&B sync command."""

from __future__ import annotations

from pathlib import Path

from tonpolicy.config.names import layout_label
from tonpolicy.config.schema import Config


def startup_line(cfg: Config, run_dir: Path, servers: int, ranks: int) -> str:
    return (
        f"tonpolicy: starting {servers} rollout server(s) ({cfg.rollout.backend}) and {ranks} trainer rank(s) "
        f"({layout_label(cfg.parallel)}); run directory {run_dir}"
    )


def offline_runs(run_dir: Path) -> list[Path]:
    """The W&B offline runs this job wrote into its run directory (none under WANDB_DIR elsewhere)."""
    return sorted((run_dir / "wandb").glob("offline-run-*"))


def where_lines(run_dir: Path) -> list[str]:
    lines = [f"tonpolicy: run directory {run_dir} (metrics.jsonl, samples.jsonl, summary.json, logs/)"]
    plot = run_dir / "reward_curve.png"
    if plot.exists():
        lines.append(f"tonpolicy: plot {plot}")
    lines += [f"tonpolicy: upload the W&B run with: wandb sync {r}" for r in offline_runs(run_dir)]
    return lines
