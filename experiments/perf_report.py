"""Collect the benchmarks' results into one table: results/perf_targets.md, results/perf_targets.png and
the table in docs/PERFORMANCE.md (between its `perf-table` markers).

    .venv/bin/python experiments/perf_report.py      # after bench_engine.py, bench_trainer.py, bench_sglang.py
"""

from __future__ import annotations

import json
import re
from pathlib import Path

from perf_targets import RESULTS

BENCHES = ("bench_engine", "bench_trainer", "bench_step", "bench_sglang")
README = Path(__file__).resolve().parents[1] / "docs" / "PERFORMANCE.md"
START, END = "<!-- perf-table:start -->", "<!-- perf-table:end -->"


CPU_KIND = {True: " with AMX", False: " without AMX"}  # unrecorded: nothing


def load() -> dict[str, dict]:
    return {b: json.loads((RESULTS / f"{b}.json").read_text()) for b in BENCHES if (RESULTS / f"{b}.json").exists()}


def table(results: dict[str, dict]) -> str:
    rows = ["| target | measured | target | result |", "|---|---|---|---|"]
    for bench, body in results.items():
        if "skipped" in body["data"]:
            rows.append(f"| {bench} | skipped: {body['data']['skipped']} | | |")
        for c in body["checks"]:
            sign = "<=" if c["at_most"] else ">="
            result = "pass" if c["passed"] else "miss"
            rows.append(f"| {c['name']} | {c['measured']:.2f} | {sign} {c['target']:.2f} | {result} |")

    def machine(b: dict) -> str:
        m = b["machine"]
        return f"{m['cpu']}{CPU_KIND.get(m.get('amx'), '')}, {m['cores']} cores, torch {m['torch']}"

    # Each benchmark with its own machine and date: the results may come from different hosts.
    parts = [f"`experiments/{name}.py` ({machine(b)}; {b['date']})" for name, b in results.items()]
    note = "Measured by " + ", ".join(parts) + "."
    return "\n".join(rows) + "\n\n" + note + "\n"


def plot(results: dict[str, dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    checks = [c for body in results.values() for c in body["checks"]]
    if not checks:
        return
    fig, ax = plt.subplots(figsize=(10, 0.32 * len(checks) + 1.2))
    names = [c["name"] for c in checks]
    # Plot every check as measured / target, so 1.0 is the line for all (left of it: better for "<=").
    scores = [c["measured"] / c["target"] if c["at_most"] else c["target"] / max(c["measured"], 1e-9) for c in checks]
    colors = ["tab:green" if c["passed"] else "tab:red" for c in checks]
    ax.barh(range(len(checks)), scores, color=colors)
    ax.axvline(1.0, color="black", linewidth=1)
    ax.set_yticks(range(len(checks)), names, fontsize=7)
    ax.invert_yaxis()
    ax.set_xlabel("cost relative to the target (<= 1: met)")
    ax.set_title("tonpolicy contract performance targets (green: met, red: missed)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def update_readme(md: str) -> None:
    text = README.read_text()
    if START not in text or END not in text:
        raise SystemExit(f"docs/PERFORMANCE.md has no {START} ... {END} block to fill")
    new = re.sub(re.escape(START) + ".*?" + re.escape(END), lambda _: f"{START}\n{md}{END}", text, flags=re.S)
    README.write_text(new)


def main() -> None:
    results = load()
    if not results:
        raise SystemExit(f"no benchmark results in {RESULTS}: run the bench_*.py scripts first")
    md = table(results)
    (RESULTS / "perf_targets.md").write_text("# Performance targets (issue 13)\n\n" + md)
    plot(results, RESULTS / "perf_targets.png")
    update_readme(md)
    print(md)


if __name__ == "__main__":
    main()
