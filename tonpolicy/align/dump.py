"""The dump format: a directory with one safetensors file and a JSON manifest.

    <dir>/tensors.safetensors   one tensor [positions, features] per checkpoint, keyed by its name
    <dir>/manifest.json         format/version, side, tokens, prompt_len, num_layers, free-form meta,
                                and per checkpoint: name, layer, op, shape, dtype, positions

Any producer that writes this layout (for instance a dump taken inside a real SGLang server on a GPU
machine) can be compared with `python -m tonpolicy.align compare A B`.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file

from tonpolicy.align.names import Checkpoint, parse_name
from tonpolicy.files import write_json_atomic

FORMAT = "tonpolicy.align.dump"
VERSION = 1
TENSORS = "tensors.safetensors"
MANIFEST = "manifest.json"


@dataclass
class Dump:
    side: str
    tokens: list[int]
    prompt_len: int
    num_layers: int
    tensors: dict[Checkpoint, torch.Tensor]
    positions: dict[Checkpoint, list[int]]
    meta: dict[str, Any] = field(default_factory=dict)


def canonical(ck: Checkpoint, val: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """Bring an engine's recorded tensor to the canonical layout (logits: the real vocab only)."""
    if ck.op == "logits":
        return val[:, :vocab_size]
    return val


def make_dump(
    side: str,
    tokens: list[int],
    prompt_len: int,
    num_layers: int,
    vocab_size: int,
    records: dict[Checkpoint, tuple[torch.Tensor, torch.Tensor]],
    meta: dict[str, Any],
) -> Dump:
    tensors = {ck: canonical(ck, v, vocab_size).contiguous() for ck, (_, v) in records.items()}
    positions = {ck: [int(p) for p in pos] for ck, (pos, _) in records.items()}
    return Dump(side, list(tokens), prompt_len, num_layers, tensors, positions, meta)


def save_dump(dump: Dump, path: str | Path) -> Path:
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    order = sorted(dump.tensors, key=Checkpoint.sort_key)
    save_file({ck.name: dump.tensors[ck] for ck in order}, str(path / TENSORS), metadata={"format": FORMAT})
    manifest = {
        "format": FORMAT,
        "version": VERSION,
        "side": dump.side,
        "tokens": dump.tokens,
        "prompt_len": dump.prompt_len,
        "num_layers": dump.num_layers,
        "meta": dump.meta,
        "checkpoints": [
            {
                "name": ck.name,
                "layer": ck.layer,
                "op": ck.op,
                "shape": list(dump.tensors[ck].shape),
                "dtype": str(dump.tensors[ck].dtype).removeprefix("torch."),
                "positions": dump.positions[ck],
            }
            for ck in order
        ],
    }
    write_json_atomic(path / MANIFEST, manifest, indent=1)  # the manifest last: it marks a complete dump
    return path


def load_dump(path: str | Path) -> Dump:
    path = Path(path)
    if not (path / MANIFEST).exists():
        raise FileNotFoundError(f"{path} is not an alignment dump (no {MANIFEST})")
    manifest = json.loads((path / MANIFEST).read_text())
    if manifest.get("format") != FORMAT or manifest.get("version") != VERSION:
        raise ValueError(f"{path}: unsupported dump format {manifest.get('format')!r} v{manifest.get('version')}")
    raw = load_file(str(path / TENSORS))
    n = manifest["num_layers"]
    tensors, positions = {}, {}
    for entry in manifest["checkpoints"]:
        ck = parse_name(entry["name"], n)
        t = raw[entry["name"]]
        if list(t.shape) != entry["shape"] or len(entry["positions"]) != t.shape[0]:
            raise ValueError(
                f"{path}: {entry['name']} has shape {tuple(t.shape)}, manifest says {entry['shape']} "
                f"over {len(entry['positions'])} positions"
            )
        tensors[ck], positions[ck] = t, [int(p) for p in entry["positions"]]
    return Dump(
        manifest["side"], manifest["tokens"], manifest["prompt_len"], n, tensors, positions, manifest.get("meta", {})
    )
