"""The trainer's attention backward (`attention_grads`, written out, no autograd graph of a recompute)
against autograd of plain softmax attention in float64: GQA, whole rows and packed rows (positions that
restart), one block of queries or many. fp32 operands agree to fp32 rounding; bf16 GEMM operands (the
activations' dtype, as megatron's own attention backward) to bf16 rounding."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from tonpolicy.trainer import kernel_autograd
from tonpolicy.trainer.kernel_autograd import attention_grads


def _reference(q, k, v, positions, grad, scale):  # noqa: ANN001, ANN202
    qq, kk, vv = (t.double().requires_grad_() for t in (q, k, v))
    g = q.shape[2] // k.shape[2]
    visible = (positions[:, None, :] <= positions[:, :, None])[:, None]
    out = F.scaled_dot_product_attention(
        qq.transpose(1, 2),
        kk.repeat_interleave(g, dim=2).transpose(1, 2),
        vv.repeat_interleave(g, dim=2).transpose(1, 2),
        attn_mask=visible,
        scale=scale,
    ).transpose(1, 2)
    return torch.autograd.grad(out, (qq, kk, vv), grad.double())


@pytest.mark.parametrize(("dtype", "tol"), [(torch.float32, 2e-6), (torch.bfloat16, 2e-2)])
@pytest.mark.parametrize("block", [1 << 17, 1])
@pytest.mark.parametrize(("b", "n", "hq", "hkv", "d"), [(2, 37, 8, 4, 32), (1, 64, 4, 4, 16), (3, 20, 6, 2, 8)])
def test_attention_grads_equal_autograd_of_plain_attention(dtype, tol, block, b, n, hq, hkv, d, monkeypatch):  # noqa: ANN001
    monkeypatch.setattr(kernel_autograd, "GRAD_BLOCK", block)  # 1: one query per block
    gen = torch.Generator().manual_seed(n)
    q, grad = (torch.randn(b, n, hq, d, generator=gen).to(dtype) for _ in range(2))
    k, v = (torch.randn(b, n, hkv, d, generator=gen).to(dtype) for _ in range(2))
    positions = torch.arange(n).repeat(b, 1)
    positions[-1, n // 2 :] = torch.arange(n - n // 2)  # a packed row: a second sample from position 0
    mine = attention_grads(q, k, v, positions, grad, 0.3)
    ref = _reference(q, k, v, positions, grad, 0.3)
    for name, a, r in zip(("dq", "dk", "dv"), mine, ref, strict=True):
        err = float((a.double() - r).abs().max() / r.abs().max())
        assert err < tol, (name, err)
    # The check can fail: the gradient of attention without the causal mask is far off.
    unmasked = attention_grads(q, k, v, torch.zeros_like(positions), grad, 0.3)
    assert float((unmasked[0].double() - ref[0]).abs().max() / ref[0].abs().max()) > 0.3


def test_causal_bias_is_reused_only_for_the_same_positions():
    """The backward keeps the causal biases of its last positions (every layer asks for the same); new
    positions, even written into the same tensor, get their own, and a cached bias is never changed."""
    torch.manual_seed(0)
    q, grad = torch.randn(2, 2, 40, 4, 16).unbind(0)
    k, v = torch.randn(2, 2, 40, 2, 16).unbind(0)
    positions = torch.arange(40)[None].repeat(2, 1)
    first = [attention_grads(q, k, v, positions, grad, 0.25) for _ in range(2)]
    assert all(torch.equal(a, b) for a, b in zip(*first, strict=True))
    positions[1] = torch.arange(40) % 17  # packed rows, in the same tensor
    kernel_autograd._BIAS.clear()
    fresh = attention_grads(q, k, v, positions, grad, 0.25)
    positions[1] = torch.arange(40)
    attention_grads(q, k, v, positions, grad, 0.25)  # caches the whole-row bias again
    positions[1] = torch.arange(40) % 17
    again = attention_grads(q, k, v, positions, grad, 0.25)
    assert all(torch.equal(a, b) for a, b in zip(fresh, again, strict=True))
    assert not torch.equal(fresh[0], first[0][0])  # the check can fail: the positions change the gradients
    ref = _reference(q, k, v, positions, grad, 0.25)
    assert all((a - r).abs().max() < 2e-6 for a, r in zip(again, ref, strict=True))
