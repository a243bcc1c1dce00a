"""Validation rules of mixture-of-experts models and expert parallelism (called by validation.validate,
every violation reported with the others)."""

from __future__ import annotations

from typing import Any

from tonpolicy.config.rollout_backends import rollout_backend, rollout_backend_names
from tonpolicy.config.schema import Config
from tonpolicy.families import FAMILIES


def check_moe(cfg: Config, bad: Any) -> None:
    m, p, c = cfg.model, cfg.parallel, cfg.contract
    fam = FAMILIES.get(m.family)
    known = cfg.rollout.backend in rollout_backend_names()
    backend = rollout_backend(cfg.rollout.backend) if known else None  # an unknown one is reported by name
    if fam is None:
        return  # the unknown family is reported by name
    if fam.routed_experts and m.num_experts < 1:
        bad("model.num_experts", f"family {m.family} is a mixture of experts: must be a positive integer")
    if not fam.routed_experts and m.num_experts:
        bad("model.num_experts", f"family {m.family} is dense: must be 0 (a MoE profile has family qwen3_moe)")
    if not m.is_moe:
        for key, size in (("parallel.ep", p.ep), ("parallel.rollout_ep", p.rollout_ep)):
            if size > 1:
                bad(key, f"expert parallelism needs a mixture of experts; model {m.name} is dense")
        return
    if p.rollout_ep > 1:
        if backend is not None and not backend.sharded:
            bad("parallel.rollout_ep", "the embedded rollout engine runs unsharded: must be 1 (SGLang's --ep-size)")
        if p.rollout_tp >= 1 and p.rollout_tp % p.rollout_ep:
            bad("parallel.rollout_ep", f"SGLang places EP inside TP: must divide parallel.rollout_tp={p.rollout_tp}")
        if m.num_experts % p.rollout_ep:
            bad("parallel.rollout_ep", f"must divide model.num_experts={m.num_experts}")
    if not 1 <= m.num_experts_per_tok <= m.num_experts:
        bad("model.num_experts_per_tok", f"must be in [1, model.num_experts={m.num_experts}]")
    for key in ("moe_intermediate_size", "decoder_sparse_step"):
        if getattr(m, key) < 1:
            bad(f"model.{key}", "must be a positive integer")
    outside = [i for i in m.mlp_only_layers if not 0 <= i < m.num_layers]
    if outside:
        bad("model.mlp_only_layers", f"layers {outside} are outside [0, model.num_layers={m.num_layers})")
    if p.ep >= 1 and m.num_experts % p.ep:
        bad("parallel.ep", f"must divide model.num_experts={m.num_experts} (every EP rank holds as many experts)")
    # Megatron's expert grid: expert-TP (= tp) * ep * expert-DP = tp * cp * dp, so ep divides cp * dp.
    if p.ep >= 1 and min(p.cp, p.dp) >= 1 and (p.cp * p.dp) % p.ep:
        bad(
            "parallel.ep",
            f"Megatron carves EP out of the data-parallel ranks: must divide parallel.cp*dp={p.cp * p.dp} "
            f"(the world size stays tp*pp*cp*dp; raise parallel.dp)",
        )
    f = m.moe_intermediate_size
    for key, size in (("parallel.tp", p.tp), ("parallel.rollout_tp", p.rollout_tp)):
        if size >= 1 and f >= 1 and f % size:
            bad(key, f"must divide model.moe_intermediate_size={f} (each TP rank holds a slice of every expert)")
    if c.exact_zero and f >= 1 and f % c.canonical_shards:
        bad(
            "model.moe_intermediate_size",
            f"must be a multiple of contract.canonical_shards={c.canonical_shards} (the experts' down projection "
            "is summed over canonical K-shards)",
        )
    if c.exact_zero and cfg.trainer.moe_capacity_factor is not None:
        bad(
            "trainer.moe_capacity_factor",
            f"contract {c.name} is dropless: a capacity drops tokens by what else was routed, so must be null",
        )
    if backend is not None and not backend.family_served(fam):
        bad("rollout.backend", f"tonpolicy's SGLang model package does not serve family {m.family} yet: use embedded")
