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


# Partial fp8 weight blocks at SGLang's TP 2: cut by TP in the experts' 96 gate/up rows (48 a rank) and k/v's
# 64 (32 a rank); whole on one rank in the dense layer's gate/up 320 (160 a rank, which cuts a whole block).
PARTIAL_BLOCKS = ("model.intermediate_size=320", "model.num_kv_heads=2")


def _ckpt(tmp_path: Path, dtype: str, model: tuple[str, ...] = ()) -> Path:
    return save_checkpoint(tmp_path / "ckpt", dtype, cfg=compose_config([MOE, *model]).model)


@pytest.mark.parametrize(
    ("dtype", "rollout_tp", "ep", "temperature", "quant"),
    [("bfloat16", 2, 1, 0.7, "fp8_block"), ("float32", 2, 2, 1.0, "none")],
    ids=["bf16-tp2-fp8_block", "fp32-tp2-ep2"],
)
def test_moe_package_gives_the_contract_bits_and_routes(
    tmp_path: Path, sglang_py: str, dtype: str, rollout_tp: int, ep: int, temperature: float, quant: str
) -> None:
    """TP 2 (experts column/row-sharded) and SGLang's `--ep-size 2` within TP 2 (whole experts per rank,
    outputs taken from their owner): the same bits and routes as the full forward. TP 2 runs
    contract.quant=fp8_block with partial weight blocks cut by TP (`PARTIAL_BLOCKS`), their amaxes
    all-reduced over SGLang's TP group; its control: the unquantized set's scoring of the same tokens
    mismatches. TP 1 is the MoE job's server in tests/sglang/test_sglang_moe_job.py (exact, routing
    agreement 1.0 every step)."""
    model = PARTIAL_BLOCKS if quant != "none" else ()
    ckpt = _ckpt(tmp_path, dtype, model)
    overrides = [MOE, *model, f"contract.dtype={dtype}", f"contract.quant={quant}", f"parallel.rollout_tp={rollout_tp}"]
    overrides.append("rollout.chunked_prefill_size=64")
    server = SGLangServer(tmp_path, "contract", ckpt, overrides, (*ROUTES, "--ep-size", str(ep)))
    try:
        client = server.start_healthy()
        result = check_parity(sglang_py, server, ckpt, "ordered", temperature, routes=True, small=True, quant=quant)
        reported = client.contract()
    finally:
        server.stop()
    assert result["tokens"] == 10 * 8 and result["mismatched"] == 0 and result["max_abs_diff"] == 0.0, result
    assert quant == "none" or result["control_mismatched"] > 0, result
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
