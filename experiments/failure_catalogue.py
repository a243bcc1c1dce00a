"""The failure catalogue, measured: refused configurations by rule, malformed requests and what the
server answers, and faults (exit code, seconds to exit, orphans, records kept).

    .venv/bin/python experiments/failure_catalogue.py [--skip-faults]

Reuses the test suite's cases and helpers (tests/): the refused configurations are
tests/config/test_config_validate.py's CASES; the faults are run as tests/e2e/test_e2e_faults.py runs them.
Prints three markdown tables.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import socket
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections import Counter
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

from config.test_config_validate import CASES  # noqa: E402
from support.e2e_common import pid_alive, records, start_job, wait_for  # noqa: E402
from support.server_proc import DTYPE, IDENTITY, ServerProc, save_checkpoint  # noqa: E402

from tonpolicy.config.compose import compose_config  # noqa: E402
from tonpolicy.launch.watchdog import descendants  # noqa: E402
from tonpolicy.validation.validate import ConfigError, validate  # noqa: E402


def refused_configurations() -> str:
    by_group: Counter[str] = Counter()
    rules: dict[str, set[str]] = {}
    for overrides, _ in CASES:
        try:
            validate(compose_config(overrides))
        except ConfigError as e:
            for issue in e.issues:
                group = issue.key.split(".")[0]
                by_group[group] += 1
                rules.setdefault(group, set()).add(issue.rule.split(":")[0][:60])
    lines = [f"{len(CASES)} refused configurations, {sum(by_group.values())} problems reported "
             "(each names key, value and rule; all of a configuration's problems at once)", "",
             "| config group | problems | distinct rules |", "|---|---|---|"]  # fmt: skip
    lines += [f"| {g} | {n} | {len(rules[g])} |" for g, n in by_group.most_common()]
    return "\n".join(lines)


MALFORMED: list[tuple[str, str, dict[str, str], bytes]] = [
    ("not JSON", "/generate", {}, b"{oops"),
    ("not UTF-8", "/generate", {}, b"\xff\xfe"),
    ("JSON list", "/generate", {}, b"[1, 2]"),
    ("nested 100k deep", "/generate", {}, b"[" * 100_000 + b"]" * 100_000),
    ("body over 64 MiB", "/generate", {"Content-Length": str(65 * 2**20)}, b""),
    ("Content-Length -1", "/generate", {"Content-Length": "-1"}, b""),
    ("token id out of vocab", "/generate", {}, b'{"input_ids": [1, 99999]}'),
    ("prompt past the context", "/generate", {}, json.dumps({"input_ids": [1] * 1030}).encode()),
    ("unknown field", "/generate", {}, b'{"input_ids": [1], "bogus": 1}'),
    ("penalty", "/generate", {}, b'{"input_ids": [1], "sampling_params": {"presence_penalty": 1}}'),
    ("NaN temperature", "/generate", {}, b'{"input_ids": [1], "sampling_params": {"temperature": NaN}}'),
    (
        "seed 2**64",
        "/generate",
        {},
        b'{"input_ids": [1], "sampling_params": {"sampling_seed": 18446744073709551616}}',
    ),
    ("n = 0", "/generate", {}, b'{"input_ids": [1], "sampling_params": {"n": 0}}'),
    ("text without tokenizer", "/generate", {}, b'{"text": "hi"}'),
    ("echo", "/v1/completions", {}, b'{"model": "m", "prompt": "x", "echo": true}'),
    (
        "chat without template",
        "/v1/chat/completions",
        {},
        b'{"model": "m", "messages": [{"role": "user", "content": "x"}]}',
    ),
    ("update from a missing path", "/update_weights_from_disk", {}, b'{"model_path": "/nonexistent"}'),
    ("unknown route", "/nope", {}, b"{}"),
]


def malformed_requests(tmp: Path) -> str:
    ckpt = save_checkpoint(tmp / "ckpt", seed=0)
    srv = ServerProc(tmp, "server", ["--model-path", str(ckpt), "--dtype", DTYPE, "--skip-tokenizer-init", *IDENTITY])
    lines = ["| request | status | answer |", "|---|---|---|"]
    try:
        srv.start_healthy()
        url = f"http://127.0.0.1:{srv.port}"
        for name, path, headers, body in MALFORMED:
            req = urllib.request.Request(url + path, data=body, headers={"Content-Type": "application/json", **headers})
            try:
                with urllib.request.urlopen(req, timeout=60) as r:
                    status, answer = r.status, r.read()
            except urllib.error.HTTPError as e:
                status, answer = e.code, e.read()
            except (urllib.error.URLError, ConnectionError) as e:
                status, answer = 0, str(e).encode()
            message = json.loads(answer).get("error", {}).get("message") if answer.startswith(b"{") else answer
            message = json.loads(answer).get("message", message) if answer.startswith(b"{") else message
            lines.append(f"| {name} | {status} | {str(message)[:110]} |")
        healthy = urllib.request.urlopen(url + "/health", timeout=10).status
        lines.append(f"| then /health | {healthy} | the server is still serving |")
    finally:
        srv.stop()
    return "\n".join(lines)


def _fault(tmp: Path, name: str, overrides: list[str], act, env: dict[str, str] | None = None) -> str:
    run_tmp = tmp / re.sub(r"\W+", "_", name)  # a path Hydra's override grammar takes unquoted
    run_tmp.mkdir()
    proc, run_dir = start_job(run_tmp, *overrides, env=env)
    wait_for(lambda: len(records(run_dir)) >= 1 or proc.poll() is not None, 300, "the first step")
    pids = json.loads((run_dir / "pids.json").read_text()) if (run_dir / "pids.json").exists() else {}
    if proc.poll() is not None and not records(run_dir) and "port taken" not in name:
        return f"| {name} | {proc.returncode} | (ended before the fault: {proc.stderr.read()[-200:]!r}) | | |"
    members = descendants(list(pids.values())) if pids else []
    t0 = time.monotonic()
    act(proc, pids)
    try:
        proc.communicate(timeout=120)
    except Exception:  # noqa: BLE001 - reported as a hang
        proc.kill()
    seconds = time.monotonic() - t0
    time.sleep(10)  # the 10 s within which every child must be gone
    orphans = sum(pid_alive(p) for p in members)
    kept = len(records(run_dir))
    return f"| {name} | {proc.returncode} | {seconds:.1f} | {orphans} | {kept} |"


def faults(tmp: Path) -> str:
    def kill(target: str, sig: int):
        return lambda proc, pids: os.kill(pids[target] if target != "launcher" else proc.pid, sig)

    lines = ["| fault | exit code | s from fault to exit | orphans after 10 s | step records kept |",
             "|---|---|---|---|---|"]  # fmt: skip
    many = ["experiment.steps=50"]
    lines.append(_fault(tmp, "launcher kill -9", ["parallel=tp2", *many], kill("launcher", signal.SIGKILL)))
    lines.append(_fault(tmp, "rollout server kill -9", many, kill("rollout", signal.SIGKILL)))
    lines.append(_fault(tmp, "rollout server hangs (SIGSTOP)", [*many, "rollout.liveness_timeout_s=5"],
                        kill("rollout", signal.SIGSTOP)))  # fmt: skip
    lines.append(_fault(tmp, "Ctrl-C", many, kill("launcher", signal.SIGINT)))
    lines.append(_fault(tmp, "trainer rank 1 dies at step 1", ["parallel=tp2", "experiment.steps=3"],
                        lambda proc, pids: None, env={"TONPOLICY_FAULT": "rank_exit:1:1"}))  # fmt: skip
    lines.append(_fault(tmp, "disk full at step 1", ["experiment.steps=3"], lambda proc, pids: None,
                        env={"TONPOLICY_FAULT": "rank_disk_full:0:1"}))  # fmt: skip
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        lines.append(_fault(tmp, "rollout port taken", [f"rollout.port={port}"], lambda proc, pids: None))
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--skip-faults", action="store_true", help="only the fast tables")
    args = ap.parse_args()
    print(refused_configurations(), end="\n\n")
    with tempfile.TemporaryDirectory() as tmp:
        (Path(tmp) / "requests").mkdir()
        print(malformed_requests(Path(tmp) / "requests"), end="\n\n")
        if not args.skip_faults:
            print(faults(Path(tmp)))


if __name__ == "__main__":
    main()
