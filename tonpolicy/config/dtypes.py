"""The one map between dtype names (contract.dtype, config.json's torch_dtype, the server's --dtype)
and torch dtypes, for every room."""

from __future__ import annotations

import torch

DTYPES: dict[str, torch.dtype] = {"bfloat16": torch.bfloat16, "float32": torch.float32, "float16": torch.float16}
DTYPE_NAMES: dict[torch.dtype, str] = {dtype: name for name, dtype in DTYPES.items()}


def torch_dtype(name: str) -> torch.dtype:
    if name not in DTYPES:
        raise ValueError(f"unknown dtype {name!r}: one of {list(DTYPES)}")
    return DTYPES[name]


def dtype_name(dtype: torch.dtype) -> str:
    if dtype not in DTYPE_NAMES:
        raise ValueError(f"no name for dtype {dtype}: one of {list(DTYPES)}")
    return DTYPE_NAMES[dtype]
