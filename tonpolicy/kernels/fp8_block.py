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

import torch

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


def _padded(x: torch.Tensor, rows: int, cols: int) -> torch.Tensor:
    """x [r, c] zero-padded at the end to [rows, cols]: zeros never raise an amax."""
    r, c = x.shape
    if (r, c) == (rows, cols):
        return x
    return torch.nn.functional.pad(x, (0, cols - c, 0, rows - r))


def quantize_weight_blocks(w: torch.Tensor, block: int = BLOCK) -> tuple[torch.Tensor, torch.Tensor]:
    """W [N, K] float -> (q [N, K] float8_e4m3fn, scale_inv [ceil(N/block), ceil(K/block)] fp32), with
    W ~ q.float() * scale_inv broadcast over each block. The rule is the module's docstring's."""
    _check_block(block)
    if w.dim() != 2:
        raise ValueError(f"fp8_block: a weight must be 2-D [N, K], got shape {tuple(w.shape)}")
    w32 = w.detach().to(torch.float32)
    _refuse_non_finite(w32, "weight")
    n, k = w32.shape
    nb, kb = _blocks(n, block), _blocks(k, block)
    tiles = _padded(w32, nb * block, kb * block).reshape(nb, block, kb, block)
    scale = _scale_of(tiles.abs().amax(dim=(1, 3)))
    q = _cast(tiles / scale[:, None, :, None]).reshape(nb * block, kb * block)[:n, :k]
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
