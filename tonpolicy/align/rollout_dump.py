"""Dumps of the rollout side: the engine's decode path (prefill + one KV-cached step per token) and,
as a second reference, one full-sequence forward of the same rollout model.

While dumping, the model's kernel set is swapped for a RecordingKernels proxy, its `forward_segments`
is wrapped to tell the proxy which absolute positions the step's rows (and logits rows) hold, and its
`fused` weight cache (if any) to tell it which weights a fused QKV / gate-up matrix is made of; all
are removed afterwards, so a model that is not dumping runs untouched.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch

from tonpolicy.align.dump import Dump, make_dump
from tonpolicy.align.names import hf_weight_role
from tonpolicy.align.recorder import RecordingKernels, Selection
from tonpolicy.kernels import logprob_temperature
from tonpolicy.model.qwen3 import Qwen3, Segment
from tonpolicy.rollout.engine import Engine
from tonpolicy.rollout.engine.generation import GenRequest


def make_recorder(model: Qwen3, selection: Selection, perturb: dict | None = None) -> RecordingKernels:
    cfg = model.cfg
    rec = RecordingKernels(
        model.kernels, cfg.num_layers, cfg.num_attention_heads // cfg.num_kv_heads, cfg.head_dim, selection, perturb
    )
    rec.bind_weights(dict(model.named_parameters()), lambda n: hf_weight_role(n, cfg))
    return rec


@contextmanager
def recording(model: Qwen3, rec: RecordingKernels) -> Iterator[RecordingKernels]:
    """Install the proxy (and the row-position wrapper) on `model` for the duration of the block."""
    inner_forward = model.forward_segments

    def forward_segments(
        input_ids: torch.Tensor, segments: list[Segment], kv: Any = None, logit_rows: torch.Tensor | None = None
    ) -> torch.Tensor:
        pos = torch.cat([torch.arange(s.start, s.start + s.length) for s in segments])
        rec.set_rows(pos, None if logit_rows is None else pos.index_select(0, logit_rows))
        return inner_forward(input_ids, segments, kv, logit_rows)

    wrapped = {"forward_segments": forward_segments}
    if hasattr(model, "fused"):  # the model fuses QKV and gate/up weights into cached row-concatenations
        inner_fused = model.fused

        def fused(name: str, weights: list[torch.Tensor]) -> torch.Tensor:
            w = inner_fused(name, weights)
            rec.bind_concat(w, weights)
            return w

        wrapped["fused"] = fused
    saved = model.kernels
    model.kernels = rec
    for name, fn in wrapped.items():  # instance attributes shadow the methods
        setattr(model, name, fn)
    try:
        yield rec
    finally:
        model.kernels = saved
        for name in wrapped:
            delattr(model, name)


def decode_dump(
    model: Qwen3,
    request: GenRequest,
    selection: Selection,
    *,
    chunked_prefill_size: int | None = None,
    perturb: dict | None = None,
    meta: dict | None = None,
) -> tuple[Dump, list[int], torch.Tensor]:
    """Generate `request` with the embedded engine while recording. Returns the dump, the response
    ids and the engine's own logprobs (which the dump's `logprobs` must equal)."""
    rec = make_recorder(model, selection, perturb)
    engine = Engine(model, max_running_requests=1, chunked_prefill_size=chunked_prefill_size)
    with recording(model, rec):
        (result,) = engine.generate([request])
    tokens = list(request.prompt_ids) + list(result.output_ids)
    info = {
        "engine": "embedded",
        "path": "decode",
        "kernels": rec.inner.name,
        "perturb": sorted(str(c) for c in (perturb or {})),
        **(meta or {}),
    }
    dump = make_dump(
        "rollout",
        tokens,
        len(request.prompt_ids),
        model.cfg.num_layers,
        model.cfg.vocab_size,
        rec.records.collect(),
        info,
    )
    return dump, list(result.output_ids), result.output_logprobs


@torch.no_grad()
def full_forward_dump(
    model: Qwen3,
    tokens: list[int],
    prompt_len: int,
    temperature: float,
    selection: Selection,
    *,
    perturb: dict | None = None,
    meta: dict | None = None,
) -> Dump:
    """One causal forward over prompt+response (no KV cache), logprobs of every next token."""
    rec = make_recorder(model, selection, perturb)
    ids = torch.tensor(tokens, dtype=torch.long)
    with recording(model, rec):
        logits = model(ids)
        rec.set_rows(torch.arange(len(tokens) - 1))  # the last position predicts no token of the sample
        rec.logprobs(logits[:-1], ids[1:], model.cfg.vocab_size, logprob_temperature(temperature))
    info = {
        "engine": "embedded",
        "path": "full_forward",
        "kernels": rec.inner.name,
        "perturb": sorted(str(c) for c in (perturb or {})),
        **(meta or {}),
    }
    return make_dump(
        "rollout_full", tokens, prompt_len, model.cfg.num_layers, model.cfg.vocab_size, rec.records.collect(), info
    )
