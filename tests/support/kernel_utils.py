"""Helpers shared by the kernel/model/engine invariance tests."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch

DTYPES = (torch.float32, torch.bfloat16)
# The contract kernel sets the kernel invariance tests run on: `ordered` (contract v2) and `invariant` (v1,
# kept selectable for comparison).
CONTRACT_SETS = ("ordered", "invariant")


@contextmanager
def num_threads(n: int) -> Iterator[None]:
    old = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(old)


def gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def randn(*shape: int, dtype: torch.dtype = torch.float32, seed: int = 0, std: float = 1.0) -> torch.Tensor:
    return (std * torch.randn(*shape, generator=gen(seed))).to(dtype)
