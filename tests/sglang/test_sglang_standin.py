"""The pure-torch stand-in for sgl_kernel's CPU ops (tonpolicy/inside_sglang/cpu_standin/sgl_kernel) against
plain-Python references of what SGLang's Triton kernels compute."""

from __future__ import annotations

import importlib.util
import sys

import torch

from tonpolicy.launch.sglang_env import CPU_STANDIN_DIR


def _load_standin():
    if "tonpolicy_sgl_kernel_standin" in sys.modules:
        return sys.modules["tonpolicy_sgl_kernel_standin"]
    spec = importlib.util.spec_from_file_location(
        "tonpolicy_sgl_kernel_standin", CPU_STANDIN_DIR / "sgl_kernel" / "__init__.py"
    )
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


sk = _load_standin()


def _murmur_reference(seed: int, pos: int, col: int) -> int:
    """MurmurHash3 x86_32 over four 4-byte blocks (seed low, seed high, position, column), seed 0."""
    m = 0xFFFFFFFF

    def rotl(x: int, r: int) -> int:
        return ((x << r) | (x >> (32 - r))) & m

    h = 0
    for k in (seed & m, (seed >> 32) & m, pos & m, col & m):
        k = (k * 0xCC9E2D51) & m
        k = rotl(k, 15)
        k = (k * 0x1B873593) & m
        h = rotl(h ^ k, 13)
        h = (h * 5 + 0xE6546B64) & m
    h ^= 16
    h ^= h >> 16
    h = (h * 0x85EBCA6B) & m
    h ^= h >> 13
    h = (h * 0xC2B2AE35) & m
    return h ^ (h >> 16)


def test_murmur_hash32_matches_the_reference_and_is_registered_as_a_torch_op() -> None:
    seeds = torch.tensor([0, 1, 2**40 + 7, 2**63 - 1, 123456789], dtype=torch.int64).to(torch.uint64)
    positions = torch.tensor([0, 5, 1023, 7, 2**31 - 1], dtype=torch.int64)
    cols = torch.arange(0, 3000, 37, dtype=torch.int64)
    out = torch.ops.sgl_kernel.murmur_hash32_cpu.default(seeds, positions, cols)
    assert out.dtype == torch.uint32 and out.shape == (5, cols.numel())
    for i, (s, p) in enumerate(zip(seeds.tolist(), positions.tolist(), strict=True)):
        expected = [_murmur_reference(int(s), p, c) for c in cols.tolist()]
        assert out[i].to(torch.int64).tolist() == expected
    # A wrong constant would be caught: the hash is not the identity and differs across columns.
    assert len(set(out[0].to(torch.int64).tolist())) == cols.numel()


def test_assign_req_to_token_pool_writes_each_request_row_in_batch_order() -> None:
    req_to_token = torch.zeros(4, 10, dtype=torch.int32)
    sk.assign_req_to_token_pool_cpu(
        torch.tensor([2, 0]),
        req_to_token,
        torch.tensor([3, 0]),
        torch.tensor([5, 3]),
        torch.tensor([101, 102, 201, 202, 203]),
        10,
    )
    assert req_to_token[2, 3:5].tolist() == [101, 102] and req_to_token[0, :3].tolist() == [201, 202, 203]
    assert int(req_to_token.count_nonzero()) == 5


def test_copy_all_layer_kv_cache_moves_rows_in_every_buffer() -> None:
    bufs = [torch.arange(24, dtype=torch.float32).view(6, 4).clone() for _ in range(2)]
    before = [b.clone() for b in bufs]
    ptrs = torch.tensor([b.data_ptr() for b in bufs], dtype=torch.int64)
    strides = torch.tensor([b.stride(0) * b.element_size() for b in bufs], dtype=torch.int64)
    sk.copy_all_layer_kv_cache_cpu(ptrs, strides, torch.tensor([4, 5]), torch.tensor([1, 2]))
    for b, old in zip(bufs, before, strict=True):
        assert torch.equal(b[4], old[1]) and torch.equal(b[5], old[2]) and torch.equal(b[:4], old[:4])


def test_other_ops_fail_loudly_and_amx_switch_is_absent() -> None:
    import pytest

    with pytest.raises(NotImplementedError, match="not in tonpolicy's CPU stand-in"):
        sk.rmsnorm_cpu(torch.zeros(1))
    assert not hasattr(sk, "convert_weight_packed")
