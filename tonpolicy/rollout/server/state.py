"""What the embedded server's route handlers share: the state, and one way to run generate items.

`run_items` checks items against the model, gives each a seed and a rid, and submits them to the
engine loop; the caller collects the results, or (`stream`) iterates `(index, result so far)` as
tokens are sampled. Both the SGLang-native and the OpenAI-compatible routes go through it.
"""

from __future__ import annotations

import itertools
import queue
import threading
import uuid
from collections.abc import Iterator
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any

from tonpolicy.config.model import ModelConfig
from tonpolicy.model.tokenizer import TextTokenizer
from tonpolicy.rollout.engine.generation import GenResult
from tonpolicy.rollout.engine.loop import EngineLoop
from tonpolicy.rollout.server.args import ServerArgs
from tonpolicy.rollout.server.model import to_gen_request
from tonpolicy.rollout.wire.request import GenerateItem, ProtocolError

Response = tuple[int, Any]  # (status, JSON-able body | str | Stream | None)


@dataclass
class Stream:
    """A streamed answer: server-sent events, written as HTTP chunks as they come."""

    chunks: Iterator[bytes]


class ServerState:
    """The arguments, the engine loop and tokenizer once loaded, and bookkeeping."""

    def __init__(self, args: ServerArgs) -> None:
        self.args = args
        self.loop: EngineLoop | None = None
        self.model_config: ModelConfig | None = None  # set once the model is loaded
        self.tokenizer: TextTokenizer | None = None  # the checkpoint's, unless --skip-tokenizer-init
        # Computed from the kernel set the engine built, once it is built (never taken from flags).
        self.runtime: dict[str, Any] | None = None
        self.model_path: str | None = args.model_path
        self.port: int = args.port
        self.update_groups: dict[str, Any] = {}  # weight-update process groups, by name
        self.weight_update_session = False  # between /begin_weight_update and /end_weight_update
        self.bucket_names: set[str] = set()  # loaded by this session's flattened buckets
        self._seeds = itertools.count()
        self._lock = threading.Lock()

    @property
    def ready(self) -> bool:
        return self.loop is not None and self.loop.is_alive()

    @property
    def weight_version(self) -> str:
        return self.loop.tag if self.loop is not None else self.args.weight_version

    @property
    def model_name(self) -> str:
        """The served model's name (SGLang's --served-model-name defaults to the model path)."""
        return self.model_path or (self.model_config.name if self.model_config else "tonpolicy")

    def next_seed(self) -> int:
        # Requests without sampling_seed still get distinct, reproducible seeds (in arrival order).
        with self._lock:
            return self.args.random_seed + next(self._seeds)

    def tokenize(self, text: str) -> list[int]:
        if self.tokenizer is None:
            raise ProtocolError("this server has no tokenizer: send token ids")
        return self.tokenizer.encode(text)

    def decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids) if self.tokenizer is not None else ""


@dataclass
class Submitted:
    rids: list[str]
    future: Future  # of a BatchResult
    progress: queue.Queue | None  # (index, GenResult so far) when streaming


def not_ready() -> Response:
    return 503, {"error": {"message": "the engine is not ready"}}


def run_items(state: ServerState, items: list[GenerateItem], stream: bool = False) -> Submitted:
    """Check every item (one bad item refuses the request, not the batch it would join), then submit."""
    cfg = state.model_config
    assert state.loop is not None and cfg is not None, "callers check state.ready"
    for it in items:
        if max(it.input_ids) >= cfg.vocab_size or min(it.input_ids) < 0:
            raise ProtocolError(f"input_ids must be in [0, {cfg.vocab_size})")
        if len(it.input_ids) + it.sampling.max_new_tokens > cfg.max_position_embeddings:
            raise ProtocolError(
                f"prompt ({len(it.input_ids)}) + max_new_tokens ({it.sampling.max_new_tokens}) exceeds "
                f"the context length {cfg.max_position_embeddings}"
            )
    seeds = [it.sampling.sampling_seed if it.sampling.sampling_seed is not None else state.next_seed() for it in items]
    progress: queue.Queue | None = queue.Queue() if stream else None
    future = state.loop.generate(
        [to_gen_request(it, seed) for it, seed in zip(items, seeds, strict=True)],
        on_progress=(lambda i, result: progress.put((i, result))) if progress is not None else None,
    )
    return Submitted([it.rid or uuid.uuid4().hex for it in items], future, progress)


def progress_events(sub: Submitted, poll_s: float = 0.05) -> Iterator[tuple[int, GenResult]]:
    """(index, result so far) as tokens are sampled, each item's final result last; then the
    job's error, if it failed, is raised."""
    assert sub.progress is not None
    while True:
        try:
            yield sub.progress.get(timeout=poll_s)
        except queue.Empty:
            # Every progress report is queued before the future completes.
            if sub.future.done() and sub.progress.empty():
                break
    sub.future.result()
