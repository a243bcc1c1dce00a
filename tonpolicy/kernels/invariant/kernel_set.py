"""The `invariant` kernel set: every op's result for a token is invariant by construction to batch
composition, token count, prefill/decode/chunked prefill, row position, TP and thread count. TP
invariance: a column-parallel linear (QKV, gate/up, LM head) never splits K, so it runs whole; a
row-parallel one (o_proj, down) is defined over canonical K-shards that any TP dividing their count
reproduces. dtype steps: weights/activations in the model dtype (bf16 or fp32); every GEMM (linears,
attention scores, p @ v) is the exact fixed-point product of tonpolicy.kernels.invariant.exact_gemm, rounded once to
fp32 (its bits depend on no library, CPU or thread count); row-parallel partials summed in fp32; norms'
statistics, softmax and logprobs in fp32; logits fp32.
"""

from __future__ import annotations

from typing import Any

import torch

from tonpolicy.kernels import moe, pointwise
from tonpolicy.kernels.base import AttnPartial
from tonpolicy.kernels.invariant import attention as invariant_attention
from tonpolicy.kernels.invariant.linear import tiled_partials, tree_sum


class InvariantKernels:
    name = "invariant"
    # torch's exp, log_softmax and sums decide bits of its row-local ops: they follow the CPU's vector path
    # and the torch build, which the runtime fingerprint therefore carries.
    bits_depend_on_host = True
    # Keys pooled per KV head in their GEMM layout ([D, keys] keys, [keys, D] values): decode upcasts the
    # visible prefix row by row, where the token layout cost a transposing copy of every key per step.
    kv_pool_layout = "head"
    # The attention's two GEMMs (scores, p @ v).
    products = invariant_attention.EXACT

    def __init__(
        self,
        *,
        attention_tile: int = 32,
        canonical_shards: int = 4,
        row_tile: int = 4,
        prefill_row_tile: int = 512,
        logits_dtype: str = "float32",
    ) -> None:
        self.attention_tile = attention_tile
        self.canonical_shards = canonical_shards
        # Attention pads a query block's rows to a multiple of this granule. Since the exact GEMM no row
        # count changes a bit (the granule and `prefill_row_tile` were the library GEMMs' fixed shapes);
        # both stay contract fields, in the fingerprint, so that configs and plans keep their keys.
        self.row_tile = row_tile
        self.prefill_row_tile = prefill_row_tile
        # "bfloat16": with bf16 operands the LM head's fp32 result is rounded to bf16 (as stock SGLang's
        # bf16 logits), then fp32.
        self.logits_dtype = logits_dtype
        # `attention_pooled`'s key templates (no pools held) and plans by geometry: a step's per-segment
        # calls (prefix-cached prompts: one call per segment and layer) alternate between a few geometries.
        self._pooled: dict[tuple, tuple[invariant_attention.PooledKeyTiles, invariant_attention.Plan]] = {}
        # The last `attention_batched` call's geometry and plan (every layer of a forward shares it).
        self._batched: tuple[tuple, invariant_attention.Plan] | None = None

    def describe(self) -> dict[str, Any]:
        """Everything that affects numerics, for the contract fingerprint."""
        return {
            "kernel_set": self.name,
            "attention_tile": self.attention_tile,
            "canonical_shards": self.canonical_shards,
            "row_tile": self.row_tile,
            "prefill_row_tile": self.prefill_row_tile,
            "logits_dtype": self.logits_dtype,
            "gemm": "exact fixed-point: per row (A) / column (B) powers of two, integers of bits_a + bits_b + "
            "ceil(log2 K) <= 53 (bf16 x bf16: equal halves; else bits_b = min(24, 41 - L), an fp32 A below 23 bits "
            "in two slices, hi*B + (lo*B)*2^-bits_a), fp64 GEMM exact below 2^53, scaled back, one rounding to "
            "fp32 (docs/REDUCTION_RULES.md)",
            "linear": "the contract GEMM, K whole (column-parallel), rounded to the activation dtype",
            "linear_k_sharded": "the contract GEMM per canonical K-shard [K/C], fp32 partials summed in fp32 in "
            "a pairwise tree, one rounding (o_proj, down)",
            "logits": "the contract GEMM, K whole, fp32"
            if self.logits_dtype == "float32"
            else "the contract GEMM rounded to bf16 (bf16 operands), then fp32",
            "attention": "split-KV fixed tile, fp32 (m,l,acc), left-to-right merge in key order; scores q.k by the "
            "contract GEMM; p @ v by the contract GEMM with v's per-key powers of two folded into p",
            "rms_norm": "fp32 sum(x^2)/K, x/sqrt(var+eps)*w, one rounding",
            "swiglu": "fp32 g/(1+exp(-g))*u, one rounding",
            "rope": "fp32 rotate-half, cos/sin tables in 64-position chunks",
            "logprobs": "fp32 log_softmax(logits[:vocab]/T) gathered",
        }

    # --- linear -------------------------------------------------------------------------------
    def linear_partials(self, x: torch.Tensor, weight: torch.Tensor, num_shards: int) -> torch.Tensor:
        return tiled_partials(x, weight, num_shards)

    def combine_partials(self, partials: torch.Tensor, out_dtype: torch.dtype) -> torch.Tensor:
        return tree_sum(partials, out_dtype)

    def fold_partials(self, partials: torch.Tensor) -> torch.Tensor | None:
        """The fp32 tree sum of one rank's consecutive canonical partials, which `combine_partials` takes
        in their place (the ranks' sums stacked in rank order give the same bits): the pairwise tree
        splits at groups of a power-of-two size. None where it does not (the partials must travel)."""
        n = partials.shape[0]
        return tree_sum(partials) if n & (n - 1) == 0 else None

    def linear(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        return tiled_partials(x, weight, 1)[0].to(x.dtype)

    def linear_k_sharded(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        return self.combine_partials(self.linear_partials(x, weight, self.canonical_shards), x.dtype)

    def lm_head(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        """fp32 logits; K whole, like every column-parallel linear. `logits_dtype` "float32": the contract
        GEMM's fp32 result; "bfloat16": that result rounded to bf16 (as a bf16 linear's), then fp32."""
        logits = tiled_partials(x, weight, 1)[0]
        if self.logits_dtype == "float32" or not x.dtype == weight.dtype == torch.bfloat16:
            return logits
        return logits.to(torch.bfloat16).float()

    # --- norms / activations / rotary ----------------------------------------------------------
    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        return pointwise.rms_norm(x, weight, eps)

    def swiglu(self, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        return pointwise.swiglu(gate, up)

    def rope_cos_sin(self, positions: torch.Tensor, head_dim: int, theta: float) -> tuple[torch.Tensor, torch.Tensor]:
        return pointwise.rope_cos_sin(positions, head_dim, theta)

    def apply_rope(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        return pointwise.apply_rope(x, cos, sin)

    def apply_rope_qk(
        self, q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        return self.apply_rope(q, cos, sin), self.apply_rope(k, cos, sin)

    # --- attention ------------------------------------------------------------------------------
    def attention(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_pos: torch.Tensor, k_pos: torch.Tensor, scale: float
    ) -> torch.Tensor:
        out = self.attention_batched(q[None], k[None], v[None], q_pos[None], k_pos[None], scale)
        return out[0]

    def attention_batched(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        q_pos: torch.Tensor,
        k_pos: torch.Tensor,
        scale: float,
    ) -> torch.Tensor:
        """Batch of independent sequences: q [B, Nq, Hq, D], k/v [B, Nk, Hkv, D], positions [B, N]."""
        keys = invariant_attention.key_tiles(k, v, k_pos, self.attention_tile)
        inplace = invariant_attention.in_place(q, keys)
        trim = invariant_attention.trim_rows(q.dtype, k.dtype, inplace)
        geometry = (q.shape, k.shape, inplace, trim, q_pos.dtype, k_pos.dtype, value_key(q_pos), value_key(k_pos))
        if self._batched is None or self._batched[0] != geometry:
            plan = invariant_attention.plan_attention(q.shape, q_pos, keys, self.row_tile, inplace, trim)
            self._batched = (geometry, plan)
        return invariant_attention.attention(q, q_pos, keys, scale, self.row_tile, self._batched[1], self.products)

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
        """q [B, Nq, Hq, D] at q_pos [B, Nq] over a head-layout KV pool (k [slots, Hkv, D, cap],
        v [slots, Hkv, cap, D]; key j sits at position j), batch row b reading pool slot slots[b],
        keys [0, num_keys) rounded up to whole tiles. Bitwise equal to `attention` over that row's keys."""
        t = self.attention_tile
        if k_pool.shape[-1] % t or k_pool.shape[-1] != v_pool.shape[-2]:
            raise ValueError(
                f"the contract reads a head-layout KV pool of whole {t}-key tiles, got k {tuple(k_pool.shape)}, "
                f"v {tuple(v_pool.shape)}"
            )
        tiles = -(-num_keys // t)
        # Every layer of a decode step asks with the same positions and slots: one plan for them all
        # (keyed on the values, so a caller may pass new tensors or reuse its own). The plan depends on
        # the slot count, not on which slots: another slot set reuses it with its own template.
        inplace = not (torch.is_grad_enabled() and q.requires_grad)
        trim = invariant_attention.trim_rows(q.dtype, k_pool.dtype, inplace)
        geometry = (q.shape, k_pool.shape[:3], tiles, inplace, trim, q_pos.shape, value_key(q_pos), len(slots))
        hit = self._pooled.get(geometry)
        if hit is None:
            template = invariant_attention.PooledKeyTiles(k_pool, v_pool, slots, tiles, t).over(None, None)
            plan = invariant_attention.plan_attention(q.shape, q_pos, template, self.row_tile, inplace, trim)
            if len(self._pooled) >= POOLED_PLANS:
                self._pooled.clear()  # a new phase of the run: its geometries refill the cache
            hit = self._pooled[geometry] = (template, plan)
        template, plan = hit
        if template.slot_index is not slots or template.slots != slots.tolist():  # the caller's tensor, as it is now
            template = template.with_slots(slots)
            self._pooled[geometry] = (template, plan)
        keys = template.over(k_pool, v_pool)
        return invariant_attention.attention(q, q_pos, keys, scale, self.row_tile, plan, self.products)

    def kv_cache_dtype(self, dtype: torch.dtype) -> torch.dtype:
        """Keys/values are cached in the model dtype (what the projections produced); each tile is
        upcast to fp32 when the attention GEMM reads it (exact), so no fp32 copy of the cache is kept."""
        return dtype

    def attention_tile_partial(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_pos: torch.Tensor, k_pos: torch.Tensor, scale: float
    ) -> AttnPartial:
        if k.shape[0] != self.attention_tile:
            raise ValueError(f"attention_tile_partial takes exactly {self.attention_tile} keys, got {k.shape[0]}")
        keys = invariant_attention.key_tiles(k[None], v[None], k_pos[None], self.attention_tile)
        return invariant_attention.tile_partial(q, q_pos, keys, scale, self.row_tile, self.products)

    def merge(self, a: AttnPartial, b: AttnPartial) -> AttnPartial:
        return invariant_attention.merge(a, b, self.products)

    def finalize(self, p: AttnPartial, dtype: torch.dtype) -> torch.Tensor:
        return invariant_attention.finalize(p, dtype)

    # --- mixture of experts ---------------------------------------------------------------------
    def router_logits(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        return tiled_partials(x, weight, 1)[0]

    def route(self, logits: torch.Tensor, top_k: int, norm_topk_prob: bool) -> moe.Routing:
        return moe.contract_route(logits, top_k, norm_topk_prob)

    def moe_combine(self, outputs: torch.Tensor, weights: torch.Tensor, out_dtype: torch.dtype) -> torch.Tensor:
        return moe.contract_combine(outputs, weights, out_dtype)

    def describe_moe(self) -> dict[str, Any]:
        return dict(moe.DESCRIPTION)

    # --- logprobs -------------------------------------------------------------------------------
    def logprobs(self, logits: torch.Tensor, tokens: torch.Tensor, vocab_size: int, temperature: float) -> torch.Tensor:
        return pointwise.logprobs(logits, tokens, vocab_size, temperature)


# Geometries `attention_pooled` keeps plans for (a step's prefill segments of a few lengths and starts).
POOLED_PLANS = 64


def value_key(t: torch.Tensor) -> bytes:
    """A tensor's values as a plan-cache key (a caller may pass new tensors, or change its own in place)."""
    return t.detach().cpu().numpy().tobytes()
