"""The interface every kernel set implements.

The rollout model (tonpolicy.model) and the Megatron layer spec (tonpolicy.trainer) call only these
functions, so a kernel set is the single source of numerical truth for both engines.

Shapes: `x` is [..., K] with any number of leading dims (tokens are rows). Weights use the
torch/HF layout [N, K]. Attention tensors are token-major: q [Nq, Hq, D], k/v [Nk, Hkv, D].
"""

from __future__ import annotations

from typing import Any, NamedTuple, Protocol

import torch


class AttnPartial(NamedTuple):
    """Split-KV partial state for a block of keys, per (query, head).

    m: running max of scaled scores, fp32 [Nq, Hq]
    l: sum of exp(score - m), fp32 [Nq, Hq]
    acc: sum of exp(score - m) * v, fp32 [Nq, Hq, D]
    """

    m: torch.Tensor
    l: torch.Tensor  # noqa: E741
    acc: torch.Tensor


class KernelSet(Protocol):
    name: str
    attention_tile: int  # keys per split-KV tile
    canonical_shards: int  # K-shards of every linear; a TP size must divide it
    # False where every bit is the set's own code (then `library_digest()` names that code): the runtime
    # fingerprint carries the host's build (torch, BLAS, CPU class) only where a library decides bits.
    bits_depend_on_host: bool

    def describe(self) -> dict[str, Any]:
        """Everything that affects numerics (part of the contract fingerprint)."""

    # --- linear -------------------------------------------------------------------------------
    def linear(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        """y = x @ weight.T, returned in x.dtype. Column-sharded weights give the matching columns
        of the unsharded result (bitwise under `invariant`). For linears whose K TP never splits (column-
        parallel: QKV, gate/up)."""

    def linear_k_sharded(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        """y = x @ weight.T defined over the canonical K-shards: `combine_partials(linear_partials(x, w,
        canonical_shards))`. For linears whose K TP splits (row-parallel: o_proj, down_proj), so that
        every TP dividing the shard count gives these bits."""

    def linear_partials(self, x: torch.Tensor, weight: torch.Tensor, num_shards: int) -> torch.Tensor:
        """Split K into `num_shards` equal canonical shards; partial products [num_shards, ..., N] (fp32,
        or the GEMM's own output dtype where the kernel set defines it so).
        A row-parallel rank holding canonical shards [r*s, (r+1)*s) calls this with num_shards=s;
        gathering every rank's partials in rank order yields the canonical [C, ..., N] stack."""

    def combine_partials(self, partials: torch.Tensor, out_dtype: torch.dtype) -> torch.Tensor:
        """Reduce the canonical partial stack [C, ..., N] in a fixed tree order, cast to out_dtype."""

    def lm_head(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        """fp32 logits x @ weight.T (weight may carry vocab padding rows)."""

    # --- norms / activations / rotary ----------------------------------------------------------
    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor: ...

    def swiglu(self, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor: ...

    def rope_cos_sin(self, positions: torch.Tensor, head_dim: int, theta: float) -> tuple[torch.Tensor, torch.Tensor]:
        """fp32 cos/sin [len(positions), head_dim] for HF-style rotate-half RoPE."""

    def apply_rope(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """x [N, H, D] rotated by per-token cos/sin [N, D]; returned in x.dtype."""

    def apply_rope_qk(
        self, q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """`apply_rope` of q and of k, in one call so that a recorder knows which is which."""

    # --- attention ------------------------------------------------------------------------------
    def attention(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        q_pos: torch.Tensor,
        k_pos: torch.Tensor,
        scale: float,
    ) -> torch.Tensor:
        """Causal attention of queries at absolute positions q_pos over keys at k_pos (key j is
        visible to query i iff k_pos[j] <= q_pos[i]). GQA: Hq is a multiple of Hkv. Returns [Nq, Hq, D]
        in q.dtype. Keys must be in ascending position order, starting at position 0."""

    def attention_batched(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        q_pos: torch.Tensor,
        k_pos: torch.Tensor,
        scale: float,
    ) -> torch.Tensor:
        """`attention` over a batch of independent sequences: q [B, Nq, Hq, D], k/v [B, Nk, Hkv, D]."""

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
        """`attention` of q [B, Nq, Hq, D] straight over a KV pool (decode path) in this set's
        `kv_pool_layout`: k/v [slots, cap, Hkv, D] ("token"), or per KV head ("head")."""

    def kv_cache_dtype(self, dtype: torch.dtype) -> torch.dtype:
        """The dtype the engine's KV cache stores for activations of `dtype`."""

    # The layout of the engine's KV pool that `attention_pooled` reads: "token" or "head" (see
    # tonpolicy/model/kv_cache.py).
    kv_pool_layout: str

    def attention_tile_partial(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        q_pos: torch.Tensor,
        k_pos: torch.Tensor,
        scale: float,
    ) -> AttnPartial:
        """Partial of one key tile (contract: exactly `attention_tile` keys, padded keys carry a position
        larger than any query and zero k/v)."""

    def merge(self, a: AttnPartial, b: AttnPartial) -> AttnPartial:
        """Merge two partials, `a` covering keys before `b`; one formula everywhere."""

    def finalize(self, p: AttnPartial, dtype: torch.dtype) -> torch.Tensor: ...

    # --- mixture of experts (tonpolicy/kernels/moe.py) ---------------------------------------------
    def router_logits(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        """fp32 router logits x @ weight.T [N, E]."""

    def route(self, logits: torch.Tensor, top_k: int, norm_topk_prob: bool) -> Any:
        """`moe.Routing`: each token's k experts in ascending id and their fp32 weights."""

    def moe_combine(self, outputs: torch.Tensor, weights: torch.Tensor, out_dtype: torch.dtype) -> torch.Tensor:
        """[N, k, H] expert outputs (slots as `route` ordered them) and [N, k] weights -> [N, H] out_dtype."""

    def describe_moe(self) -> dict[str, Any]:
        """The MoE ops' numerics, for the fingerprint of a MoE contract."""

    # --- logprobs -------------------------------------------------------------------------------
    def logprobs(self, logits: torch.Tensor, tokens: torch.Tensor, vocab_size: int, temperature: float) -> torch.Tensor:
        """fp32 log_softmax(logits[..., :vocab_size] / temperature) gathered at `tokens`.
        `logits` may carry TP vocab padding; it is truncated to the real vocab before softmax."""
