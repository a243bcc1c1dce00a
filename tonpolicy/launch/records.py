"""Reading a run's records (metrics.jsonl, written by `tonpolicy.loop.records`) and their tables:
the per-step table printed at the end of a run, the sweep's markdown table."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any


def read_jsonl(path: Path) -> list[dict[str, Any]]:
    if not path.exists():
        return []
    out = []
    for line in path.read_text().splitlines():
        try:
            out.append(json.loads(line))
        except json.JSONDecodeError:
            break  # a torn last line from a killed writer; earlier lines are complete
    return out


STEP_COLUMNS = [
    ("step", "step", "{}"),
    ("tokens", "tokens_scored", "{}"),
    ("mismatched", "mismatched_tokens", "{}"),
    ("max|Δlogp|", "max_abs_logprob_diff", "{:.3e}"),
    ("train_rollout_abs_diff", "train_rollout_logprob_abs_diff", "{:.3e}"),
    ("K3 KL", "train_rollout_k3_kl", "{:.3e}"),
    ("reward", "reward_mean", "{:.3f}"),
    ("clipfrac", "clipfrac", "{:.3f}"),
    ("grad_norm", "grad_norm", "{:.6g}"),
]


def _cell(fmt: str, value: Any) -> str:
    if value is None:
        return "-"
    try:
        return fmt.format(value)
    except (ValueError, TypeError):
        return str(value)


def markdown_table(headers: list[str], rows: list[list[str]]) -> str:
    widths = [max(len(h), *(len(r[i]) for r in rows)) if rows else len(h) for i, h in enumerate(headers)]
    line = lambda cells: "| " + " | ".join(c.ljust(w) for c, w in zip(cells, widths, strict=True)) + " |"  # noqa: E731
    sep = "|" + "|".join("-" * (w + 2) for w in widths) + "|"
    return "\n".join([line(headers), sep, *(line(r) for r in rows)])


# An MoE run's column, after `mismatched`: the fraction of (token, MoE layer) pairs the trainer routed
# as the rollout did. Dense runs' records lack the field, and their table the column.
ROUTING_COLUMN = ("routing_agree", "routing_agreement", "{:.4f}")


def step_columns(records: list[dict[str, Any]]) -> list[tuple[str, str, str]]:
    if not any("routing_agreement" in r for r in records):
        return STEP_COLUMNS
    at = [key for _, key, _ in STEP_COLUMNS].index("mismatched_tokens") + 1
    return [*STEP_COLUMNS[:at], ROUTING_COLUMN, *STEP_COLUMNS[at:]]


def step_table(records: list[dict[str, Any]]) -> str:
    columns = step_columns(records)
    headers = [h for h, _, _ in columns]
    rows = [[_cell(fmt, r.get(key)) for _, key, fmt in columns] for r in records]
    return markdown_table(headers, rows)
