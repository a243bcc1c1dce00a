"""Trainer memory per rank, before launch (the plan's `memory_per_rank`): parameters, gradients and
optimizer state of the fullest rank at the configured layout, so a user knows whether a model fits
before asking a cluster for it. Counted from the family's HF parameter plan (shapes, TP kinds), as
Megatron lays the model out here: dense weights split over TP, expert weights over EP (and expert-TP =
TP), layers over PP stages (embedding on the first, final norm and LM head on the last), DP replicas
whole (the distributed optimizer is not used). Activations and the KV cache are not counted."""

from __future__ import annotations

from typing import Any

from tonpolicy.config.hf_qwen3 import EMBED, FINAL_NORM, LM_HEAD, REPLICATED
from tonpolicy.config.layout import Layout
from tonpolicy.config.schema import Config
from tonpolicy.families import adapter

GIB = 1 << 30
# Megatron DDP keeps fp32 main gradients; Adam keeps exp_avg and exp_avg_sq in fp32, plus an fp32
# master copy of bf16 parameters.
GRAD_BYTES = 4
ADAM_BYTES = {"bfloat16": 12, "float32": 8}
PARAM_BYTES = {"bfloat16": 2, "float32": 4}


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def memory_per_rank(cfg: Config) -> dict[str, Any]:
    m, p = cfg.model, Layout.from_config(cfg)
    ad = adapter(m.family)
    stages = p.stage_layers(m.num_layers)
    first_layer = [sum(stages[:i]) for i in range(len(stages))]
    per_stage = [{"dense": 0, "expert": 0} for _ in stages]
    for name, param in ad.hf_params(m).items():
        n = _numel(param.shape)
        if name == EMBED:
            stage = 0
        elif name in (FINAL_NORM, LM_HEAD):
            stage = len(stages) - 1
        else:
            layer = int(name.split(".")[2])  # model.layers.{i}.…
            stage = max(i for i, start in enumerate(first_layer) if start <= layer)
        sharded = n if param.tp == REPLICATED else n // p.tp
        if ".experts." in name:
            per_stage[stage]["expert"] += sharded // p.ep
        else:
            per_stage[stage]["dense"] += sharded
    counts = [s["dense"] + s["expert"] for s in per_stage]
    worst = max(range(len(counts)), key=counts.__getitem__)
    params = counts[worst]
    dtype = cfg.contract.dtype
    out = {
        "rank": f"pipeline stage {worst} of {p.pp}, one of tp={p.tp} x ep={p.ep}",
        "parameters": params,
        "expert_parameters": per_stage[worst]["expert"],
        "param_gib": params * PARAM_BYTES[dtype] / GIB,
        "grad_gib": params * GRAD_BYTES / GIB,
        "optimizer_gib": params * ADAM_BYTES[dtype] / GIB,
    }
    out["total_gib"] = out["param_gib"] + out["grad_gib"] + out["optimizer_gib"]
    out["note"] = "parameters, fp32 gradients and Adam state of the fullest rank; activations not counted"
    return out
