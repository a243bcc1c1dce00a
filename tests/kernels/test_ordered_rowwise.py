"""The ordered row-wise ops (contract v2, tonpolicy.kernels.invariant.ordered_rowwise): every instruction-set path this
CPU runs, and the portable build, give the scalar reference's bits (int32/int16 views, NaN included: every
NaN returned is 0x7FC00000) on random bit patterns and edge inputs (zeros of both signs, subnormals, infs,
NaNs, huge and tiny values, the exp/log/sin range edges) at row lengths 1..300; the reference follows the
written definition (a Python model of the 16-lane sum). The invariances, accuracy and negative controls are
in test_ordered_rowwise_invariance.py."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
import torch
from support.ordered_rowwise_inputs import (
    BF16,
    EDGE,
    FP32,
    INF,
    LENGTHS,
    NAN_BITS,
    QNAN,
    bits,
    elementwise_inputs,
    rows_with_edges,
    same,
)

from tonpolicy.kernels.invariant import ordered_rowwise

try:
    ordered_rowwise.require()
except ordered_rowwise.OrderedKernelsUnavailable as e:  # pragma: no cover - a host without g++ or AVX2
    pytest.skip(f"the ordered row-wise ops cannot run here: {e}", allow_module_level=True)

PATHS = [*ordered_rowwise.isa_paths(), ordered_rowwise.PORTABLE]
ordered_rowwise.build_paths(PATHS)  # at once: two compilers on two cores
FNS = {p: ordered_rowwise.functions(p) for p in PATHS}
REF = ordered_rowwise.functions()


# ---------------------------------------------------------------------------------------------------
def test_every_path_is_its_own_build() -> None:
    for p, fns in FNS.items():
        assert fns.lib.isa == ordered_rowwise.ISA_IDS[p], p
    assert ordered_rowwise.chosen_path() in ordered_rowwise.isa_paths()


@pytest.mark.parametrize("path", PATHS)
def test_exp_log_sincos_equal_reference(path: str) -> None:
    fns = FNS[path]
    x = elementwise_inputs(1)
    assert same(fns.exp(x), REF.reference_exp(x))
    assert same(fns.log(x), REF.reference_log(x))
    s, c = fns.sincos(x)
    rs, rc = REF.reference_sincos(x)
    assert same(s, rs) and same(c, rc)
    y = x.clone()
    assert fns.exp_(y) is y and same(y, REF.reference_exp(x))
    for n in range(1, 40):  # every tail length, at every offset of a 16-lane block
        part = x[100 + n : 100 + 2 * n]
        assert same(fns.exp(part), REF.reference_exp(part)) and same(fns.log(part), REF.reference_log(part))
    strided = x[: 3000 * 2].view(3000, 2)[:, 1]  # exp_ of a non-contiguous view
    want = REF.reference_exp(strided)
    fns.exp_(strided)
    assert same(strided, want)


def test_special_values_by_definition() -> None:
    def f(vals: list[float]) -> torch.Tensor:
        return torch.tensor(vals, dtype=FP32)

    e = REF.reference_exp(f([-INF, INF, 0.0, -0.0, 100.0, -200.0, 89.0, math.nan]))
    assert bits(e).tolist()[:7] == bits(f([0.0, INF, 1.0, 1.0, INF, 0.0, INF])).tolist() and bits(e)[7] == QNAN
    sub = REF.reference_exp(f([-100.0, -103.0]))  # gradual underflow: a subnormal, rounded once
    assert ((sub > 0) & (sub < 2**-126)).all()
    assert ((sub.double() - torch.exp(f([-100.0, -103.0]).double())).abs() <= 2**-149).all()  # one final rounding
    lg = REF.reference_log(f([0.0, -0.0, INF, 1.0, -1.0, -INF, math.nan, 2**-149]))
    assert bits(lg).tolist()[:4] == bits(f([-INF, -INF, INF, 0.0])).tolist()
    assert (bits(lg)[4:7] == QNAN).all() and lg[7] == pytest.approx(-149 * math.log(2), rel=1e-6)
    for fns in FNS.values():  # every NaN is one pattern, whatever NaN came in
        assert (bits(fns.exp(NAN_BITS)) == QNAN).all() and (bits(fns.log(NAN_BITS)) == QNAN).all()
        assert (bits(fns.row_sum(NAN_BITS[None])) == QNAN).all() and (bits(fns.row_max(NAN_BITS[None])) == QNAN).all()
    s = REF.reference_row_sum(f([-0.0, -0.0])[None])
    assert bits(s).item() == bits(f([-0.0])).item()  # -0.0 is the lanes' start: a sum of -0s is -0
    assert bits(REF.reference_row_sum(torch.empty(3, 0))).tolist() == bits(f([-0.0] * 3)).tolist()
    m = REF.reference_row_max(torch.stack([f([-0.0, 0.0, -1.0]), f([0.0, -0.0, -1.0]), f([-INF, -INF, -INF])]))
    assert bits(m).tolist() == bits(f([0.0, 0.0, -INF])).tolist()  # +0 beats -0 in either order
    assert bits(REF.reference_row_max(torch.empty(2, 0))).tolist() == bits(f([-INF, -INF])).tolist()
    assert bits(REF.reference_row_max(f([1.0, math.nan, INF])[None])).item() == QNAN
    s, c = REF.reference_sincos(f([0.0, 2.0**24 + 2, INF, math.nan]))
    assert s[0].item() == 0.0 and c[0].item() == 1.0 and (bits(s)[1:] == QNAN).all() and (bits(c)[1:] == QNAN).all()


def _model_row_sum(row: np.ndarray) -> np.float32:
    """The definition's sum in numpy fp32 scalars: 16 lanes from -0.0, then the tree."""
    acc = [np.float32(-0.0)] * 16
    for i, v in enumerate(row):
        acc[i % 16] = np.float32(acc[i % 16] + v)
    w = 8
    while w:
        for j in range(w):
            acc[j] = np.float32(acc[j] + acc[j + w])
        w //= 2
    return acc[0]


def test_reference_sum_follows_the_written_definition() -> None:
    g = torch.Generator().manual_seed(2)
    for n in (1, 5, 16, 17, 31, 33, 100, 257):
        x = rows_with_edges(10, n, g)
        got = REF.reference_row_sum(x)
        with np.errstate(all="ignore"):
            want = torch.tensor([_model_row_sum(r) for r in x.numpy()], dtype=FP32)
        want[want.isnan()] = math.nan
        assert same(got, want), n
    # and a plain left-to-right sum is not it (so the model check can fail)
    x = torch.randn(64, 300, generator=g) * 1e3
    seq = torch.tensor([np.add.accumulate(r, dtype=np.float32)[-1] for r in x.numpy()], dtype=FP32)
    assert not same(REF.reference_row_sum(x), seq)


@pytest.mark.parametrize("path", PATHS)
def test_row_reductions_equal_reference(path: str) -> None:
    fns, g = FNS[path], torch.Generator().manual_seed(3)
    for n in LENGTHS:
        x = rows_with_edges(10, n, g)
        assert same(fns.row_sum(x), REF.reference_row_sum(x)), n
        assert same(fns.row_max(x), REF.reference_row_max(x)), n
    x = rows_with_edges(6, 70, g)[:, 3:60]  # rows with a stride: no copy
    assert same(fns.row_sum(x), REF.reference_row_sum(x.contiguous()))
    x3 = torch.randn(2, 3, 45, generator=g)
    assert same(fns.row_sum(x3), REF.reference_row_sum(x3.reshape(6, 45)).view(2, 3))


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("xd,wd", [(FP32, FP32), (BF16, BF16), (BF16, FP32), (FP32, BF16)])
def test_rms_norm_equals_reference(path: str, xd: torch.dtype, wd: torch.dtype) -> None:
    fns, g = FNS[path], torch.Generator().manual_seed(4)
    for h in (1, 7, 16, 33, 300, 1024):
        x = rows_with_edges(10, h, g).to(xd)
        w = (torch.randn(h, generator=g) * 2).to(wd)
        for eps in (1e-6, 1e-5):
            got = fns.rms_norm(x, w, eps)
            assert got.dtype == xd and same(got, REF.reference_rms_norm(x, w, eps)), (h, eps)
    x = torch.randn(2, 3, 64, generator=g).to(xd)
    w = torch.randn(64, generator=g).to(wd)
    assert same(fns.rms_norm(x, w, 1e-6), REF.reference_rms_norm(x.reshape(6, 64), w, 1e-6).view(2, 3, 64))
    xt = torch.randn(64, 6, generator=g).to(xd).t()  # a transposed (non-contiguous) input
    assert same(fns.rms_norm(xt, w, 1e-6), REF.reference_rms_norm(xt.contiguous(), w, 1e-6))


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("gd,ud", [(FP32, FP32), (BF16, BF16), (BF16, FP32), (FP32, BF16)])
def test_swiglu_equals_reference(path: str, gd: torch.dtype, ud: torch.dtype) -> None:
    fns, g = FNS[path], torch.Generator().manual_seed(5)
    gate = elementwise_inputs(6)[:30001]
    up = torch.randn(30001, generator=g) * 10.0 ** torch.empty(30001).uniform_(-3, 3, generator=g)
    up[:100] = EDGE[torch.randint(0, len(EDGE), (100,), generator=g)]
    gate, up = gate.to(gd), up.to(ud)
    got = fns.swiglu(gate, up)
    assert got.dtype == gd and same(got, REF.reference_swiglu(gate, up))
    for n in (1, 15, 17, 33):
        assert same(fns.swiglu(gate[:n], up[:n]), REF.reference_swiglu(gate[:n], up[:n]))
    g2, u2 = gate[:3000].view(3, 1000), up[:3000].view(3, 1000)
    assert same(fns.swiglu(g2[:, ::2], u2[:, ::2]), REF.reference_swiglu(g2[:, ::2].contiguous(), u2[:, ::2]))


def _logit_rows(rows: int, v: int, pad: int, dtype: torch.dtype, g: torch.Generator) -> torch.Tensor:
    x = torch.randn(rows, v + pad, generator=g) * 4
    x[:, v:] = math.nan  # the (TP) padding is not read
    if rows > 7:
        x[1, : v // 2] = -INF  # masked
        x[2, v // 3] = math.nan
        x[3, 0] = INF
        x[4, :v] = 3.0  # all equal
        x[5, :v] *= 1e30
        x[6, :v] = -INF  # every logit masked
        x[7, :v] = EDGE[torch.randint(0, len(EDGE) - 8, (v,), generator=g)]  # no NaN
    return x.to(dtype)


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("dtype", [FP32, BF16])
def test_logprobs_equal_reference(path: str, dtype: torch.dtype) -> None:
    fns, g = FNS[path], torch.Generator().manual_seed(7)
    for v in (1, 5, 16, 17, 300, 2003):
        x = _logit_rows(10, v, 13, dtype, g)
        tok = torch.randint(0, v, (10,), generator=g)
        for t in (1.0, 0.7, 1.3, 0.0):
            got = fns.logprobs(x, tok, v, t)
            assert got.dtype == FP32 and same(got, REF.reference_logprobs(x, tok, v, t)), (v, t)
    x = _logit_rows(6, 40, 0, dtype, g).view(2, 3, 40)
    tok = torch.randint(0, 40, (2, 3), generator=g)
    assert same(
        fns.logprobs(x, tok, 40, 0.7), REF.reference_logprobs(x.reshape(6, 40), tok.reshape(6), 40, 0.7).view(2, 3)
    )
    with pytest.raises(ValueError, match="token"):
        fns.logprobs(x, tok + 40, 40, 1.0)


@pytest.mark.parametrize("dtype", [FP32, BF16])
def test_log_softmax_rows_equal_logprobs_at_every_token(dtype: torch.dtype) -> None:
    """The full rows (prompt and top-k logprobs) are the sampled-token recipe at every column, edge rows
    included. Negative control: torch's log_softmax of the same rows differs in some bits."""
    g, control = torch.Generator().manual_seed(11), 0
    for v in (5, 17, 300, 2003):
        x = _logit_rows(10, v, 13, dtype, g)
        for t in (1.0, 0.7, 0.0):
            full = ordered_rowwise.log_softmax(x, v, t)
            every = torch.stack([ordered_rowwise.logprobs(x, torch.full((10,), j), v, t) for j in range(v)], -1)
            assert full.shape == (10, v) and same(full, every), (v, t)
            z = x[:, :v].float() / (t or 1.0)
            control += int((torch.log_softmax(z, -1)[:4].view(torch.int32) != every[:4].view(torch.int32)).sum())
    assert control > 0


def test_reference_logprobs_follow_the_written_definition() -> None:
    g = torch.Generator().manual_seed(8)
    for v, t in ((37, 1.0), (300, 0.7)):
        x = torch.randn(4, v, generator=g) * 5
        tok = torch.randint(0, v, (4,), generator=g)
        z = x / t if t != 1.0 else x
        m = z.max(-1, keepdim=True).values
        s = torch.tensor([_model_row_sum(r) for r in REF.reference_exp(z - m).numpy()], dtype=FP32)
        want = (z.gather(-1, tok[:, None])[:, 0] - m[:, 0]) - REF.reference_log(s)
        assert same(REF.reference_logprobs(x, tok, v, t), want)


@pytest.mark.parametrize("path", PATHS)
def test_rope_equals_reference(path: str) -> None:
    fns, g = FNS[path], torch.Generator().manual_seed(9)
    pos = torch.cat([torch.arange(70), torch.randint(0, 1_000_001, (200,), generator=g), torch.tensor([2**24 - 1])])
    for d in (2, 34, 64, 96, 128):
        for theta in (1e4, 1e6, 1e7):
            c, s = fns.rope_cos_sin(pos, d, theta)
            rc, rs = REF.reference_rope_cos_sin(pos, d, theta)
            assert c.shape == (len(pos), d) and same(c, rc) and same(s, rs), (d, theta)
            assert same(c[:, : d // 2], c[:, d // 2 :]) and same(s[:, : d // 2], s[:, d // 2 :])
    with pytest.raises(ValueError, match="position"):
        fns.rope_cos_sin(torch.tensor([2**24]), 64, 1e6)


def test_describe_names_every_op() -> None:
    d = ordered_rowwise.describe()
    assert set(d) >= {"exp", "log", "row_sum", "row_max", "rms_norm", "swiglu", "logprobs", "rope", "sincos"}
    assert all(isinstance(v, str) and v for v in d.values())
    json.dumps(d)  # fingerprintable
