"""contract.quant=fp8_block's pieces: the block quantizer's rule (scale, rounding, saturation, locality), the
ordered fp8 GEMM against its written definition (a scalar chain reference and IEEE scalar arithmetic), its
row and shard invariances, the plain control (dequantize, then torch's matmul: close, not the same bits),
the kernel set's straight-through gradient and the config's refusals."""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest
import torch

from tonpolicy.config.compose import compose_config
from tonpolicy.kernels import get_kernels
from tonpolicy.kernels.fp8_block import (
    dequantize_weight_blocks,
    quantize_activation_groups,
    quantize_weight_blocks,
)
from tonpolicy.kernels.invariant import float_mode, host_check, ordered_gemm
from tonpolicy.kernels.invariant.ordered_fp8 import (
    RowParts,
    cached_weight,
    fp8_linear,
    fp8_linear_partials,
    plain_fp8_linear,
    quantize_weight,
)
from tonpolicy.validation.validate import ConfigError, validate


def _randn(*shape: int, seed: int, std: float = 1.0) -> torch.Tensor:
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed)) * std


def test_weight_blocks_scale_round_and_saturate() -> None:
    w = torch.zeros(130, 200)
    w[0, :4] = torch.tensor([448.0, 17.0, 19.0, -448.0])  # scale 1.0: 17 and 19 are e4m3 ties
    w[128:, 128:] = _randn(2, 72, seed=1, std=1e-3)
    q, s = quantize_weight_blocks(w)
    assert q.dtype == torch.float8_e4m3fn and q.shape == w.shape and s.shape == (2, 2) and s.dtype == torch.float32
    assert q[0, :4].float().tolist() == [448.0, 16.0, 20.0, -448.0]  # round to nearest even
    amax = w[128:, 128:].abs().max()
    assert s[1, 1] == amax / 448 and s[0, 1] == 1.0 and s[1, 0] == 1.0  # zero blocks take 1.0
    assert q[128:, 128:].float().abs().max() == 448  # the block's largest magnitude saturates exactly
    d = dequantize_weight_blocks(q, s, torch.float32)
    assert torch.equal(d[128:, 128:], q[128:, 128:].float() * s[1, 1])
    assert ((d - w).abs() <= w.abs() / 16 + s.max() * 2**-10).all()  # 3 mantissa bits (or e4m3's subnormals)
    with pytest.raises(ValueError, match="non-finite"):
        quantize_weight_blocks(torch.tensor([[float("nan")]]))


def test_blocks_are_local() -> None:
    w = _randn(256, 256, seed=2)
    q, s = quantize_weight_blocks(w)
    w2 = w.clone()
    w2[5, 7] = 100.0  # in block (0, 0)
    q2, s2 = quantize_weight_blocks(w2)
    assert not torch.equal(s2[0, 0], s[0, 0])
    assert torch.equal(s2.flatten()[1:], s.flatten()[1:])
    assert torch.equal(q2[128:].float(), q[128:].float()) and torch.equal(q2[:, 128:].float(), q[:, 128:].float())
    x = _randn(6, 200, seed=3)
    qa, sa = quantize_activation_groups(x)
    qa1, sa1 = quantize_activation_groups(x[4:5])
    assert sa.shape == (6, 2) and torch.equal(sa[4:5], sa1) and torch.equal(qa[4:5].float(), qa1.float())


def _reference(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """The definition, from the scalar chain reference and numpy's IEEE fp32 scalars."""
    qa, sa = quantize_activation_groups(x)
    qw, sw = quantize_weight_blocks(w)
    k = x.shape[-1]
    y = np.zeros((x.shape[0], w.shape[0]), dtype=np.float32)
    for b, a in enumerate(range(0, k, 128)):
        xs, ws = qa[:, a : a + 128].to(torch.bfloat16), qw[:, a : a + 128].to(torch.bfloat16)
        s = ordered_gemm.reference_linear_partials(xs, ws, 1)[0].numpy()
        for m in range(y.shape[0]):
            for n in range(y.shape[1]):
                t = np.float32(sa[m, b].item()) * np.float32(sw[n // 128, b].item())
                y[m, n] = np.float32(y[m, n] + np.float32(np.float32(s[m, n]) * t))
    return torch.from_numpy(y)


def test_gemm_is_its_definition_and_row_invariant() -> None:
    x = _randn(5, 300, seed=4) * torch.logspace(-3, 3, 300)  # scales over six decades across the groups
    w = _randn(130, 300, seed=5, std=0.05)
    y = fp8_linear(x.to(torch.bfloat16), w.to(torch.bfloat16))
    assert torch.equal(y, _reference(x.to(torch.bfloat16).float(), w.to(torch.bfloat16).float()))
    xb, wb = x.to(torch.bfloat16), w.to(torch.bfloat16)
    assert torch.equal(fp8_linear(xb[3:4], wb), y[3:4])  # a row alone: its bits in the batch
    assert torch.equal(fp8_linear(xb, wb[:128]), y[:, :128])  # a column shard of whole row blocks


def test_a_process_that_flushes_subnormals_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    """t = sa * sw = 2^-110 * 2^-30 is subnormal: gradual underflow keeps it, FTZ would zero the output."""
    x, w = torch.zeros(1, 128), torch.zeros(1, 128)
    x[0, 0], w[0, 0] = 448 * 2.0**-110, 448 * 2.0**-30
    y = fp8_linear(x, w)
    assert y.item() == 448 * 448 * 2.0**-140
    shapes = host_check.Shapes(128, 128, 2, 2, 64, 256, "bfloat16", 1, 32)
    assert torch.set_flush_denormal(True)  # FTZ|DAZ in this thread's MXCSR
    try:
        with pytest.raises(float_mode.FlushDenormalError, match=r"set_flush_denormal\(True\).*gradual underflow"):
            fp8_linear(x, w)
        failures = host_check.probe(get_kernels("ordered", quant="fp8_block"), shapes)
        monkeypatch.setattr(float_mode, "require_gradual_underflow", lambda what: None)
        unguarded = fp8_linear(x, w)
    finally:
        torch.set_flush_denormal(False)
    assert [f.prop for f in failures] == ["fp32.gradual_underflow"]
    assert not torch.equal(unguarded.view(torch.int32), y.view(torch.int32))  # control: the bits a guard prevents


def test_intra_op_threads_started_while_flushing_are_refused() -> None:
    """Threads keep the mode they started with: the main thread's reset does not reach them."""
    code = (
        "import torch\n"
        "from tonpolicy.kernels.invariant import float_mode\n"
        "torch.set_num_threads(2); torch.set_flush_denormal(True)\n"
        "torch.ones(1 << 18).mul(2.0)\n"  # starts the intra-op threads
        "torch.set_flush_denormal(False)\n"
        "assert not float_mode.calling_thread_flushes()\n"
        "try:\n    float_mode.require_gradual_underflow('t')\n"
        "except float_mode.FlushDenormalError:\n    print('refused')"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.stdout.strip() == "refused", out.stderr


def test_canonical_shards_and_tp_halves() -> None:
    x, w = _randn(4, 512, seed=6).to(torch.bfloat16), _randn(64, 512, seed=7, std=0.04).to(torch.bfloat16)
    whole = fp8_linear_partials(x, w, 4)
    halves = [fp8_linear_partials(x[:, i * 256 : (i + 1) * 256], w[:, i * 256 : (i + 1) * 256], 2) for i in (0, 1)]
    assert torch.equal(torch.cat(halves), whole)  # TP 2's ranks give TP 1's canonical partials
    narrow = fp8_linear_partials(x[:, :192], w[:, :192], 3)  # 64-wide shards: each its own blocks
    assert torch.equal(narrow[1], fp8_linear(x[:, 64:128], w[:, 64:128]))


def test_plain_control_is_close_but_not_the_bits() -> None:
    x, w = _randn(16, 384, seed=8).to(torch.bfloat16), _randn(96, 384, seed=9, std=0.05).to(torch.bfloat16)
    y, plain = fp8_linear(x, w), plain_fp8_linear(x, w)
    assert not torch.equal(y, plain)
    assert (y - plain).abs().max() < 1e-4 * plain.abs().max()


def test_kernel_set_linears_and_straight_through_gradient() -> None:
    k = get_kernels("ordered", quant="fp8_block")
    x = _randn(3, 256, seed=10).to(torch.bfloat16).requires_grad_()
    w = _randn(128, 256, seed=11, std=0.05).to(torch.bfloat16).requires_grad_()
    y = k.linear(x, w)
    assert y.dtype == torch.bfloat16 and torch.equal(y, fp8_linear(x, w).to(torch.bfloat16))
    y.float().sum().backward()
    assert torch.equal(x.grad, torch.ones(3, 128).matmul(w.detach().float()).to(torch.bfloat16))  # master W
    assert torch.equal(k.lm_head(x.detach(), w.detach()), ordered_gemm.linear(x.detach(), w.detach()))  # v2
    assert k.describe()["quant"] == "fp8_block" and get_kernels("ordered").describe()["quant"] == "none"
    assert quantize_weight(w.detach()).row_scales.shape == (128, 2)
    with pytest.raises(ValueError, match="ordered"):
        get_kernels("plain", quant="fp8_block")


def test_fused_weights_quantize_per_hf_weight_with_partial_blocks() -> None:
    x = _randn(3, 200, seed=12).to(torch.bfloat16)
    gate, up = _randn(96, 200, seed=13, std=0.05), _randn(96, 200, seed=14, std=0.5)
    gate, up = gate.to(torch.bfloat16), up.to(torch.bfloat16)
    fused = torch.cat([gate, up])
    y = fp8_linear(x, fused, RowParts.whole(96, 96))
    assert torch.equal(y, torch.cat([fp8_linear(x, gate), fp8_linear(x, up)], dim=-1))
    assert not torch.equal(y, fp8_linear(x, fused))  # control: blocks straddling gate and up


def test_expert_views_of_a_stack_stay_cached_until_the_stack_is_written() -> None:
    """The SGLang package's experts are views of one stacked weight (kept, one per expert): a view's
    quantization is reused while the stack is unchanged, and a write into the stack (a weight sync's
    `copy_`) invalidates every expert, since views share the stack's version counter."""
    stack = _randn(4, 96, 128, seed=21, std=0.05)
    views = list(stack.unbind(0))
    first = cached_weight(views[1], 1)
    assert cached_weight(views[1], 1) is first  # hit: the same view, unchanged
    assert cached_weight(stack[1], 1) is not first  # control: a fresh view each call quantizes again
    stack.copy_(_randn(4, 96, 128, seed=22, std=0.05))
    again = cached_weight(views[1], 1)
    assert again is not first and not torch.equal(again[0].full, first[0].full)
    assert torch.equal(again[0].full, quantize_weight(stack[1]).full)


def _tp_ranks(x: torch.Tensor, hf: list[torch.Tensor], tp: int, reduce: bool) -> list[torch.Tensor]:
    """Each rank's fp8 linear on its slice of every HF weight (fused in order), the amax all-reduce MAX done
    by a stand-in that takes the max of every rank's grid (gathered in a first pass)."""
    sizes = [w.shape[0] for w in hf]
    ranks = [(torch.cat([w.chunk(tp)[r] for w in hf]), RowParts.tp_shard(sizes, r, tp)) for r in range(tp)]
    grids: list[torch.Tensor] = []
    for w, parts in ranks:  # first pass: every rank's partial amax grid, as the all-reduce would see it
        fp8_linear(x, w.clone(), parts, lambda t: grids.append(t.clone()))
    most = torch.stack(grids).amax(0)
    out = []
    for w, parts in ranks:
        out.append(fp8_linear(x, w.clone(), parts, (lambda t: most.clone()) if reduce else None))
    return out


def test_blocks_split_across_tp_ranks_take_the_whole_blocks_amax() -> None:
    x = _randn(4, 128, seed=15).to(torch.bfloat16)
    q, k, v = (
        _randn(n, 128, seed=16 + i, std=0.05 * (i + 1)).to(torch.bfloat16) for i, n in enumerate((256, 128, 128))
    )
    k[100, 3] = 2.0  # the largest k value on rank 1's half: rank 0's half of the block scales by it too
    whole = fp8_linear(x, torch.cat([q, k, v]), RowParts.whole(256, 128, 128)).split([256, 128, 128], dim=-1)
    for tp in (2, 4):
        got = [y.split([256 // tp, 128 // tp, 128 // tp], dim=-1) for y in _tp_ranks(x, [q, k, v], tp, True)]
        for part in range(3):
            assert torch.equal(torch.cat([g[part] for g in got], dim=-1), whole[part]), (tp, part)
    alone = _tp_ranks(x, [q, k, v], 2, False)[0].split([128, 64, 64], dim=-1)
    assert torch.equal(alone[0], whole[0][:, :128])  # q's blocks are whole on each rank
    assert not torch.equal(alone[1], whole[1][:, :64])  # control: k's block scaled by rank 0's half alone


def test_config_refuses_where_fp8_cannot_hold() -> None:
    with pytest.raises(ConfigError, match="contract.quant='fp8': must be one of"):
        validate(compose_config(["contract=off_policy", "contract.quant=fp8"]), check_hf=False)
    with pytest.raises(ConfigError) as refused:
        validate(compose_config(["contract.kernels=invariant", "contract.quant=fp8_block"]), check_hf=False)
    text = str(refused.value)
    assert "contract.quant='fp8_block': fp8_block is defined on the kernel sets ordered, triton, not on" in text
    # The embedded engine, the trainer and the SGLang package hold at every layout: split blocks reduced,
    # partial blocks allowed (SGLang's: tests/sglang/test_sglang_moe.py cuts every weight's partial block at
    # TP 2, tests/sglang/test_sglang_moe_job.py runs the MoE job).
    for overrides in (
        ["parallel=tp2"],
        ["parallel=tp4"],
        ["model=qwen3_moe_tiny", "parallel=tp2_ep2"],
        ["rollout=sglang", "parallel.rollout_tp=2"],
        ["model=qwen3_moe_tiny", "rollout=sglang", "parallel.rollout_tp=2"],
        ["rollout=sglang", "model.intermediate_size=320", "model.num_kv_heads=2"],
    ):
        validate(compose_config([*overrides, "contract.quant=fp8_block"]), check_hf=False)
