"""The block-scaled FP8 GEMM of the `triton` set under contract.quant=fp8_block (docs/REDUCTION_RULES.md,
"Triton fp8_block"): e4m3 operands on Hopper's FP8 tensor cores, fp32 accumulation.

The operands are quantized by fp8_block's one rule (tonpolicy.kernels.fp8_block, through ordered_fp8's
`cached_weight` and `RowParts`: a fused weight per HF weight, a block cut by TP scaled by the reduced amax).
y[m, n] for x [M, K] against W [N, K], per canonical K-shard c (shard-local groups b of 128, the last may be
partial):
- S_b[m, n] = one `tl.dot` of the group's e4m3 values from +0 (K = 128, masked zeros past the group's end;
  on sm_90 the MMA's own accumulator over the whole group, `max_num_imprecise_acc` = 128);
- t_b = sa[m, b] * sw[n, b], y_c = +0, then y_c = y_c + S_b * t_b over b ascending: each one fp32 rounding
  (compiled without FMA contraction);
- y = ((y_0 + y_1) + y_2) + ..., the set's fold (`linear.fold`) of the partials.
Nothing depends on M, the tile or the program: a row's bits are that row's and the weight's. The tile per
batch bucket (`FP8_BUCKETS`) only decides which program computes an element; that the compiler gives every
member the same MMA chain for a group is probed before a GPU's first fp8 GEMM (`check_fp8_family`).
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from tonpolicy.kernels.fp8_block import BLOCK, quantize_activation_groups
from tonpolicy.kernels.invariant import ordered_fp8
from tonpolicy.kernels.invariant.ordered_fp8 import AmaxReduce, QuantizedWeight, RowParts
from tonpolicy.kernels.triton import linear as tlin


@dataclass(frozen=True)
class Fp8Tiles:
    """A member of the fp8 GEMM family: which program computes which element. `dot_k` exists for the family
    check's negative control (a group as several dots: another chain); every member of FP8_FAMILY keeps
    the whole group in one dot."""

    block_m: int
    block_n: int
    num_warps: int
    dot_k: int = BLOCK


# Per batch-size bucket: BLOCK_M >= 64 and warps in fours, so Hopper keeps warpgroup MMAs throughout.
FP8_BUCKETS: tuple[tuple[int, Fp8Tiles], ...] = ((64, Fp8Tiles(64, 64, 4)), (1 << 62, Fp8Tiles(128, 128, 8)))
FP8_FAMILY: tuple[Fp8Tiles, ...] = tuple(t for _, t in FP8_BUCKETS)


@triton.jit(do_not_specialize=["M"])
def _fp8_kernel(
    xq_ptr,
    sa_ptr,
    wq_ptr,
    sw_ptr,
    out_ptr,
    M,
    N,
    k_shard,
    groups,
    stride_xm,
    stride_sam,
    stride_wn,
    stride_swn,
    stride_os,
    stride_om,
    SHARDS: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    GROUP: tl.constexpr,
    DOT_K: tl.constexpr,
):
    """One output tile, every shard's partial y_c stored at out[c]: per shard the scaled group chain."""
    pid = tl.program_id(0)
    tiles_n = tl.cdiv(N, BLOCK_N)
    off_m, off_n = (pid // tiles_n) * BLOCK_M, (pid % tiles_n) * BLOCK_N
    rm = off_m + tl.arange(0, BLOCK_M)
    rn = off_n + tl.arange(0, BLOCK_N)
    rk = tl.arange(0, DOT_K)
    mm, nn = rm < M, rn < N
    for s in range(SHARDS):
        y = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for b in range(groups):
            acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
            for kk in tl.static_range(0, GROUP, DOT_K):  # one dot per group (DOT_K = GROUP) in every member
                k_in = b * GROUP + kk + rk  # shard-local columns
                kmask = k_in < k_shard
                col = s * k_shard + k_in
                am, wm = mm[:, None] & kmask[None, :], nn[None, :] & kmask[:, None]
                a = tl.load(xq_ptr + rm[:, None] * stride_xm + col[None, :], mask=am, other=0.0)
                w = tl.load(wq_ptr + rn[None, :] * stride_wn + col[:, None], mask=wm, other=0.0)
                acc = tl.dot(a, w, acc, max_num_imprecise_acc=DOT_K)
            g = s * groups + b
            sa = tl.load(sa_ptr + rm * stride_sam + g, mask=mm, other=1.0)
            sw = tl.load(sw_ptr + rn * stride_swn + g, mask=nn, other=1.0)
            y = y + acc * (sa[:, None] * sw[None, :])
        tl.store(out_ptr + s * stride_os + rm[:, None] * stride_om + rn[None, :], y, mask=mm[:, None] & nn[None, :])


def fp8_tiles_for(m: int) -> Fp8Tiles:
    return next(t for bound, t in FP8_BUCKETS if m <= bound)


def gemm_partials(
    qa: torch.Tensor,
    sa: torch.Tensor,
    qw: torch.Tensor,
    sw: torch.Tensor,
    num_shards: int,
    tiles: Fp8Tiles | None = None,
) -> torch.Tensor:
    """fp32 [C, M, N] from quantized operands: qa [M, K] / qw [N, K] e4m3, sa [M, C*G] / sw [N, C*G] fp32 scales
    (G = ceil((K/C)/128) groups per shard). `tiles`: the member (default by M); no member moves a bit."""
    m, k = qa.shape
    n = qw.shape[0]
    ks = k // num_shards
    out = torch.empty(num_shards, m, n, dtype=torch.float32, device=qa.device)
    if m and n:
        ensure_fp8_family(qa.device)
        t = tiles or fp8_tiles_for(m)
        grid = (triton.cdiv(m, t.block_m) * triton.cdiv(n, t.block_n),)
        _fp8_kernel[grid](
            qa, sa, qw, sw, out, m, n, ks, -(-ks // BLOCK),
            qa.stride(0), sa.stride(0), qw.stride(0), sw.stride(0), out.stride(0), out.stride(1),
            SHARDS=num_shards, BLOCK_M=t.block_m, BLOCK_N=t.block_n, GROUP=BLOCK, DOT_K=t.dot_k,
            num_warps=t.num_warps, num_stages=3, enable_fp_fusion=False,
        )  # fmt: skip
    return out


def quantize_activations(x2: torch.Tensor, num_shards: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(qa [M, K] e4m3, sa [M, C*G] fp32): each canonical K-shard's groups of 128 from its first column."""
    width = x2.shape[1] // num_shards
    parts = [quantize_activation_groups(x2[:, c * width : (c + 1) * width], BLOCK) for c in range(num_shards)]
    return torch.cat([q for q, _ in parts], 1).contiguous(), torch.cat([s for _, s in parts], 1).contiguous()


def _pack(shards: list[QuantizedWeight]) -> tuple[torch.Tensor, torch.Tensor]:
    """ordered_fp8's per-shard quantized weight (e4m3 values held as bf16, exactly) as e4m3 [N, K] and
    row scales [N, C*G]."""
    values = [v for qw in shards for v in (qw.full, qw.tail) if v is not None]
    q = torch.cat(values, 1).to(torch.float8_e4m3fn).contiguous()
    return q, torch.cat([qw.row_scales for qw in shards], 1).contiguous()


# The e4m3 packing of ordered_fp8's cached quantization, kept while that entry lives (keyed by its scales).
_packed: dict[int, tuple[weakref.ref, tuple[torch.Tensor, torch.Tensor]]] = {}


def packed_weight(
    w: torch.Tensor, num_shards: int, rows: RowParts | None, reduce_amax: AmaxReduce | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """w quantized per canonical K-shard (ordered_fp8.cached_weight: the one rule, cached per weights
    version) as the kernel's operands."""
    shards = ordered_fp8.cached_weight(w, num_shards, rows, reduce_amax)
    key = shards[0].row_scales
    hit = _packed.get(id(key))
    if hit is None or hit[0]() is not key:
        for k in [k for k, (ref, _) in _packed.items() if ref() is None]:
            del _packed[k]
        hit = _packed[id(key)] = (weakref.ref(key), _pack(shards))
    return hit[1]


def fp8_partials(
    x: torch.Tensor,
    w: torch.Tensor,
    num_shards: int,
    rows: RowParts | None = None,
    reduce_amax: AmaxReduce | None = None,
) -> torch.Tensor:
    """fp32 [C, *lead, N]: x [..., K] against the master weight w [N, K] per canonical K-shard."""
    k, n = x.shape[-1], w.shape[0]
    if w.shape[-1] != k or num_shards < 1 or k % num_shards:
        raise ValueError(f"fp8_block: x [..., {k}] and w {tuple(w.shape)} must contract in {num_shards} K-shards")
    x2 = x.detach().reshape(-1, k)
    qw, sw = packed_weight(w, num_shards, rows, reduce_amax)
    qa, sa = quantize_activations(x2, num_shards)
    return gemm_partials(qa, sa, qw, sw, num_shards).view(num_shards, *x.shape[:-1], n)


def fp8_linear(
    x: torch.Tensor,
    w: torch.Tensor,
    num_shards: int,
    out_dtype: torch.dtype,
    rows: RowParts | None = None,
    reduce_amax: AmaxReduce | None = None,
) -> torch.Tensor:
    """The partials folded left to right (the set's fold), in out_dtype; num_shards=1: K whole."""
    return tlin.fold(fp8_partials(x, w, num_shards, rows, reduce_amax), out_dtype)


# --- the family check ---------------------------------------------------------------------------------------

# Probe (M, N, K): ragged row and column tiles, 4 canonical shards of a ragged group each (and K whole).
FP8_PROBE_GPU, FP8_PROBE_INTERPRETED = (300, 1100, 1536), (5, 80, 384)
_verified: set[str] = set()


def check_fp8_family(device: torch.device, members: tuple[Fp8Tiles, ...] = FP8_FAMILY) -> None:
    """Every member on the probe, K whole and in 4 shards; tlin.GemmFamilyMismatch naming the member, the
    device and the rule if any bit differs from the first member's."""
    m, n, k = FP8_PROBE_GPU if device.type == "cuda" else FP8_PROBE_INTERPRETED
    g = torch.Generator().manual_seed(55)
    x, w = torch.randn(m, k, generator=g).to(device), (torch.randn(n, k, generator=g) * k**-0.5).to(device)
    want = None
    for t in members:
        got = []
        for shards in (1, 4):
            qw, sw = _pack(
                [ordered_fp8.quantize_weight(w[:, c * (k // shards) : (c + 1) * (k // shards)]) for c in range(shards)]
            )
            qa, sa = quantize_activations(x, shards)
            got.append(gemm_partials(qa, sa, qw, sw, shards, tiles=t))
        want = want or (t, got)
        for a, b in zip(got, want[1], strict=True):
            if not torch.equal(a.view(torch.int32), b.view(torch.int32)):
                raise tlin.GemmFamilyMismatch(
                    f"triton fp8_block GEMM family: member {t} gives other bits than {want[0]} on "
                    f"{tlin._describe(device)}; rule: every member must sum each {BLOCK}-column group in one MMA "
                    "chain from +0, so its tiling cannot change a bit. The contract's bits cannot be promised on "
                    "this device: refusing to run it"
                )


def ensure_fp8_family(device: torch.device) -> None:
    """check_fp8_family once per GPU before its first fp8 GEMM (not in the interpreter: tests call it)."""
    key = tlin._device_key(device)
    if device.type != "cuda" or key in _verified:
        return
    _verified.add(key)  # the probe's own GEMMs pass through here
    try:
        check_fp8_family(device)
    except BaseException:
        _verified.discard(key)
        raise
