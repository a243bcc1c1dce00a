"""The gradients of contract v2's differentiable row-wise ops: the forward is the library's (its bits under
the contract), the backward the plain torch formula's, recomputed (only the forward is under the contract)."""

from __future__ import annotations

import torch

from tonpolicy.kernels import logprob_temperature


class PlainGrad(torch.autograd.Function):
    """out = fwd(*inputs) (the library's bits), with the gradient of plain(*inputs), the torch formula
    (recomputed in backward: only the forward is under the contract)."""

    @staticmethod
    def forward(ctx, fwd, plain, *inputs):  # noqa: ANN001, ANN205
        ctx.plain = plain
        ctx.save_for_backward(*inputs)
        return fwd(*inputs)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):  # noqa: ANN205
        need = ctx.needs_input_grad[2:]
        ins = [
            t.detach().requires_grad_(n) if t.is_floating_point() else t
            for t, n in zip(ctx.saved_tensors, need, strict=True)
        ]
        with torch.enable_grad():
            out = ctx.plain(*ins)
        wanted = [t for t, n in zip(ins, need, strict=True) if n]
        got = iter(torch.autograd.grad(out, wanted, grad) if wanted else ())
        return (None, None, *(next(got) if n else None for n in need))


def tracked(*ts: torch.Tensor) -> bool:
    return torch.is_grad_enabled() and any(t.requires_grad for t in ts)


def plain_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """The torch formula (rms_norm's gradient)."""
    xf = x.float()
    var = (xf * xf).sum(dim=-1, keepdim=True) / x.shape[-1]
    return (xf / torch.sqrt(var + eps) * weight.float()).to(x.dtype)


def plain_swiglu(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """The torch formula (swiglu's gradient)."""
    g = gate.float()
    return (g / (1.0 + torch.exp(-g)) * up.float()).to(gate.dtype)


def plain_logprobs(logits: torch.Tensor, tokens: torch.Tensor, vocab_size: int, temperature: float) -> torch.Tensor:
    """The torch formula (logprobs' gradient)."""
    x = logits[..., :vocab_size].float()
    t = logprob_temperature(temperature)
    if t != 1.0:
        x = x / t
    return torch.log_softmax(x, dim=-1).gather(-1, tokens.long().unsqueeze(-1)).squeeze(-1)
