"""rollout.cuda_graphs: the embedded engine decodes in CUDA graphs by default exactly where they apply
(embedded engine, triton kernel set, CUDA, dense model); CPU defaults stay eager; `true` where graphs
cannot apply is refused naming the key, every reason at once; the server gets it from the run config."""

from __future__ import annotations

import pytest

from tonpolicy.config.compose import compose_config
from tonpolicy.config.device import cuda_graphs_on
from tonpolicy.rollout.server.args import args_from_config, parse_server_args
from tonpolicy.validation.validate import ConfigError, validate

TRITON_CUDA = ["mode=plan", "contract=qwen3_dense_triton_v1", "trainer.device=cuda"]


def _graph_issues(overrides: list[str]) -> list[str]:
    with pytest.raises(ConfigError) as info:
        validate(compose_config(overrides))
    return [i.rule for i in info.value.issues if i.key == "rollout.cuda_graphs"]


def test_on_by_default_only_where_graphs_apply() -> None:
    cpu = compose_config(["mode=plan"])
    assert cpu.rollout.cuda_graphs is None and not cuda_graphs_on(cpu)
    assert args_from_config(cpu)["cuda_graphs"] is False
    triton = compose_config(TRITON_CUDA)
    validate(triton)
    assert cuda_graphs_on(triton) and args_from_config(triton)["cuda_graphs"] is True
    assert not cuda_graphs_on(compose_config(["mode=plan", "trainer.device=cuda"]))  # invariant set: eager
    assert not cuda_graphs_on(compose_config([*TRITON_CUDA, "rollout.cuda_graphs=false"]))
    validate(compose_config([*TRITON_CUDA, "rollout.cuda_graphs=true"]))
    fp8 = compose_config([*TRITON_CUDA, "contract.quant=fp8_block"])  # its quantizer checks values on the host
    validate(fp8)
    assert not cuda_graphs_on(fp8)


def test_refused_where_graphs_cannot_apply() -> None:
    rules = _graph_issues(["mode=plan", "trainer.device=cpu", "rollout.cuda_graphs=true"])
    assert len(rules) == 2 and "need a CUDA device" in rules[0] and "triton kernel set" in rules[1]
    rules = _graph_issues(["mode=plan", "rollout=sglang", *TRITON_CUDA[1:], "rollout.cuda_graphs=false"])
    assert rules and "applies to the embedded engine" in rules[0]
    rules = _graph_issues([*TRITON_CUDA, "contract.quant=fp8_block", "rollout.cuda_graphs=true"])
    assert rules == [rules[0]] and "contract.quant=fp8_block" in rules[0]


def test_server_flag() -> None:
    ident = ["--contract-name", "x", "--contract-version", "1", "--contract-fingerprint", "f"]
    assert parse_server_args([*ident, "--cuda-graphs"]).cuda_graphs is True
    assert parse_server_args([*ident, "--no-cuda-graphs"]).cuda_graphs is False
    assert parse_server_args(ident).cuda_graphs is False
