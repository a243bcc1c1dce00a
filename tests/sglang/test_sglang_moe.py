"""Released SGLang serves Qwen3-MoE on the contract kernels (the package's `Qwen3MoeForCausalLM`).

One server per case, started with the command and environment tonpolicy's launch plan renders, driven
like GRPO (concurrent requests, radix-cache prefixes, chunked prefill); every returned logprob is
compared with tonpolicy's own full-forward scoring (`Qwen3Moe`), fp32 bit for bit, and the routes SGLang's
capturer returns (`--enable-return-routed-experts`) with the full forward's. Negative control: the plain
kernel set in the same package (stock SGLang's own Qwen3-MoE does not run correctly on this CPU).
"""

from __future__ import annotations

from pathlib import Path

import pytest
from support.sglang_proc import SGLangServer, check_parity, save_checkpoint, sglang_env_python

from tonpolicy.config.compose import compose_config

MOE = "model=qwen3_moe_tiny"
ROUTES = ("--enable-return-routed-experts",)


@pytest.fixture(scope="module")
def sglang_py() -> str:
    return sglang_env_python()


def _ckpt(tmp_path: Path, dtype: str) -> Path:
    return save_checkpoint(tmp_path / "ckpt", dtype, cfg=compose_config([MOE]).model)


@pytest.mark.parametrize(
    ("dtype", "rollout_tp", "ep", "temperature"),
    [("bfloat16", 2, 1, 0.7), ("float32", 2, 2, 1.0)],
)
def test_moe_package_gives_the_contract_bits_and_routes(
    tmp_path: Path, sglang_py: str, dtype: str, rollout_tp: int, ep: int, temperature: float
) -> None:
    """TP 2 (experts column/row-sharded) and SGLang's `--ep-size 2` within TP 2 (whole experts per rank,
    outputs taken from their owner): the same bits and routes as the full forward. TP 1 is the MoE job's
    server in tests/sglang/test_sglang_moe_job.py (exact, routing agreement 1.0 every step)."""
    ckpt = _ckpt(tmp_path, dtype)
    overrides = [MOE, f"contract.dtype={dtype}", f"parallel.rollout_tp={rollout_tp}", "rollout.chunked_prefill_size=64"]
    server = SGLangServer(tmp_path, "contract", ckpt, overrides, (*ROUTES, "--ep-size", str(ep)))
    try:
        client = server.start_healthy()
        result = check_parity(sglang_py, server, ckpt, "ordered", temperature, routes=True, small=True)
        reported = client.contract()
    finally:
        server.stop()
    assert result["tokens"] == 10 * 8 and result["mismatched"] == 0 and result["max_abs_diff"] == 0.0, result
    assert result["cached_tokens"] > 0, "the radix cache served no prefix: the check lost its point"
    assert result["route_rows"] > 0 and result["route_mismatched_rows"] == 0, result
    assert reported["name"] == "qwen3_moe_v2" and reported["tp_size"] == rollout_tp


def test_plain_kernels_in_the_package_are_close_but_not_exact(tmp_path: Path, sglang_py: str) -> None:
    """Negative control: the same package and check on the plain kernel set (torch's own GEMMs,
    `torch.topk` routing, the activation-dtype combine). Stock SGLang's own Qwen3-MoE is no control on
    this CPU: its CPU MoE path returned null logprobs (NaN) and differences up to 0.09 here."""
    ckpt = _ckpt(tmp_path, "float32")
    server = SGLangServer(tmp_path, "plain", ckpt, [MOE, "contract.kernels=plain", "contract.dtype=float32"])
    try:
        server.start_healthy()
        result = check_parity(sglang_py, server, ckpt, "ordered", 1.0, small=True)
    finally:
        server.stop()
    assert result["mismatched"] > 0 and 0 < result["max_abs_diff"] < 1e-3, result
