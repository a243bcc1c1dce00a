"""The host check: before a job starts, probe on this host every invariance the contract kernels rely on,
at the job's shapes, in well under a second.

The GEMMs are exact by construction (tonpolicy.kernels.invariant.exact_gemm, v1) or own their order
(tonpolicy.kernels.invariant.ordered_gemm, v2); what the check proves for them is the one premise of that
construction (v1: the library's fp64 GEMM is IEEE, integers below 2^53 sum exactly; v2: the compiled
path, the pair instruction where the CPU has it, equals the chain's scalar definition), and it probes
the rest of the kernel set, whose elementwise and fixed-length row ops run
through torch's vectorised code: a row's bits must not depend on the row count, its position, the column
shard, the canonical K-shards or the thread count; attention's prefill must equal its decode.
`TONPOLICY_HOST_CHECK_FAIL=<property>` makes that property fail (for tests of the refusal path).
"""

from __future__ import annotations

import functools
import os
from dataclasses import dataclass

import torch

from tonpolicy.kernels.invariant import exact_gemm, float_mode

FORCE_FAIL_ENV = "TONPOLICY_HOST_CHECK_FAIL"
ROWS = 12  # rows of each probe batch; slices of 1, 3 and 5 rows at offsets 0, 4 and 7 are compared
COLS = 256  # columns of a probe weight at most (column count invariance is probed on its own)


@dataclass(frozen=True)
class Shapes:
    hidden: int
    intermediate: int
    heads: int
    kv_heads: int
    head_dim: int
    vocab: int
    dtype: str
    canonical_shards: int
    attention_tile: int


@dataclass(frozen=True)
class Failure:
    prop: str
    shape: str
    detail: str


def _randn(shape: tuple[int, ...], dtype: torch.dtype, seed: int, std: float = 1.0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(shape, generator=g) * std).to(dtype)


def _fp64_exact(k: int) -> bool:
    """The library's fp64 GEMM on integers at the contract's bound equals int64 arithmetic, for the
    worst case (every product at its maximum, one sign) and random integers."""
    g = torch.Generator().manual_seed(k)
    cases = []
    for dtype in (torch.bfloat16, torch.float32):
        bits_a, bits_b, _ = exact_gemm.contraction_bits(dtype, dtype, k)
        ta, tb = float(2**bits_a), float(2**bits_b)
        cases.append((torch.full((3, k), ta, dtype=torch.float64), torch.full((k, 5), tb, dtype=torch.float64)))
        cases.append(
            (
                torch.randint(-(2**bits_a), 2**bits_a + 1, (5, k), generator=g).double(),
                torch.randint(-(2**bits_b), 2**bits_b + 1, (k, 7), generator=g).double(),
            )
        )
    for a, b in cases:
        if not torch.equal(torch.matmul(a, b), (a.long() @ b.long()).double()):
            return False
    return True


def _ordered_definition(k: int, dtype: torch.dtype) -> bool:
    """The ordered GEMM's compiled path (the pair instruction, or its FMA emulation) equals the scalar
    definition, flushed subnormals and signed zeros included."""
    from tonpolicy.kernels.invariant import ordered_gemm

    x = _randn((5, k), dtype, k + 7)
    w = _randn((33, k), dtype, k + 8, k**-0.5)
    x[1, : min(k, 8)] = 1e-39  # subnormal operands read as zero
    x[2] = -0.0
    w[3, : min(k, 8)] = 3e-38  # products below the normal range flush
    fast = ordered_gemm.linear_partials(x, w, 1)
    ref = ordered_gemm.reference_linear_partials(x, w, 1)
    return torch.equal(fast.view(torch.int32), ref.view(torch.int32))


def _rows_invariant(fn, x: torch.Tensor) -> bool:  # noqa: ANN001
    """fn's row results of slices of x equal the same rows of fn(x)."""
    full = fn(x)
    return all(torch.equal(fn(x[a : a + m]), full[a : a + m]) for a, m in ((0, 1), (4, 3), (7, 5), (11, 1)))


def _with_threads(n: int, fn):  # noqa: ANN001, ANN202
    before = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        return fn()
    finally:
        torch.set_num_threads(before)


def probe(kernels, s: Shapes) -> list[Failure]:  # noqa: ANN001
    """Every failed invariance of `kernels` on this host at the shapes `s`."""
    dtype = getattr(torch, s.dtype)
    failures: list[Failure] = []
    forced = os.environ.get(FORCE_FAIL_ENV, "")

    def check(prop: str, shape: str, ok: bool, detail: str) -> None:
        if not ok or prop == forced:
            failures.append(Failure(prop, shape, detail + (f" (forced by {FORCE_FAIL_ENV})" if prop == forced else "")))

    if getattr(kernels, "fp8", False):  # its combine's torch ops assume IEEE gradual underflow
        flushes = float_mode.any_thread_flushes()
        check("fp32.gradual_underflow", "process", not flushes, f"subnormals are flushed ({float_mode.SETTING}?)")
        if flushes:
            return failures  # every fp8 linear below would refuse
    c = s.canonical_shards
    contractions = sorted({s.hidden, s.intermediate // c, s.hidden // c, s.head_dim, 2 * s.hidden, s.attention_tile})
    for k in contractions:
        if kernels.name == "ordered":
            ok = _ordered_definition(k, dtype)
            check("gemm.ordered_chain", f"K={k}", ok, "the compiled GEMM differs from the chain's scalar definition")
        else:
            check("gemm.fp64_exact", f"K={k}", _fp64_exact(k), "fp64 GEMM of integers below 2^53 is not exact")
    threads = torch.get_num_threads()
    for k, n, name in ((s.hidden, s.intermediate, "gate_up"), (s.intermediate, s.hidden, "down")):
        n = min(n, COLS)
        x = _randn((ROWS, k), dtype, k)
        w = _randn((n, k), dtype, n + 1, k**-0.5)
        shape = f"{name}: K={k} N={n} {s.dtype}"
        full = kernels.linear(x, w)
        check(
            "linear.row_count",
            shape,
            _rows_invariant(lambda t, w=w: kernels.linear(t, w), x),
            "a row's bits depend on the row count or its position",
        )
        # A set whose weights are quantized in row blocks keeps a column's bits only across whole blocks.
        block = getattr(kernels, "column_block", 1)
        cut = n // 2 // block * block
        check(
            "linear.column_shards",
            shape,
            cut == 0 or torch.equal(kernels.linear(x, w[:cut]), full[:, :cut]),
            "column halves differ from the full GEMM's columns",
        )
        one = _with_threads(1, lambda x=x, w=w: kernels.linear(x, w))
        check("linear.threads", shape, torch.equal(one, full), f"1 thread differs from {threads}")
        if k % c == 0:
            ref = kernels.linear_k_sharded(x, w)
            half = k // 2
            parts = (
                torch.cat(
                    [
                        kernels.linear_partials(
                            x[:, i * half : (i + 1) * half], w[:, i * half : (i + 1) * half], c // 2
                        )
                        for i in (0, 1)
                    ]
                )
                if c % 2 == 0
                else None
            )
            ok = parts is None or torch.equal(kernels.combine_partials(parts, x.dtype), ref)
            check("linear.canonical_shards", shape, ok, "TP=2 partials do not combine to the TP=1 bits")
    xh = _randn((ROWS, s.hidden), dtype, 3)
    wh = _randn((min(s.vocab, COLS), s.hidden), dtype, 4, s.hidden**-0.5)
    check(
        "lm_head.row_count",
        f"K={s.hidden} {s.dtype}",
        _rows_invariant(lambda t: kernels.lm_head(t, wh), xh),
        "a logit row depends on the row count",
    )
    norm_w = _randn((s.hidden,), dtype, 5)
    check(
        "rms_norm.row_count",
        f"D={s.hidden} {s.dtype}",
        _rows_invariant(lambda t: kernels.rms_norm(t, norm_w, 1e-6), xh),
        "a row's norm depends on the batch",
    )
    g, u = _randn((ROWS, s.intermediate), dtype, 6), _randn((ROWS, s.intermediate), dtype, 7)
    sw_full = kernels.swiglu(g, u)
    ok = all(torch.equal(kernels.swiglu(g[a : a + m], u[a : a + m]), sw_full[a : a + m]) for a, m in ((0, 1), (5, 3)))
    check("swiglu.row_count", f"D={s.intermediate} {s.dtype}", ok, "an element's bits depend on its position")
    logits = _randn((ROWS, s.vocab), torch.float32, 8, 3.0)
    tokens = torch.arange(ROWS) % s.vocab
    lp = kernels.logprobs(logits, tokens, s.vocab, 0.7)
    ok = all(
        torch.equal(kernels.logprobs(logits[a : a + m], tokens[a : a + m], s.vocab, 0.7), lp[a : a + m])
        for a, m in ((0, 1), (3, 4))
    )
    check("logprobs.row_count", f"vocab={s.vocab}", ok, "a token's logprob depends on the batch")
    check(
        "logprobs.threads",
        f"vocab={s.vocab}",
        torch.equal(_with_threads(1, lambda: kernels.logprobs(logits, tokens, s.vocab, 0.7)), lp),
        f"1 thread differs from {threads}",
    )
    kv = min(s.kv_heads, 4)  # up to 4 KV heads with the job's group size
    heads = kv * (s.heads // s.kv_heads)
    n = 2 * s.attention_tile + 3
    q, kk, v = (_randn((n, h, s.head_dim), dtype, 9 + i) for i, h in enumerate((heads, kv, kv)))
    pos = torch.arange(n)
    scale = s.head_dim**-0.5
    prefill = kernels.attention(q, kk, v, pos, pos, scale)
    ok = all(
        torch.equal(
            kernels.attention(q[i : i + 1], kk[: i + 1], v[: i + 1], pos[i : i + 1], pos[: i + 1], scale),
            prefill[i : i + 1],
        )
        for i in (0, s.attention_tile, n - 1)
    )
    check(
        "attention.prefill_vs_decode",
        f"heads={heads}/{kv} D={s.head_dim} {s.dtype}",
        ok,
        "a query's output differs between prefill and decode",
    )
    return failures


@functools.cache
def probe_cached(kernel_set: str, params: tuple, s: Shapes) -> tuple[Failure, ...]:
    from tonpolicy.kernels import get_kernels

    return tuple(probe(get_kernels(kernel_set, **dict(params)), s))
