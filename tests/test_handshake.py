"""The trainer refuses a rollout server whose contract fingerprint differs from its own (real HTTP)."""

from __future__ import annotations

from pathlib import Path

from server_proc import IDENTITY, ServerProc, save_checkpoint

from tonpolicy.config.compose import compose_config
from tonpolicy.contract.identity import identity
from tonpolicy.launch.trainer_main import handshake


def test_handshake_refuses_foreign_fingerprint_and_accepts_ours(tmp_path: Path) -> None:
    cfg = compose_config()
    ckpt = save_checkpoint(tmp_path / "ckpt", seed=0)
    ours = identity(cfg.contract)
    own = ["--contract-name", ours.name, "--contract-version", str(ours.version), "--contract-fingerprint", ours.fingerprint]
    servers = [ServerProc(tmp_path, "foreign", ["--model-path", str(ckpt), *IDENTITY]),
               ServerProc(tmp_path, "own", ["--model-path", str(ckpt), *own])]
    try:
        foreign, own_client = (s.start_healthy() for s in servers)
        refusal = handshake(cfg, foreign)
        assert refusal is not None and "fingerprint mismatch" in refusal and ours.fingerprint in refusal
        assert handshake(cfg, own_client) is None
    finally:
        for s in servers:
            s.proc.terminate()
            s.proc.wait(timeout=30)
