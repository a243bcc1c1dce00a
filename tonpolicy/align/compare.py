"""Compare two dumps bit for bit and find where they first part.

Checkpoints are compared on the positions both dumps hold, by the bits of their values (so -0.0 vs
0.0 and NaN payloads count), in canonical order: layer, then op within the layer, then position. The
first divergence is the earliest (layer, op) with any differing bit and, there, the smallest
position. The report carries max |Δ| at that point and over everything after it, and a per-layer
table of mismatched-element counts.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

import torch

from tonpolicy.align.dump import Dump
from tonpolicy.align.names import Checkpoint
from tonpolicy.contract.gate import bits_differ


@dataclass
class CheckpointDiff:
    name: str
    layer: int
    op: str
    positions: int
    elements: int
    mismatched_elements: int
    mismatched_positions: int
    first_position: int | None
    max_abs_diff: float
    note: str | None = None


@dataclass
class Divergence:
    name: str
    layer: int
    op: str
    position: int
    token: int | None
    max_abs_diff_at_position: float
    max_abs_diff_checkpoint: float
    max_abs_diff_after: float


@dataclass
class AlignReport:
    a: str
    b: str
    num_layers: int
    checkpoints: list[CheckpointDiff]
    first: Divergence | None
    tokens_differ_at: int | None = None
    only_in_a: list[str] = field(default_factory=list)
    only_in_b: list[str] = field(default_factory=list)

    @property
    def compared_elements(self) -> int:
        return sum(c.elements for c in self.checkpoints)

    @property
    def match(self) -> bool:
        """Everything both dumps hold agrees bitwise (and there was something to compare)."""
        return (
            self.first is None
            and self.tokens_differ_at is None
            and self.compared_elements > 0
            and not any(c.note for c in self.checkpoints)
        )

    def layer_label(self, layer: int) -> str:
        return "embed" if layer < 0 else "head" if layer >= self.num_layers else str(layer)

    def table(self) -> dict[str, dict[str, int]]:
        """layer label -> op -> mismatched elements."""
        out: dict[str, dict[str, int]] = {}
        for c in self.checkpoints:
            out.setdefault(self.layer_label(c.layer), {})[c.op] = c.mismatched_elements
        return out

    def to_dict(self) -> dict[str, Any]:
        return {
            "match": self.match,
            "a": self.a,
            "b": self.b,
            "num_layers": self.num_layers,
            "compared_checkpoints": len(self.checkpoints),
            "compared_elements": self.compared_elements,
            "mismatched_elements": sum(c.mismatched_elements for c in self.checkpoints),
            "first_divergence": None if self.first is None else asdict(self.first),
            "tokens_differ_at": self.tokens_differ_at,
            "only_in_a": self.only_in_a,
            "only_in_b": self.only_in_b,
            "per_layer_mismatched_elements": self.table(),
            "checkpoints": [asdict(c) for c in self.checkpoints],
        }


def _compare_one(ck: Checkpoint, a: Dump, b: Dump) -> tuple[CheckpointDiff, list[int], torch.Tensor]:
    """The diff summary, the common positions and the per-position max |Δ| (float64)."""
    pa, pb = a.positions[ck], b.positions[ck]
    ib = {p: i for i, p in enumerate(pb)}
    common = [p for p in pa if p in ib]
    ta = a.tensors[ck][[i for i, p in enumerate(pa) if p in ib]]
    tb = b.tensors[ck][[ib[p] for p in common]]
    note = None
    if ta.shape[1:] != tb.shape[1:]:
        n = len(common)
        diff = CheckpointDiff(
            ck.name,
            ck.layer,
            ck.op,
            n,
            ta.numel(),
            ta.numel(),
            n,
            common[0] if common else None,
            float("nan"),
            f"feature shapes differ: {tuple(ta.shape[1:])} vs {tuple(tb.shape[1:])}",
        )
        return diff, common, torch.full((n,), float("inf"), dtype=torch.float64)
    if ta.dtype != tb.dtype:
        note = f"dtypes differ: {ta.dtype} vs {tb.dtype}"
    ne = bits_differ(ta, tb)
    absdiff = (ta.double() - tb.double()).abs().nan_to_num(nan=float("inf"))
    absdiff = torch.where(ne, absdiff, torch.zeros_like(absdiff))
    per_pos = absdiff.reshape(len(common), -1).amax(-1) if common else torch.zeros(0, dtype=torch.float64)
    bad = ne.reshape(len(common), -1).any(-1) if common else torch.zeros(0, dtype=torch.bool)
    first = common[int(bad.nonzero()[0])] if bad.any() else None
    diff = CheckpointDiff(
        ck.name,
        ck.layer,
        ck.op,
        len(common),
        ne.numel(),
        int(ne.sum()),
        int(bad.sum()),
        first,
        float(per_pos.max()) if per_pos.numel() else 0.0,
        note,
    )
    return diff, common, per_pos


def compare_dumps(a: Dump, b: Dump, label_a: str = "A", label_b: str = "B") -> AlignReport:
    if a.num_layers != b.num_layers:
        raise ValueError(f"the dumps are of different models: {a.num_layers} vs {b.num_layers} layers")
    shared = sorted(set(a.tensors) & set(b.tensors), key=Checkpoint.sort_key)
    diffs, per = [], []
    for ck in shared:
        d, common, per_pos = _compare_one(ck, a, b)
        diffs.append(d)
        per.append((common, per_pos))
    first = None
    for i, d in enumerate(diffs):
        if d.first_position is None:
            continue
        common, per_pos = per[i]
        j = common.index(d.first_position)
        later = [float(per_pos[j + 1 :].max())] if j + 1 < len(common) else []
        later += [float(p.max()) for _, p in per[i + 1 :] if p.numel()]
        tok = a.tokens[d.first_position] if d.first_position < len(a.tokens) else None
        first = Divergence(
            d.name, d.layer, d.op, d.first_position, tok, float(per_pos[j]), d.max_abs_diff, max(later, default=0.0)
        )
        break
    n = min(len(a.tokens), len(b.tokens))
    tokens_differ = next((p for p in range(n) if a.tokens[p] != b.tokens[p]), None)
    return AlignReport(
        f"{label_a} ({a.side})",
        f"{label_b} ({b.side})",
        a.num_layers,
        diffs,
        first,
        tokens_differ,
        sorted(c.name for c in set(a.tensors) - set(b.tensors)),
        sorted(c.name for c in set(b.tensors) - set(a.tensors)),
    )


def format_report(r: AlignReport) -> str:
    lines = [f"alignment: {r.a} vs {r.b}: {len(r.checkpoints)} checkpoints, {r.compared_elements} elements compared"]
    if r.tokens_differ_at is not None:
        lines.append(
            f"WARNING: the dumps hold different token sequences (first difference at position {r.tokens_differ_at})"
        )
    for side, names in (("A", r.only_in_a), ("B", r.only_in_b)):
        if names:
            lines.append(f"only in {side} (not compared): {', '.join(names[:8])}{' ...' if len(names) > 8 else ''}")
    for c in r.checkpoints:
        if c.note:
            lines.append(f"{c.name}: {c.note}")
    f = r.first
    if f is None:
        lines.append(
            "MATCH: every compared bit is identical" if r.match else "NO DIVERGENCE FOUND in the compared checkpoints"
        )
    else:
        lines.append(
            f"FIRST DIVERGENCE: layer {r.layer_label(f.layer)}, op {f.op}, position {f.position} (token {f.token}) "
            f"[{f.name}]"
        )
        lines.append(
            f"  max|Δ| there {f.max_abs_diff_at_position:.3e} (over the checkpoint {f.max_abs_diff_checkpoint:.3e}), "
            f"after it {f.max_abs_diff_after:.3e}"
        )
    lp = next((c for c in r.checkpoints if c.op == "logprobs"), None)
    if lp is not None:  # what the parity gate sees
        lines.append(
            f"logprobs: {lp.mismatched_positions} of {lp.positions} tokens differ, max|Δ| {lp.max_abs_diff:.3e}"
        )
    lines.append(f"{'layer':>6} {'mismatched':>12} {'of':>10}  ops with mismatches")
    rows: dict[str, list[CheckpointDiff]] = {}
    for c in r.checkpoints:
        rows.setdefault(r.layer_label(c.layer), []).append(c)
    for label, cs in rows.items():
        bad = ", ".join(f"{c.op}={c.mismatched_elements}" for c in cs if c.mismatched_elements)
        lines.append(
            f"{label:>6} {sum(c.mismatched_elements for c in cs):>12} {sum(c.elements for c in cs):>10}  {bad or '-'}"
        )
    return "\n".join(lines)
