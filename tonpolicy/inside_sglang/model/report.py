"""The contract an SGLang model process runs, and its report to the HTTP front end.

The launch plan puts the contract in TONPOLICY_CONTRACT (JSON: name, version, fingerprint, kernels,
kernel_params). Each TP rank builds its kernel set from it, computes its runtime identity from that
kernel set (tonpolicy.contract.identity.runtime_identity) and writes it to
$TONPOLICY_CONTRACT_REPORT_DIR/rank<r>.json; `python -m tonpolicy.inside_sglang.server` serves those
reports at GET /tonpolicy/contract. The declared fingerprint is only a label: what the trainer
compares is the runtime fingerprint each rank computed itself.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from tonpolicy.contract.identity import CONTRACT_ENV
from tonpolicy.files import write_json_atomic

REPORT_DIR_ENV = "TONPOLICY_CONTRACT_REPORT_DIR"


def contract_from_env() -> dict[str, Any]:
    raw = os.environ.get(CONTRACT_ENV)
    if not raw:
        raise RuntimeError(
            f"{CONTRACT_ENV} is not set: start SGLang through tonpolicy's launch plan "
            "(python -m tonpolicy rollout=sglang ...), which names the contract to run"
        )
    contract = json.loads(raw)
    missing = {"name", "version", "fingerprint", "kernels", "kernel_params"} - set(contract)
    if missing:
        raise RuntimeError(f"{CONTRACT_ENV} lacks {sorted(missing)}")
    return contract


def write_report(contract: dict[str, Any], runtime: dict[str, Any], tp_rank: int, tp_size: int) -> None:
    directory = os.environ.get(REPORT_DIR_ENV)
    if not directory:
        return
    report = {
        "name": contract["name"],
        "version": contract["version"],
        "fingerprint": contract["fingerprint"],
        "runtime": runtime,
        "tp_rank": tp_rank,
        "tp_size": tp_size,
    }
    write_json_atomic(Path(directory) / f"rank{tp_rank}.json", report, indent=None)


def read_reports(directory: str) -> list[dict[str, Any]]:
    return [json.loads(p.read_text()) for p in sorted(Path(directory).glob("rank*.json"))]


def merged_report(directory: str) -> tuple[int, dict[str, Any]]:
    """(HTTP status, body) for GET /tonpolicy/contract: rank 0's identity once every TP rank has
    reported; 500 when the ranks disagree (they must all run the same numerics)."""
    reports = read_reports(directory)
    if not reports or len(reports) < reports[0]["tp_size"]:
        return 503, {"error": {"message": f"{len(reports)} TP rank(s) reported so far; the model is loading"}}
    prints = {r["tp_rank"]: r["runtime"]["fingerprint"] for r in reports}
    if len(set(prints.values())) > 1:
        return 500, {"error": {"message": f"TP ranks run different numerics: {prints}"}}
    first = min(reports, key=lambda r: r["tp_rank"])
    return 200, {k: first[k] for k in ("name", "version", "fingerprint", "runtime")} | {"tp_size": first["tp_size"]}
