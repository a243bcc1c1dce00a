"""Rank 0's object on every trainer rank."""

from __future__ import annotations

from typing import Any

import torch.distributed as dist


def broadcast(obj: Any) -> Any:
    """`obj` as rank 0 gave it (the other ranks pass anything, usually None)."""
    box = [obj]
    dist.broadcast_object_list(box, src=0)
    return box[0]
