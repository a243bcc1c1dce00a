"""Attention partials, shared by the kernel sets: the positions that pad keys and queries, the one merge
formula of two partials (m, l, acc) and their finalisation. A set passes its own `exp` (its row-local
ops are part of its numerics); the plain set takes torch's."""

from __future__ import annotations

import math
from collections.abc import Callable

import torch

from tonpolicy.kernels.base import AttnPartial

# Position given to padded keys: larger than any query, so the causal mask removes them.
KEY_PAD_POS = 2**62
# Position given to padded queries: smaller than any key, so they see nothing (their rows are dropped).
QUERY_PAD_POS = -1


def safe_max(m: torch.Tensor) -> torch.Tensor:
    # A fully masked row has m = -inf; subtract 0 instead so exp(-inf - 0) = 0, never NaN. (One op: the
    # values of where(m == -inf, 0, m), NaN, +inf and -0.0 kept.)
    return torch.nan_to_num(m, nan=math.nan, posinf=math.inf, neginf=0.0)


def merge(a: AttnPartial, b: AttnPartial, exp: Callable[[torch.Tensor], torch.Tensor] = torch.exp) -> AttnPartial:
    """The one merge formula; `a` covers keys before `b`."""
    m = torch.maximum(a.m, b.m)
    ms = safe_max(m)
    ca = exp(a.m - ms)
    cb = exp(b.m - ms)
    l = a.l * ca + b.l * cb  # noqa: E741
    acc = a.acc * ca.unsqueeze(-1) + b.acc * cb.unsqueeze(-1)
    return AttnPartial(m, l, acc)


def finalize(p: AttnPartial, dtype: torch.dtype) -> torch.Tensor:
    # A query that sees no key (only padding rows) has l = 0, acc = 0: return 0, not 0/0 = NaN (which
    # would poison a backward pass). Real rows have l >= 1, so their bits are untouched.
    l = torch.where(p.l == 0, 1.0, p.l)  # noqa: E741
    return (p.acc / l.unsqueeze(-1)).to(dtype)
