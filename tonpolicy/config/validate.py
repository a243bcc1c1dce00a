"""Cross-group validation: every rule is checked and every violation reported at once.

Each message names the dotted config key, the offending value and the rule, so a user can fix the
whole command line in one go, before any process starts.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

from tonpolicy.config.hf_check import hf_config_mismatches
from tonpolicy.config.schema import Config

KNOWN = {
    "mode": ("plan", "run", "align"),
    "contract.kernels": ("contract", "default"),
    "contract.dtype": ("bfloat16", "float32"),
    "parallel.cp_type": ("none", "ulysses", "ring"),
    "rollout.backend": ("embedded", "sglang"),
    "trainer.backend": ("megatron",),
    "trainer.device": ("auto", "cpu", "cuda"),
    "logger.backend": ("wandb", "none"),
    "logger.mode": ("offline", "online", "disabled"),
    "experiment.task": ("digit_copy",),
}
# Backends that released SGLang's --enable-deterministic-inference accepts.
SGLANG_DETERMINISTIC_BACKENDS = ("fa3", "fa4", "flashinfer", "triton", "ascend", "intel_xpu")


@dataclass(frozen=True)
class ConfigIssue:
    key: str
    value: Any
    rule: str

    def __str__(self) -> str:
        return f"{self.key}={self.value!r}: {self.rule}"


class ConfigError(ValueError):
    def __init__(self, issues: list[ConfigIssue]):
        self.issues = issues
        lines = "\n".join(f"  - {i}" for i in issues)
        super().__init__(f"invalid configuration ({len(issues)} problem(s)):\n{lines}")


def _get(cfg: Config, dotted: str) -> Any:
    obj: Any = cfg
    for part in dotted.split("."):
        obj = getattr(obj, part)
    return obj


def world_size(cfg: Config) -> int:
    p = cfg.parallel
    return p.tp * p.pp * p.cp * p.dp


def seq_pad_multiple(cfg: Config) -> int:
    """The smallest multiple training sequences are padded to for this layout."""
    if cfg.trainer.seq_pad_multiple is not None:
        return cfg.trainer.seq_pad_multiple
    p, tile = cfg.parallel, cfg.contract.attention_tile
    if p.cp_type == "ring":
        return 2 * p.cp * tile
    if p.cp_type == "ulysses":
        return p.cp
    return 1


def padded_seq_len(cfg: Config) -> int:
    e = cfg.experiment
    m = max(seq_pad_multiple(cfg), 1)
    return -(-(e.max_prompt_len + e.max_new_tokens) // m) * m


# The model package that carries the contract into released SGLang.
CONTRACT_SGLANG_PACKAGE = "tonpolicy.rollout.sglang_model"


def _check_sglang(cfg: Config, bad: Any) -> None:
    """Rules for released SGLang: what the contract needs inside it, what its CPU engine accepts."""
    c, pol = cfg.contract, cfg.contract.sglang
    if c.kernels == "contract" and pol.model_package != CONTRACT_SGLANG_PACKAGE:
        bad("contract.sglang.model_package", f"contract {c.name} runs its kernels inside SGLang only through "
            f"{CONTRACT_SGLANG_PACKAGE!r}; SGLang's own kernels cannot reproduce its bits")
    if c.kernels != "contract" and pol.model_package:
        bad("contract.sglang.model_package", f"kernel set {c.kernels!r} is stock SGLang's: must be null")
    if pol.model_package:
        if pol.enable_deterministic_inference:
            bad("contract.sglang.enable_deterministic_inference", "must be false with the model package: its "
                "kernels are invariant by construction, and SGLang's deterministic mode swaps the sampler, "
                "turns the radix cache off and refuses the CPU attention backend")
        if pol.rl_on_policy_target is not None:
            bad("contract.sglang.rl_on_policy_target", "must be null with the model package: SGLang would "
                "round the returned logprobs to bf16")
    device = cfg.trainer.device
    if device == "auto":  # as the launch plan resolves it
        import torch

        device = "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cpu":
        if pol.attention_backend not in (None, "torch_native"):
            bad("contract.sglang.attention_backend", "SGLang's CPU engine on a CPU without AMX runs only "
                "torch_native (or null)")
        if pol.enable_deterministic_inference:
            bad("contract.sglang.enable_deterministic_inference", "SGLang's deterministic mode needs an accelerator")
    if cfg.rollout.max_total_tokens is not None and cfg.rollout.max_total_tokens < 1:
        bad("rollout.max_total_tokens", "must be a positive number of tokens (or null)")
    if cfg.mode == "run":
        from tonpolicy.rollout.sglang_env import sglang_python

        py = sglang_python(cfg)
        if os.sep in py and not os.access(py, os.X_OK):
            bad("rollout.python", f"{py} is not an executable interpreter; make the SGLang environment with "
                "`bash scripts/setup_sglang.sh` or point rollout.python at one")


def validate(cfg: Config, *, check_hf: bool = True) -> None:
    """Raise ConfigError listing every violated rule; return None when the config is valid."""
    issues: list[ConfigIssue] = []

    def bad(key: str, rule: str) -> None:
        issues.append(ConfigIssue(key, _get(cfg, key), rule))

    for key, allowed in KNOWN.items():
        if _get(cfg, key) not in allowed:
            bad(key, f"must be one of {list(allowed)}")

    m, p, c, e = cfg.model, cfg.parallel, cfg.contract, cfg.experiment
    positive = [
        "model.num_layers", "model.hidden_size", "model.num_attention_heads", "model.num_kv_heads",
        "model.head_dim", "model.intermediate_size", "model.vocab_size", "model.max_position_embeddings",
        "parallel.tp", "parallel.pp", "parallel.cp", "parallel.dp", "parallel.rollout_tp",
        "parallel.rollout_dp", "parallel.num_microbatches", "contract.attention_tile",
        "contract.row_tile", "contract.prefill_row_tile", "contract.attention_row_tile", "contract.canonical_shards", "experiment.steps",
        "experiment.prompts_per_step", "experiment.samples_per_prompt", "experiment.max_prompt_len",
        "experiment.max_new_tokens", "rollout.max_running_requests", "trainer.nnodes",
        "trainer.micro_batch_size",
    ]
    for key in positive:
        if _get(cfg, key) < 1:
            bad(key, "must be a positive integer")
    if min(m.num_attention_heads, m.num_kv_heads, p.tp, p.pp, p.cp, p.rollout_tp) < 1:
        raise ConfigError(issues)  # divisibility rules below are meaningless with zeros

    # Model-internal consistency.
    if m.num_attention_heads % m.num_kv_heads:
        bad("model.num_kv_heads", f"must divide model.num_attention_heads={m.num_attention_heads} (GQA)")

    # Trainer tensor parallelism (Megatron shards query groups, so TP divides both head counts).
    if m.num_attention_heads % p.tp:
        bad("parallel.tp", f"must divide model.num_attention_heads={m.num_attention_heads}")
    if m.num_kv_heads % p.tp:
        bad("parallel.tp", f"must divide model.num_kv_heads={m.num_kv_heads} (Megatron query groups)")

    # Rollout tensor parallelism: SGLang replicates KV heads when TP > KV heads, so it needs
    # heads % tp == 0 and either kv_heads % tp == 0 or tp % kv_heads == 0.
    rtp = p.rollout_tp
    if m.num_attention_heads % rtp:
        bad("parallel.rollout_tp", f"must divide model.num_attention_heads={m.num_attention_heads}")
    if m.num_kv_heads % rtp and rtp % m.num_kv_heads:
        bad("parallel.rollout_tp", f"must divide or be a multiple of model.num_kv_heads={m.num_kv_heads}")
    if cfg.rollout.backend == "embedded" and rtp != 1:
        bad("parallel.rollout_tp", "the embedded rollout engine runs unsharded: must be 1 (use rollout=sglang for TP)")

    # Pipeline parallelism.
    if p.pp_layers is not None:
        if len(p.pp_layers) != p.pp:
            bad("parallel.pp_layers", f"must list one layer count per stage (parallel.pp={p.pp})")
        if sum(p.pp_layers) != m.num_layers or min(p.pp_layers, default=0) < 1:
            bad("parallel.pp_layers", f"stages must each hold >= 1 layer and sum to model.num_layers={m.num_layers}")
    elif m.num_layers % p.pp:
        bad("parallel.pp", f"must divide model.num_layers={m.num_layers} (or declare parallel.pp_layers)")
    if p.pp > 1 and p.num_microbatches < p.pp:
        bad("parallel.num_microbatches", f"must be >= parallel.pp={p.pp} to fill the pipeline")

    # Context parallelism.
    if p.cp > 1 and p.cp_type == "none":
        bad("parallel.cp_type", f"parallel.cp={p.cp} needs a CP type: ulysses or ring")
    if p.cp == 1 and p.cp_type not in ("none",):
        bad("parallel.cp_type", "must be none when parallel.cp=1")
    if p.cp > 1 and p.cp_type == "ulysses":
        for key, heads in (("num_attention_heads", m.num_attention_heads), ("num_kv_heads", m.num_kv_heads)):
            if heads % (p.tp * p.cp):
                bad("parallel.cp", f"Ulysses CP needs model.{key}={heads} divisible by tp*cp={p.tp * p.cp}")
    pad = seq_pad_multiple(cfg)
    if p.cp > 1 and p.cp_type == "ring" and pad % (2 * p.cp * c.attention_tile):
        bad("trainer.seq_pad_multiple", f"ring CP needs sequences padded to a multiple of 2*cp*attention_tile={2 * p.cp * c.attention_tile}")

    # World size against the declared resources.
    ws = world_size(cfg)
    if cfg.trainer.nproc_per_node is not None and cfg.trainer.nproc_per_node * cfg.trainer.nnodes != ws:
        bad("trainer.nproc_per_node", f"nnodes*nproc_per_node must equal tp*pp*cp*dp={ws}")

    # Contract against model, layout and backends.
    if c.family != m.family:
        bad("contract.family", f"contract {c.name} is for family {c.family!r} but model {m.name} is {m.family!r}")
    if c.kernels == "contract":
        if c.canonical_shards % p.tp:
            bad("parallel.tp", f"contract {c.name} reproduces bits only for TP dividing canonical_shards={c.canonical_shards}")
        if c.canonical_shards % rtp:
            bad("parallel.rollout_tp", f"contract {c.name} reproduces bits only for TP dividing canonical_shards={c.canonical_shards}")
    if p.cp > 1 and p.cp_type not in c.supported_cp_types:
        bad("parallel.cp_type", f"contract {c.name} supports CP types {c.supported_cp_types}")
    if cfg.rollout.backend not in c.supported_rollout_backends:
        bad("rollout.backend", f"contract {c.name} supports rollout backends {c.supported_rollout_backends}")
    if cfg.trainer.backend not in c.supported_trainer_backends:
        bad("trainer.backend", f"contract {c.name} supports trainer backends {c.supported_trainer_backends}")
    if c.sglang.enable_deterministic_inference and c.sglang.attention_backend not in SGLANG_DETERMINISTIC_BACKENDS:
        bad("contract.sglang.attention_backend", f"SGLang deterministic inference accepts only {list(SGLANG_DETERMINISTIC_BACKENDS)}")
    if c.sglang.rl_on_policy_target not in (None, "fsdp"):
        bad("contract.sglang.rl_on_policy_target", "released SGLang accepts only 'fsdp' (or null to omit the flag)")
    if cfg.rollout.backend == "sglang":
        _check_sglang(cfg, bad)

    # Sampling and lengths.
    if not e.temperature > 0:
        bad("experiment.temperature", "must be > 0 (logprobs are log_softmax(logits / temperature))")
    if not 0 < e.top_p <= 1:
        bad("experiment.top_p", "must be in (0, 1]")
    if e.top_k != -1 and e.top_k < 1:
        bad("experiment.top_k", "must be -1 (off) or >= 1")
    if padded_seq_len(cfg) > m.max_position_embeddings:
        bad("experiment.max_new_tokens", f"max_prompt_len + max_new_tokens (padded to {pad}) = {padded_seq_len(cfg)} exceeds model.max_position_embeddings={m.max_position_embeddings}")
    if not 0 <= cfg.rollout.port <= 65535:
        bad("rollout.port", "must be in [0, 65535] (0 picks a free port)")

    if check_hf and m.hf_config:
        for key, value, rule in hf_config_mismatches(m):
            issues.append(ConfigIssue(key, value, rule))

    if issues:
        raise ConfigError(issues)
