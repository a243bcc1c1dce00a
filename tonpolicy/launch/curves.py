"""reward_curve.png: the reward beside the parity panel, per step (run dir), and per layout (sweep)."""

from __future__ import annotations

from pathlib import Path
from typing import Any


def _pyplot() -> Any:
    import matplotlib

    matplotlib.use("Agg")  # headless
    import matplotlib.pyplot as plt

    return plt


# Where an exact zero is drawn on the log axis: below any difference fp32 logprobs can show.
EXACT_FLOOR = 1e-12


def reward_curve(records: list[dict[str, Any]], path: Path, title: str) -> Path:
    """Two panels by step: the reward mean, and the parity: max |Δ logprob| between rollout and trainer
    on a log scale (an exact 0 drawn on a marked floor) with each step's mismatched tokens as text."""
    plt = _pyplot()
    steps = [r["step"] for r in records]
    fig, (ax, par) = plt.subplots(1, 2, figsize=(9, 3.2), dpi=90)
    ax.plot(steps, [r["reward_mean"] for r in records], "o-", color="tab:green", markersize=3)
    ax.set_xlabel("step")
    ax.set_ylabel("reward mean")
    ax.set_ylim(0, 1.05)
    ax.set_title("reward", fontsize=9)
    parity_panel(par, records)
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return path


def parity_panel(ax: Any, records: list[dict[str, Any]]) -> None:
    steps = [r["step"] for r in records]
    diffs = [r.get("max_abs_logprob_diff") or 0.0 for r in records]
    shown = [max(d, EXACT_FLOOR) for d in diffs]
    ax.set_yscale("log")
    ax.axhline(EXACT_FLOOR, color="tab:gray", linestyle=":", linewidth=1)
    ax.text(0.99, EXACT_FLOOR, "exact 0", transform=ax.get_yaxis_transform(), ha="right", va="top", fontsize=7)
    ax.plot(steps, shown, "o-", color="tab:red", markersize=3)
    ax.set_ylim(EXACT_FLOOR / 10, max(1.0, *shown) * 10)
    for step, y, r in zip(steps, shown, records, strict=True):
        ax.annotate(
            f"{r.get('mismatched_tokens', '?')}/{r.get('tokens_scored', '?')}",
            (step, y),
            textcoords="offset points",
            xytext=(0, 6),
            ha="center",
            fontsize=6,
        )
    total = sum(r.get("mismatched_tokens") or 0 for r in records)
    scored = sum(r.get("tokens_scored") or 0 for r in records)
    ax.set_title(f"parity: mismatched tokens {total} of {scored}", fontsize=9)
    ax.set_xlabel("step")
    ax.set_ylabel("max |Δ logprob| (log)")


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
