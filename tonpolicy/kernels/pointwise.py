"""Row-local ops of the `invariant` set: RMSNorm, SwiGLU, RoPE, logprobs.

dtype steps: inputs upcast to fp32, all arithmetic in fp32 using only IEEE-exact elementwise ops
(+ - * / sqrt) plus `torch.exp`/`cos`/`sin` (scalar and vector paths measured identical), last-dim
reductions of a fixed length (per-row results independent of the other rows), one rounding to the
activation dtype at the end.
"""

from __future__ import annotations

import torch

_ROPE_CHUNK = 64  # cos/sin are computed for fixed 64-position chunks, so a position's bits never
# depend on which other positions were requested.
_rope_cache: dict[tuple[int, float, int], tuple[torch.Tensor, torch.Tensor]] = {}


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    xf = x.float()
    var = (xf * xf).sum(dim=-1, keepdim=True) / x.shape[-1]
    y = xf / torch.sqrt(var + eps)
    return (y * weight.float()).to(x.dtype)


_BLOCK_ROWS = 128


def swiglu(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    # silu written with exp: torch.sigmoid/silu differ between their scalar and vector paths.
    if torch.is_grad_enabled() and (gate.requires_grad or up.requires_grad):
        g = gate.float()
        return (g / (1.0 + torch.exp(-g)) * up.float()).to(gate.dtype)
    # The same ops in the same order, in place in one fp32 buffer per block of rows (`g` may be `gate`
    # itself): fp32 temporaries that stay in cache instead of whole-tensor ones streamed through memory.
    n = gate.shape[-1]
    g2, u2 = gate.reshape(-1, n), up.reshape(-1, n)
    if g2.shape[0] <= _BLOCK_ROWS:  # one block (decode): the same ops, rounded by `to` instead of a copy
        g = g2.float()
        t = torch.neg(g).exp_().add_(1.0)
        torch.div(g, t, out=t)
        return t.mul_(u2.float()).to(gate.dtype).view(gate.shape)
    out = torch.empty(g2.shape, dtype=gate.dtype, device=gate.device)
    for a in range(0, g2.shape[0], _BLOCK_ROWS):
        g = g2[a : a + _BLOCK_ROWS].float()
        t = torch.neg(g).exp_().add_(1.0)
        torch.div(g, t, out=t)
        out[a : a + _BLOCK_ROWS] = t.mul_(u2[a : a + _BLOCK_ROWS].float())
    return out.view(gate.shape)


def _rope_chunk(head_dim: int, theta: float, chunk: int) -> tuple[torch.Tensor, torch.Tensor]:
    key = (head_dim, float(theta), chunk)
    hit = _rope_cache.get(key)
    if hit is None:
        inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
        pos = torch.arange(chunk * _ROPE_CHUNK, (chunk + 1) * _ROPE_CHUNK, dtype=torch.int64).float()
        freqs = pos[:, None] * inv_freq[None, :]
        emb = torch.cat([freqs, freqs], dim=-1)
        hit = (emb.cos(), emb.sin())
        _rope_cache[key] = hit
    return hit


def rope_cos_sin(positions: torch.Tensor, head_dim: int, theta: float) -> tuple[torch.Tensor, torch.Tensor]:
    positions = positions.reshape(-1).long()
    if positions.numel() == 0:
        empty = torch.empty(0, head_dim, device=positions.device)
        return empty, empty
    nchunks = int(positions.max()) // _ROPE_CHUNK + 1
    chunks = [_rope_chunk(head_dim, theta, c) for c in range(nchunks)]
    cos = torch.cat([c for c, _ in chunks])
    sin = torch.cat([s for _, s in chunks])
    # Tables are built on the CPU (same bits everywhere), then moved.
    cpu = positions.cpu()
    return cos.index_select(0, cpu).to(positions.device), sin.index_select(0, cpu).to(positions.device)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat([-x[..., half:], x[..., :half]], dim=-1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    xf = x.float()
    out = xf * cos.unsqueeze(-2) + rotate_half(xf) * sin.unsqueeze(-2)
    return out.to(x.dtype)


def logprobs(logits: torch.Tensor, tokens: torch.Tensor, vocab_size: int, temperature: float) -> torch.Tensor:
    # Truncate the (TP-padded) vocab first, then an fp32 last-dim log_softmax (row-local kernel).
    x = logits[..., :vocab_size].float()
    if temperature != 1.0:
        x = x / temperature
    lp = torch.log_softmax(x, dim=-1)
    return lp.gather(-1, tokens.long().unsqueeze(-1)).squeeze(-1)
