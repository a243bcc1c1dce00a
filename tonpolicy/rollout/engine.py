"""Embedded rollout engine: continuous batching over a KV pool, optional chunked prefill, seeded
per-request sampling, and per-token fp32 logprobs from the step that sampled each token.

Each engine step forwards one flat batch made of prefill chunks (admission order, sharing a
`chunked_prefill_size` token budget) and one decode token per request already past its prompt.
Requests become visible at `arrival_step` and are admitted while fewer than `max_running_requests`
run, so batch composition changes as requests arrive and finish. Under the `contract` kernels each
logits row is independent of the batch, so results equal the request run alone and `score_logprobs`.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from tonpolicy.model.kv_cache import KVPool
from tonpolicy.model.qwen3 import Qwen3, Segment
from tonpolicy.rollout.sampling import make_generator, sample_token
from tonpolicy.rollout.scoring import score_logprobs
from tonpolicy.rollout.types import GenRequest, GenResult, logprob_temperature

__all__ = ["Engine", "GenRequest", "GenResult", "score_logprobs"]


@dataclass
class _Running:
    index: int
    req: GenRequest
    slot: int
    gen: torch.Generator
    prefilled: int = 0
    out_ids: list[int] = field(default_factory=list)
    out_lps: list[torch.Tensor] = field(default_factory=list)


class Engine:
    def __init__(
        self,
        model: Qwen3,
        *,
        max_running_requests: int,
        chunked_prefill_size: int | None = None,
        eos_token_id: int | None = None,
    ) -> None:
        if max_running_requests < 1:
            raise ValueError("max_running_requests must be >= 1")
        if chunked_prefill_size is not None and chunked_prefill_size < 1:
            raise ValueError("chunked_prefill_size must be >= 1 or None")
        self.model = model
        self.max_running = max_running_requests
        self.chunk = chunked_prefill_size
        self.eos_token_id = eos_token_id
        self.steps_run = 0  # engine steps of the last generate() call (for tests and benchmarks)

    def _check(self, req: GenRequest) -> None:
        cfg = self.model.cfg
        if not req.prompt_ids:
            raise ValueError("prompt_ids must be non-empty")
        if len(req.prompt_ids) + req.max_new_tokens > cfg.max_position_embeddings:
            raise ValueError("prompt + max_new_tokens exceeds max_position_embeddings")
        if any(not 0 <= t < cfg.vocab_size for t in req.prompt_ids):
            raise ValueError("prompt token id out of vocab range")

    @torch.no_grad()
    def generate(self, requests: list[GenRequest]) -> list[GenResult]:
        for r in requests:
            self._check(r)
        cfg = self.model.cfg
        results: list[GenResult | None] = [None] * len(requests)
        waiting = sorted(range(len(requests)), key=lambda i: (requests[i].arrival_step, i))
        for i in [i for i in waiting if requests[i].max_new_tokens <= 0]:
            results[i] = GenResult([], torch.empty(0, dtype=torch.float32), "length")
        waiting = [i for i in waiting if results[i] is None]
        if not waiting:
            return results  # type: ignore[return-value]
        cap = max(len(requests[i].prompt_ids) + requests[i].max_new_tokens for i in waiting)
        pool = KVPool(
            cfg.num_layers, min(self.max_running, len(waiting)), cap, cfg.num_kv_heads, cfg.head_dim,
            self.model.kernels.kv_cache_dtype(self.model.dtype), self.model.kernels.tile_size,
            self.model.model.embed_tokens.weight.device,
        )
        running: list[_Running] = []
        step = 0
        self.steps_run = 0
        while waiting or running:
            while waiting and len(running) < self.max_running and requests[waiting[0]].arrival_step <= step:
                i = waiting.pop(0)
                running.append(_Running(i, requests[i], pool.alloc(), make_generator(requests[i].seed)))
            if not running:
                step = requests[waiting[0]].arrival_step  # idle: jump to the next arrival
                continue
            for r in self._step(running, pool):
                running.remove(r)
                pool.release(r.slot)
                results[r.index] = self._result(r)
            step += 1
            self.steps_run += 1
        return results  # type: ignore[return-value]

    def _step(self, running: list[_Running], pool: KVPool) -> list[_Running]:
        """One forward over the current batch; returns the requests that finished."""
        budget = self.chunk if self.chunk is not None else float("inf")
        tokens: list[int] = []
        segments: list[Segment] = []
        samplers: list[_Running] = []
        rows: list[int] = []
        for r in running:
            prompt = r.req.prompt_ids
            if r.prefilled < len(prompt):
                take = int(min(len(prompt) - r.prefilled, budget))
                if take <= 0:
                    continue
                budget -= take
                segments.append(Segment(take, start=r.prefilled, slot=r.slot))
                tokens.extend(prompt[r.prefilled : r.prefilled + take])
                r.prefilled += take
                if r.prefilled < len(prompt):
                    continue  # prompt not complete yet: nothing to sample
            else:
                segments.append(Segment(1, start=len(prompt) + len(r.out_ids) - 1, slot=r.slot))
                tokens.append(r.out_ids[-1])
            rows.append(len(tokens) - 1)
            samplers.append(r)
        if not segments:
            return []
        logits = self.model.forward_segments(
            torch.tensor(tokens, dtype=torch.long), segments, pool, torch.tensor(rows, dtype=torch.long)
        )
        finished = []
        vocab = self.model.cfg.vocab_size
        logits = logits.cpu()  # sampling and logprobs run on the CPU with per-request CPU generators
        for j, r in enumerate(samplers):
            q = r.req
            row = logits[j : j + 1]
            tok = sample_token(row[0], vocab, q.temperature, q.top_p, q.top_k, r.gen)
            lp = self.model.kernels.logprobs(
                row, torch.tensor([tok]), vocab, logprob_temperature(q.temperature)
            )
            r.out_ids.append(tok)
            r.out_lps.append(lp)
            if self._stops(q, tok) or len(r.out_ids) >= q.max_new_tokens:
                finished.append(r)
        return finished

    def _stops(self, req: GenRequest, tok: int) -> bool:
        return tok in req.stop_token_ids or (self.eos_token_id is not None and tok == self.eos_token_id)

    def _result(self, r: _Running) -> GenResult:
        reason = "stop" if self._stops(r.req, r.out_ids[-1]) else "length"
        return GenResult(list(r.out_ids), torch.cat(r.out_lps).float(), reason)
