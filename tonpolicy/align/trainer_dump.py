"""Dump of the trainer side: the trainer's own logprob recompute of one sample (TrainerWorker: megatron-
core's GPTModel on the kernel layer spec, megatron's forward schedule) at the configured TP/PP/CP
layout, in real processes (gloo on CPU).

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

from tonpolicy.align.dump import Dump, make_dump
from tonpolicy.align.names import Checkpoint, megatron_weight_role, parse_name
from tonpolicy.align.recorder import RecordingKernels, Records, Selection, is_column_op
from tonpolicy.config.schema import Config

_POS = "::positions"


def cp_type(cfg: Config) -> str:
    return cfg.parallel.cp_type if cfg.parallel.cp > 1 else "ulysses"


def _logit_positions(pos: torch.Tensor, prompt_len: int, response_len: int) -> torch.Tensor:
    """The rows whose logits score a response token (the trainer computes logprobs for those only)."""
    nxt = pos + 1 - prompt_len
    return pos[(nxt >= 0) & (nxt < response_len)]


def _worker(
    cfg: Config,
    tokens: list[int],
    prompt_len: int,
    selection: Selection,
    perturb: dict[Checkpoint, Any],
    shard_dir: str,
) -> None:
    """One trainer rank: the trainer's own TrainerWorker (kernel layer spec, megatron's schedule,
    response slicing, logprob recipe) with its kernel set swapped for the recording proxy."""
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    from tonpolicy.trainer.worker import TrainerWorker

    worker = TrainerWorker(cfg, cfg.model.checkpoint, spec="kernels")
    m = worker.model_cfg
    rec = RecordingKernels(
        worker.kernels, m.num_layers, m.num_attention_heads // m.num_kv_heads, m.head_dim, selection, perturb
    )
    for mod in worker.module.modules():  # every layer-spec module holds the set as `kernels`
        if getattr(mod, "kernels", None) is worker.kernels:
            mod.kernels = rec
    worker.kernels = rec
    layers = worker.module.decoder.layers
    offset = layers[0].layer_number - 1 if len(layers) else 0  # pipeline stage: global = local + offset
    rec.bind_weights(dict(worker.module.named_parameters()), lambda n: megatron_weight_role(n, m.num_layers, offset))
    prompt, response = tokens[:prompt_len], tokens[prompt_len:]

    def rows(_mod: Any, args: tuple) -> None:  # GPTModel(tokens, positions, mask): this rank's positions
        pos = args[1].reshape(-1)
        rec.set_rows(pos, _logit_positions(pos, prompt_len, len(response)))

    hook = worker.module.register_forward_pre_hook(rows)
    try:
        (lps,) = worker.logprobs([prompt], [response])
    finally:
        hook.remove()
    tensors: dict[str, torch.Tensor] = {}
    for ck, (pos, val) in rec.records.collect().items():
        tensors[ck.name] = val.contiguous()
        tensors[ck.name + _POS] = pos.contiguous()
    tensors["trainer_logprobs"] = lps.float().contiguous()  # what the trainer returns, for a cross-check
    meta = {
        "tp_rank": str(ps.get_tensor_model_parallel_rank()),
        "cp_rank": str(ps.get_context_parallel_rank()),
        "pp_rank": str(ps.get_pipeline_model_parallel_rank()),
    }
    save_file(tensors, str(Path(shard_dir) / f"rank{dist.get_rank()}.safetensors"), metadata=meta)
    worker.close()


def assemble(shard_dir: Path, num_layers: int) -> dict[Checkpoint, tuple[torch.Tensor, torch.Tensor]]:
    """Full tensors from every rank's shard (see the module docstring)."""
    by_tp: dict[Checkpoint, dict[int, Records]] = {}
    for f in sorted(shard_dir.glob("rank*.safetensors")):
        with safe_open(str(f), "pt") as sf:
            tp_rank = int(sf.metadata()["tp_rank"])
            for key in sf.keys():
                if key.endswith(_POS) or key == "trainer_logprobs":
                    continue
                ck = parse_name(key, num_layers)
                by_tp.setdefault(ck, {}).setdefault(tp_rank, Records()).add(
                    ck, sf.get_tensor(key + _POS), sf.get_tensor(key)
                )
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


def trainer_dump(
    cfg: Config,
    tokens: list[int],
    prompt_len: int,
    selection: Selection,
    work_dir: Path,
    *,
    perturb: dict[Checkpoint, Any] | None = None,
    timeout: float = 600.0,
) -> Dump:
    """Dump the trainer's logprob forward of one sample (temperature: cfg.experiment's, as in training)."""
    from tonpolicy.trainer.process_groups import spawn

    p = cfg.parallel
    shard_dir = work_dir / "trainer_shards"
    shutil.rmtree(shard_dir, ignore_errors=True)
    shard_dir.mkdir(parents=True)
    spawn(
        _worker, p.tp * p.pp * p.cp, cfg, tokens, prompt_len, selection, perturb or {}, str(shard_dir), timeout=timeout
    )
    records = assemble(shard_dir, cfg.model.num_layers)
    _check_trainer_logprobs(shard_dir, records, prompt_len)
    shutil.rmtree(shard_dir, ignore_errors=True)
    layout = {"tp": p.tp, "pp": p.pp, "cp": p.cp, "cp_type": p.cp_type}
    meta = {
        "engine": "megatron-core",
        "path": "full_forward",
        "kernels": cfg.contract.kernels,
        "layout": json.loads(json.dumps(layout)),
        "perturb": sorted(str(c) for c in (perturb or {})),
    }
    return make_dump("trainer", tokens, prompt_len, cfg.model.num_layers, cfg.model.vocab_size, records, meta)


def _check_trainer_logprobs(shard_dir: Path, records: dict, prompt_len: int) -> None:
    """The dumped logprobs must be the ones TrainerWorker.logprobs returned."""
    lp = next((v for ck, v in records.items() if ck.op == "logprobs"), None)
    if lp is None:
        return
    with safe_open(str(shard_dir / "rank0.safetensors"), "pt") as sf:
        returned = sf.get_tensor("trainer_logprobs")
    pos, val = lp
    if not torch.equal(val.flatten(), returned[pos - (prompt_len - 1)]):
        raise RuntimeError("the dumped trainer logprobs differ from the ones TrainerWorker.logprobs returned")
