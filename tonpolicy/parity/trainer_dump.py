"""Dump of the trainer side: one full-sequence forward of megatron-core's GPTModel (contract layer
spec) at the configured TP/PP/CP layout, in real processes (gloo on CPU, NCCL on GPUs).

Every rank records what its kernels see (its TP column shards, its CP positions, its PP stage's
layers) into a shard file; the parent then assembles full tensors: TP column ops are concatenated over
TP ranks in rank order (heads and FFN columns are contiguous per rank), replicated ops are taken from
TP rank 0, and positions from all CP ranks and PP stages are merged.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from tonpolicy.config.schema import Config
from tonpolicy.parity.dump import Dump, make_dump
from tonpolicy.parity.names import Checkpoint, megatron_weight_role, parse_name
from tonpolicy.parity.recorder import RecordingKernels, Records, Selection, is_column_op

_POS = "::positions"


def cp_mode(cfg: Config) -> str:
    return cfg.parallel.cp_type if cfg.parallel.cp > 1 else "ulysses"


def hf_weights(cfg: Config, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """The same starting weights as the rollout model: the user's checkpoint or the seeded init."""
    from tonpolicy.model.checkpoint import init_state_dict, load_hf

    if cfg.model.checkpoint:
        return load_hf(cfg.model.checkpoint)[1]
    return init_state_dict(cfg.model, dtype, cfg.model.init_seed)


def _forward_and_record(cfg: Config, tokens: list[int], temperature: float, rec: RecordingKernels) -> None:
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    from tonpolicy.trainer import cp as cp_layout
    from tonpolicy.trainer.logprobs import token_logprobs
    from tonpolicy.trainer.model import build_gpt, padded_vocab
    from tonpolicy.trainer.weights import load_into

    m, dtype, mode = cfg.model, getattr(torch, cfg.contract.dtype), cp_mode(cfg)
    model = build_gpt(m, dtype, "contract", mode, kernels=rec)
    load_into(model, hf_weights(cfg, dtype), m, padded_vocab(m))
    offset = model.decoder.layers[0].layer_number - 1 if len(model.decoder.layers) else 0  # global = local + offset
    rec.bind_weights(dict(model.named_parameters()), lambda n: megatron_weight_role(n, m.num_layers, offset))
    model.eval()

    n = len(tokens)
    seq = cp_layout.padded_len(n, cfg.parallel.cp, mode, cfg.contract.attention_tile)
    ids = torch.zeros(seq, dtype=torch.long)
    ids[:n] = torch.tensor(tokens, dtype=torch.long)
    pos = cp_layout.local_positions(seq, cfg.parallel.cp, ps.get_context_parallel_rank(), mode)
    cp_layout.set_positions(pos[None])
    rec.set_rows(pos)
    with torch.no_grad():
        if not ps.is_pipeline_first_stage():
            h = torch.empty(pos.numel(), 1, m.hidden_size, dtype=dtype)
            dist.recv(h, src=ps.get_pipeline_model_parallel_prev_rank())
            model.set_input_tensor(h)
        out = model(ids[pos][None], pos[None], None)
        if not ps.is_pipeline_last_stage():
            dist.send(out.contiguous(), dst=ps.get_pipeline_model_parallel_next_rank())
            return
        keep = pos < n - 1  # the logits at p score token p+1 of the sample
        rec.set_rows(pos[keep])
        token_logprobs(out[:, keep], ids[pos[keep] + 1][None], m.vocab_size, temperature, kernels=rec)


def _worker(cfg: Config, tokens: list[int], temperature: float, selection: Selection,
            perturb: dict[Checkpoint, Any], shard_dir: str) -> None:
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    from tonpolicy.contract.identity import kernel_params
    from tonpolicy.kernels import get_kernels
    from tonpolicy.trainer.dist import Layout, init_distributed

    p, m = cfg.parallel, cfg.model
    init_distributed(Layout(p.tp, p.pp, p.cp, cp_mode(cfg)))
    inner = get_kernels(cfg.contract.kernels, **kernel_params(cfg.contract))
    rec = RecordingKernels(inner, m.num_layers, m.num_attention_heads // m.num_kv_heads, m.head_dim, selection, perturb)
    _forward_and_record(cfg, tokens, temperature, rec)
    tensors: dict[str, torch.Tensor] = {}
    for ck, (pos, val) in rec.records.collect().items():
        tensors[ck.name] = val.contiguous()
        tensors[ck.name + _POS] = pos.contiguous()
    meta = {"tp_rank": str(ps.get_tensor_model_parallel_rank()), "cp_rank": str(ps.get_context_parallel_rank()),
            "pp_rank": str(ps.get_pipeline_model_parallel_rank())}
    save_file(tensors, str(Path(shard_dir) / f"rank{dist.get_rank()}.safetensors"), metadata=meta)


def assemble(shard_dir: Path, num_layers: int) -> dict[Checkpoint, tuple[torch.Tensor, torch.Tensor]]:
    """Full tensors from every rank's shard (see the module docstring)."""
    by_tp: dict[Checkpoint, dict[int, Records]] = {}
    for f in sorted(shard_dir.glob("rank*.safetensors")):
        with safe_open(str(f), "pt") as sf:
            tp_rank = int(sf.metadata()["tp_rank"])
            for key in sf.keys():
                if key.endswith(_POS):
                    continue
                ck = parse_name(key, num_layers)
                by_tp.setdefault(ck, {}).setdefault(tp_rank, Records()).add(ck, sf.get_tensor(key + _POS), sf.get_tensor(key))
    out = {}
    for ck, ranks in by_tp.items():
        parts = [ranks[r].collect()[ck] for r in sorted(ranks)]
        if not is_column_op(ck):
            out[ck] = parts[0]
            continue
        pos = parts[0][0]
        if any(not torch.equal(p, pos) for p, _ in parts):
            raise RuntimeError(f"{ck}: TP ranks recorded different positions")
        out[ck] = (pos, torch.cat([v for _, v in parts], dim=-1))
    return out


def trainer_dump(cfg: Config, tokens: list[int], prompt_len: int, temperature: float, selection: Selection,
                 work_dir: Path, *, perturb: dict[Checkpoint, Any] | None = None, timeout: float = 600.0) -> Dump:
    from tonpolicy.trainer.dist import spawn

    p = cfg.parallel
    shard_dir = work_dir / "trainer_shards"
    shutil.rmtree(shard_dir, ignore_errors=True)
    shard_dir.mkdir(parents=True)
    spawn(_worker, p.tp * p.pp * p.cp, cfg, tokens, temperature, selection, perturb or {}, str(shard_dir),
          timeout=timeout)
    records = assemble(shard_dir, cfg.model.num_layers)
    shutil.rmtree(shard_dir, ignore_errors=True)
    layout = {"tp": p.tp, "pp": p.pp, "cp": p.cp, "cp_type": p.cp_type}
    meta = {"engine": "megatron-core", "path": "full_forward", "kernels": cfg.contract.kernels,
            "layout": json.loads(json.dumps(layout)), "perturb": sorted(str(c) for c in (perturb or {}))}
    return make_dump("trainer", tokens, prompt_len, cfg.model.num_layers, cfg.model.vocab_size, records, meta)
