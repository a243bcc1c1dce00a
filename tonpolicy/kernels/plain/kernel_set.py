"""The `plain` kernel set: plain torch, as an ordinary inference stack would run it.

This is the negative control. F.linear in the model dtype (its row results depend on M), SDPA for
prefill and a plain softmax decode path, HF-style norms/RoPE in the model dtype, partials summed with
a plain `sum`, logits rounded to the model dtype. The parity tests must see it mismatch.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from tonpolicy.kernels import moe
from tonpolicy.kernels.attention_merge import KEY_PAD_POS, finalize, merge
from tonpolicy.kernels.base import AttnPartial


class PlainKernels:
    name = "plain"
    bits_depend_on_host = True  # library kernels (torch's, or Triton's for the GPU it runs on)
    kv_pool_layout = "token"

    def __init__(self, *, attention_tile: int = 32, canonical_shards: int = 4) -> None:
        self.attention_tile = attention_tile
        self.canonical_shards = canonical_shards

    def describe(self) -> dict[str, Any]:
        return {
            "kernel_set": self.name,
            "attention_tile": self.attention_tile,
            "canonical_shards": self.canonical_shards,
            "linear": "F.linear",
            "attention": "sdpa",
        }

    def linear(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        return F.linear(x, weight)

    def linear_k_sharded(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        return F.linear(x, weight)

    def linear_partials(self, x: torch.Tensor, weight: torch.Tensor, num_shards: int) -> torch.Tensor:
        xs = x.float().chunk(num_shards, dim=-1)
        ws = weight.float().chunk(num_shards, dim=-1)
        return torch.stack([F.linear(a, b) for a, b in zip(xs, ws, strict=True)])

    def combine_partials(self, partials: torch.Tensor, out_dtype: torch.dtype) -> torch.Tensor:
        return partials.sum(0).to(out_dtype)

    def lm_head(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        return F.linear(x, weight).float()

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
        return weight * xf.to(x.dtype)

    def swiglu(self, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        return F.silu(gate) * up

    def rope_cos_sin(self, positions: torch.Tensor, head_dim: int, theta: float) -> tuple[torch.Tensor, torch.Tensor]:
        inv_freq = 1.0 / (
            theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64, device=positions.device).float() / head_dim)
        )
        freqs = positions.reshape(-1).float()[:, None] * inv_freq[None, :]
        emb = torch.cat([freqs, freqs], dim=-1)
        return emb.cos(), emb.sin()

    def apply_rope(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        c = cos.to(x.dtype).unsqueeze(-2)
        s = sin.to(x.dtype).unsqueeze(-2)
        half = x.shape[-1] // 2
        rot = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
        return x * c + rot * s

    def apply_rope_qk(
        self, q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        return self.apply_rope(q, cos, sin), self.apply_rope(k, cos, sin)

    def attention_batched(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_pos: torch.Tensor, k_pos: torch.Tensor, scale: float
    ) -> torch.Tensor:
        """q [B, Nq, Hq, D], k/v [B, Nk, Hkv, D]: SDPA for prefill, plain softmax for decode."""
        g = q.shape[2] // k.shape[2]
        qh = q.transpose(1, 2)
        kh = k.transpose(1, 2).repeat_interleave(g, dim=1)
        vh = v.transpose(1, 2).repeat_interleave(g, dim=1)
        mask = (k_pos[:, None, :] <= q_pos[:, :, None]).unsqueeze(1)  # [B, 1, Nq, Nk]
        if q.shape[1] == 1:
            s = (qh @ kh.transpose(-1, -2)) * scale
            s = s.masked_fill(~mask, float("-inf"))
            out = torch.softmax(s.float(), dim=-1).to(q.dtype) @ vh
        else:
            out = F.scaled_dot_product_attention(qh, kh, vh, attn_mask=mask, scale=scale)
        return out.transpose(1, 2)

    def attention_pooled(
        self,
        q: torch.Tensor,
        q_pos: torch.Tensor,
        k_pool: torch.Tensor,
        v_pool: torch.Tensor,
        slots: torch.Tensor,
        num_keys: int,
        scale: float,
    ) -> torch.Tensor:
        """Plain gather of each row's cached keys, then `attention_batched`."""
        nk = -(-num_keys // self.attention_tile) * self.attention_tile
        k_pos = torch.arange(nk, device=q.device)[None].expand(q.shape[0], nk)
        return self.attention_batched(q, k_pool[slots, :nk], v_pool[slots, :nk], q_pos, k_pos, scale)

    def kv_cache_dtype(self, dtype: torch.dtype) -> torch.dtype:
        return dtype

    def attention(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_pos: torch.Tensor, k_pos: torch.Tensor, scale: float
    ) -> torch.Tensor:
        return self.attention_batched(q[None], k[None], v[None], q_pos[None], k_pos[None], scale)[0]

    def attention_tile_partial(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_pos: torch.Tensor, k_pos: torch.Tensor, scale: float
    ) -> AttnPartial:
        extra = self.attention_tile - k.shape[0]
        if extra > 0:
            k = torch.cat([k, k.new_zeros(extra, *k.shape[1:])])
            v = torch.cat([v, v.new_zeros(extra, *v.shape[1:])])
            k_pos = torch.cat([k_pos, k_pos.new_full((extra,), KEY_PAD_POS)])
        g = q.shape[1] // k.shape[1]
        kh = k.float().repeat_interleave(g, dim=1)
        vh = v.float().repeat_interleave(g, dim=1)
        s = torch.einsum("qhd,khd->qhk", q.float(), kh) * scale
        s = s.masked_fill(~(k_pos[None, None, :] <= q_pos[:, None, None]), float("-inf"))
        m = s.amax(-1)
        ms = torch.where(m == float("-inf"), torch.zeros_like(m), m)
        p = torch.exp(s - ms.unsqueeze(-1))
        return AttnPartial(m, p.sum(-1), torch.einsum("qhk,khd->qhd", p, vh))

    def merge(self, a: AttnPartial, b: AttnPartial) -> AttnPartial:
        return merge(a, b)

    def finalize(self, p: AttnPartial, dtype: torch.dtype) -> torch.Tensor:
        return finalize(p, dtype)

    # --- mixture of experts ---------------------------------------------------------------------
    def router_logits(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        return F.linear(x, weight).float()  # in the activation dtype, as transformers' router

    def route(self, logits: torch.Tensor, top_k: int, norm_topk_prob: bool) -> moe.Routing:
        return moe.plain_route(logits, top_k, norm_topk_prob)

    def moe_combine(self, outputs: torch.Tensor, weights: torch.Tensor, out_dtype: torch.dtype) -> torch.Tensor:
        return moe.plain_combine(outputs, weights, out_dtype)

    def describe_moe(self) -> dict[str, Any]:
        return {
            "router": "F.linear in the activation dtype, softmax over all, torch.topk, renormalised by a sum",
            "combine": "w*y in the activation dtype, summed in that dtype",
        }

    def logprobs(self, logits: torch.Tensor, tokens: torch.Tensor, vocab_size: int, temperature: float) -> torch.Tensor:
        x = logits[..., :vocab_size]
        if temperature != 1.0:
            x = x / temperature
        lp = torch.log_softmax(x, dim=-1).float()
        return lp.gather(-1, tokens.long().unsqueeze(-1)).squeeze(-1)
