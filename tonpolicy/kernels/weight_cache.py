"""The one weights generation every kernel-side weight cache keys on (v1's quantized weights and column
scales, v2's packed panels).

A cache entry also keys on the weight's storage and tensor version, but writes through `.data` (Megatron's
optimizer copies its main params into the model's that way, as do snapshot restores) bump no version: the
writer then calls `weights_updated()` once and every cache forgets its entries."""

from __future__ import annotations

_generation = [0]


def generation() -> int:
    """The current weights generation (part of every weight cache's key)."""
    return _generation[0]


def weights_updated() -> None:
    """Forget every cached weight: call after writing weights in a way that bumps no tensor version."""
    _generation[0] += 1
