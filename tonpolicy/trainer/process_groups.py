"""Process-group setup for the trainer and a spawn helper for multi-process runs.

One process per (tp, pp, cp) rank; data parallel size is world / (tp*pp*cp). The sizes are the config's
`Layout` (tonpolicy.config.layout), re-exported here for the trainer. CPU uses gloo (with the
megatron CUDA redirections of `cpu_compat`), GPU uses NCCL.
"""

from __future__ import annotations

import io
import os
import traceback
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from tonpolicy.config.layout import Layout as Layout
from tonpolicy.ports import free_port
from tonpolicy.process_exit import exit_now


def device() -> torch.device:
    if torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def init_distributed(layout: Layout, seed: int = 1234) -> None:
    """Initialize torch.distributed from the env (MASTER_ADDR/PORT, RANK, WORLD_SIZE) and megatron's
    model-parallel groups for `layout`. Safe to call again with the same layout after `reset_model_parallel`."""
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

    from tonpolicy.trainer import cpu_compat

    if not dist.is_initialized():
        if torch.cuda.is_available():
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", os.environ.get("RANK", "0"))))
            dist.init_process_group("nccl")
        else:
            dist.init_process_group("gloo")
    cpu_compat.apply()
    parallel_state.initialize_model_parallel(**layout.megatron_sizes)
    model_parallel_cuda_manual_seed(seed, force_reset_rng=True)


def reset_model_parallel() -> None:
    """Tear down megatron's groups (keeps the world group) so another layout can be initialized."""
    from megatron.core import parallel_state

    parallel_state.destroy_model_parallel()


def _to_bytes(obj: Any) -> bytes:
    buf = io.BytesIO()
    torch.save(obj, buf)
    return buf.getvalue()


def _child(rank: int, world: int, port: int, fn: Callable[..., Any], args: tuple, queue: Any) -> None:
    os.environ.update(
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank)
    )
    torch.set_num_threads(1)  # the build machine has 2 shared cores; ranks must not oversubscribe
    try:
        out = fn(*args)
        # As bytes: a tensor put on the queue as is travels as a shared-memory fd that the parent must
        # fetch from this process while it still lives (a rank that exits first fails the parent's get).
        queue.put((rank, "ok", _to_bytes(out) if rank == 0 else None))
    except BaseException:  # report to the parent instead of hanging the others
        queue.put((rank, "error", traceback.format_exc()))
        raise
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    queue.close()
    queue.join_thread()  # the result is in the pipe: nothing of this rank's is left to lose
    exit_now(0)


def spawn(fn: Callable[..., Any], world_size: int, *args: Any, timeout: float = 600.0) -> Any:
    """Run `fn(*args)` in `world_size` fresh processes (gloo/NCCL env set); return rank 0's result.
    `fn` must be importable (module level)."""
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_child, args=(r, world_size, port, fn, args, queue)) for r in range(world_size)]
    for p in procs:
        p.start()
    result, errors = None, []
    try:
        for _ in range(world_size):
            rank, status, payload = queue.get(timeout=timeout)
            if status == "error":
                errors.append(f"rank {rank}:\n{payload}")
                break
            if rank == 0:
                result = torch.load(io.BytesIO(payload), weights_only=False)
    finally:
        for p in procs:
            p.join(timeout=5 if errors else timeout)
            if p.is_alive():
                p.kill()
    if errors:
        raise RuntimeError("spawned rank failed\n" + "\n".join(errors))
    return result
