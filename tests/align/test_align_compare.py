"""The comparator and the dump format on synthetic dumps, and the offline CLI on two saved directories."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tonpolicy.align.compare import compare_dumps
from tonpolicy.align.dump import Dump, load_dump, save_dump
from tonpolicy.align.names import LAYER_OPS, Checkpoint, checkpoint, parse_name, split_qkv

LAYERS = 2


def _dump(seed: int = 0, positions: list[int] | None = None) -> Dump:
    g = torch.Generator().manual_seed(seed)
    pos = positions or list(range(6))
    cks = [checkpoint(-1, "embed", LAYERS)] + [checkpoint(i, op, LAYERS) for i in range(LAYERS) for op in LAYER_OPS]
    cks += [checkpoint(0, op, LAYERS) for op in ("final_norm", "logits", "logprobs")]
    tensors = {ck: torch.randn(len(pos), 8, generator=g).to(torch.bfloat16) for ck in cks}
    tensors[checkpoint(0, "logprobs", LAYERS)] = torch.randn(len(pos), 1, generator=g)
    return Dump("test", list(range(100, 100 + max(pos) + 2)), 3, LAYERS, tensors, {ck: list(pos) for ck in cks})


def test_names_round_trip_and_order() -> None:
    for ck in [checkpoint(-1, "embed", 4), checkpoint(2, "q_rope", 4), checkpoint(0, "logprobs", 4)]:
        assert parse_name(ck.name, 4) == ck
    assert (
        checkpoint(1, "mlp_act", 4).sort_key()
        < checkpoint(1, "residual", 4).sort_key()
        < checkpoint(2, "input_norm", 4).sort_key()
    )
    with pytest.raises(ValueError):
        checkpoint(4, "q", 4)
    # Megatron's fused QKV (per group: its q heads, then k, then v) splits back into HF order.
    qkv = torch.arange(2 * (2 + 2) * 3).float()[None]  # 2 groups, 2 q heads per group, head_dim 3
    parts = split_qkv(qkv, heads_per_group=2, head_dim=3)
    assert parts["q"].tolist() == [[0, 1, 2, 3, 4, 5, 12, 13, 14, 15, 16, 17]]
    assert parts["k"].tolist() == [[6, 7, 8, 18, 19, 20]] and parts["v"].tolist() == [[9, 10, 11, 21, 22, 23]]


def test_identical_dumps_match(tmp_path: Path) -> None:
    a = load_dump(save_dump(_dump(), tmp_path / "a"))
    r = compare_dumps(a, _dump())
    assert r.match and r.first is None and r.compared_elements > 0
    assert all(v == 0 for row in r.table().values() for v in row.values())


def test_first_divergence_is_earliest_layer_op_then_position() -> None:
    a, b = _dump(), _dump()
    late, early = checkpoint(1, "q_norm", LAYERS), checkpoint(1, "k", LAYERS)
    b.tensors[late][1, 0] += 1.0  # a later op at an earlier position...
    b.tensors[early][4, 2] = -b.tensors[early][4, 2]  # ...loses to the earlier op
    b.tensors[early][5, :] += 0.5
    r = compare_dumps(a, b)
    assert not r.match
    f = r.first
    assert (f.layer, f.op, f.position, f.token) == (1, "k", 4, 104)
    assert f.max_abs_diff_at_position == pytest.approx(2 * abs(float(a.tensors[early][4, 2])))
    assert f.max_abs_diff_after >= 0.5  # position 5 of the same op and the later q_norm
    by = {c.name: c for c in r.checkpoints}
    assert by["layers.1.k"].mismatched_positions == 2 and by["layers.1.q_norm"].mismatched_elements == 1
    assert r.table()["1"]["k"] == 1 + 8  # one sign flip, one whole row
    assert r.table()["0"]["q"] == 0


def test_bits_not_values_and_position_intersection() -> None:
    a, b = _dump(), _dump(positions=[2, 3, 4, 5, 6, 7])
    b.tensors = {ck: torch.cat([a.tensors[ck][2:], a.tensors[ck][:2]]) for ck in a.tensors}  # positions 2..7
    r = compare_dumps(a, b)
    assert r.match and all(c.positions == 4 for c in r.checkpoints)  # 2..5 in common
    z = checkpoint(0, "mlp_act", LAYERS)
    a.tensors[z][3, 0], b.tensors[z][1, 0] = 0.0, -0.0  # equal values, different bits
    r = compare_dumps(a, b)
    assert (r.first.name, r.first.position) == ("layers.0.mlp_act", 3)


def test_dump_files(tmp_path: Path) -> None:
    d = save_dump(_dump(), tmp_path / "d")
    manifest = json.loads((d / "manifest.json").read_text())
    entry = next(e for e in manifest["checkpoints"] if e["name"] == "layers.1.mlp_up")
    assert entry == {
        "name": "layers.1.mlp_up",
        "layer": 1,
        "op": "mlp_up",
        "shape": [6, 8],
        "dtype": "bfloat16",
        "positions": [0, 1, 2, 3, 4, 5],
    }
    assert (d / "tensors.safetensors").exists()
    back = load_dump(d)
    assert all(torch.equal(back.tensors[ck], t) for ck, t in _dump().tensors.items())


def test_cli_compare_two_saved_dirs(tmp_path: Path) -> None:
    a = save_dump(_dump(), tmp_path / "a")
    same = save_dump(_dump(), tmp_path / "same")
    other = _dump()
    other.tensors[Checkpoint(0, "o_proj")][2, 3] += 1
    diff = save_dump(other, tmp_path / "diff")

    def cli(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run(
            [sys.executable, "-m", "tonpolicy.align", "compare", *args], capture_output=True, text=True, timeout=120
        )

    ok = cli(str(a), str(same))
    assert ok.returncode == 0, ok.stderr
    assert "MATCH" in ok.stdout
    bad = cli(str(a), str(diff), "--out", str(tmp_path / "rep"))
    assert bad.returncode == 1, bad.stderr
    assert "FIRST DIVERGENCE: layer 0, op o_proj, position 2" in bad.stdout
    report = json.loads((tmp_path / "rep" / "align_report.json").read_text())
    assert report["first_divergence"]["name"] == "layers.0.o_proj" and report["mismatched_elements"] == 1
    assert (tmp_path / "rep" / "align_report.png").read_bytes()[:4] == b"\x89PNG"
    missing = cli(str(a), str(tmp_path / "nope"))
    assert missing.returncode == 2 and "not an alignment dump" in missing.stderr
