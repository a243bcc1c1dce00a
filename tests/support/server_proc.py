"""Start the real rollout server as a subprocess on loopback (shared by the tests/server/ files)."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import torch
from support.tied_to_suite import tied_to_suite

from tonpolicy.config.model import ModelConfig
from tonpolicy.kernels import get_kernels
from tonpolicy.model.checkpoint import init_state_dict, load_hf, save_hf
from tonpolicy.model.qwen3 import Qwen3
from tonpolicy.rollout.client import RolloutClient
from tonpolicy.rollout.engine import Engine

ROOT = Path(__file__).resolve().parents[2]
IDENTITY = ["--contract-name", "test_contract", "--contract-version", "1", "--contract-fingerprint", "f" * 64]
DTYPE = "bfloat16"


def save_checkpoint(path: Path, seed: int, cfg: ModelConfig | None = None) -> Path:
    cfg = cfg or ModelConfig()
    save_hf(init_state_dict(cfg, getattr(torch, DTYPE), seed), cfg, path)
    return path


def local_engine(checkpoint: Path, kernels: str = "ordered") -> Engine:
    """The same engine the server runs, built in this process, to compare answers against."""
    cfg, sd = load_hf(checkpoint)
    return Engine(Qwen3(cfg, get_kernels(kernels), getattr(torch, DTYPE), sd), max_running_requests=8)


class ServerProc:
    def __init__(self, tmp: Path, name: str, args: list[str], python: str = sys.executable) -> None:
        self.port_file = tmp / f"{name}.port"
        self.log_path = tmp / f"{name}.log"
        self._log = open(self.log_path, "w")  # noqa: SIM115 - closed in stop()
        argv = [python, "-m", "tonpolicy.rollout.server", *args, "--port-file", str(self.port_file)]
        self.proc = subprocess.Popen(tied_to_suite(argv), cwd=ROOT, stdout=self._log, stderr=subprocess.STDOUT)
        self.port: int | None = None

    def log(self) -> str:
        return self.log_path.read_text()

    def wait_port(self, timeout_s: float = 60.0) -> int:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline and self.proc.poll() is None:
            if self.port_file.exists():
                self.port = int(self.port_file.read_text())
                return self.port
            time.sleep(0.05)
        raise AssertionError(f"server reported no port (exit {self.proc.poll()}):\n{self.log()}")

    def start_healthy(self, timeout_s: float = 60.0) -> RolloutClient:
        client = RolloutClient(f"http://127.0.0.1:{self.wait_port(timeout_s)}")
        client.wait_healthy(timeout_s, process=self.proc)
        return client

    def wait_exit(self, timeout_s: float = 60.0) -> int:
        try:
            return self.proc.wait(timeout_s)
        finally:
            self._log.close()

    def stop(self) -> int:
        if self.proc.poll() is None:
            self.proc.terminate()
        return self.wait_exit(15.0)
