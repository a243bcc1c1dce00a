"""megatron-core's distributed checkpoint (its `torch_dist` format), with the files written by the
calling process.

megatron's `torch_dist` save hands its files to a writer that forks one process per file and collects
their results through a `multiprocessing` Manager, a spawned server process cached for the life of the
rank. tonpolicy's processes end with `os._exit` (and a run may be killed with SIGKILL), which skips the
Manager's shutdown: its server outlives the run. The strategy here is megatron's own (the plan, the
metadata, the format, each file written by megatron's per-file writer) except that the files are
written in this process, one after another, with in-process queues. Loading is megatron's unchanged.
"""

from __future__ import annotations

import queue
import shutil
from collections.abc import Iterator
from contextlib import contextmanager
from functools import partial
from pathlib import Path
from typing import Any

import torch.distributed as dist
from megatron.core import dist_checkpointing
from megatron.core.dist_checkpointing.strategies import filesystem_async
from megatron.core.dist_checkpointing.strategies.async_utils import AsyncRequest
from megatron.core.dist_checkpointing.strategies.filesystem_async import FileSystemWriterAsync
from megatron.core.dist_checkpointing.strategies.state_dict_saver import save_state_dict_async_finalize
from megatron.core.dist_checkpointing.strategies.torch import TorchDistSaveShardedStrategy


def _write_here(transforms: list[Any], rank: int, buckets: list[Any], results: queue.Queue) -> None:
    """What megatron's forked writers do, in this process: each bucket (a file) written and fsynced,
    the write results (or the first error) put on `results` keyed by the bucket's index."""
    written: dict[int, Any] = {}
    for index, bucket in enumerate(buckets):
        done, count = queue.Queue(), queue.Queue()
        count.put(index)  # the writer marks its bucket done on this queue
        FileSystemWriterAsync.write_preloaded_data(transforms, index, bucket, done, count, use_fsync=True)
        _, result = done.get()
        if isinstance(result, Exception):
            results.put(result)
            return
        written[index] = result
    results.put(written)


@contextmanager
def _in_process_results() -> Iterator[None]:
    """The writer takes its results queue from this module function (a spawned Manager's queue)."""
    original = filesystem_async._get_write_results_queue
    filesystem_async._get_write_results_queue = queue.Queue
    try:
        yield
    finally:
        filesystem_async._get_write_results_queue = original


class InProcessTorchDistSave(TorchDistSaveShardedStrategy):
    """megatron's `torch_dist` save, one file per rank, written by the calling process."""

    def __init__(self) -> None:
        super().__init__("torch_dist", 1, thread_count=1)

    def async_save(self, sharded_state_dict: Any, checkpoint_dir: Path) -> AsyncRequest:
        with _in_process_results():
            return super().async_save(sharded_state_dict, checkpoint_dir)

    def _get_save_and_finalize_callbacks(self, writer: FileSystemWriterAsync, save_state_dict_ret: Any) -> AsyncRequest:
        _, _, args = writer.get_save_function_and_args()

        def finalize() -> None:
            save_state_dict_async_finalize(*save_state_dict_ret)

        if not args:  # nothing of this rank's to write
            return AsyncRequest(None, [], [finalize])
        transforms = [writer.transforms] if hasattr(writer, "transforms") else []
        # A blocking copy to the host: its non-blocking form waits with torch.cuda.synchronize().
        preload = partial(writer.preload_tensors, writer.write_buckets, False)
        return AsyncRequest(partial(_write_here, transforms), args, [finalize], preload_fn=preload)


def save(sharded_state_dict: dict[str, Any], directory: Path) -> None:
    """Save `sharded_state_dict` (megatron ShardedTensors and plain objects) into `directory`, made
    afresh (a collective)."""
    if dist.get_rank() == 0:
        shutil.rmtree(directory, ignore_errors=True)  # what a save killed midway left
        directory.mkdir(parents=True)
    dist.barrier()
    dist_checkpointing.save(sharded_state_dict, str(directory), sharded_strategy=InProcessTorchDistSave())


def load(sharded_state_dict: dict[str, Any], directory: Path) -> dict[str, Any]:
    """The saved tensors resharded to the ShardedTensors of `sharded_state_dict` (this rank's layout)."""
    return dist_checkpointing.load(sharded_state_dict, str(directory))
