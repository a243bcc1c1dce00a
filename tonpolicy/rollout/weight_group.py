"""Weight sync over a process group, SGLang's disk-free path (`/init_weights_update_group`,
`/update_weights_from_distributed`): the trainer's rank 0 is rank 0 of a group of its own with every
rollout engine rank, and broadcasts each updated tensor (full, HF-named) to them; nothing is written to
disk and no shared file system is assumed.

The group is made the way SGLang makes its end (`init_custom_process_group`): a TCP rendezvous at the
trainer's address, a store prefixed with the group name, and torch's own process-group constructor,
so a tonpolicy trainer, tonpolicy's embedded server and released SGLang all join the same group.
It lives beside the processes' default group (torchrun's, or none in the embedded server).
"""

from __future__ import annotations

import socket
import time
from collections.abc import Callable, Iterable
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

DEFAULT_GROUP = "weight_update_group"  # SGLang's default group name
# SGLang's load_format for one broadcast of the request's tensors as one flat byte buffer
# (sglang.srt.weight_sync.tensor_bucket.FlattenedTensorBucket: raw bytes, in order, each tensor at an
# offset aligned to its dtype).
FLATTENED_BUCKET = "flattened_bucket"


def listen(address: str) -> socket.socket:
    """A listening socket on `address` alone, its port chosen by the OS, for rank 0's rendezvous store:
    torch's store would otherwise listen on every interface (and a port guessed free can be raced for)."""
    family, kind, proto, _, where = socket.getaddrinfo(address, 0, type=socket.SOCK_STREAM)[0]
    sock = socket.socket(family, kind, proto)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(where)
    sock.listen(128)
    return sock


def init_update_group(
    backend: str,
    master_address: str,
    master_port: int,
    world_size: int,
    rank: int,
    group_name: str,
    timeout_s: float = 300.0,
    listener: socket.socket | None = None,
) -> Any:
    """Join the weight-update group (rank 0: the trainer, which hosts the rendezvous, on `listener`
    when given: see `listen`). Only ranks that know `group_name` find each other in the store."""
    from torch.distributed.distributed_c10d import PrefixStore, _new_process_group_helper, _world

    timeout = timedelta(seconds=timeout_s)
    # The store by hand, not torch's tcp:// rendezvous: under torchrun that would make rank 0 a client
    # of the agent's store (TORCHELASTIC_USE_AGENT_STORE) and nobody would host this one.
    bound = {"master_listen_fd": listener.detach()} if listener is not None else {}  # the store owns it now
    store = dist.TCPStore(master_address, master_port, world_size, is_master=rank == 0, timeout=timeout, **bound)
    store = PrefixStore(group_name, store)  # as SGLang does: one rendezvous may serve several groups
    pg, _ = _new_process_group_helper(world_size, rank, [], backend, store, group_name=group_name, timeout=timeout)
    _world.pg_group_ranks[pg] = {i: i for i in range(world_size)}
    return pg


def send(
    group: Any, tensors: Iterable[torch.Tensor], abandon: Callable[[], bool] = lambda: False, flattened: bool = False
) -> None:
    """Rank 0's side: broadcast each tensor, in the order the receivers were told (`flattened`: all of
    them as one byte buffer). `abandon` is polled while a broadcast waits: a receiver that refused the
    update never joins it, and the sender must not wait for it forever."""
    if flattened:
        tensors = [torch.cat([t.contiguous().flatten().view(torch.uint8) for t in tensors])]
    for t in tensors:
        work = dist.broadcast(t.contiguous(), src=0, group=group, async_op=True)
        while not work.is_completed():
            if abandon():
                raise RuntimeError("the receivers refused the weight update; the broadcast was abandoned")
            time.sleep(0.001)
        work.wait()


def receive(
    group: Any, dtypes: list[str], shapes: list[list[int]], device: str = "cpu", flattened: bool = False
) -> list[torch.Tensor]:
    """An engine rank's side: the tensors rank 0 broadcasts, allocated from their announced dtypes and shapes."""
    if flattened:
        return _receive_flat(group, [getattr(torch, d) for d in dtypes], shapes, device)
    out = []
    for dtype, shape in zip(dtypes, shapes, strict=True):
        t = torch.empty(shape, dtype=getattr(torch, dtype), device=device)
        dist.broadcast(t, src=0, group=group)
        out.append(t)
    return out


def _receive_flat(group: Any, dtypes: list[torch.dtype], shapes: list[list[int]], device: str) -> list[torch.Tensor]:
    offsets, offset = [], 0
    for dtype, shape in zip(dtypes, shapes, strict=True):
        if offset % dtype.itemsize:
            raise ValueError(f"a {dtype} tensor at byte offset {offset} is unaligned: order the bucket by dtype")
        offsets.append(offset)
        offset += torch.Size(shape).numel() * dtype.itemsize
    flat = torch.empty(offset, dtype=torch.uint8, device=device)
    dist.broadcast(flat, src=0, group=group)
    ends = [*offsets[1:], offset]
    return [
        flat[a:b].view(dtype).reshape(shape) for a, b, dtype, shape in zip(offsets, ends, dtypes, shapes, strict=True)
    ]


def buckets(tensors: list[torch.Tensor], max_bytes: int) -> list[list[int]]:
    """Indices of consecutive tensors, grouped so each group's bytes stay within `max_bytes` (a larger
    tensor goes alone)."""
    groups: list[list[int]] = []
    size = 0
    for i, t in enumerate(tensors):
        nbytes = t.numel() * t.element_size()
        if not groups or size + nbytes > max_bytes:
            groups.append([])
            size = 0
        groups[-1].append(i)
        size += nbytes
    return groups


def dtype_name(t: torch.Tensor) -> str:
    return str(t.dtype).removeprefix("torch.")


def destroy(group: Any) -> None:
    dist.destroy_process_group(group)
