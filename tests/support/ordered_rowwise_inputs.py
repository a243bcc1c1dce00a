"""Inputs and bit comparisons for the ordered row-wise ops' tests: edge values (zeros, subnormals, infs,
NaNs, huge and tiny, the exp/log/sin range edges), random bit patterns, rows mixing them."""

from __future__ import annotations

import math

import torch

FP32, BF16 = torch.float32, torch.bfloat16
QNAN = 0x7FC00000
INF = math.inf
LENGTHS = [*range(1, 41), 47, 63, 64, 65, 100, 127, 128, 129, 255, 256, 257, 300]


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.int32) if t.dtype == FP32 else t.view(torch.int16)


def same(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape == b.shape and a.dtype == b.dtype and torch.equal(bits(a), bits(b))


def from_bits(*us: int) -> torch.Tensor:
    return torch.tensor([u - (1 << 32) if u >= 1 << 31 else u for u in us], dtype=torch.int32).view(FP32)


# Edge inputs: zeros, subnormals, the normal range's edge, 1, infs, NaNs (quiet, signalling, negative, payload),
# huge/tiny, exp's overflow/underflow edges, log's sqrt(2) split, multiples of pi/2.
EDGE = torch.cat(
    [
        torch.tensor(
            [0.0, -0.0, 2**-149, -(2**-149), 2**-126 - 2**-149, 2**-126, -(2**-126), 1e-30, -1e-30, 1.0, -1.0, 0.5,
             2.0, INF, -INF, 3.4028234e38, -3.4028234e38, 1e30, -1e30, 88.72283, 88.7229, 88.73, 89.0, 89.5, 100.0,
             -87.33, -87.34, -100.0, -103.9, -103.97, -104.0, -112.0, -113.0, -150.0, 1.4142135, 0.70710677,
             1.5707964, 3.1415927, 4.712389, 1e5, 1e6, 2.0**24, 2.0**24 + 2, 1e10, -1e10, 20.0, -20.0],
            dtype=FP32,
        ),
        from_bits(0x7FC00000, 0xFFC00000, 0x7FC00001, 0x7F800001, 0xFFFFFFFF, 0x3F800001, 0x3F7FFFFF, 0x007FFFFF),
    ]
)  # fmt: skip
NAN_BITS = from_bits(0x7FC00001, 0xFF800001, 0xFFC00000)


def rand_bits(n: int, g: torch.Generator) -> torch.Tensor:
    return torch.randint(-(2**31), 2**31, (n,), generator=g, dtype=torch.int32).view(FP32)


def elementwise_inputs(seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.cat(
        [
            EDGE,
            rand_bits(20000, g),
            torch.randn(20000, generator=g) * 30,
            torch.empty(20000).uniform_(-120, 95, generator=g),
            torch.rand(5000, generator=g) * 2**-126,  # subnormals
        ]
    )


def rows_with_edges(rows: int, n: int, g: torch.Generator) -> torch.Tensor:
    """[rows, n]: randn at several scales, and rows of edge cases."""
    x = torch.randn(rows, n, generator=g) * 10.0 ** torch.empty(rows, 1).uniform_(-3, 3, generator=g)
    specials = [
        lambda r: r.mul_(1e30),  # sums overflow
        lambda r: r.mul_(1e-40),  # subnormal
        lambda r: r.copy_(torch.where(torch.rand(n, generator=g) < 0.5, 0.0, -0.0)),
        lambda r: r.fill_(-0.0),  # a sum of -0s is -0: a tail padded with +0 would say +0
        lambda r: r.__setitem__(n // 2, math.nan),
        lambda r: r.__setitem__(n - 1, INF),
        lambda r: r.__setitem__(0, -INF),
        lambda r: r.__setitem__(slice(None), EDGE[torch.randint(0, len(EDGE), (n,), generator=g)]),
        lambda r: r.__setitem__(slice(None), rand_bits(n, g)),
    ]
    for i, f in enumerate(specials):
        if i + 1 < rows:
            f(x[i + 1])
    return x
