"""Invariant GEMM of the `triton` kernel set: one fixed K chain per output element, a family of tilings.

The contract (docs/REDUCTION_RULES.md, "Triton GEMMs"): an output element y[m, n] over a K range is one
fp32 accumulator that walks K in BLOCK_K steps from its start, `acc = dot(x[m, k:k+BLOCK_K],
w[n, k:k+BLOCK_K], acc)` (bf16/fp16 operands on tensor cores, fp32 products and accumulation; fp32
operands as IEEE fp32, never tf32). Column-parallel linears (QKV, gate/up, LM head, router) run K whole in
one chain. Row-parallel linears (o_proj, down_proj) run one chain per canonical K-shard, and the shards'
fp32 partials are added left to right, ((p0 + p1) + p2) + p3; a TP rank computes its shards' partials, the
ranks' partials are gathered in rank order and folded the same way, so TP 1, 2 and 4 give the same bits.

Nothing else is part of the contract: BLOCK_M/BLOCK_N, warps, pipeline stages, grouped tile order,
persistence and TMA loads only decide which program computes which element and how operands reach it,
never the chain, so they are chosen per batch-size bucket (`tiles_for`). `check_family` runs every member
on a probe before the first GEMM on a device and refuses the device if any member's bits differ (the
GPU's compiler could pick another MMA instruction for some tile shape; the check is how that would show).
For few rows and several shards the shards run in programs of their own and the last program of a tile to
finish folds the partials in shard order (split-K, fold inside the kernel): same additions, more programs.
"""

from __future__ import annotations

import functools
import os
from dataclasses import dataclass, replace

import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

from tonpolicy.kernels.triton.interpreter import use_torch_dot

use_torch_dot()  # in Triton's interpreter (tests on a CPU): tl.dot as a fixed-order tile GEMM

# The contract's K step: every chain of every member adds BLOCK_K-wide dot products in K order.
BLOCK_K = 64
# Rows up to which a sharded GEMM splits its shards over programs (decode, short prefill chunks).
SPLIT_K_MAX_ROWS = 64


@dataclass(frozen=True)
class Tiles:
    """One member of the GEMM family: how programs cover the output, never how an element is summed.
    `block_k` exists for the family check's own negative control; every member of FAMILY keeps BLOCK_K."""

    block_m: int
    block_n: int
    num_warps: int
    num_stages: int
    group_m: int = 1  # tiles of GROUP_M row blocks walked column-major (L2 reuse of the weight)
    persistent: bool = False  # one program per SM looping over tiles
    tma: bool = False  # operands through TMA descriptors (Hopper and later)
    block_k: int = BLOCK_K


# Per batch-size bucket (rows up to the bound) and operand kind. BLOCK_M stays >= 64 with warps in
# groups of 4 so that Hopper keeps one MMA instruction family (warpgroup MMA) for every member.
_BF16_BUCKETS: tuple[tuple[int, Tiles], ...] = (
    (64, Tiles(64, 64, 4, 6)),
    (256, Tiles(64, 128, 4, 4, group_m=8)),
    (1024, Tiles(128, 128, 8, 4, group_m=8, persistent=True, tma=True)),
    (1 << 62, Tiles(128, 256, 8, 3, group_m=8, persistent=True, tma=True)),
)
_FP32_BUCKETS: tuple[tuple[int, Tiles], ...] = (
    (64, Tiles(64, 64, 4, 3)),
    (1 << 62, Tiles(128, 64, 8, 3, group_m=8, persistent=True)),
)
FAMILY: tuple[Tiles, ...] = tuple(dict.fromkeys(t for _, t in _BF16_BUCKETS + _FP32_BUCKETS))


class GemmFamilyMismatch(RuntimeError):
    """A member of the GEMM family gave other bits than the first member on this device."""


@dataclass(frozen=True)
class _Device:
    tma: bool
    num_sms: int


@functools.cache
def _device_features(device: torch.device) -> _Device:
    if device.type == "cuda":
        major, _ = torch.cuda.get_device_capability(device)
        return _Device(tma=major >= 9, num_sms=torch.cuda.get_device_properties(device).multi_processor_count)
    # A CPU runs the kernels only in Triton's interpreter (tests) or the sm_90 compile check: both take
    # the Hopper members, so that every member is exercised.
    return _Device(tma=True, num_sms=8)


def tiles_for(m: int, dtype: torch.dtype, device: torch.device) -> Tiles:
    """The member that computes an M-row GEMM in `dtype` on `device`."""
    buckets = _FP32_BUCKETS if dtype == torch.float32 else _BF16_BUCKETS
    tiles = next(t for bound, t in buckets if m <= bound)
    return tiles if _device_features(device).tma or not tiles.tma else replace(tiles, tma=False)


@triton.jit
def _tile_coords(tile, tiles_m, tiles_n, GROUP_M: tl.constexpr):
    """(row block, column block) of a linear tile index, GROUP_M row blocks per column sweep."""
    per_group = GROUP_M * tiles_n
    first_m = (tile // per_group) * GROUP_M
    size_m = tl.minimum(tiles_m - first_m, GROUP_M)
    return first_m + (tile % per_group) % size_m, (tile % per_group) // size_m


@triton.jit
def _chain(
    x_ptr,
    w_ptr,
    x_desc,
    w_desc,
    off_m,
    off_n,
    M,
    N,
    k_lo,
    k_len,
    stride_xm,
    stride_wn,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    EVEN_K: tl.constexpr,
    TMA: tl.constexpr,
    IEEE: tl.constexpr,
):
    """fp32 [BLOCK_M, BLOCK_N] = x[off_m:, k_lo:k_lo+k_len] @ w[off_n:, same].T, K walked in BLOCK_K steps
    from k_lo: the contract's chain. Out-of-range rows, columns and K read as zero (masks or TMA fill)."""
    rm = off_m + tl.arange(0, BLOCK_M)
    rn = off_n + tl.arange(0, BLOCK_N)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, k_len, BLOCK_K):
        if TMA:
            a = x_desc.load([off_m, k_lo + k0])
            b = tl.trans(w_desc.load([off_n, k_lo + k0]))
        else:
            rk = k0 + tl.arange(0, BLOCK_K)
            if EVEN_K:
                a = tl.load(x_ptr + rm[:, None] * stride_xm + (k_lo + rk)[None, :], mask=rm[:, None] < M, other=0.0)
                b = tl.load(w_ptr + rn[None, :] * stride_wn + (k_lo + rk)[:, None], mask=rn[None, :] < N, other=0.0)
            else:
                kmask = rk < k_len
                a = tl.load(
                    x_ptr + rm[:, None] * stride_xm + (k_lo + rk)[None, :],
                    mask=(rm[:, None] < M) & kmask[None, :],
                    other=0.0,
                )
                b = tl.load(
                    w_ptr + rn[None, :] * stride_wn + (k_lo + rk)[:, None],
                    mask=(rn[None, :] < N) & kmask[:, None],
                    other=0.0,
                )
        if IEEE:
            acc = tl.dot(a, b, acc, input_precision="ieee")
        else:
            acc = tl.dot(a, b, acc)
    return acc


@triton.jit(do_not_specialize=["M", "num_progs"])
def _gemm_kernel(
    x_ptr,
    w_ptr,
    x_desc,
    w_desc,
    out_ptr,
    M,
    N,
    k_shard,
    shards,
    stride_xm,
    stride_wn,
    stride_om,
    num_progs,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr,
    EVEN_K: tl.constexpr,
    TMA: tl.constexpr,
    IEEE: tl.constexpr,
):
    """Every shard chain of an output tile, folded left to right in registers; a persistent launch has
    fewer programs than tiles and each loops over tiles num_progs apart."""
    tiles_m, tiles_n = tl.cdiv(M, BLOCK_M), tl.cdiv(N, BLOCK_N)
    for tile in range(tl.program_id(0), tiles_m * tiles_n, num_progs):
        pm, pn = _tile_coords(tile, tiles_m, tiles_n, GROUP_M)
        off_m, off_n = pm * BLOCK_M, pn * BLOCK_N
        y = _chain(
            x_ptr, w_ptr, x_desc, w_desc, off_m, off_n, M, N, 0, k_shard, stride_xm, stride_wn,
            BLOCK_M, BLOCK_N, BLOCK_K, EVEN_K, TMA, IEEE,
        )  # fmt: skip
        for s in range(1, shards):
            y = y + _chain(
                x_ptr, w_ptr, x_desc, w_desc, off_m, off_n, M, N, s * k_shard, k_shard, stride_xm, stride_wn,
                BLOCK_M, BLOCK_N, BLOCK_K, EVEN_K, TMA, IEEE,
            )  # fmt: skip
        rm = off_m + tl.arange(0, BLOCK_M)
        rn = off_n + tl.arange(0, BLOCK_N)
        tl.store(
            out_ptr + rm[:, None] * stride_om + rn[None, :],
            y.to(out_ptr.dtype.element_ty),
            mask=(rm[:, None] < M) & (rn[None, :] < N),
        )


@triton.jit(do_not_specialize=["M"])
def _shard_kernel(
    x_ptr,
    w_ptr,
    x_desc,
    w_desc,
    part_ptr,
    out_ptr,
    lock_ptr,
    M,
    N,
    k_shard,
    shards,
    stride_xm,
    stride_wn,
    stride_ps,
    stride_pm,
    stride_om,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr,
    EVEN_K: tl.constexpr,
    TMA: tl.constexpr,
    IEEE: tl.constexpr,
    FOLD: tl.constexpr,
):
    """One program per (tile, shard) writes its shard's fp32 partial. With FOLD, the tile's last program
    to finish (a counter per tile) folds the partials in shard order, writes y and resets the counter."""
    tile, s = tl.program_id(0), tl.program_id(1)
    tiles_m, tiles_n = tl.cdiv(M, BLOCK_M), tl.cdiv(N, BLOCK_N)
    pm, pn = _tile_coords(tile, tiles_m, tiles_n, GROUP_M)
    off_m, off_n = pm * BLOCK_M, pn * BLOCK_N
    acc = _chain(
        x_ptr, w_ptr, x_desc, w_desc, off_m, off_n, M, N, s * k_shard, k_shard, stride_xm, stride_wn,
        BLOCK_M, BLOCK_N, BLOCK_K, EVEN_K, TMA, IEEE,
    )  # fmt: skip
    rm = off_m + tl.arange(0, BLOCK_M)
    rn = off_n + tl.arange(0, BLOCK_N)
    ok = (rm[:, None] < M) & (rn[None, :] < N)
    part = part_ptr + rm[:, None] * stride_pm + rn[None, :]
    tl.store(part + s * stride_ps, acc, mask=ok)
    if FOLD:
        tl.debug_barrier()  # every thread's partial is stored before the counter moves
        if tl.atomic_add(lock_ptr + tile, 1, sem="acq_rel") == shards - 1:
            y = tl.load(part, mask=ok, other=0.0, cache_modifier=".cg")
            for t in range(1, shards):
                y = y + tl.load(part + t * stride_ps, mask=ok, other=0.0, cache_modifier=".cg")
            tl.store(out_ptr + rm[:, None] * stride_om + rn[None, :], y.to(out_ptr.dtype.element_ty), mask=ok)
            tl.atomic_xchg(lock_ptr + tile, 0)


@triton.jit
def _fold_kernel(p_ptr, out_ptr, numel, stride_s, shards, BLOCK: tl.constexpr):
    """out = ((p[0] + p[1]) + p[2]) + ... elementwise, cast to out's dtype."""
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    ok = offs < numel
    y = tl.load(p_ptr + offs, mask=ok, other=0.0)
    for s in range(1, shards):
        y = y + tl.load(p_ptr + s * stride_s + offs, mask=ok, other=0.0)
    tl.store(out_ptr + offs, y.to(out_ptr.dtype.element_ty), mask=ok)


def _prepare(x: torch.Tensor, weight: torch.Tensor, num_shards: int) -> tuple[torch.Tensor, torch.Tensor, int]:
    k = x.shape[-1]
    if weight.shape[1] != k or k % num_shards:
        raise ValueError(f"K={k} must match weight {tuple(weight.shape)} and divide into {num_shards} shards")
    if x.dtype != weight.dtype:
        raise TypeError(f"activations ({x.dtype}) and weight ({weight.dtype}) must share a dtype")
    return x.reshape(-1, k).contiguous(), weight.contiguous(), k // num_shards


def _operands(x2: torch.Tensor, w: torch.Tensor, ks: int, t: Tiles) -> tuple[object, object, bool]:
    """(x_desc, w_desc, tma): TMA descriptors where the member and the operands allow (16-byte aligned
    rows; shards a whole number of K steps, as a TMA block is zero-filled only past the tensor's end, not
    past a shard's), else the pointers stand in for them (unused)."""
    ok = (
        t.tma
        and ks % t.block_k == 0
        and all(u.data_ptr() % 16 == 0 and (u.stride(0) * u.element_size()) % 16 == 0 for u in (x2, w))
    )
    if not ok:
        return x2, w, False
    return (
        TensorDescriptor.from_tensor(x2, [t.block_m, t.block_k]),
        TensorDescriptor.from_tensor(w, [t.block_n, t.block_k]),
        True,
    )


def _opts(t: Tiles) -> dict:
    # No mul+add contraction into FMA: the fold's additions round once each, as the definition's.
    return {"num_warps": t.num_warps, "num_stages": t.num_stages, "enable_fp_fusion": False}


def _launch_shards(
    x2: torch.Tensor, w: torch.Tensor, ks: int, shards: int, t: Tiles, part: torch.Tensor, out: torch.Tensor | None
) -> None:
    m, n = x2.shape[0], w.shape[0]
    tiles = triton.cdiv(m, t.block_m) * triton.cdiv(n, t.block_n)
    # A fresh counter per call (one small memset): no state shared between streams or CUDA graphs.
    lock = torch.zeros(tiles if out is not None else 1, dtype=torch.int32, device=x2.device)
    xd, wd, tma = _operands(x2, w, ks, t)
    _shard_kernel[(tiles, shards)](
        x2, w, xd, wd, part, part if out is None else out, lock, m, n, ks, shards,
        x2.stride(0), w.stride(0), part.stride(0), part.stride(1), n if out is None else out.stride(0),
        BLOCK_M=t.block_m, BLOCK_N=t.block_n, BLOCK_K=t.block_k, GROUP_M=t.group_m, EVEN_K=ks % t.block_k == 0,
        TMA=tma, IEEE=x2.dtype == torch.float32, FOLD=out is not None, **_opts(t),
    )  # fmt: skip


def partials(x: torch.Tensor, weight: torch.Tensor, num_shards: int, tiles: Tiles | None = None) -> torch.Tensor:
    """fp32 partials [num_shards, ..., N] of x [..., K] @ weight[N, K].T over equal K shards."""
    x2, w, ks = _prepare(x, weight, num_shards)
    m, n = x2.shape[0], w.shape[0]
    out = torch.empty(num_shards, m, n, dtype=torch.float32, device=x.device)
    if m:
        ensure_family(x2.device, x2.dtype)
        _launch_shards(x2, w, ks, num_shards, tiles or tiles_for(m, x2.dtype, x2.device), out, None)
    return out.view(num_shards, *x.shape[:-1], n)


def fold(stack: torch.Tensor, out_dtype: torch.dtype) -> torch.Tensor:
    """Left-to-right sum over dim 0 of an fp32 stack [C, ...], cast to out_dtype."""
    c = stack.shape[0]
    stack = stack.contiguous()
    out = torch.empty(stack.shape[1:], dtype=out_dtype, device=stack.device)
    numel = out.numel()
    if numel:
        block = 1024
        _fold_kernel[(triton.cdiv(numel, block),)](
            stack, out, numel, stack.stride(0), c, BLOCK=block, enable_fp_fusion=False
        )
    return out


def linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    num_shards: int,
    out_dtype: torch.dtype,
    tiles: Tiles | None = None,
    split_k: bool | None = None,
) -> torch.Tensor:
    """fold(partials(x, weight, num_shards)) in out_dtype; num_shards=1 is K whole in one chain. `tiles` and
    `split_k` pick the member and route (default: by the row count); no choice changes a bit."""
    x2, w, ks = _prepare(x, weight, num_shards)
    m, n = x2.shape[0], w.shape[0]
    out = torch.empty(m, n, dtype=out_dtype, device=x.device)
    if m == 0:
        return out.view(*x.shape[:-1], n)
    ensure_family(x2.device, x2.dtype)
    t = tiles or tiles_for(m, x2.dtype, x2.device)
    if split_k if split_k is not None else (num_shards > 1 and m <= SPLIT_K_MAX_ROWS):
        part = torch.empty(num_shards, m, n, dtype=torch.float32, device=x.device)
        _launch_shards(x2, w, ks, num_shards, t, part, out)
        return out.view(*x.shape[:-1], n)
    tiles_total = triton.cdiv(m, t.block_m) * triton.cdiv(n, t.block_n)
    progs = min(tiles_total, _device_features(x2.device).num_sms) if t.persistent else tiles_total
    xd, wd, tma = _operands(x2, w, ks, t)
    _gemm_kernel[(progs,)](
        x2, w, xd, wd, out, m, n, ks, num_shards, x2.stride(0), w.stride(0), out.stride(0), progs,
        BLOCK_M=t.block_m, BLOCK_N=t.block_n, BLOCK_K=t.block_k, GROUP_M=t.group_m, EVEN_K=ks % t.block_k == 0,
        TMA=tma, IEEE=x2.dtype == torch.float32, **_opts(t),
    )  # fmt: skip
    return out.view(*x.shape[:-1], n)


# --- the family check -------------------------------------------------------------------------------

# Probe (M, N, K): rows no multiple of any BLOCK_M, columns over several column tiles with a ragged end,
# K of several BLOCK_K steps per shard; on a GPU more tiles than SMs, so persistent programs loop. Triton's
# interpreter runs a program at a time on the CPU: there, the smallest probe that still has ragged tiles.
PROBE_GPU, PROBE_INTERPRETED, PROBE_SHARDS = (300, 4200, 1024), (5, 80, 256), 4
_verified: set[tuple[str, torch.dtype]] = set()


def _device_key(device: torch.device) -> str:
    if device.type == "cuda":
        index = device.index if device.index is not None else torch.cuda.current_device()
        return f"cuda:{index}"
    return device.type


def _describe(device: torch.device) -> str:
    if device.type == "cuda":
        return f"{torch.cuda.get_device_name(device)} (triton {triton.__version__})"
    interp = " under TRITON_INTERPRET=1" if os.environ.get("TRITON_INTERPRET") == "1" else ""
    return f"{device.type}{interp} (triton {triton.__version__})"


def check_family(device: torch.device, dtype: torch.dtype, members: tuple[Tiles, ...] = FAMILY) -> None:
    """Run every member (both routes, K whole and sharded) on the probe; raise GemmFamilyMismatch naming the
    member, the device and the rule if any bit differs from the first member's."""
    m, n, k = PROBE_GPU if device.type == "cuda" else PROBE_INTERPRETED
    g = torch.Generator().manual_seed(54)
    x = torch.randn(m, k, generator=g).to(dtype).to(device)
    w = (torch.randn(n, k, generator=g) * k**-0.5).to(dtype).to(device)
    feats = _device_features(device)
    if device.type != "cuda":  # the interpreter has no warps or pipeline stages: members equal but for them run once
        members = tuple({replace(t, num_warps=4, num_stages=1): t for t in members}.values())
    routes = ("K whole", f"{PROBE_SHARDS} shards folded in registers", f"{PROBE_SHARDS} shards split-K")
    first, want = None, None
    for t in members:
        t = t if feats.tma or not t.tma else replace(t, tma=False)
        got = [
            linear(x, w, 1, torch.float32, tiles=t, split_k=False),
            linear(x, w, PROBE_SHARDS, torch.float32, tiles=t, split_k=False),
            linear(x, w, PROBE_SHARDS, torch.float32, tiles=t, split_k=True),
        ]
        if first is None:
            first, want = t, got
        for route, a, b in zip(routes, got, want, strict=True):
            if not torch.equal(a.view(torch.int32), b.view(torch.int32)):
                raise GemmFamilyMismatch(
                    f"triton GEMM family: member {t} ({route}) gives other bits than {first} on "
                    f"{_describe(device)} for {dtype}; rule: every member must walk each output element's K in "
                    f"the same BLOCK_K={BLOCK_K} chain, so its tiling cannot change a bit. The contract's bits "
                    "cannot be promised on this device: refusing to run it"
                )


def ensure_family(device: torch.device, dtype: torch.dtype) -> None:
    """check_family once per GPU and operand dtype, before that GPU's first GEMM. Not in Triton's
    interpreter: its `tl.dot` is torch's GEMM (interpreter.py), not a GPU's instruction, and its tests call
    check_family themselves."""
    key = (_device_key(device), dtype)
    if device.type != "cuda" or key in _verified:
        return
    if torch.cuda.is_current_stream_capturing():
        raise RuntimeError(
            f"the triton GEMM family check for {dtype} on {_describe(device)} cannot run inside a CUDA graph "
            "capture: run one eager forward (a warm-up) before capturing"
        )
    _verified.add(key)  # the probe's own GEMMs pass through here
    try:
        check_family(device, dtype)
    except BaseException:
        _verified.discard(key)
        raise
