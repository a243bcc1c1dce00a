"""The engine's KV pool: the head layout (keys and values stored per KV head in the layout the contract's
attention GEMMs read) holds exactly what the token layout holds, through writes that cross tiles,
one-scatter decode writes and pool growth."""

from __future__ import annotations

import pytest
import torch

from tonpolicy.model.kv_cache import KVPool, convert_layout


def _as_tokens(pool: KVPool, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
    k, v = pool.k[layer], pool.v[layer]
    if pool.layout == "token":
        return k, v
    return k.permute(0, 3, 1, 2), v.permute(0, 2, 1, 3)


def _fill(pool: KVPool) -> None:
    g = torch.Generator().manual_seed(0)
    for layer in range(2):
        pool.write(layer, 1, 30, torch.randn(5, 2, 4, generator=g), torch.randn(5, 2, 4, generator=g))  # crosses 32
        pool.write(layer, 0, 0, torch.randn(40, 2, 4, generator=g), torch.randn(40, 2, 4, generator=g))
        slots, pos = torch.tensor([0, 2, 1]), torch.tensor([40, 7, 35])
        pool.write_tokens(layer, slots, pos, torch.randn(3, 2, 4, generator=g), torch.randn(3, 2, 4, generator=g))


def test_head_layout_holds_what_the_token_layout_holds() -> None:
    token = KVPool(2, 3, 64, 2, 4, torch.float32, 32, layout="token")
    head = KVPool(2, 3, 64, 2, 4, torch.float32, 32, layout="head")
    assert head.k[0].shape == (3, 2, 4, 64) and head.v[0].shape == (3, 2, 64, 4)
    _fill(token)
    _fill(head)
    for layer in range(2):
        for a, b in zip(_as_tokens(token, layer), _as_tokens(head, layer), strict=True):
            assert torch.equal(a, b)
    assert _as_tokens(head, 1)[0][2, 7].abs().sum() > 0  # the scattered decode token landed
    bigger = KVPool(2, 6, 128, 2, 4, torch.float32, 32, layout="head")
    bigger.copy_from(head)
    assert torch.equal(_as_tokens(bigger, 0)[0][:3, :64], _as_tokens(head, 0)[0])
    assert torch.equal(_as_tokens(bigger, 1)[1][:3, :64], _as_tokens(head, 1)[1])


def test_overflow_and_unknown_layout_are_refused() -> None:
    pool = KVPool(1, 2, 32, 1, 4, torch.float32, 32, layout="head")
    with pytest.raises(ValueError, match="overflow"):
        pool.write(0, 0, 30, torch.zeros(3, 1, 4), torch.zeros(3, 1, 4))
    with pytest.raises(ValueError, match="overflow"):
        pool.write_tokens(0, torch.tensor([1]), torch.tensor([32]), torch.zeros(1, 1, 4), torch.zeros(1, 1, 4))
    with pytest.raises(ValueError, match="layout"):
        KVPool(1, 2, 32, 1, 4, torch.float32, 32, layout="paged")


def test_convert_layout_round_trips() -> None:
    token = KVPool(1, 3, 64, 2, 4, torch.float32, 32, layout="token")
    gen = torch.Generator().manual_seed(1)
    token.write(0, 2, 0, torch.randn(50, 2, 4, generator=gen), torch.randn(50, 2, 4, generator=gen))
    kh, vh = convert_layout(token.k[0], token.v[0], "token", "head")
    assert kh.shape == (3, 2, 4, 64) and vh.shape == (3, 2, 64, 4)
    k, v = convert_layout(kh, vh, "head", "token")
    assert torch.equal(k, token.k[0]) and torch.equal(v, token.v[0])
