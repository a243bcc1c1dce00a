"""An API key, as SGLang's --api-key: every route but /health needs `Authorization: Bearer KEY`; a
server reachable from other hosts needs it; the key never lands in the config, the plan or launch.sh."""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from pathlib import Path

import pytest
from support.e2e_common import records, run_job
from support.server_proc import DTYPE, IDENTITY, ServerProc, save_checkpoint

from tonpolicy.config.compose import compose_config
from tonpolicy.launch.plan import launch_plan, launch_script
from tonpolicy.rollout.client import RolloutClient, RolloutError
from tonpolicy.validation.validate import ConfigError, validate

KEY = "s3cret-key-for-tests"


def status(url: str, path: str, key: str | None = None, body: dict | None = None) -> int:
    req = urllib.request.Request(url + path, data=None if body is None else json.dumps(body).encode())
    if key is not None:
        req.add_header("Authorization", f"Bearer {key}")
    try:
        with urllib.request.urlopen(req, timeout=60) as r:
            return r.status
    except urllib.error.HTTPError as e:
        return e.code


def test_the_embedded_server_checks_the_key(tmp_path: Path) -> None:
    ckpt = save_checkpoint(tmp_path / "ckpt", seed=0)
    srv = ServerProc(tmp_path, "keyed", ["--model-path", str(ckpt), "--dtype", DTYPE, "--api-key", KEY, *IDENTITY])
    try:
        srv.wait_port()
        url = f"http://127.0.0.1:{srv.port}"
        RolloutClient(url, api_key="").wait_healthy(60, process=srv.proc)  # /health needs no key
        body = {"input_ids": [3, 11], "sampling_params": {"max_new_tokens": 2}}
        assert status(url, "/generate", None, body) == 401
        assert status(url, "/generate", "wrong", body) == 401
        assert status(url, "/v1/models") == 401 and status(url, "/get_server_info", "wrong") == 401
        assert status(url, "/generate", KEY, body) == 200
        with pytest.raises(RolloutError, match="401"):
            RolloutClient(url, api_key="").server_info()
        assert RolloutClient(url, api_key=KEY).server_info()["model_path"] == str(ckpt)
    finally:
        srv.stop()


def test_remote_binding_needs_opt_in_and_a_key(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("TONPOLICY_API_KEY", raising=False)
    for overrides in (["rollout.host=0.0.0.0"], ["rollout.host=0.0.0.0", "rollout.allow_remote=true"]):
        with pytest.raises(ConfigError, match="rollout.require_api_key=true"):
            validate(compose_config(overrides))
    remote = ["rollout.host=0.0.0.0", "rollout.allow_remote=true", "rollout.require_api_key=true"]
    with pytest.raises(ConfigError, match=r"rollout.require_api_key=True: needs the key in \$TONPOLICY_API_KEY"):
        validate(compose_config(remote))
    monkeypatch.setenv("TONPOLICY_API_KEY", KEY)
    validate(compose_config(remote))


def test_the_key_is_never_written_into_the_plan(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TONPOLICY_API_KEY", KEY)
    cfg = compose_config(["rollout=sglang", "trainer.device=cpu", "rollout.require_api_key=true"])
    plan = launch_plan(cfg, tmp_path)
    script = launch_script(plan)
    assert KEY not in json.dumps(plan) and KEY not in script
    command = plan["rollout"]["command"]
    assert command[command.index("--api-key") + 1] == "${TONPOLICY_API_KEY}"
    assert '--api-key "${TONPOLICY_API_KEY:?set TONPOLICY_API_KEY}"' in script


def test_a_run_with_a_key_is_exact(tmp_path: Path) -> None:
    proc, run_dir = run_job(tmp_path, "experiment.steps=2", "rollout.require_api_key=true",
                            env={"TONPOLICY_API_KEY": KEY})  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert [r["mismatched_tokens"] for r in records(run_dir)] == [0, 0]
    assert KEY not in (run_dir / "resolved_config.yaml").read_text() + (run_dir / "launch.sh").read_text()
