"""Qwen3 dense for released SGLang, every numerical op a contract kernel call.

Tensor parallelism over SGLang's TP group, the contract way (same as the Megatron layer spec):
- q/k/v and gate/up are column shards: `kernels.linear` on the local rows of the weight gives exactly
  those columns of the unsharded result;
- o_proj and down_proj are row-parallel: each rank computes fp32 partials over its canonical K-shards
  (`linear_partials`), combined across ranks in the contract's fixed tree (`kernels.row_parallel`, the
  trainer's way), so TP 1, 2 and 4 give the same bits;
- the LM head is a column shard of the padded vocab (padding depends on the canonical shard count,
  never on TP); the fp32 logits are gathered in rank order.
KV heads are replicated when TP exceeds their number (SGLang's rule), so the pool SGLang sizes for
this rank matches what the layers write.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from sglang.srt.distributed.parallel_state import get_tp_group
from torch import nn

from tonpolicy.config import hf_qwen3
from tonpolicy.config.dtypes import dtype_name
from tonpolicy.config.hf_qwen3 import EMBED, FINAL_NORM, LAYER_PARAMS, LM_HEAD, SHARD_DIM, VOCAB
from tonpolicy.contract.identity import runtime_identity
from tonpolicy.inside_sglang.model.attention import pooled_attention
from tonpolicy.inside_sglang.model.fp8_load import check_quant_config, dequantized
from tonpolicy.inside_sglang.model.fp8_rows import fused_column_linear
from tonpolicy.inside_sglang.model.heads import ContractLogitsProcessor, contract_sampler_active
from tonpolicy.inside_sglang.model.report import contract_from_env, write_report
from tonpolicy.kernels import get_kernels, padded_vocab_size
from tonpolicy.kernels.row_parallel import combine_row_parallel, gather_in_rank_order
from tonpolicy.kernels.sets import kernel_set


def _empty(*shape: int) -> nn.Parameter:
    return nn.Parameter(torch.empty(*shape), requires_grad=False)


def _checkpoint_config(config) -> dict:  # noqa: ANN001 - SGLang's HF config
    """config.json as the checkpoint has it: SGLang's CPU engine pads sizes TP does not divide evenly
    enough for its kernels (moe_intermediate_size 96 -> 128 at TP 2) and keeps the checkpoint's as
    `original_*`; the contract model shards the checkpoint's own sizes."""
    d = config.to_dict()
    return {k: d.get(f"original_{k}", v) for k, v in d.items() if not k.startswith("original_")}


class _Layer(nn.Module):
    """Attention and norms; the MLP's parameters are added by the model's `_build_mlp`."""

    def __init__(self, hidden: int, q_local: int, kv_local: int, head_dim: int) -> None:
        super().__init__()
        self.input_layernorm, self.post_attention_layernorm = _empty(hidden), _empty(hidden)
        self.qkv, self.o_proj = _empty(q_local + 2 * kv_local, hidden), _empty(hidden, q_local)
        self.q_norm, self.k_norm = _empty(head_dim), _empty(head_dim)


class Qwen3ForCausalLM(nn.Module):
    # The family's HF adapter (config.json, parameter names); a subclass family swaps it.
    adapter = hf_qwen3

    def __init__(self, config, quant_config=None, prefix: str = "", **_: object) -> None:  # noqa: ANN001
        super().__init__()
        # SGLang's Fp8Config (a published FP8 checkpoint) builds nothing here: load_weights reads its pairs
        # back into master weights; contract.quant decides whether the linears run FP8.
        check_quant_config(quant_config, _checkpoint_config(config))
        if not contract_sampler_active():
            raise RuntimeError(
                "the contract model needs the contract sampler, which tonpolicy's SGLang plugin registers: "
                "install tonpolicy into SGLang's environment (`pip install -e .` there: the plugin is an entry "
                "point, found only in an installed package) and, if SGLANG_PLUGINS is set, include "
                "tonpolicy_contract_sampler in it"
            )
        self.config = config
        self.cfg = cfg = self.adapter.config_from_hf(_checkpoint_config(config))
        contract = contract_from_env()
        self.kernels = get_kernels(contract["kernels"], **contract["kernel_params"])
        tp = get_tp_group()
        self.tp_rank, self.tp_size, self.tp_group = tp.rank_in_group, tp.world_size, tp.device_group
        heads, kv_heads, d = cfg.num_attention_heads, cfg.num_kv_heads, cfg.head_dim
        self.q_heads = heads // self.tp_size
        self.kv_heads = max(1, kv_heads // self.tp_size)
        self.kv_first = (
            self.tp_rank * kv_heads // self.tp_size if kv_heads < self.tp_size else self.tp_rank * self.kv_heads
        )
        self.inter = cfg.intermediate_size // self.tp_size
        # This rank's rows of q, k and v in their HF weights (KV heads replicated past their number).
        q_rows, kv_part = self.q_heads * d, (self.kv_heads * d, self.kv_first * d, kv_heads * d)
        self._qkv_parts = ((q_rows, self.tp_rank * q_rows, heads * d), kv_part, kv_part)
        self.padded_vocab = padded_vocab_size(cfg.vocab_size, self.kernels.canonical_shards)
        self.embed_tokens = _empty(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(
            _Layer(cfg.hidden_size, self.q_heads * d, self.kv_heads * d, d) for _ in range(cfg.num_layers)
        )
        for li, layer in enumerate(self.layers):
            self._build_mlp(li, layer)
        self.norm = _empty(cfg.hidden_size)
        self.lm_head = nn.Module()
        self.lm_head.weight = _empty(self.padded_vocab // self.tp_size, cfg.hidden_size)
        self.logits_processor = ContractLogitsProcessor(config, self._logits)
        dtype = self.embed_tokens.dtype
        device = self.embed_tokens.device.type
        self._rope_table = self._build_rope_table(config)
        write_report(contract, runtime_identity(self.kernels, dtype_name(dtype), device), self.tp_rank, self.tp_size)

    def _build_rope_table(self, config) -> tuple[torch.Tensor, torch.Tensor] | None:  # noqa: ANN001
        """The triton set's cos/sin for every position, built once (on the CPU, as the kernel set builds
        them) and kept on the model's device: a forward then only gathers rows (the same values), with
        no host work, so decode can run in CUDA graphs. The other sets build them per forward."""
        if not kernel_set(self.kernels.name).rope_table:
            return None
        cfg = self.cfg
        positions = torch.arange(max(cfg.max_position_embeddings, getattr(config, "max_position_embeddings", 0)))
        cos, sin = self.kernels.rope_cos_sin(positions, cfg.head_dim, cfg.rope_theta)
        return cos.to(self.embed_tokens.device), sin.to(self.embed_tokens.device)

    def _rope(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if self._rope_table is None:
            return self.kernels.rope_cos_sin(positions, self.cfg.head_dim, self.cfg.rope_theta)
        if self._rope_table[0].device != positions.device:
            self._rope_table = tuple(t.to(positions.device) for t in self._rope_table)
        index = positions.reshape(-1).long()
        return self._rope_table[0].index_select(0, index), self._rope_table[1].index_select(0, index)

    # --- parallel pieces ---------------------------------------------------------------------
    def _gather(self, x: torch.Tensor, dim: int) -> torch.Tensor:
        if self.tp_size == 1:
            return x
        return gather_in_rank_order(x, self.tp_group, dim)

    def _row_linear(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        k = self.kernels
        partials = k.linear_partials(x, weight, k.canonical_shards // self.tp_size)
        return combine_row_parallel(k, partials, x.dtype, self.tp_group if self.tp_size > 1 else None)

    def _column(self, x: torch.Tensor, weight: torch.Tensor, parts: tuple[tuple[int, int, int], ...]) -> torch.Tensor:
        """A column-parallel fused linear: `parts` say which HF weights its rows are (fp8_block)."""
        return fused_column_linear(self.kernels, x, weight, parts, self.tp_group if self.tp_size > 1 else None)

    def _logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self._gather(self.kernels.lm_head(hidden, self.lm_head.weight), -1)

    # --- the MLP: dense here, a subclass family overrides these three ------------------------
    def _build_mlp(self, li: int, layer: _Layer) -> None:
        layer.gate_up, layer.down_proj = (
            _empty(2 * self.inter, self.cfg.hidden_size),
            _empty(self.cfg.hidden_size, self.inter),
        )

    def _mlp(self, li: int, layer: _Layer, x: torch.Tensor) -> torch.Tensor:
        full, rank = self.cfg.intermediate_size, self.tp_rank * self.inter
        parts = ((self.inter, rank, full), (self.inter, rank, full))
        gate, up = self._column(x, layer.gate_up, parts).split([self.inter, self.inter], dim=-1)
        return self._row_linear(self.kernels.swiglu(gate, up), layer.down_proj)

    def _load_layer(self, li: int, suffix: str, w: torch.Tensor) -> None:
        dest, rows, first = self._destinations(self.layers[li])[suffix]
        dim = SHARD_DIM[LAYER_PARAMS[suffix]]
        dest.copy_(w if dim is None else w.narrow(dim, first, rows))

    # --- forward -----------------------------------------------------------------------------
    @torch.no_grad()
    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        forward_batch,
        input_embeds=None,  # noqa: ANN001
        get_embedding: bool = False,
        pp_proxy_tensors=None,
    ):
        if get_embedding or pp_proxy_tensors is not None:
            raise ValueError("the tonpolicy contract model serves generation without pipeline parallelism")
        cfg, kern = self.cfg, self.kernels
        n, d = input_ids.numel(), cfg.head_dim
        cos, sin = self._rope(positions)
        attend = pooled_attention(forward_batch, kern, d**-0.5)
        h = self.embed_tokens.index_select(0, input_ids) if input_embeds is None else input_embeds
        q_size, kv_size = self.q_heads * d, self.kv_heads * d
        for li, layer in enumerate(self.layers):
            x = kern.rms_norm(h, layer.input_layernorm, cfg.rms_norm_eps)
            q, k, v = self._column(x, layer.qkv, self._qkv_parts).split([q_size, kv_size, kv_size], dim=-1)
            q, k = kern.apply_rope_qk(
                kern.rms_norm(q.reshape(n, self.q_heads, d), layer.q_norm, cfg.rms_norm_eps),
                kern.rms_norm(k.reshape(n, self.kv_heads, d), layer.k_norm, cfg.rms_norm_eps),
                cos,
                sin,
            )
            o = attend(li, q, k, v.reshape(n, self.kv_heads, d))
            h = h + self._row_linear(o.reshape(n, q_size), layer.o_proj)
            h = h + self._mlp(li, layer, kern.rms_norm(h, layer.post_attention_layernorm, cfg.rms_norm_eps))
        h = kern.rms_norm(h, self.norm, cfg.rms_norm_eps)
        return self.logits_processor(input_ids, h, self.lm_head, forward_batch)

    # --- weights -----------------------------------------------------------------------------
    def _destinations(self, layer: _Layer) -> dict[str, tuple[torch.Tensor, int, int]]:
        """HF layer parameter -> (where it goes, rows this rank keeps, first row) along its shard dim
        (the adapter's TP plan); KV heads start at `kv_first` (replicated when TP exceeds them)."""
        d, inter = self.cfg.head_dim, self.inter
        q_rows, kv_rows, kv_first = self.q_heads * d, self.kv_heads * d, self.kv_first * d
        out = {
            "input_layernorm.weight": (layer.input_layernorm, 0, 0),
            "post_attention_layernorm.weight": (layer.post_attention_layernorm, 0, 0),
            "self_attn.q_norm.weight": (layer.q_norm, 0, 0),
            "self_attn.k_norm.weight": (layer.k_norm, 0, 0),
            "self_attn.q_proj.weight": (layer.qkv[:q_rows], q_rows, self.tp_rank * q_rows),
            "self_attn.k_proj.weight": (layer.qkv[q_rows : q_rows + kv_rows], kv_rows, kv_first),
            "self_attn.v_proj.weight": (layer.qkv[q_rows + kv_rows :], kv_rows, kv_first),
            "self_attn.o_proj.weight": (layer.o_proj, q_rows, self.tp_rank * q_rows),
        }
        if hasattr(layer, "gate_up"):  # a dense MLP (a MoE layer's experts load elsewhere)
            out["mlp.gate_proj.weight"] = (layer.gate_up[:inter], inter, self.tp_rank * inter)
            out["mlp.up_proj.weight"] = (layer.gate_up[inter:], inter, self.tp_rank * inter)
            out["mlp.down_proj.weight"] = (layer.down_proj, inter, self.tp_rank * inter)
        return out

    @torch.no_grad()
    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """HF-named full tensors in; each rank keeps its shard (also on /update_weights_from_disk). FP8 pairs
        of a published checkpoint come in as master weights (`fp8_load.dequantized`)."""
        cfg = self.cfg
        where = getattr(self.config, "_name_or_path", "") or "SGLang's weight stream"
        for name, w in dequantized(weights, self.embed_tokens.dtype, where):
            if name.endswith("rotary_emb.inv_freq"):
                continue
            if name == EMBED:
                self.embed_tokens.copy_(w)  # replicated here: the lookup needs the whole table
                if cfg.tie_word_embeddings:
                    self._load_head(w)
            elif name == LM_HEAD:
                if not cfg.tie_word_embeddings:
                    self._load_head(w)
            elif name == FINAL_NORM:
                self.norm.copy_(w)
            elif (layer := self.adapter.parse_layer_param(name)) and layer[0] < cfg.num_layers:
                self._load_layer(*layer, w)
            else:
                raise KeyError(f"unexpected {type(self).__name__} weight {name}")

    def _load_head(self, w: torch.Tensor) -> None:  # VOCAB: rows of the padded vocab
        padded = torch.nn.functional.pad(w, (0, 0, 0, self.padded_vocab - w.shape[0]))
        rows = self.padded_vocab // self.tp_size
        self.lm_head.weight.copy_(padded.narrow(SHARD_DIM[VOCAB], self.tp_rank * rows, rows))


EntryClass = [Qwen3ForCausalLM]
