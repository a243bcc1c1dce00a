"""A pure-torch stand-in for the three `sgl_kernel` CPU ops that released SGLang calls on a CPU
without AMX.

Why: PyPI's sglang-kernel wheel is CUDA-only (`import sgl_kernel` fails without libcuda) and SGLang's
CPU kernels are built from source. With `SGLANG_USE_CPU_ENGINE=1` SGLang's compute ops fall back to
`forward_native`; only these bookkeeping ops are called at run time:
- `assign_req_to_token_pool_cpu` (writes new KV slots into a request's row of `req_to_token`);
- `copy_all_layer_kv_cache_cpu` (moves KV rows between slots, every layer);
- `torch.ops.sgl_kernel.murmur_hash32_cpu` (the hash behind seeded sampling).
This directory goes first on PYTHONPATH for the SGLang server on CPU only (the launch plan does it),
so it shadows the CUDA wheel. Any other name raises when called, so a new dependency shows up as a
clear error. `convert_weight_packed` is deliberately absent: its presence switches SGLang to AMX paths.
"""

from __future__ import annotations

import ctypes
from typing import Any

import torch

__version__ = "0.0.0+tonpolicy-cpu-stand-in"
_MISSING = ("convert_weight_packed",)


def assign_req_to_token_pool_cpu(
    req_pool_indices: torch.Tensor,
    req_to_token: torch.Tensor,
    start_offset: torch.Tensor,
    end_offset: torch.Tensor,
    out_cache_loc: torch.Tensor,
    pool_len: int,
) -> None:
    """req_to_token[req_pool_indices[i], start[i]:end[i]] = the next end[i]-start[i] entries of
    out_cache_loc (requests in batch order, like SGLang's Triton kernel)."""
    offset = 0
    for row, start, end in zip(req_pool_indices.tolist(), start_offset.tolist(), end_offset.tolist(), strict=True):
        n = end - start
        if n > 0:
            req_to_token[row, start:end] = out_cache_loc[offset : offset + n].to(req_to_token.dtype)
        offset += n


def copy_all_layer_kv_cache_cpu(
    data_ptrs: torch.Tensor, strides: torch.Tensor, tgt_loc: torch.Tensor, src_loc: torch.Tensor
) -> None:
    """For every buffer (base address data_ptrs[b], row size strides[b] bytes): row src -> row tgt."""
    for base, stride in zip(data_ptrs.tolist(), strides.tolist(), strict=True):
        for tgt, src in zip(tgt_loc.tolist(), src_loc.tolist(), strict=True):
            if tgt != src:
                ctypes.memmove(base + tgt * stride, base + src * stride, stride)


_M32 = 0xFFFFFFFF


def _rotl32(x: torch.Tensor, r: int) -> torch.Tensor:
    return ((x << r) | (x >> (32 - r))) & _M32


def _mix(h: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
    k = (k * 0xCC9E2D51) & _M32
    k = _rotl32(k, 15)
    k = (k * 0x1B873593) & _M32
    h = h ^ k
    h = _rotl32(h, 13)
    return (h * 5 + 0xE6546B64) & _M32


def murmur_hash32(seed: torch.Tensor, positions: torch.Tensor, col_indices: torch.Tensor) -> torch.Tensor:
    """SGLang's murmur_hash32 (kernels/ops/sampling/murmur_hash.py): uint32 [n, m] from a 64-bit seed
    and a 32-bit position per row and a 32-bit column index, as four 4-byte blocks. int64 arithmetic:
    a product of two 32-bit values may wrap past 2**63, which leaves its low 32 bits (all we keep) exact."""
    s = seed.to(torch.int64)
    lo, hi = s & _M32, (s >> 32) & _M32
    pos = positions.to(torch.int64) & _M32
    col = col_indices.to(torch.int64) & _M32
    h = torch.zeros_like(lo)
    h = _mix(h, lo)
    h = _mix(h, hi)
    h = _mix(h, pos)
    h = _mix(h[:, None], col[None, :])
    h = h ^ 16
    h = h ^ (h >> 16)
    h = (h * 0x85EBCA6B) & _M32
    h = h ^ (h >> 13)
    h = (h * 0xC2B2AE35) & _M32
    h = h ^ (h >> 16)
    return h.to(torch.uint32)


_lib = torch.library.Library("sgl_kernel", "DEF")  # noqa: TID251 - SGLang looks the op up under this name
_lib.define("murmur_hash32_cpu(Tensor seed, Tensor positions, Tensor col_indices) -> Tensor")
_lib.impl("murmur_hash32_cpu", murmur_hash32, "CPU")


def _unavailable(name: str) -> Any:
    def op(*args: Any, **kwargs: Any) -> Any:
        raise NotImplementedError(
            f"sgl_kernel.{name}: not in tonpolicy's CPU stand-in (tonpolicy/inside_sglang/cpu_standin/sgl_kernel); "
            "only the bookkeeping ops SGLang's CPU engine calls without AMX are provided"
        )

    op.__name__ = name
    return op


def __getattr__(name: str) -> Any:
    if name.startswith("_") or name in _MISSING:
        raise AttributeError(name)
    return _unavailable(name)
