"""Embedded rollout engine: continuous batching over a KV pool, optional chunked prefill, seeded
per-request sampling, and per-token fp32 logprobs from the step that sampled each token.

Incremental API (what the server's engine loop drives): `add(request) -> handle` queues a request at
any time, even while others are mid-decode; `step()` runs one engine step and returns the
`(handle, GenResult)` pairs that finished in it; `has_work()` says whether anything is unfinished.
`generate(requests)` is `add` for each request, then `step` until done: one scheduling code path.

Each engine step forwards one flat batch made of prefill chunks (admission order, sharing a
`chunked_prefill_size` token budget) and one decode token per request already past its prompt.
A request becomes visible `arrival_step` steps after it was added (idle gaps are skipped, not
stepped through) and is admitted while fewer than `max_running_requests` run, so batch composition
changes as requests arrive and finish. Under the `invariant` kernels each logits row is independent
of the batch, so results equal the request run alone and `score_logprobs`.

The KV pool lives as long as the engine (or until `flush_cache`) and grows on admission, in slots
(up to `max_running_requests`) and in positions (up to what admitted requests need), so its memory
is bounded by max_running_requests x max_position_embeddings and is usually far less.

Prefix cache (`prefix_cache`, on by default as SGLang's radix cache; off: `--disable-radix-cache`): a
finished request's slot keeps the keys/values of the tokens it fed (prompt + output but the last) while
it is free; a new request whose prompt starts with such a prefix takes that slot and prefills only the
rest (`GenResult.cached_tokens`), as a later turn of a conversation does. A prefix is matched per slot
(the longest common prefix of token ids), not shared between running requests. It is exact under the
invariant kernels: K/V are per-row ops, so a position's cached K/V have the same bits whether a decode
step or a prefill wrote them, and attention reduces them in the same tile order
(tests/engine/test_prefix_cache.py, with `plain` as the control). `forget_prefixes` drops them (weight
updates must: cached K/V were computed with the old weights).
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass, field

import torch

from tonpolicy.kernels import logprob_temperature
from tonpolicy.model.kv_cache import KVPool
from tonpolicy.model.qwen3 import Qwen3, Segment
from tonpolicy.rollout.engine.generation import GenRequest, GenResult, TopLogprobs
from tonpolicy.rollout.engine.graphs import DecodeGraphs
from tonpolicy.rollout.engine.logits import make_generator, sample_token, score_logprobs, top_logprobs

__all__ = ["Engine", "GenRequest", "GenResult", "score_logprobs"]


@dataclass
class _Running:
    handle: int
    req: GenRequest
    slot: int
    gen: torch.Generator
    prefilled: int = 0
    cached: int = 0  # prompt tokens whose K/V came from the prefix cache
    out_ids: list[int] = field(default_factory=list)
    out_lps: list[torch.Tensor] = field(default_factory=list)
    out_top: list[TopLogprobs] = field(default_factory=list)
    in_lps: dict[int, float] = field(default_factory=dict)  # prompt position -> logprob
    in_top: dict[int, TopLogprobs] = field(default_factory=dict)
    error: str | None = None  # set when this request alone failed; it finishes with reason "error"
    routes: list[torch.Tensor] = field(default_factory=list)  # [fed positions, layers, k] per step, if asked


@dataclass(order=True)
class _Waiting:
    visible_at: int  # scheduler time at which the request may be admitted
    handle: int  # ties go to the request added first
    req: GenRequest = field(compare=False)


class Engine:
    def __init__(
        self,
        model: Qwen3,
        *,
        max_running_requests: int,
        chunked_prefill_size: int | None = None,
        eos_token_id: int | None = None,
        prefix_cache: bool = True,
        decode_graphs: DecodeGraphs | None = None,
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
        self.steps_total = 0  # engine steps since construction
        self._clock = 0  # scheduler time: one per step, jumps over idle gaps to the next arrival
        self._next_handle = 0
        self._waiting: list[_Waiting] = []  # sorted by (visible_at, handle)
        self._running: list[_Running] = []  # admission order
        self._done: list[tuple[int, GenResult]] = []  # finished without a step (max_new_tokens <= 0)
        self._pool: KVPool | None = None
        self.prefix_cache = prefix_cache
        # free slot -> the token ids whose K/V it holds at positions 0.. (oldest first: evicted first)
        self._prefixes: dict[int, list[int]] = {}
        # Decode-only steps through padded static buffers (CUDA graphs on a GPU); mixed steps run eagerly.
        self.decode_graphs = decode_graphs
        self.graph_steps = 0  # engine steps that went through `decode_graphs`

    # --- incremental API ------------------------------------------------------------------------
    def check(self, req: GenRequest) -> None:
        """Raise ValueError for a request the engine cannot run."""
        cfg = self.model.cfg
        if not req.prompt_ids:
            raise ValueError("prompt_ids must be non-empty")
        if len(req.prompt_ids) + req.max_new_tokens > cfg.max_position_embeddings:
            raise ValueError("prompt + max_new_tokens exceeds max_position_embeddings")
        if any(not 0 <= t < cfg.vocab_size for t in req.prompt_ids):
            raise ValueError("prompt token id out of vocab range")
        if not 0 <= req.seed < 2**63:
            raise ValueError(f"seed must be in [0, 2**63), got {req.seed}")
        if req.return_routed_experts and not cfg.is_moe:
            raise ValueError(f"return_routed_experts needs a mixture-of-experts model; {cfg.name} is dense")

    def add(self, req: GenRequest) -> int:
        """Queue a request (visible `req.arrival_step` steps from now); returns its handle."""
        self.check(req)
        handle = self._next_handle
        self._next_handle += 1
        if req.max_new_tokens <= 0 and req.prompt_logprobs_from is None:
            self._done.append((handle, GenResult([], torch.empty(0, dtype=torch.float32), "length")))
        else:
            bisect.insort(self._waiting, _Waiting(self._clock + req.arrival_step, handle, req))
        return handle

    def has_work(self) -> bool:
        return bool(self._waiting or self._running or self._done)

    @property
    def unfinished(self) -> int:
        """Requests added and not yet returned by `step`."""
        return len(self._waiting) + len(self._running) + len(self._done)

    @property
    def decoding(self) -> int:
        """Running requests whose prompt is fully prefilled (they have sampled at least one token)."""
        return sum(1 for r in self._running if r.out_ids)

    @torch.no_grad()
    def step(self) -> list[tuple[int, GenResult]]:
        """Admit what is visible, run one forward, return the requests that finished."""
        finished, self._done = self._done, []
        self._admit()
        if not self._running and self._waiting:
            self._clock = self._waiting[0].visible_at  # idle: jump to the next arrival
            self._admit()
        if not self._running:
            return finished
        pool = self._pool
        assert pool is not None  # admission allocated it
        for r in self._forward():
            self._running.remove(r)
            pool.release(r.slot)
            self._keep_prefix(r)
            finished.append((r.handle, self._result(r)))
        self._clock += 1
        self.steps_total += 1
        return finished

    def partial(self, handle: int) -> GenResult | None:
        """What a running request has produced so far (finish_reason ""); None when not running."""
        for r in self._running:
            if r.handle == handle:
                return self._result(r)
        return None

    def abort(self) -> list[int]:
        """Drop every unfinished request (after a failed step its state is unknown); their handles."""
        handles = [w.handle for w in self._waiting] + [r.handle for r in self._running]
        handles += [h for h, _ in self._done]
        self._waiting, self._running, self._done = [], [], []
        self._pool = None  # slots of dropped requests are not worth tracking down
        self._prefixes = {}
        return handles

    def flush_cache(self) -> None:
        """Free the KV pool and the prefix cache in it."""
        if self._running:
            raise RuntimeError("flush_cache while requests are running")
        self._pool = None
        self._prefixes = {}

    def forget_prefixes(self) -> None:
        """Drop the prefix cache (safe while requests run: only free slots hold cached prefixes)."""
        self._prefixes = {}

    @property
    def cached_prefixes(self) -> int:
        """Free slots holding a reusable prefix (for tests)."""
        return len(self._prefixes)

    # --- whole batch ----------------------------------------------------------------------------
    @torch.no_grad()
    def generate(self, requests: list[GenRequest]) -> list[GenResult]:
        """Run `requests` to completion (arrival_step counted from this call); results in order."""
        if self.has_work():
            raise RuntimeError("generate() needs an idle engine; requests added with add() are unfinished")
        for r in requests:
            self.check(r)  # all or nothing: no request is queued when one is invalid
        index = {self.add(r): i for i, r in enumerate(requests)}
        results: list[GenResult | None] = [None] * len(requests)
        start = self.steps_total
        try:
            while self.has_work():
                for handle, res in self.step():
                    results[index[handle]] = res
        except BaseException:
            self.abort()  # leave the engine usable for the next call
            raise
        finally:
            self.steps_run = self.steps_total - start
        failed = [(i, r.error) for i, r in enumerate(results) if r is not None and r.finish_reason == "error"]
        if failed:
            raise RuntimeError(f"request {failed[0][0]} failed: {failed[0][1]}")
        return results  # type: ignore[return-value]

    # --- scheduling internals -------------------------------------------------------------------
    def _admit(self) -> None:
        while self._waiting and len(self._running) < self.max_running and self._waiting[0].visible_at <= self._clock:
            w = self._waiting.pop(0)
            slot, hit = self._alloc_slot(w.req)
            self._running.append(_Running(w.handle, w.req, slot, make_generator(w.req.seed), prefilled=hit, cached=hit))

    def _alloc_slot(self, req: GenRequest) -> tuple[int, int]:
        """A free slot for `req` and how many of its prompt tokens that slot already holds."""
        pool = self._pool
        positions = len(req.prompt_ids) + req.max_new_tokens
        if pool is None or not pool.free or pool.capacity < positions:
            pool = self._grow_pool(positions)
        slot, hit = self._best_slot(pool.free, req)
        pool.free.remove(slot)
        self._prefixes.pop(slot, None)  # its positions are the new request's now
        return slot, hit

    def _best_slot(self, free: list[int], req: GenRequest) -> tuple[int, int]:
        """The free slot with the longest cached prefix of the prompt (at least the last prompt token is
        fed, to sample from its logits); else an empty slot, else the oldest cached one."""
        prompt = req.prompt_ids
        # Prompt logprobs and routes are reported from the request's own prefill rows: no reuse.
        usable = self.prefix_cache and req.prompt_logprobs_from is None and not req.return_routed_experts
        best, best_hit = None, 0
        for slot, ids in self._prefixes.items() if usable else ():
            n, limit = 0, min(len(ids), len(prompt) - 1)
            while n < limit and ids[n] == prompt[n]:
                n += 1
            if n > best_hit:
                best, best_hit = slot, n
        if best is not None:
            return best, best_hit
        empty = [s for s in free if s not in self._prefixes]
        return (empty[-1] if empty else next(iter(self._prefixes))), 0  # free pops from its end: lowest first

    def _keep_prefix(self, r: _Running) -> None:
        """A finished request's fed tokens stay in its (now free) slot for a later prompt to reuse."""
        if not self.prefix_cache or r.error is not None:
            return
        fed = r.prefilled + max(len(r.out_ids) - 1, 0)  # the last sampled token was never fed
        if fed > 0:
            self._prefixes[r.slot] = [*r.req.prompt_ids, *r.out_ids][:fed]

    def _grow_pool(self, positions: int) -> KVPool:
        """A larger pool holding the running requests' keys/values at their slots. Doubling keeps
        regrowth rare; capacity never matters numerically (attention reads only visible tiles)."""
        old = self._pool
        cfg = self.model.cfg
        slots, cap = len(self._running) + 1, positions
        if old is not None:
            slots = max(slots, old.slots * (1 if old.free else 2))
            cap = max(cap, old.capacity * (1 if old.capacity >= positions else 2))
        slots, cap = min(slots, self.max_running), min(cap, cfg.max_position_embeddings)
        pool = KVPool(
            cfg.num_layers,
            slots,
            cap,
            cfg.num_kv_heads,
            cfg.head_dim,
            self.model.kernels.kv_cache_dtype(self.model.dtype),
            self.model.kernels.attention_tile,
            self.model.model.embed_tokens.weight.device,
            self.model.kernels.kv_pool_layout,
        )
        if old is not None:
            pool.copy_from(old)
        used = {r.slot for r in self._running}
        pool.free = [s for s in range(slots - 1, -1, -1) if s not in used]  # lowest slot first, as KVPool
        self._pool = pool
        return pool

    def _forward(self) -> list[_Running]:
        """One forward over the current batch; returns the requests that finished."""
        running, pool = self._running, self._pool
        budget = self.chunk if self.chunk is not None else float("inf")
        tokens: list[int] = []
        segments: list[Segment] = []
        samplers: list[_Running] = []
        rows: list[int] = []
        scored: list[tuple[_Running, int, int]] = []  # (request, flat row, prompt position it predicts)
        fed: list[tuple[_Running, int, int]] = []  # (request, first flat row, rows) of each segment
        decode_only = True
        for r in running:
            prompt = r.req.prompt_ids
            if r.prefilled < len(prompt):
                take = int(min(len(prompt) - r.prefilled, budget))
                if take <= 0:
                    continue
                decode_only = False
                budget -= take
                segments.append(Segment(take, start=r.prefilled, slot=r.slot))
                fed.append((r, len(tokens), take))
                first = r.req.prompt_logprobs_from
                if first is not None:  # the row at position p predicts prompt token p + 1
                    base = len(tokens) - r.prefilled
                    # SGLang leaves the first position's logprob null, whatever the start
                    lo, hi = max(r.prefilled + 1, first + 1), min(r.prefilled + take, len(prompt) - 1)
                    scored += [(r, base + p - 1, p) for p in range(lo, hi + 1)]
                tokens.extend(prompt[r.prefilled : r.prefilled + take])
                r.prefilled += take
                if r.prefilled < len(prompt):
                    continue  # prompt not complete yet: nothing to sample
            else:
                segments.append(Segment(1, start=len(prompt) + len(r.out_ids) - 1, slot=r.slot))
                fed.append((r, len(tokens), 1))
                tokens.append(r.out_ids[-1])
            rows.append(len(tokens) - 1)
            samplers.append(r)
        if not segments:
            return []
        want_routes = any(r.req.return_routed_experts for r, _, _ in fed)
        if want_routes:
            self.model.routes = {}  # the MoE model leaves each layer's routing of every row there
        try:
            if decode_only and not want_routes and self.decode_graphs is not None:
                assert pool is not None
                logits = self.decode_graphs.run(tokens, [s.start for s in segments], [r.slot for r in samplers], pool)
                self.graph_steps += 1
            else:
                logits = self.model.forward_segments(
                    torch.tensor(tokens, dtype=torch.long),
                    segments,
                    pool,
                    torch.tensor(rows + [row for _, row, _ in scored], dtype=torch.long),
                )
            if want_routes:
                self._keep_routes(fed, self.model.routes)
        finally:
            if want_routes:
                self.model.routes = None
        self._score_prompts(logits[len(rows) :], scored)
        finished = []
        vocab = self.model.cfg.vocab_size
        # Sampling runs on the CPU (per-request CPU generators); the logprob runs where the logits are,
        # as in the trainer: a kernel set's logprob on a GPU is not its logprob on the CPU.
        sample_rows = logits.cpu()
        for j, r in enumerate(samplers):
            q = r.req
            if q.max_new_tokens <= 0:  # it only asked for its prompt's logprobs
                finished.append(r)
                continue
            try:  # one request's failure ends that request, not the batch
                tok = sample_token(sample_rows[j], vocab, q.temperature, q.top_p, q.top_k, r.gen)
                lp = self.model.kernels.logprobs(
                    logits[j : j + 1],
                    torch.tensor([tok], device=logits.device),
                    vocab,
                    logprob_temperature(q.temperature),
                ).cpu()
            except Exception as e:  # noqa: BLE001 - reported to that request's caller
                r.error = f"{type(e).__name__}: {e}"
                finished.append(r)
                continue
            r.out_ids.append(tok)
            r.out_lps.append(lp)
            if q.top_logprobs_num > 0:
                r.out_top.append(top_logprobs(self.model, logits[j], q.top_logprobs_num, q.temperature))
            if self._stops(q, tok) or len(r.out_ids) >= q.max_new_tokens:
                finished.append(r)
        return finished

    def _keep_routes(self, fed: list[tuple[_Running, int, int]], routes: dict) -> None:
        """Each asking request's rows of this step's routing: [rows, layers, k], -1 in dense layers."""
        cfg = self.model.cfg
        n = sum(take for _, _, take in fed)
        table = torch.full((n, cfg.num_layers, cfg.num_experts_per_tok), -1, dtype=torch.int32)
        for layer, r in routes.items():
            table[:, layer] = r.experts.to(torch.int32).cpu()
        for r, start, take in fed:
            if r.req.return_routed_experts:
                r.routes.append(table[start : start + take])

    def _score_prompts(self, logits: torch.Tensor, scored: list[tuple[_Running, int, int]]) -> None:
        """Logprobs of prompt tokens (requests that asked), from their own prefill rows."""
        vocab = self.model.cfg.vocab_size
        for j, (r, _, p) in enumerate(scored):
            q = r.req
            target = torch.tensor([q.prompt_ids[p]], device=logits.device)
            lp = self.model.kernels.logprobs(logits[j : j + 1], target, vocab, logprob_temperature(q.temperature))
            r.in_lps[p] = float(lp.cpu()[0])
            if q.top_logprobs_num > 0:
                r.in_top[p] = top_logprobs(self.model, logits[j], q.top_logprobs_num, q.temperature)

    def _stops(self, req: GenRequest, tok: int) -> bool:
        if req.ignore_eos:  # SGLang: ignore_eos ignores stop_token_ids too
            return False
        return tok in req.stop_token_ids or (self.eos_token_id is not None and tok == self.eos_token_id)

    def _result(self, r: _Running) -> GenResult:
        """The request's result; finish_reason is "" while it is still running."""
        lps = torch.cat(r.out_lps).float() if r.out_lps else torch.empty(0, dtype=torch.float32)
        extras = {
            "routed_experts": torch.cat(r.routes) if r.req.return_routed_experts and r.routes else None,
            "output_top_logprobs": list(r.out_top),
            "prompt_logprobs": dict(r.in_lps),
            "prompt_top_logprobs": dict(r.in_top),
        }
        if r.error is not None:
            return GenResult(list(r.out_ids), lps, "error", r.error, cached_tokens=r.cached, **extras)
        stopped = bool(r.out_ids) and self._stops(r.req, r.out_ids[-1])
        done = stopped or len(r.out_ids) >= r.req.max_new_tokens
        reason = ("stop" if stopped else "length") if done else ""
        return GenResult(list(r.out_ids), lps, reason, cached_tokens=r.cached, **extras)
