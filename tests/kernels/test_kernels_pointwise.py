"""Row-local contract ops (RMSNorm, SwiGLU, RoPE, logprobs): a row's bits do not depend on the other
rows, its position in the batch, or the thread count; and they compute what they claim."""

from __future__ import annotations

import random

import pytest
import torch
import torch.nn.functional as F
from support.kernel_utils import DTYPES, num_threads, randn

from tonpolicy.kernels import get_kernels

K = get_kernels("invariant")


def _close(got: torch.Tensor, ref: torch.Tensor) -> bool:
    """fp32 math rounded once to the output dtype: within one output ulp (relative) of the exact value."""
    rel = 2**-7 if got.dtype == torch.bfloat16 else 2**-20
    return bool(((got.double() - ref).abs() <= ref.abs() * rel + 1e-6).all())


def _row_invariant(fn, x: torch.Tensor, rng: random.Random) -> None:
    full = fn(x)
    for _ in range(8):
        m = rng.choice([1, 3, rng.randrange(1, x.shape[0] + 1)])
        off = rng.randrange(0, x.shape[0] - m + 1)
        assert torch.equal(fn(x[off : off + m]), full[off : off + m]), (m, off)
    with num_threads(1):
        one = fn(x)
    with num_threads(2):
        two = fn(x)
    assert torch.equal(one, full) and torch.equal(two, full)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("width", [32, 128, 1024, 4096])
def test_rms_norm_rows(dtype, width):
    rng = random.Random(width)
    w = randn(width, dtype=dtype, seed=1)
    # many rows so the op crosses the parallel grain; odd row count so vector tails move around
    x = randn(1 + 70000 // width, width, dtype=dtype, seed=2)
    _row_invariant(lambda t: K.rms_norm(t, w, 1e-6), x, rng)
    ref = x.double() * torch.rsqrt(x.double().pow(2).mean(-1, keepdim=True) + 1e-6) * w.double()
    assert _close(K.rms_norm(x, w, 1e-6), ref)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("width", [96, 384, 3072])
def test_swiglu_rows(dtype, width):
    rng = random.Random(width)
    g = randn(1 + 90000 // width, width, dtype=dtype, seed=3, std=4.0)
    u = randn(g.shape[0], width, dtype=dtype, seed=4)
    full = K.swiglu(g, u)
    for _ in range(8):
        m = rng.randrange(1, g.shape[0] + 1)
        off = rng.randrange(0, g.shape[0] - m + 1)
        assert torch.equal(K.swiglu(g[off : off + m], u[off : off + m]), full[off : off + m])
    with num_threads(1):
        assert torch.equal(K.swiglu(g, u), full)
    ref = F.silu(g.double()) * u.double()
    assert _close(full, ref)
    # The trainer's autograd path (out of place) and the engine's (in place) give the same bits, and the
    # engine's leaves its fp32 inputs untouched.
    gg, uu = g.clone().requires_grad_(), u.clone().requires_grad_()
    assert torch.equal(K.swiglu(gg, uu).detach(), full)
    assert torch.equal(g, gg.detach()) and torch.equal(u, uu.detach())


def test_rope_positions_independent():
    """cos/sin of a position never depend on which other positions were requested."""
    rng = random.Random(0)
    for d in (32, 64, 128):
        allpos = torch.arange(0, 3000)
        cos, sin = K.rope_cos_sin(allpos, d, 1_000_000.0)
        for _ in range(5):
            sel = torch.tensor(sorted(rng.sample(range(3000), rng.randrange(1, 50))))
            c, s = K.rope_cos_sin(sel, d, 1_000_000.0)
            assert torch.equal(c, cos[sel]) and torch.equal(s, sin[sel])
        ref = get_kernels("plain").rope_cos_sin(allpos, d, 1_000_000.0)
        assert (cos - ref[0]).abs().max() < 1e-6


@pytest.mark.parametrize("dtype", DTYPES)
def test_apply_rope_rows(dtype):
    rng = random.Random(1)
    x = randn(300, 8, 64, dtype=dtype, seed=5)
    pos = torch.arange(300)
    cos, sin = K.rope_cos_sin(pos, 64, 10000.0)
    full = K.apply_rope(x, cos, sin)
    for _ in range(8):
        m = rng.randrange(1, 300)
        off = rng.randrange(0, 300 - m + 1)
        assert torch.equal(K.apply_rope(x[off : off + m], cos[off : off + m], sin[off : off + m]), full[off : off + m])
    ref = get_kernels("plain").apply_rope(x.double(), cos.double(), sin.double())
    assert (full.double() - ref).abs().max() <= (1e-5 if dtype == torch.float32 else 2**-7 * 8)


@pytest.mark.parametrize("vocab,padded", [(2003, 2048), (32000, 32256), (151936, 152064)])
def test_logprobs_rows_and_truncation(vocab, padded):
    rng = random.Random(vocab)
    logits = randn(9, padded, seed=6, std=3.0)
    logits[:, vocab:] = 50.0  # garbage in the padding must be ignored
    toks = torch.randint(0, vocab, (9,), generator=torch.Generator().manual_seed(0))
    for t in (1.0, 0.7):
        full = K.logprobs(logits, toks, vocab, t)
        assert full.dtype == torch.float32
        for _ in range(4):
            i = rng.randrange(9)
            assert torch.equal(K.logprobs(logits[i : i + 1], toks[i : i + 1], vocab, t), full[i : i + 1])
        with num_threads(1):
            assert torch.equal(K.logprobs(logits, toks, vocab, t), full)
        ref = torch.log_softmax(logits[:, :vocab].double() / t, -1).gather(-1, toks[:, None])[:, 0]
        assert (full.double() - ref).abs().max() < 1e-4
