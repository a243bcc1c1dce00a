"""The ordered GEMM (contract v2, tonpolicy.kernels.invariant.ordered_gemm): every instruction-set path this CPU runs,
and the portable builds of the AVX-512 paths' 16-lane code, give the scalar reference's bits (int32 views,
NaNs made one pattern: a NaN's payload is not defined) on many shapes, dtypes and magnitudes (1e-30..1e30,
subnormals, zeros of both signs, inf, NaN, results at the edge of the normal range); a row's bits do not
depend on the batch, its position, the thread count or the columns computed; K-shards are their own
chains. Negative control: torch's own F.linear differs from the reference, so the equality can fail."""

from __future__ import annotations

import itertools

import pytest
import torch
import torch.nn.functional as F

from tonpolicy.kernels import weights_updated
from tonpolicy.kernels.invariant import exact_gemm, ordered_gemm

try:
    ordered_gemm.require()
except ordered_gemm.OrderedKernelsUnavailable as e:  # pragma: no cover - a host without g++ or AVX2
    pytest.skip(f"the ordered GEMM cannot run here: {e}", allow_module_level=True)

PATHS = [*ordered_gemm.isa_paths(), ordered_gemm.PORTABLE, ordered_gemm.PORTABLE_DP]
ordered_gemm.build_paths(PATHS)  # at once: two compilers on two cores
FNS = {p: ordered_gemm.functions(p) for p in PATHS}
REF = ordered_gemm.functions()
BF16, FP32 = torch.bfloat16, torch.float32
DTYPE_PAIRS = list(itertools.product((FP32, BF16), (FP32, BF16)))
FLT_MIN = 2.0**-126


def bits(t: torch.Tensor) -> torch.Tensor:
    t = t.detach().clone()
    t[t.isnan()] = float("nan")  # one NaN pattern
    return t.view(torch.int32)


def same(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape == b.shape and torch.equal(bits(a), bits(b))


def _wide(shape: tuple[int, ...], g: torch.Generator, lo: float, hi: float) -> torch.Tensor:
    """randn times 10^U(lo, hi) per element: products over ~1e-30..1e30, no overflow."""
    return torch.randn(shape, generator=g) * torch.pow(10.0, torch.empty(shape).uniform_(lo, hi, generator=g))


def operands(m: int, k: int, n: int, xd: torch.dtype, wd: torch.dtype, seed: int) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(seed)
    x, w = _wide((m, k), g, -15, 15), _wide((n, k), g, -15, 15)
    special = {
        1: lambda r: r.copy_(torch.randn(k, generator=g) * 1e-30),  # products below 2^-126: flushed results
        3: lambda r: r.copy_(torch.where(torch.rand(k, generator=g) < 0.5, 3e-39, -1e-40)),  # subnormal inputs
        5: lambda r: r.copy_(torch.where(torch.rand(k, generator=g) < 0.5, 0.0, -0.0)),  # zeros of both signs
        7: lambda r: r.mul_(1e-19).clamp_(-2e-19, 2e-19),  # sums crossing the normal range's edge
        9: lambda r: r.__setitem__(k // 2, float("inf")),
        11: lambda r: r.__setitem__(k - 1, float("nan")),
        13: lambda r: r.copy_(torch.randn(k, generator=g) * 1e-30),
    }
    for i, f in special.items():
        if i < m:
            f(x[i])
    for j in (1, 3):  # with rows 1 and 13 every product is tiny: +-0 results, -0 accumulators
        if j < n:
            w[j] = torch.randn(k, generator=g) * 1e-12
            w[j, -1] = 1e-12
    if m > 1:
        x[1, -1] = -1e-30  # the last product negative: a -0 result
    if n > 5:
        w[n - 2, k // 3] = float("-inf")
        w[n - 3].mul_(1e-20)
    return x.to(xd), w.to(wd)


def _one_thread(fn):  # noqa: ANN001, ANN202
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return fn()
    finally:
        torch.set_num_threads(before)


def _check_all_paths(x: torch.Tensor, w: torch.Tensor, shards: int, what: object) -> None:
    want = REF.reference_linear_partials(x, w, shards)
    for p, fn in FNS.items():
        got = fn.linear_partials(x, w, shards)
        assert same(got, want), (p, what, int((bits(got) != bits(want)).sum()))
        if shards == 1:
            assert same(fn.linear(x, w), want[0]), (p, what)


@pytest.mark.parametrize("xd,wd", DTYPE_PAIRS)
def test_every_path_gives_the_reference_bits(xd: torch.dtype, wd: torch.dtype) -> None:
    for m, k, n in itertools.product((1, 3, 5, 17, 64), (1, 7, 64, 130, 1024), (1, 15, 16, 17, 200)):
        x, w = operands(m, k, n, xd, wd, seed=m * 1000 + k * 7 + n)
        _check_all_paths(x, w, 1, (m, k, n))


def test_the_output_is_not_all_specials() -> None:
    """The operands above give mostly finite, non-zero results (the comparison means something)."""
    x, w = operands(64, 1024, 200, FP32, FP32, seed=1)
    out = REF.reference_linear_partials(x, w, 1)[0]
    finite = out.isfinite() & (out != 0)
    assert finite.float().mean() > 0.8
    assert (out == 0).any() and out.isnan().any()  # flushed rows and the NaN row are there too
    assert (bits(out) == bits(torch.tensor(-0.0))).any()  # a -0 result (tiny negative products, flushed)


@pytest.mark.parametrize("pair_chain", [False, True])
def test_ftz_flushes_a_result_tiny_after_rounding(pair_chain: bool) -> None:
    """FTZ as x86 decides: c + a*b = 2^-126 - 0.75 * 2^-150 rounds to 2^-126 under gradual underflow but is
    tiny at 24 bits with an unbounded exponent: zero. 2^-126 - 2^-151 (the midpoint) rounds to 2^-126."""
    dt = BF16 if pair_chain else FP32
    a = torch.tensor([-0.75 * 2.0**-100, -(2.0**-100), -0.5 * 2.0**-100, 0.0])
    x = torch.stack([torch.full((4,), FLT_MIN), a], 1)  # [4, 2]: (c, a) per row
    w = torch.tensor([[1.0, 2.0**-50]])
    if pair_chain:  # odd element first: c * 1 first, then a * b + c
        x, w = x.flip(1), w.flip(1)
    x, w = x.to(dt), w.to(dt)
    want = torch.tensor([[0.0], [0.0], [FLT_MIN], [FLT_MIN]])  # -0.75 ulp: 0; -1: 2^-126 - 2^-150 flushes
    assert same(REF.reference_linear_partials(x, w, 1)[0], want)
    for p, fn in FNS.items():
        assert same(fn.linear(x, w), want), p


@pytest.mark.parametrize("xd,wd", DTYPE_PAIRS)
def test_k_shards_are_their_own_chains(xd: torch.dtype, wd: torch.dtype) -> None:
    for (m, k, n), c in itertools.product(
        ((1, 64, 33), (5, 1024, 40), (17, 260, 17), (9, 264, 20), (64, 520, 16)), (1, 2, 4)
    ):
        if xd == wd == BF16 and (k // c) % 2:
            continue  # the pair chain takes even shards only (checked below)
        x, w = operands(m, k, n, xd, wd, seed=k + c)
        _check_all_paths(x, w, c, (m, k, n, c))
        got = FNS[PATHS[0]].linear_partials(x, w, c)
        ks = k // c
        for s in range(c):  # shard s is the whole chain of its K range
            assert same(
                got[s], REF.reference_linear_partials(x[:, s * ks : (s + 1) * ks], w[:, s * ks : (s + 1) * ks], 1)[0]
            )
    x, w = operands(3, 30, 8, FP32, BF16, seed=5)  # odd shards (15): the fp32 chain takes them
    _check_all_paths(x, w, 2, "odd shards")
    with pytest.raises(ValueError, match="even shard length"):
        ordered_gemm.linear_partials(x.to(BF16), w, 2)  # the pair chain does not
    x, w = operands(3, 7, 8, BF16, BF16, seed=6)  # one shard: odd K is padded
    _check_all_paths(x, w, 1, "odd K")


@pytest.mark.parametrize("xd,wd", [(FP32, FP32), (BF16, BF16)])
def test_a_rows_bits_do_not_depend_on_batch_position_threads_or_columns(xd: torch.dtype, wd: torch.dtype) -> None:
    x, w = operands(64, 1024, 200, xd, wd, seed=7)
    before = torch.get_num_threads()
    try:
        for p, fn in FNS.items():
            torch.set_num_threads(2)
            full = fn.linear(x, w)
            torch.set_num_threads(1)
            assert same(fn.linear(x, w), full), p
            torch.set_num_threads(2)
            for i in (0, 5, 17, 63):
                assert same(fn.linear(x[i : i + 1], w), full[i : i + 1]), (p, i)
                other = torch.cat([x[40:47], x[i : i + 1], x[:3]])  # the row at another position
                assert same(fn.linear(other, w)[7], full[i]), (p, i)
            assert same(fn.linear(x[3:20], w), full[3:20]), p
            for a, b in ((0, 1), (15, 17), (16, 200), (33, 100)):  # column shards: W's rows
                assert same(fn.linear(x, w[a:b]), full[:, a:b]), (p, a, b)
            x3 = x.view(4, 16, -1)
            assert same(fn.linear(x3, w), full.view(4, 16, -1)), p  # leading dims
            assert same(fn.linear(x.t().contiguous().t(), w), full), p  # a strided x
            wide = torch.cat([x[:, :3], x, x[:, :2]], 1)
            assert same(fn.linear(wide[:, 3:-2], w), full), p  # rows read in place, lda > K
            assert same(fn.linear_partials(wide[:, 3:-2], w, 4), REF.reference_linear_partials(x, w, 4)), p
    finally:
        torch.set_num_threads(before)


@pytest.mark.parametrize("ad,bd", DTYPE_PAIRS)
def test_bmm_gives_the_reference_bits(ad: torch.dtype, bd: torch.dtype) -> None:
    shapes = [(64, 1, 128, 32), (8, 16, 32, 128), (3, 64, 128, 32), (2, 5, 7, 13), (4, 3, 1, 9), (2, 17, 64, 200)]
    shapes += [(5, 1, 64, 40), (9, 1, 16, 8), (3, 1, 32, 128), (7, 1, 5, 200)]  # one row: items grouped
    for batch, m, k, n in shapes:
        g = torch.Generator().manual_seed(batch * m + k + n)
        a = _wide((batch, m, k), g, -10, 10)
        b = _wide((batch, k, n), g, -10, 10)
        a[0, 0, 0] = 1e-39
        b[-1, 0, -1] = float("inf")
        a, b = a.to(ad), b.to(bd)
        want = REF.reference_bmm(a, b)
        for p, fn in FNS.items():
            assert same(fn.bmm(a, b), want), (p, batch, m, k, n)
            assert same(_one_thread(lambda fn=fn, a=a, b=b: fn.bmm(a, b)), want), (p, batch, m, k, n)
            assert same(fn.bmm(a[1:2], b[1:2]), want[1:2]), p  # a batch alone
            if m > 2:
                assert same(fn.bmm(a[:, 1:3], b), want[:, 1:3]), p  # rows alone
    a, b = torch.randn(2, 3, 4, 8), torch.randn(2, 3, 8, 5)  # two leading dims; b transposed in memory
    assert same(ordered_gemm.bmm(a, b.transpose(-1, -2).contiguous().transpose(-1, -2)), REF.reference_bmm(a, b))
    assert same(ordered_gemm.bmm(a, b[:1]), REF.reference_bmm(a, b[:1].expand(2, 3, 8, 5)))  # broadcast


def test_negative_control_torch_linear_differs_from_the_reference() -> None:
    mismatched = 0
    for dt in (FP32, BF16):
        g = torch.Generator().manual_seed(8)
        x, w = torch.randn(4, 1024, generator=g).to(dt), torch.randn(96, 1024, generator=g).to(dt)
        want = REF.reference_linear_partials(x, w, 1)[0]
        mismatched += int((bits(F.linear(x.float(), w.float())) != bits(want)).sum())
    assert mismatched > 0


def test_the_packed_weight_cache_sees_in_place_writes_and_weights_updated() -> None:
    x, w = operands(3, 64, 20, BF16, BF16, seed=9)
    x, w = x.nan_to_num(0.0, 0.0, 0.0), w.nan_to_num(0.0, 0.0, 0.0)
    before = ordered_gemm.linear(x, w)
    assert ordered_gemm.packed_weight(w, 1) is ordered_gemm.packed_weight(w, 1)  # cached
    w.mul_(4.0)  # bumps the version: packed anew
    assert same(ordered_gemm.linear(x, w), before * 4.0)
    w.data.mul_(0.5)  # no version bump: stale until told
    assert same(ordered_gemm.linear(x, w), before * 4.0)
    weights_updated()  # the one call a weight writer makes
    assert same(ordered_gemm.linear(x, w), before * 2.0)


def test_one_weights_update_reaches_every_sets_weight_cache() -> None:
    """v1's quantized weights and v2's packed panels key on the same generation: one call refreshes both,
    and without it both stay stale (the control)."""
    x, w = operands(5, 64, 20, torch.float32, torch.float32, seed=10)  # 5 rows: v1 quantizes the weight
    x, w = x.nan_to_num(0.0, 0.0, 0.0), w.nan_to_num(0.0, 0.0, 0.0)
    v2, v1 = ordered_gemm.linear(x, w), exact_gemm.linear_partials(x, w, 1)
    w.data.mul_(2.0)
    assert same(ordered_gemm.linear(x, w), v2) and same(exact_gemm.linear_partials(x, w, 1), v1)  # stale
    assert not same(ordered_gemm.linear(x, w.clone()), v2)  # a fresh weight: other bits
    weights_updated()
    fresh = w.clone()  # never cached
    assert same(ordered_gemm.linear(x, w), ordered_gemm.linear(x, fresh))
    assert same(exact_gemm.linear_partials(x, w, 1), exact_gemm.linear_partials(x, fresh, 1))


def test_empty_zero_k_errors_and_autograd() -> None:
    w = torch.randn(8, 16)
    assert ordered_gemm.linear(torch.randn(0, 16), w).shape == (0, 8)
    assert ordered_gemm.linear(torch.randn(2, 3, 16), w[:0]).shape == (2, 3, 0)
    assert ordered_gemm.linear_partials(torch.randn(0, 16), w, 2).shape == (2, 0, 8)
    assert ordered_gemm.bmm(torch.randn(2, 0, 4), torch.randn(2, 4, 3)).shape == (2, 0, 3)
    zero_k = ordered_gemm.linear(torch.randn(3, 0), torch.randn(5, 0))
    assert same(zero_k, torch.zeros(3, 5))  # the empty chain: +0
    with pytest.raises(ValueError, match="CPU"):
        ordered_gemm.linear(torch.randn(2, 16, device="meta"), w)
    with pytest.raises(ValueError, match="bf16 or fp32"):
        ordered_gemm.linear(torch.randn(2, 16, dtype=torch.float64), w)
    with pytest.raises(ValueError):
        ordered_gemm.linear(torch.randn(2, 15), w)
    with pytest.raises(ValueError, match="divide"):
        ordered_gemm.linear_partials(torch.randn(2, 16), w, 3)

    x = torch.randn(2, 3, 16, requires_grad=True)
    wp = torch.randn(8, 16, requires_grad=True)
    out = ordered_gemm.linear(x, wp)
    assert same(out, ordered_gemm.linear(x.detach(), wp.detach()))
    g = torch.randn(2, 3, 8)
    out.backward(g)
    # The gradient is the plain product's (not under the contract): einsum sums in another order.
    assert torch.allclose(x.grad, g @ wp.detach()) and torch.allclose(
        wp.grad, torch.einsum("btn,btk->nk", g, x.detach()), atol=1e-5
    )
    x.grad = wp.grad = None
    parts = ordered_gemm.linear_partials(x, wp, 2)
    assert same(parts, ordered_gemm.linear_partials(x.detach(), wp.detach(), 2))
    parts.sum(0).backward(g)
    assert torch.allclose(x.grad, g @ wp.detach(), atol=1e-5)
    a, b = torch.randn(2, 4, 8, requires_grad=True), torch.randn(2, 8, 3, requires_grad=True)
    ordered_gemm.bmm(a, b).sum().backward()
    assert torch.allclose(a.grad, torch.ones(2, 4, 3) @ b.detach().transpose(-1, -2))


def test_describe_states_the_definition_not_the_host() -> None:
    text = " ".join(ordered_gemm.describe().values()).lower()
    assert "fma(a[2i+1], w[2i+1], c)" in text and "ascending" in text and "daz" in text and "ftz" in text
    for word in (*ordered_gemm.PATHS, "avx", "vdpbf16ps", "amd", "intel", "epyc", "xeon"):
        assert word not in text


def test_isa_choice_and_missing_compiler_are_clear_errors(monkeypatch: pytest.MonkeyPatch, tmp_path) -> None:  # noqa: ANN001
    monkeypatch.setenv(ordered_gemm.ISA_ENV, "sse9")
    with pytest.raises(ordered_gemm.OrderedKernelsUnavailable, match=ordered_gemm.ISA_ENV):
        ordered_gemm.chosen_path()
    missing = [p for p in ordered_gemm.PATHS if p not in ordered_gemm.isa_paths()]
    if missing:  # a CPU without that path: named with the variable and the CPU's flags
        monkeypatch.setenv(ordered_gemm.ISA_ENV, missing[0])
        with pytest.raises(ordered_gemm.OrderedKernelsUnavailable, match="CPU's flags"):
            ordered_gemm.chosen_path()
    monkeypatch.setenv(ordered_gemm.ISA_ENV, ordered_gemm.isa_paths()[-1])
    assert ordered_gemm.chosen_path() == ordered_gemm.isa_paths()[-1]

    monkeypatch.delenv(ordered_gemm.ISA_ENV)
    monkeypatch.setattr(ordered_gemm, "_libs", {})
    monkeypatch.setenv("TONPOLICY_KERNEL_CACHE", str(tmp_path))
    monkeypatch.setenv("CXX", str(tmp_path / "no-such-g++"))
    with pytest.raises(ordered_gemm.OrderedKernelsUnavailable, match=r"CXX.*g\+\+.*qwen3_dense_v1"):
        ordered_gemm.require()
    monkeypatch.setenv("CXX", "false")  # a "compiler" that fails: its exit and stderr are reported
    monkeypatch.setattr(ordered_gemm, "_libs", {})
    with pytest.raises(ordered_gemm.OrderedKernelsUnavailable, match="build failed"):
        ordered_gemm.require()


def test_build_command_prints_the_paths(capsys: pytest.CaptureFixture) -> None:
    assert ordered_gemm.main(["--build"]) == 0
    out = capsys.readouterr().out
    assert all(f"ordered_gemm {p}:" in out for p in ordered_gemm.isa_paths())
