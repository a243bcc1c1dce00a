"""CP token layouts and the one response slicer (pure, no processes)."""

from __future__ import annotations

import pytest
import torch

from tonpolicy.trainer import cp_layout


@pytest.mark.parametrize("mode,n_cp", [("ulysses", 1), ("ulysses", 2), ("ring", 2), ("ring", 4)])
def test_layout_partitions_the_sequence(mode: str, n_cp: int) -> None:
    n = cp_layout.padded_len(77, n_cp, mode, tile=8)
    assert n >= 77 and (mode != "ring" or n % (2 * n_cp * 8) == 0)
    held = torch.cat([cp_layout.local_positions(n, n_cp, r, mode) for r in range(n_cp)])
    assert torch.equal(held.sort().values, torch.arange(n))
    if mode == "ring":  # zigzag: rank 0 holds the first and the last chunk
        c = n // (2 * n_cp)
        first = cp_layout.local_positions(n, n_cp, 0, mode)
        assert torch.equal(first, torch.cat([torch.arange(c), torch.arange(n - c, n)]))


@pytest.mark.parametrize("mode,n_cp", [("ulysses", 2), ("ring", 2), ("ring", 3)])
def test_response_slices_cover_each_token_once(mode: str, n_cp: int) -> None:
    prompt, response = 19, 13
    tokens = torch.arange(1000, 1000 + prompt + response)
    n = cp_layout.padded_len(prompt + response - 1, n_cp, mode, tile=4)
    inputs = torch.cat([tokens[:-1], torch.zeros(n - (prompt + response - 1), dtype=torch.long)])
    seen = []
    for r in range(n_cp):
        pos = cp_layout.local_positions(n, n_cp, r, mode)
        s = cp_layout.response_slice(pos, prompt, response)
        [(rows, sliced)] = cp_layout.slice_responses([inputs[pos]], [{"targets": tokens[prompt:]}], [s])
        # The row at position p holds token p and predicts token p + 1, the response token resp.
        assert torch.equal(rows + 1, sliced["targets"])
        seen.append(s.resp)
    assert torch.equal(torch.cat(seen).sort().values, torch.arange(response))


def test_slicer_is_strict_about_sample_counts() -> None:
    s = cp_layout.response_slice(torch.arange(4), 2, 2)
    with pytest.raises(ValueError):
        cp_layout.slice_responses([torch.zeros(4), torch.zeros(4)], [{"m": torch.ones(2)}], [s])
