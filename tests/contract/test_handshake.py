"""The trainer refuses a rollout server whose contract fingerprint, or whose runtime fingerprint (what
the server computed from the kernel set it built), differs from its own (real HTTP)."""

from __future__ import annotations

from pathlib import Path

from support.server_proc import IDENTITY, ServerProc, save_checkpoint

from tonpolicy.config.compose import compose_config
from tonpolicy.contract.handshake import handshake
from tonpolicy.contract.identity import identity, kernel_params, runtime_identity
from tonpolicy.kernels import get_kernels


def test_handshake_refuses_foreign_fingerprint_and_accepts_ours(tmp_path: Path) -> None:
    cfg = compose_config()
    ckpt = save_checkpoint(tmp_path / "ckpt", seed=0)
    ours = identity(cfg.contract)
    own = [
        "--contract-name",
        ours.name,
        "--contract-version",
        str(ours.version),
        "--contract-fingerprint",
        ours.fingerprint,
    ]
    runtime = runtime_identity(
        get_kernels(cfg.contract.kernels, **kernel_params(cfg.contract)), cfg.contract.dtype, "cpu"
    )
    servers = [
        ServerProc(tmp_path, "foreign", ["--model-path", str(ckpt), *IDENTITY]),
        ServerProc(tmp_path, "own", ["--model-path", str(ckpt), *own]),
        # Our contract's label, but built in another dtype: only the runtime fingerprint tells.
        ServerProc(tmp_path, "fp32", ["--model-path", str(ckpt), *own, "--dtype", "float32"]),
    ]
    try:
        foreign, own_client, fp32 = (s.start_healthy() for s in servers)
        refusal = handshake(cfg, foreign, runtime)
        assert refusal is not None and "fingerprint mismatch" in refusal and ours.fingerprint in refusal
        assert handshake(cfg, own_client, runtime) is None
        refusal = handshake(cfg, fp32, runtime)
        assert refusal is not None and "runtime fingerprint mismatch" in refusal
        assert "'dtype': ('bfloat16', 'float32')" in refusal
    finally:
        for s in servers:
            s.proc.terminate()
            s.proc.wait(timeout=30)
