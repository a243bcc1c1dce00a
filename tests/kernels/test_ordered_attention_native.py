"""Contract v2's attention steps in one native call each (ordered_rowwise_attention: a span's tile softmax
partials, the merge of a block's tiles with its finalisation) give the bits of the torch ops they replace,
and of the differentiable path the trainer runs; the comparison tells merge trees apart (negative control)."""

from __future__ import annotations

import random

import pytest
import torch
from support.kernel_utils import DTYPES, num_threads, randn

from tonpolicy.kernels import get_kernels
from tonpolicy.kernels.invariant.ordered import OrderedKernels

HEADS = [(8, 4, 32), (4, 4, 64), (16, 2, 128)]  # (Hq, Hkv, D)


def _torch_steps(tile: int = 32) -> OrderedKernels:
    """The ordered set with its attention steps as the torch ops (the definition the native calls keep)."""
    k = OrderedKernels(attention_tile=tile)
    k.products = k.products._replace(softmax_tiles=None, merge_finalize=None)
    return k


def _pools(kk: torch.Tensor, v: torch.Tensor, tile: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A head-layout pool with keys [0, len(kk)) in slot 1 and stale values elsewhere (never read)."""
    cap = (-(-len(kk) // tile) + 1) * tile
    kp = torch.full((2, cap, *kk.shape[1:]), 7.0, dtype=kk.dtype)
    vp = kp.clone()
    kp[1, : len(kk)], vp[1, : len(v)] = kk, v
    return kp.permute(0, 2, 3, 1).contiguous(), vp.permute(0, 2, 1, 3).contiguous()


@pytest.mark.parametrize("dtype", DTYPES)
def test_native_steps_give_the_torch_steps_bits(dtype):
    """Prefill, chunked prefill and decode (pooled keys, long enough for masked and skipped tiles), with
    scores wide enough that exp underflows into subnormals and whole tiles weigh nothing."""
    native, steps = get_kernels("ordered"), _torch_steps()
    assert native.products.softmax_tiles is not None and native.products.merge_finalize is not None
    rng = random.Random(5)
    for trial in range(10):
        hq, hkv, d = rng.choice(HEADS)
        n = rng.choice([1, 31, 33, 97, 200])
        nq = rng.choice([1, 1, 3, n])
        std = rng.choice([1.0, 12.0])  # 12: score gaps of hundreds, exp far below fp32's normal range
        q = randn(nq, hq, d, dtype=dtype, seed=trial, std=std)
        kk, v = randn(n, hkv, d, dtype=dtype, seed=trial + 50, std=std), randn(n, hkv, d, dtype=dtype, seed=trial + 99)
        pos = torch.arange(n)
        kp, vp = _pools(kk, v, native.attention_tile)
        slot, q_pos = torch.tensor([1]), pos[n - nq :][None]
        with num_threads(rng.choice([1, 2])):
            got = native.attention_pooled(q[None], q_pos, kp, vp, slot, n, d**-0.5)
            want = steps.attention_pooled(q[None], q_pos, kp, vp, slot, n, d**-0.5)
            assert torch.equal(got, want), (trial, hq, hkv, d, n, nq)
            assert torch.equal(native.attention(q, kk, v, pos[n - nq :], pos, d**-0.5), want[0])
            # The trainer's differentiable path (torch ops, no native call) computes the same bits.
            qg = q.clone().requires_grad_()
            assert torch.equal(steps.attention(qg, kk, v, pos[n - nq :], pos, d**-0.5).detach(), want[0])


def test_a_query_seeing_no_key_stays_zero():
    """A padded query (position -1) sees no key: l = 0 is read as 1, so its row is 0, as in `finalize`."""
    q, kk, v = randn(4, 8, 32, seed=1), randn(5, 4, 32, seed=2), randn(5, 4, 32, seed=3)
    q_pos, k_pos = torch.tensor([-1, 0, 2, 4]), torch.arange(5)
    got = get_kernels("ordered").attention(q, kk, v, q_pos, k_pos, 0.2)
    assert torch.equal(got, _torch_steps().attention(q, kk, v, q_pos, k_pos, 0.2))
    assert torch.all(got[0] == 0) and not torch.isnan(got).any()


def test_another_merge_tree_differs():
    """Negative control: the same keys merged as 16-key tiles (another tree) differ in some bit from the
    native 32-key path, so the equalities above see a merge order."""
    q, kk, v = randn(1, 8, 32, seed=7), randn(200, 4, 32, seed=8), randn(200, 4, 32, seed=9)
    pos = torch.arange(200)
    native = get_kernels("ordered").attention(q, kk, v, pos[-1:], pos, 32**-0.5)
    other = _torch_steps(tile=16).attention(q, kk, v, pos[-1:], pos, 32**-0.5)
    assert not torch.equal(native, other)
    assert torch.allclose(native, other, atol=1e-5)  # the same attention all the same
