"""Re-measure every performance row and collect them into one table: results/perf_targets.md,
results/perf_targets.png and the table in docs/PERFORMANCE.md (between its `perf-table` markers).

    .venv/bin/python experiments/perf_report.py                  # each bench with --quick, then the table
    .venv/bin/python experiments/perf_report.py --full           # each bench with its own defaults (slow)
    .venv/bin/python experiments/perf_report.py --collect-only   # only the table, from results/*.json
    .venv/bin/python experiments/perf_report.py --benches bench_engine,bench_trainer

A bench's quick mode measures fewer repeats and, for the slowest rows (bench_step's hidden-1024 job,
bench_sglang's hidden-1024 cell), none: a row the run did not re-measure keeps its last measurement,
with the machine and date that measured it (`carried`). Every row says which CPU measured it and when.
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
import time
from pathlib import Path

from perf_targets import RESULTS

BENCHES = ("bench_engine", "bench_trainer", "bench_moe_trainer", "bench_step", "bench_sglang")
README = Path(__file__).resolve().parents[1] / "docs" / "PERFORMANCE.md"
START, END = "<!-- perf-table:start -->", "<!-- perf-table:end -->"


CPU_KIND = {True: " with AMX", False: " without AMX"}  # unrecorded: nothing
HERE = Path(__file__).resolve().parent


def remeasure(bench: str, quick: bool) -> float:
    """Run one bench (its --quick mode unless `quick` is False); rows it did not measure are carried over
    from its previous results with their own machine and date. Returns the wall seconds."""
    path = RESULTS / f"{bench}.json"
    old = json.loads(path.read_text()) if path.exists() else None
    t0 = time.time()
    done = subprocess.run([sys.executable, HERE / "bench" / f"{bench}.py", *(["--quick"] if quick else [])], cwd=HERE)
    wall = time.time() - t0
    if done.returncode:
        print(f"{bench} failed (exit {done.returncode}); its previous results stay", file=sys.stderr)
        return wall
    new = json.loads(path.read_text())
    if old is not None and old.get("date") != new.get("date"):
        names = {c["name"] for c in new["checks"]}
        for c in old["checks"]:
            if c["name"] not in names:
                new["checks"].append(
                    {
                        **c,
                        "machine": c.get("machine", old["machine"]),
                        "date": c.get("date", old["date"]),
                        "carried": True,
                    }
                )
        path.write_text(json.dumps(new, indent=2) + "\n")
    return wall


def load() -> dict[str, dict]:
    return {b: json.loads((RESULTS / f"{b}.json").read_text()) for b in BENCHES if (RESULTS / f"{b}.json").exists()}


def machine(m: dict) -> str:
    return f"{m['cpu']}{CPU_KIND.get(m.get('amx'), '')}, {m['cores']} cores"


def table(results: dict[str, dict]) -> str:
    """One row per target, each with the CPU and date that measured it (rows may come from different hosts
    and runs: a quick re-measure carries the rows it skips)."""
    rows = ["| target | measured | target | result | measured on |", "|---|---|---|---|---|"]
    for bench, body in results.items():
        if "skipped" in body["data"]:
            rows.append(f"| {bench} | skipped: {body['data']['skipped']} | | | |")
        for c in body["checks"]:
            sign = "<=" if c["at_most"] else ">="
            result = "pass" if c["passed"] else "miss"
            on = f"{machine(c.get('machine', body['machine']))}, {c.get('date', body['date'])}"
            on += " (not re-measured)" if c.get("carried") else ""
            rows.append(f"| {c['name']} | {c['measured']:.2f} | {sign} {c['target']:.2f} | {result} | {on} |")
    parts = [
        f"`experiments/bench/{name}.py` (torch {b['machine']['torch']}; {b['date']})" for name, b in results.items()
    ]
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
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--collect-only", action="store_true", help="no measuring: the table from results/*.json")
    ap.add_argument("--full", action="store_true", help="each bench with its own defaults, not --quick")
    ap.add_argument("--benches", default=",".join(BENCHES))
    a = ap.parse_args()
    if not a.collect_only:
        walls = {b: remeasure(b, quick=not a.full) for b in a.benches.split(",")}
        print("re-measured: " + ", ".join(f"{b} {w / 60:.1f} min" for b, w in walls.items()))
    results = load()
    if not results:
        raise SystemExit(f"no benchmark results in {RESULTS}: run the bench_*.py scripts first")
    md = table(results)
    (RESULTS / "perf_targets.md").write_text("# Performance targets\n\n" + md)
    plot(results, RESULTS / "perf_targets.png")
    update_readme(md)
    print(md)


if __name__ == "__main__":
    main()
