"""reward_curve.png: the reward beside the parity line, per step (run dir), and per layout (sweep)."""

from __future__ import annotations

from pathlib import Path
from typing import Any


def _pyplot() -> Any:
    import matplotlib

    matplotlib.use("Agg")  # headless
    import matplotlib.pyplot as plt

    return plt


def reward_curve(records: list[dict[str, Any]], path: Path, title: str) -> Path:
    """Reward mean (left axis) and mismatched tokens (right axis, 0 under the contract) by step."""
    plt = _pyplot()
    steps = [r["step"] for r in records]
    fig, ax = plt.subplots(figsize=(6, 3.2), dpi=90)
    ax.plot(steps, [r["reward_mean"] for r in records], "o-", color="tab:green", markersize=3, label="reward mean")
    ax.set_xlabel("step")
    ax.set_ylabel("reward mean", color="tab:green")
    ax.set_ylim(0, 1.05)
    ax2 = ax.twinx()
    mism = [r["mismatched_tokens"] for r in records]
    ax2.step(steps, mism, where="mid", color="tab:red", label="mismatched tokens")
    ax2.set_ylabel("mismatched tokens", color="tab:red")
    ax2.set_ylim(0, max(1, *mism) * 1.2)
    ax.set_title(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return path


def reward_overlay(ax: Any, rows: list[dict[str, Any]], labels: list[str]) -> None:
    """Each job's reward by step on one axis (a sweep's third panel)."""
    for row, label in zip(rows, labels, strict=True):
        rewards = row.get("rewards") or []
        if rewards:
            ax.plot(range(len(rewards)), rewards, marker=".", label=label.replace("\n", " "))
    ax.set_title("reward mean by step")
    ax.set_xlabel("step")
    ax.set_ylim(0, 1.05)
    ax.legend(fontsize=6)
