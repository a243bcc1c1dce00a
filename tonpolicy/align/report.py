"""Offline comparison of two dump directories, and the report files (JSON + PNG).

    python -m tonpolicy.align compare A B [--out DIR]

exits 0 when every checkpoint both dumps hold is bitwise identical, 1 otherwise (2 on bad input).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from tonpolicy.align.compare import AlignReport, compare_dumps, format_report
from tonpolicy.align.dump import load_dump
from tonpolicy.files import write_json_atomic

REPORT_JSON = "align_report.json"
REPORT_PNG = "align_report.png"


def write_report(report: AlignReport, out_dir: str | Path) -> tuple[Path, Path]:
    from tonpolicy.align.plot import save_png

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    write_json_atomic(out / REPORT_JSON, report.to_dict(), indent=1)
    return out / REPORT_JSON, save_png(report, out / REPORT_PNG)


def compare_dirs(a: str | Path, b: str | Path) -> AlignReport:
    return compare_dumps(load_dump(a), load_dump(b), str(a), str(b))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="python -m tonpolicy.align", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    sub = ap.add_subparsers(dest="cmd", required=True)
    c = sub.add_parser("compare", help="compare two dump directories and report the first divergence")
    c.add_argument("a", help="dump directory (e.g. the rollout's)")
    c.add_argument("b", help="dump directory (e.g. the trainer's)")
    c.add_argument("--out", help="also write align_report.json and align_report.png into this directory")
    args = ap.parse_args(argv)
    try:
        report = compare_dirs(args.a, args.b)
    except (OSError, ValueError) as exc:
        print(f"tonpolicy.align: {exc}", file=sys.stderr)
        return 2
    print(format_report(report))
    if args.out:
        js, png = write_report(report, args.out)
        print(f"report written to {js} and {png}")
    return 0 if report.match else 1
