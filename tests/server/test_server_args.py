"""Rollout server arguments from the launcher's resolved config file and from flags."""

from __future__ import annotations

from pathlib import Path

import pytest
from omegaconf import OmegaConf

from tonpolicy.config.compose import compose_config
from tonpolicy.contract.identity import identity, kernel_params
from tonpolicy.rollout.server.args import parse_server_args


def _write_resolved(tmp_path: Path, overrides: list[str]) -> tuple[Path, object]:
    cfg = compose_config(overrides)
    path = tmp_path / "resolved_config.yaml"
    path.write_text(OmegaConf.to_yaml(OmegaConf.structured(cfg)))  # what tonpolicy.app writes
    return path, cfg


def test_resolved_config_gives_contract_identity_and_engine_settings(tmp_path: Path) -> None:
    path, cfg = _write_resolved(tmp_path, ["contract=qwen3_dense_v2", "rollout.max_running_requests=5"])
    a = parse_server_args(["--config", str(path), "--port", "0", "--port-file", str(tmp_path / "port")])
    ident = identity(cfg.contract)
    assert (a.contract_name, a.contract_version, a.contract_fingerprint) == (
        ident.name,
        ident.version,
        ident.fingerprint,
    )
    assert a.kernels == cfg.contract.kernels and a.dtype == cfg.contract.dtype
    assert a.kernel_params == kernel_params(cfg.contract)
    assert a.model == cfg.model and a.model_path is None
    assert a.max_running_requests == 5 and a.host == "127.0.0.1" and a.port == 0
    assert a.port_file == str(tmp_path / "port")


def test_off_policy_config_has_another_fingerprint(tmp_path: Path) -> None:
    on, _ = _write_resolved(tmp_path, ["contract=qwen3_dense_v2"])
    on_args = parse_server_args(["--config", str(on)])
    off, _ = _write_resolved(tmp_path, ["contract=off_policy"])
    off_args = parse_server_args(["--config", str(off)])
    assert off_args.kernels == "plain"
    assert off_args.contract_fingerprint != on_args.contract_fingerprint


def test_flags_alone(tmp_path: Path) -> None:
    a = parse_server_args(
        [
            "--model-path", str(tmp_path), "--kernels", "plain", "--dtype", "float32",
            "--contract-name", "c", "--contract-version", "2", "--contract-fingerprint", "ab" * 32,
            "--attention-tile", "16", "--max-running-requests", "3",
        ]
    )  # fmt: skip
    assert a.model_path == str(tmp_path) and a.kernels == "plain" and a.dtype == "float32"
    assert (a.contract_name, a.contract_version) == ("c", 2)
    assert a.kernel_params == {"attention_tile": 16} and a.max_running_requests == 3


def test_contract_identity_is_required(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as e:
        parse_server_args(["--model-path", "x"])
    assert e.value.code == 2
    assert "--contract-fingerprint" in capsys.readouterr().err
