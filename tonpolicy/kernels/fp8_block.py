"""Block-scaled FP8 (e4m3) quantization of contract.quant=fp8_block: one pure function of the master
weights, shared by the rollout engine, the trainer's fake quantization and the weight sync.

The format is the published DeepSeek-V3 / Qwen3-FP8 checkpoints' (`weight_scale_inv`, `weight_block_size`
[128, 128]): a weight W [N, K] is stored as q [N, K] float8_e4m3fn and one fp32 scale_inv per block of
128 x 128 (the last block of a dimension may be partial), and W is read back as q.float() * scale_inv.

The rule (docs/REDUCTION_RULES.md, contract.quant=fp8_block), per block, in fp32:
- amax = max |w| over the block (w converted to fp32 exactly); a non-finite weight is refused;
- scale_inv = amax / 448 (fp32 division, round to nearest even); a block whose scale_inv would be below
  2^-126 (a zero block, or one so small that its scale would be subnormal) gets scale_inv = 1.0, which
  quantizes it to zeros (its magnitudes are below e4m3's smallest subnormal); every scale is therefore a
  normal fp32 number, so flushing subnormals in the GEMM never touches a scale;
- q = e4m3(clamp(w / scale_inv, -448, 448)): fp32 division, then the cast rounds to nearest even (torch's
  cast); the clamp only catches a quotient that rounding pushed past 448 (e4m3fn has no inf: saturate).
Activations follow the same rule per token in groups of 128 along K (`quantize_activation_groups`).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

BLOCK = 128
E4M3_MAX = 448.0
# Below this a scale would be subnormal (flushed to zero by the contract's GEMM): such a block takes 1.0.
_MIN_SCALE = 2.0**-126


def _blocks(n: int, block: int) -> int:
    return -(-n // block)


def _check_block(block: int) -> None:
    if block < 1:
        raise ValueError(f"fp8 block size must be >= 1, got {block}")


def _scale_of(amax: torch.Tensor) -> torch.Tensor:
    scale = amax / E4M3_MAX
    return torch.where(scale < _MIN_SCALE, torch.ones_like(scale), scale)


def _cast(scaled: torch.Tensor) -> torch.Tensor:
    return scaled.clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn)


def _refuse_non_finite(x: torch.Tensor, what: str) -> None:
    if not bool(torch.isfinite(x).all()):
        raise ValueError(f"fp8_block: {what} holds a non-finite value (NaN or inf); it cannot be quantized")


def touched_blocks(rows: int, row_offset: int, block: int = BLOCK) -> tuple[int, int]:
    """(first, count): the row blocks of an HF weight that its rows [row_offset, row_offset + rows) touch
    (blocks start at the HF weight's multiples of `block`)."""
    if rows == 0:
        return row_offset // block, 0
    first = row_offset // block
    return first, (row_offset + rows - 1) // block - first + 1


def _tiles(w32: torch.Tensor, row_offset: int, block: int) -> torch.Tensor:
    """w's rows placed at their offset inside their HF weight's blocks, zero-padded to whole blocks:
    [blocks touched, block, KB, block]."""
    n, k = w32.shape
    _, nb = touched_blocks(n, row_offset, block)
    kb, lead = _blocks(k, block), row_offset % block
    padded = torch.nn.functional.pad(w32, (0, kb * block - k, lead, nb * block - n - lead))
    return padded.reshape(nb, block, kb, block)


def weight_block_amax(w: torch.Tensor, block: int = BLOCK, row_offset: int = 0) -> torch.Tensor:
    """The amax of each block that w's rows touch, over those rows only: [blocks touched, ceil(K/block)] fp32.
    w [n, K] are rows [row_offset, row_offset + n) of an HF weight (a TP rank's part). The whole block's
    amax is the max of its parts' (exact, in any order): what a rank holding part of a block reduces."""
    _check_block(block)
    w32 = w.detach().to(torch.float32)
    _refuse_non_finite(w32, "weight")
    return _tiles(w32, row_offset, block).abs().amax(dim=(1, 3))


def amax_all_reduce(group: Any) -> Any:  # noqa: ANN401 - a torch process group
    """The exact elementwise MAX of block amaxes over `group`, the ranks holding parts of the blocks (None:
    one rank, nothing to reduce): what a caller hands the kernels for blocks cut by TP."""
    if group is None:
        return None

    def reduce(t: torch.Tensor) -> torch.Tensor:
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
        return t

    return reduce


def quantize_weight_blocks(
    w: torch.Tensor, block: int = BLOCK, *, row_offset: int = 0, amax: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """W [N, K] float -> (q [N, K] float8_e4m3fn, scale_inv [ceil(N/block), ceil(K/block)] fp32), with
    W ~ q.float() * scale_inv broadcast over each block. The rule is the module's docstring's.

    A part of an HF weight (rows [row_offset, row_offset + N) of it, e.g. a TP rank's) takes its blocks
    where the HF weight has them: scale_inv holds the blocks it touches (`touched_blocks`), and `amax`
    (that shape) gives each block's amax over the whole block, where the block extends past the part (the
    max of every part's `weight_block_amax`). Without it, the part's own rows are the block."""
    _check_block(block)
    if w.dim() != 2:
        raise ValueError(f"fp8_block: a weight must be 2-D [N, K], got shape {tuple(w.shape)}")
    if row_offset < 0:
        raise ValueError(f"fp8_block: row_offset must be >= 0, got {row_offset}")
    w32 = w.detach().to(torch.float32)
    _refuse_non_finite(w32, "weight")
    n, k = w32.shape
    tiles = _tiles(w32, row_offset, block)
    nb, kb = tiles.shape[0], tiles.shape[2]
    if amax is None:
        amax = tiles.abs().amax(dim=(1, 3))
    elif tuple(amax.shape) != (nb, kb):
        raise ValueError(f"fp8_block: amax shape {tuple(amax.shape)} is not the touched blocks' {(nb, kb)}")
    scale = _scale_of(amax.to(torch.float32))
    lead = row_offset % block
    q = _cast(tiles / scale[:, None, :, None]).reshape(nb * block, kb * block)[lead : lead + n, :k]
    return q.contiguous(), scale.contiguous()


def dequantize_weight_blocks(
    q: torch.Tensor, scale_inv: torch.Tensor, dtype: torch.dtype, block: int = BLOCK
) -> torch.Tensor:
    """(q [N, K] e4m3, scale_inv [ceil(N/block), ceil(K/block)]) -> W [N, K] in dtype: q.float() * scale_inv
    (one fp32 product, rounded to nearest even, then rounded to dtype)."""
    _check_block(block)
    if q.dim() != 2 or scale_inv.dim() != 2:
        raise ValueError(f"fp8_block: q and scale_inv must be 2-D, got {tuple(q.shape)} and {tuple(scale_inv.shape)}")
    n, k = q.shape
    if tuple(scale_inv.shape) != (_blocks(n, block), _blocks(k, block)):
        raise ValueError(
            f"fp8_block: scale_inv shape {tuple(scale_inv.shape)} does not match a weight {(n, k)} in blocks of"
            f" {block} (expected {(_blocks(n, block), _blocks(k, block))})"
        )
    expanded = scale_inv.to(torch.float32).repeat_interleave(block, 0).repeat_interleave(block, 1)[:n, :k]
    return (q.to(torch.float32) * expanded).to(dtype)


def quantize_activation_groups(x: torch.Tensor, block: int = BLOCK) -> tuple[torch.Tensor, torch.Tensor]:
    """x [..., K] float -> (q [..., K] e4m3, scale [..., ceil(K/block)] fp32): per token, groups of `block`
    along K, the weight rule (amax / 448, tiny or zero group -> 1.0, RNE cast with saturation). Each token's
    result depends on that token alone."""
    _check_block(block)
    x32 = x.detach().to(torch.float32)
    _refuse_non_finite(x32, "activation")
    k = x32.shape[-1]
    kb = _blocks(k, block)
    padded = torch.nn.functional.pad(x32, (0, kb * block - k)) if kb * block != k else x32
    groups = padded.reshape(*x32.shape[:-1], kb, block)
    scale = _scale_of(groups.abs().amax(dim=-1))
    q = _cast(groups / scale[..., None]).reshape(*x32.shape[:-1], kb * block)[..., :k]
    return q.contiguous(), scale.contiguous()
