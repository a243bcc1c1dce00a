"""Read the history rows of an offline W&B run file (run-*.wandb) without a network or the W&B app.

The file is W&B's 7-byte header (":W&B", magic 0xBEE1, version) followed by a LevelDB-style log:
32 KiB blocks of chunks, each chunk [crc32 u32][length u16][type u8] + payload, where type 1 is a
whole record and 2/3/4 are first/middle/last pieces. Every record is a `wandb_internal_pb2.Record`.
(wandb 0.31 no longer ships a Python reader for it.)
"""

from __future__ import annotations

import json
import struct
from pathlib import Path
from typing import Any

BLOCK = 32768
HEADER = 7


def _payloads(data: bytes):  # noqa: ANN202
    pos, pieces = HEADER, b""
    while pos + 7 <= len(data):
        room = BLOCK - pos % BLOCK
        if room < 7:
            pos += room
            continue
        _crc, length, kind = struct.unpack("<IHB", data[pos : pos + 7])
        chunk = data[pos + 7 : pos + 7 + length]
        pos += 7 + length
        if kind == 1:
            yield chunk
        elif kind == 2:
            pieces = chunk
        elif kind == 3:
            pieces += chunk
        elif kind == 4:
            yield pieces + chunk
        elif kind == 0 and length == 0:  # zero padding at a block's end
            pos += BLOCK - pos % BLOCK if pos % BLOCK else 0


def history(run_file: Path) -> list[dict[str, Any]]:
    from wandb.proto import wandb_internal_pb2 as pb

    assert run_file.read_bytes()[:4] == b":W&B", run_file
    rows = []
    for payload in _payloads(run_file.read_bytes()):
        record = pb.Record()
        record.ParseFromString(payload)
        if record.WhichOneof("record_type") == "history":
            rows.append({(i.key or "/".join(i.nested_key)): json.loads(i.value_json) for i in record.history.item})
    return rows
