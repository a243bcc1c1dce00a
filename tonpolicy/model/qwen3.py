"""Qwen3 dense (GQA, QK RMSNorm, RoPE, SwiGLU, tied or untied embeddings) on top of a kernel set.

No parallelism here: every numeric op is a call into the kernel set. Parameters carry the Hugging
Face names. Logits are fp32 over the *padded* vocab (`padded_vocab_size(vocab, canonical_shards)`
columns; pad columns come from zero weight rows); `kernels.logprobs` truncates to the real vocab.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from tonpolicy.config.model import ModelConfig
from tonpolicy.kernels import KernelSet, padded_vocab_size
from tonpolicy.model.checkpoint import init_state_dict, param_shapes
from tonpolicy.model.kv_cache import KVPool

# Position of a padding key in a batched call: after every query, so no query sees it.
PAD_KEY_POSITION = 2**62


@dataclass
class Segment:
    """A run of consecutive tokens of one sequence inside a flat token batch.

    start: absolute position of the first token. slot: KV pool slot (its keys [0, start) must already
    be cached); None means no cache: the segment attends only to itself and must start at 0."""

    length: int
    start: int = 0
    slot: int | None = None


@dataclass
class _DecodeTokens:
    """The single-token (decode) segments of a forward, gathered once for every layer."""

    rows: torch.Tensor  # their rows in the flat token batch
    slots: torch.Tensor  # their KV pool slots
    starts: torch.Tensor  # their positions (where their keys/values are written)
    q_pos: torch.Tensor  # [n, 1]
    num_keys: int  # keys the longest of them sees

    @staticmethod
    def of(segments: list[Segment], pos: torch.Tensor, kv: KVPool | None) -> _DecodeTokens | None:
        offs, rows, picked = 0, [], []
        for s in segments:
            if s.slot is not None and s.length == 1:
                rows.append(offs)
                picked.append(s)
            offs += s.length
        if not picked:
            return None
        assert kv is not None
        starts = [s.start for s in picked]
        kv.check_positions(max(starts))
        r = torch.tensor(rows, device=pos.device)
        slots = torch.tensor([s.slot for s in picked])
        return _DecodeTokens(r, slots, torch.tensor(starts), pos.index_select(0, r)[:, None], max(starts) + 1)


class Weight(nn.Module):
    """Holds one `weight` parameter so the state dict carries HF names."""

    def __init__(self, shape: tuple[int, ...], dtype: torch.dtype) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(shape, dtype=dtype), requires_grad=False)


class Qwen3(nn.Module):
    def __init__(
        self,
        cfg: ModelConfig,
        kernels: KernelSet,
        dtype: torch.dtype,
        state_dict: dict[str, torch.Tensor] | None = None,
    ) -> None:
        super().__init__()
        self.cfg, self.kernels, self.dtype = cfg, kernels, dtype
        self.model = nn.Module()
        self.model.embed_tokens = Weight((cfg.vocab_size, cfg.hidden_size), dtype)
        self.model.layers = nn.ModuleList()
        self._lm_cache: tuple[tuple[int, int], torch.Tensor] | None = None
        self._fused: dict[str, tuple[tuple[tuple[int, int], ...], torch.Tensor]] = {}
        for _ in range(cfg.num_layers):
            layer = nn.Module()
            layer.input_layernorm = Weight((cfg.hidden_size,), dtype)
            layer.post_attention_layernorm = Weight((cfg.hidden_size,), dtype)
            attn = nn.Module()
            attn.q_proj = Weight((cfg.q_size, cfg.hidden_size), dtype)
            attn.k_proj = Weight((cfg.kv_size, cfg.hidden_size), dtype)
            attn.v_proj = Weight((cfg.kv_size, cfg.hidden_size), dtype)
            attn.o_proj = Weight((cfg.hidden_size, cfg.q_size), dtype)
            attn.q_norm = Weight((cfg.head_dim,), dtype)
            attn.k_norm = Weight((cfg.head_dim,), dtype)
            layer.self_attn, layer.mlp = attn, self._build_mlp(len(self.model.layers))
            self.model.layers.append(layer)
        self.model.norm = Weight((cfg.hidden_size,), dtype)
        if not cfg.tie_word_embeddings:
            self.lm_head = Weight((cfg.vocab_size, cfg.hidden_size), dtype)
        assert set(dict(self.named_parameters())) == set(param_shapes(cfg))
        self.load_weights(state_dict if state_dict is not None else init_state_dict(cfg, dtype, cfg.init_seed))
        self.padded_vocab = padded_vocab_size(cfg.vocab_size, getattr(kernels, "canonical_shards", 1))

    def _build_mlp(self, layer: int) -> nn.Module:
        """Layer `layer`'s feed-forward block (a family with another block overrides this and `_mlp`)."""
        cfg, dtype = self.cfg, self.dtype
        mlp = nn.Module()
        mlp.gate_proj = Weight((cfg.intermediate_size, cfg.hidden_size), dtype)
        mlp.up_proj = Weight((cfg.intermediate_size, cfg.hidden_size), dtype)
        mlp.down_proj = Weight((cfg.hidden_size, cfg.intermediate_size), dtype)
        return mlp

    def _mlp(self, li: int, mlp: nn.Module, x: torch.Tensor) -> torch.Tensor:
        """The dense SwiGLU block: fused gate/up (column), down over the canonical K-shards (row)."""
        f = self.cfg.intermediate_size
        gate, up = self.fused_linear(x, f"{li}.gate_up", [mlp.gate_proj.weight, mlp.up_proj.weight]).split(
            [f, f], dim=-1
        )
        return self.kernels.linear_k_sharded(self.kernels.swiglu(gate, up), mlp.down_proj.weight)

    @torch.no_grad()
    def load_weights(self, state_dict: dict[str, torch.Tensor], partial: bool = False) -> None:
        """Copy an HF-named state dict in (cast to the model dtype); strict on names: all of them, or
        (`partial`) any subset, e.g. one bucket of a weight sync."""
        params = dict(self.named_parameters())
        sd = {k: v for k, v in state_dict.items() if not (k == "lm_head.weight" and self.cfg.tie_word_embeddings)}
        if set(sd) - set(params) or (not partial and set(sd) != set(params)):
            raise KeyError(f"state dict mismatch: missing {set(params) - set(sd)}, extra {set(sd) - set(params)}")
        for k, v in sd.items():
            params[k].copy_(v.to(self.dtype))
        self._lm_cache = None
        self._fused.clear()

    def lm_weight(self) -> torch.Tensor:
        """LM head weight padded with zero rows to the padded vocab (cached per weight version)."""
        w = (self.model.embed_tokens if self.cfg.tie_word_embeddings else self.lm_head).weight
        key = (w.data_ptr(), w._version)
        if self._lm_cache is None or self._lm_cache[0] != key:
            pad = self.padded_vocab - w.shape[0]
            self._lm_cache = (key, torch.nn.functional.pad(w.detach(), (0, 0, 0, pad)))
        return self._lm_cache[1]

    def fused(self, name: str, weights: list[torch.Tensor]) -> torch.Tensor:
        """Row-concatenation of weights (QKV, gate/up), cached per weight version. One wide linear
        equals the separate ones column for column (column invariance, tests/kernels/test_kernels_linear.py)."""
        key = tuple((w.data_ptr(), w._version) for w in weights)
        hit = self._fused.get(name)
        if hit is None or hit[0] != key:
            hit = (key, torch.cat([w.detach() for w in weights]))
            self._fused[name] = hit
        return hit[1]

    def fused_linear(self, x: torch.Tensor, name: str, weights: list[torch.Tensor]) -> torch.Tensor:
        """The column linear of the fused weights; a quantizing set (fp8_block) is told which rows are
        which weight, since it quantizes each weight on its own."""
        w = self.fused(name, weights)
        if getattr(self.kernels, "fp8", False):
            from tonpolicy.kernels.invariant.ordered_fp8 import RowParts

            return self.kernels.linear(x, w, RowParts.whole(*(t.shape[0] for t in weights)))
        return self.kernels.linear(x, w)

    # --- forward --------------------------------------------------------------------------------
    @torch.no_grad()
    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        """Full-sequence causal forward of one sequence: fp32 logits [T, padded_vocab]."""
        ids = torch.as_tensor(input_ids, dtype=torch.long).reshape(-1)
        return self.forward_segments(ids, [Segment(ids.numel())])

    @torch.no_grad()
    def forward_segments(
        self,
        input_ids: torch.Tensor,
        segments: list[Segment],
        kv: KVPool | None = None,
        logit_rows: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Forward a flat batch of token segments (prefill chunks and decode tokens of many sequences).

        Writes each cached segment's keys/values into `kv` at [start, start+length). Returns fp32
        logits [len(logit_rows) or N, padded_vocab]."""
        cfg, kern = self.cfg, self.kernels
        dev = self.model.embed_tokens.weight.device
        ids = input_ids.reshape(-1).long().to(dev)
        n = ids.numel()
        if sum(s.length for s in segments) != n:
            raise ValueError("segment lengths must add up to the token count")
        pos = torch.cat([torch.arange(s.start, s.start + s.length, device=dev) for s in segments])
        cos, sin = kern.rope_cos_sin(pos, cfg.head_dim, cfg.rope_theta)
        scale = cfg.head_dim**-0.5
        h = self.model.embed_tokens.weight.index_select(0, ids)
        decode = _DecodeTokens.of(segments, pos, kv)
        for li, layer in enumerate(self.model.layers):
            a = layer.self_attn
            x = kern.rms_norm(h, layer.input_layernorm.weight, cfg.rms_norm_eps)
            qkv = self.fused_linear(x, f"{li}.qkv", [a.q_proj.weight, a.k_proj.weight, a.v_proj.weight])
            q, k, v = qkv.split([cfg.q_size, cfg.kv_size, cfg.kv_size], dim=-1)
            q = q.reshape(n, cfg.num_attention_heads, cfg.head_dim)
            k = k.reshape(n, cfg.num_kv_heads, cfg.head_dim)
            v = v.reshape(n, cfg.num_kv_heads, cfg.head_dim)
            q, k = kern.apply_rope_qk(
                kern.rms_norm(q, a.q_norm.weight, cfg.rms_norm_eps),
                kern.rms_norm(k, a.k_norm.weight, cfg.rms_norm_eps),
                cos,
                sin,
            )
            o = self._attend(li, q, k, v, pos, segments, kv, scale, decode)
            h = h + kern.linear_k_sharded(o.reshape(n, cfg.q_size), a.o_proj.weight)
            x = kern.rms_norm(h, layer.post_attention_layernorm.weight, cfg.rms_norm_eps)
            h = h + self._mlp(li, layer.mlp, x)
        if logit_rows is not None:
            h = h.index_select(0, logit_rows.to(dev))
        h = kern.rms_norm(h, self.model.norm.weight, cfg.rms_norm_eps)
        return kern.lm_head(h, self.lm_weight())

    @torch.no_grad()
    def forward_decode(
        self,
        ids: torch.Tensor,
        positions: torch.Tensor,
        slots: torch.Tensor,
        kv: KVPool,
        cos: torch.Tensor,
        sin: torch.Tensor,
    ) -> torch.Tensor:
        """One decode token per row from device tensors only: token ids, positions and KV slots [B],
        rotary cos/sin [B, head_dim] of those positions. Writes each row's keys/values at (slot, position)
        and attends over its slot's keys [0, position] (tiles past a row's position are skipped, so the
        pool's capacity does not reach its bits). No host value changes from step to step, so a caller may
        capture this in a CUDA graph. Returns fp32 logits [B, padded_vocab]; each row equals
        `forward_segments`' decode row under a row-invariant kernel set."""
        cfg, kern = self.cfg, self.kernels
        n = ids.shape[0]
        scale = cfg.head_dim**-0.5
        h = self.model.embed_tokens.weight.index_select(0, ids)
        for li, layer in enumerate(self.model.layers):
            a = layer.self_attn
            x = kern.rms_norm(h, layer.input_layernorm.weight, cfg.rms_norm_eps)
            qkv = self.fused_linear(x, f"{li}.qkv", [a.q_proj.weight, a.k_proj.weight, a.v_proj.weight])
            q, k, v = qkv.split([cfg.q_size, cfg.kv_size, cfg.kv_size], dim=-1)
            q, k = kern.apply_rope_qk(
                kern.rms_norm(q.reshape(n, cfg.num_attention_heads, cfg.head_dim), a.q_norm.weight, cfg.rms_norm_eps),
                kern.rms_norm(k.reshape(n, cfg.num_kv_heads, cfg.head_dim), a.k_norm.weight, cfg.rms_norm_eps),
                cos,
                sin,
            )
            kv.write_tokens(li, slots, positions, k, v.reshape(n, cfg.num_kv_heads, cfg.head_dim), checked=True)
            o = kern.attention_pooled(q[:, None], positions[:, None], kv.k[li], kv.v[li], slots, kv.capacity, scale)
            h = h + kern.linear_k_sharded(o.reshape(n, cfg.q_size), a.o_proj.weight)
            x = kern.rms_norm(h, layer.post_attention_layernorm.weight, cfg.rms_norm_eps)
            h = h + self._mlp(li, layer.mlp, x)
        h = kern.rms_norm(h, self.model.norm.weight, cfg.rms_norm_eps)
        return kern.lm_head(h, self.lm_weight())

    def _attend(
        self,
        li: int,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        pos: torch.Tensor,
        segments: list[Segment],
        kv: KVPool | None,
        scale: float,
        decode: _DecodeTokens | None,
    ) -> torch.Tensor:
        kern = self.kernels
        out = torch.empty_like(q)
        offs, off = [], 0
        for s in segments:
            offs.append(off)
            off += s.length
        fresh: list[int] = []
        for i, (s, o) in enumerate(zip(segments, offs, strict=True)):
            sl = slice(o, o + s.length)
            if s.slot is None and s.start != 0:
                raise ValueError("an uncached segment must start at position 0")
            if s.slot is not None and s.length == 1:
                continue  # a decode token: below, all in one call
            if s.slot is not None:
                assert kv is not None
                kv.write(li, s.slot, s.start, k[sl], v[sl])
            if s.start == 0:
                fresh.append(i)  # attends only to itself: below, all in one batched call
                continue
            assert kv is not None
            out[sl] = kern.attention_pooled(
                q[None, sl],
                pos[None, sl],
                kv.k[li],
                kv.v[li],
                torch.tensor([s.slot], device=q.device),
                s.start + s.length,
                scale,
            )[0]
        if fresh:
            self._attend_fresh(q, k, v, [(offs[i], segments[i].length) for i in fresh], out, scale)
        if decode is not None:
            # All single-token segments attend in one batched call; keys past a request's own length
            # are masked by position (and their tiles skipped), so different lengths can share it.
            assert kv is not None
            d = decode
            kv.write_tokens(li, d.slots, d.starts, k.index_select(0, d.rows), v.index_select(0, d.rows), checked=True)
            res = kern.attention_pooled(
                q.index_select(0, d.rows)[:, None], d.q_pos, kv.k[li], kv.v[li], d.slots, d.num_keys, scale
            )
            out.index_copy_(0, d.rows, res[:, 0])
        return out

    def _attend_fresh(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        spans: list[tuple[int, int]],
        out: torch.Tensor,
        scale: float,
    ) -> None:
        """Segments that start at position 0 attend only to themselves: one batched call over them,
        padded to the longest (padded keys sit past every query, padded queries are dropped)."""
        if len(spans) == 1:
            o, n = spans[0]
            pos = torch.arange(n, device=q.device)
            out[o : o + n] = self.kernels.attention(q[o : o + n], k[o : o + n], v[o : o + n], pos, pos, scale)
            return
        longest = max(n for _, n in spans)
        rows = torch.cat([torch.arange(o, o + longest, device=q.device) for o, _ in spans])
        real = torch.cat([torch.arange(longest, device=q.device) < n for _, n in spans])
        rows = torch.where(real, rows, 0)  # padding reads row 0; its keys are masked, its queries dropped
        pos = torch.arange(longest, device=q.device).repeat(len(spans), 1)
        q_pos = torch.where(real.view(len(spans), longest), pos, -1)
        k_pos = torch.where(real.view(len(spans), longest), pos, PAD_KEY_POSITION)
        b = len(spans)
        res = self.kernels.attention_batched(
            q[rows].view(b, longest, *q.shape[1:]),
            k[rows].view(b, longest, *k.shape[1:]),
            v[rows].view(b, longest, *v.shape[1:]),
            q_pos,
            k_pos,
            scale,
        )
        out[rows[real]] = res.reshape(b * longest, *q.shape[1:])[real]
