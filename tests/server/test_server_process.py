"""The rollout server as a process: started from the launcher's resolved config, a port that is
taken, a model that cannot be loaded, and a clean exit on SIGTERM."""

from __future__ import annotations

import ctypes
import os
import signal
import socket
from dataclasses import replace
from pathlib import Path

import torch
from omegaconf import OmegaConf
from support.server_proc import IDENTITY, ServerProc, save_checkpoint

from tonpolicy.config.compose import compose_config
from tonpolicy.contract.identity import identity, kernel_params
from tonpolicy.kernels import get_kernels
from tonpolicy.model.qwen3 import Qwen3
from tonpolicy.rollout.engine import Engine
from tonpolicy.rollout.engine.generation import GenRequest
from tonpolicy.rollout.server.app import EXIT_BIND_FAILED, EXIT_LOAD_FAILED


def _resolved_config(tmp_path: Path) -> tuple[Path, object]:
    cfg = compose_config(["contract=qwen3_dense_v2"])
    path = tmp_path / "resolved_config.yaml"
    path.write_text(OmegaConf.to_yaml(OmegaConf.structured(cfg)))
    return path, cfg


def test_server_from_resolved_config(tmp_path: Path) -> None:
    path, cfg = _resolved_config(tmp_path)
    srv = ServerProc(tmp_path, "cfg", ["--config", str(path), "--num-threads", "1"])
    try:
        client = srv.start_healthy()
        assert "listening on http://127.0.0.1:" in srv.log()
        info = client.server_info()
        assert info["tonpolicy_contract"] == identity(cfg.contract).to_dict()
        assert (info["kernels"], info["dtype"]) == (cfg.contract.kernels, cfg.contract.dtype)
        out = client.generate([[3, 1, 4, 1, 5]], {"max_new_tokens": 4, "sampling_seed": 9})[0]
    finally:
        code = srv.stop()
    assert code == 0, srv.log()
    # No checkpoint in the config: the profile's deterministic init, as the trainer builds it.
    kernels = get_kernels(cfg.contract.kernels, **kernel_params(cfg.contract))
    model = Qwen3(cfg.model, kernels, getattr(torch, cfg.contract.dtype))
    exp = Engine(model, max_running_requests=1).generate([GenRequest([3, 1, 4, 1, 5], 4, seed=9)])[0]
    assert out["output_ids"] == exp.output_ids
    assert torch.equal(torch.tensor(out["output_logprobs"], dtype=torch.float32), exp.output_logprobs)


def test_port_taken_is_a_clear_nonzero_exit(tmp_path: Path) -> None:
    path, _ = _resolved_config(tmp_path)
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        srv = ServerProc(tmp_path, "taken", ["--config", str(path), "--port", str(port)])
        code = srv.wait_exit(60)
    assert code == EXIT_BIND_FAILED
    assert f"127.0.0.1:{port}" in srv.log() and "already in use" in srv.log()
    assert not srv.port_file.exists()


def test_unloadable_model_is_a_clear_nonzero_exit(tmp_path: Path) -> None:
    srv = ServerProc(tmp_path, "noload", ["--model-path", str(tmp_path / "missing"), *IDENTITY])
    code = srv.wait_exit(60)
    assert code == EXIT_LOAD_FAILED
    assert "cannot load the model" in srv.log()


def test_checkpoint_of_another_architecture_than_the_config_is_refused(tmp_path: Path) -> None:
    path, cfg = _resolved_config(tmp_path)
    ckpt = save_checkpoint(tmp_path / "ckpt", seed=0, cfg=replace(cfg.model, num_layers=2))
    srv = ServerProc(tmp_path, "arch", ["--config", str(path), "--model-path", str(ckpt)])
    code = srv.wait_exit(60)
    assert code == EXIT_LOAD_FAILED
    assert "another architecture" in srv.log() and "num_layers" in srv.log()


def test_sigterm_received_by_any_thread_stops_an_idle_server(tmp_path: Path) -> None:
    """The kernel hands a process's SIGTERM to any thread that does not block it; Python runs the
    handler on the main thread, where the idle engine loop waits. Sent to each other thread in turn
    (tgkill), it must still stop the server at once (an untimed wait there ignored it)."""
    ck = save_checkpoint(tmp_path / "ck", seed=1)
    srv = ServerProc(tmp_path, "term", ["--model-path", str(ck), "--kernels", "plain", *IDENTITY, "--num-threads", "1"])
    try:
        srv.start_healthy()
        pid = srv.proc.pid
        others = sorted(int(t) for t in os.listdir(f"/proc/{pid}/task") if int(t) != pid)
        assert others, "the server runs no other thread: nothing to aim at"
        assert ctypes.CDLL(None, use_errno=True).tgkill(pid, others[0], signal.SIGTERM) == 0
        assert srv.proc.wait(timeout=5) == 0, srv.log()
    finally:
        if srv.proc.poll() is None:
            srv.proc.kill()
        srv.wait_exit(10)
