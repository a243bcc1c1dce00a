"""Released SGLang for the tests: its environment, and a server started from tonpolicy's own plan."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from support.tied_to_suite import tied_to_suite

from tonpolicy.config.compose import compose_config
from tonpolicy.config.model import ModelConfig
from tonpolicy.config.sglang_rules import sglang_python
from tonpolicy.contract.identity import identity
from tonpolicy.launch.plan import sglang_argv
from tonpolicy.launch.sglang_env import server_environment
from tonpolicy.model.checkpoint import init_state_dict, save_hf
from tonpolicy.ports import free_port
from tonpolicy.rollout.client import RolloutClient

ROOT = Path(__file__).resolve().parents[2]


def sglang_env_python() -> str:
    """The SGLang environment's interpreter. Without one these tests fail (CI sets it up), unless
    TONPOLICY_SKIP_SGLANG=1 says to skip them, and the skip is then reported as such."""
    py = sglang_python(compose_config(["rollout=sglang"]))
    # .venv carries SGLang's argument parser only (--no-deps); the SGLang environment is another one.
    probe = subprocess.run([py, "-c", "import sys, sglang; print(sys.prefix)"], capture_output=True, text=True)
    if probe.returncode != 0 or probe.stdout.strip() == sys.prefix:
        message = f"no SGLang environment at {py}: run `bash scripts/setup_sglang.sh`"
        if os.environ.get("TONPOLICY_SKIP_SGLANG") == "1":
            pytest.skip(message + " (TONPOLICY_SKIP_SGLANG=1)")
        pytest.fail(message + ", or set TONPOLICY_SKIP_SGLANG=1 to skip the real-SGLang tests")
    return py


def save_checkpoint(path: Path, dtype: str, seed: int = 0, cfg: ModelConfig | None = None) -> Path:
    cfg = cfg or ModelConfig()
    save_hf(init_state_dict(cfg, getattr(torch, dtype), seed), cfg, path)
    return path


class SGLangServer:
    """`overrides` compose a run config; the server is started with the command and environment its
    launch plan renders (so the tests run what users run)."""

    def __init__(
        self, tmp: Path, name: str, ckpt: Path, overrides: list[str], extra_args: tuple[str, ...] = ()
    ) -> None:
        self.cfg = compose_config(["rollout=sglang", "trainer.device=cpu", *overrides])
        self.port = free_port()
        argv = sglang_argv(self.cfg, str(ckpt), "cpu", self.port) + list(extra_args)
        env = server_environment(self.cfg, "cpu", identity(self.cfg.contract).fingerprint)
        self.log_path = tmp / f"{name}.log"
        self._log = open(self.log_path, "w")  # noqa: SIM115 - closed in stop()
        self.proc = subprocess.Popen(
            tied_to_suite(argv),
            stdout=self._log,
            stderr=subprocess.STDOUT,
            cwd=ROOT,
            env={**os.environ, **env},
            start_new_session=True,
        )
        self.url = f"http://127.0.0.1:{self.port}"
        self.client = RolloutClient(self.url, timeout_s=300)

    def start_healthy(self, timeout_s: float = 240) -> RolloutClient:
        try:
            self.client.wait_healthy(timeout_s, process=self.proc)
        except Exception as e:
            self.stop()
            raise AssertionError(f"SGLang did not start: {e}\n{self.log_path.read_text()[-4000:]}") from e
        return self.client

    def stop(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(timeout=10)
        self._log.close()


def check_parity(
    py: str,
    server: SGLangServer,
    ckpt: Path,
    kernels: str,
    temperature: float,
    routes: bool = False,
    small: bool = False,
    quant: str = "none",
) -> dict:
    proc = subprocess.run(
        [
            py,
            str(ROOT / "tests" / "support" / "sglang_check.py"),
            server.url,
            str(ckpt),
            server.cfg.contract.dtype,
            kernels,
            str(temperature),
            *(["routes"] if routes else []),
            *(["small"] if small else []),
            *([f"quant={quant}"] if quant != "none" else []),
        ],
        capture_output=True,
        text=True,
        timeout=600,
        cwd=ROOT,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])
