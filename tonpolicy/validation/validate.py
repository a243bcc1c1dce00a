"""Cross-group validation: every rule is checked and every violation reported at once.

Each message names the dotted config key, the offending value and the rule, so a user can fix the
whole command line in one go, before any process starts.
"""

from __future__ import annotations

import math
import os
from pathlib import Path
from typing import Any

from tonpolicy.config.device import resolve_device
from tonpolicy.config.errors import ConfigError as ConfigError
from tonpolicy.config.errors import ConfigIssue as ConfigIssue
from tonpolicy.config.errors import unknown_keys as unknown_keys
from tonpolicy.config.hf_check import hf_config_mismatches
from tonpolicy.config.layout import Layout
from tonpolicy.config.moe_rules import check_moe
from tonpolicy.config.ranges import check_ranges
from tonpolicy.config.rollout_backends import RolloutBackend, rollout_backend, rollout_backend_names
from tonpolicy.config.schema import Config, value_at
from tonpolicy.config.server_access import LOOPBACK
from tonpolicy.families import ANY_FAMILY, FAMILIES
from tonpolicy.kernels.sets import LOGITS_DTYPES, KernelSetSpec, kernel_set, kernel_set_names, kernel_sets
from tonpolicy.rl.task import TASKS
from tonpolicy.validation.async_rules import check_staleness
from tonpolicy.validation.quant_rules import check_quant
from tonpolicy.validation.task_rules import check_task

# Values that were renamed, so an old config is told the new name.
RENAMED = {("contract.kernels", "contract"): "invariant", ("contract.kernels", "default"): "plain"}
KNOWN = {
    "mode": ("plan", "run", "align"),
    "contract.dtype": ("bfloat16", "float32"),
    "parallel.cp_type": ("none", "ulysses", "ring"),
    "trainer.backend": ("megatron",),
    "trainer.device": ("auto", "cpu", "cuda"),
    "logger.backend": ("wandb", "none"),
    "logger.mode": (None, "offline", "online", "disabled"),
    "reward.on_error": ("zero", "fail"),
}
# Backends that released SGLang's --enable-deterministic-inference accepts.
SGLANG_DETERMINISTIC_BACKENDS = ("fa3", "fa4", "flashinfer", "triton", "ascend", "intel_xpu")


def known() -> dict[str, tuple[Any, ...]]:
    """Every key with a closed set of values; the registries' names are read now, so a model family,
    kernel set, rollout backend or task registered after import is known."""
    return {
        **KNOWN,
        "model.family": tuple(FAMILIES),
        "contract.family": (*FAMILIES, ANY_FAMILY),
        "contract.kernels": kernel_set_names(),
        "rollout.backend": rollout_backend_names(),
        "task.name": tuple(TASKS),
    }


def _backend(cfg: Config) -> RolloutBackend | None:
    """The configured rollout backend; None when unknown (reported by name)."""
    return rollout_backend(cfg.rollout.backend) if cfg.rollout.backend in rollout_backend_names() else None


def _kernels(cfg: Config) -> KernelSetSpec | None:
    """The configured kernel set's spec; None when unknown (reported by name)."""
    return kernel_set(cfg.contract.kernels) if cfg.contract.kernels in kernel_set_names() else None


def validate(cfg: Config, *, check_hf: bool = True, unknown: list[ConfigIssue] | None = None) -> None:
    """Raise ConfigError listing every violated rule; return None when the config is valid.
    `unknown`: issues found on the composed config before it became `cfg` (see unknown_keys)."""
    issues: list[ConfigIssue] = list(unknown or [])

    def bad(key: str, rule: str) -> None:
        issues.append(ConfigIssue(key, value_at(cfg, key), rule))

    for key, allowed in known().items():
        if value_at(cfg, key) not in allowed:
            renamed = RENAMED.get((key, value_at(cfg, key)))
            bad(key, f"must be one of {list(allowed)}" + (f" (renamed: use {renamed!r})" if renamed else ""))

    m, p = cfg.model, cfg.parallel
    positive = [
        "model.num_layers",
        "model.hidden_size",
        "model.num_attention_heads",
        "model.num_kv_heads",
        "model.head_dim",
        "model.intermediate_size",
        "model.vocab_size",
        "model.max_position_embeddings",
        "parallel.tp",
        "parallel.pp",
        "parallel.cp",
        "parallel.dp",
        "parallel.rollout_tp",
        "parallel.rollout_ep",
        "parallel.rollout_dp",
        "parallel.ep",
        "contract.attention_tile",
        "contract.row_tile",
        "contract.prefill_row_tile",
        "contract.canonical_shards",
        "experiment.steps",
        "experiment.prompts_per_step",
        "experiment.samples_per_prompt",
        "experiment.max_prompt_len",
        "experiment.max_new_tokens",
        "rollout.max_running_requests",
        "trainer.nnodes",
        "trainer.ppo_epochs",
        "checkpoint.keep_last",
        "trainer.ppo_minibatches",
    ]
    if p.num_microbatches is not None:
        positive.append("parallel.num_microbatches")
    if cfg.trainer.micro_batch_size is not None:
        positive.append("trainer.micro_batch_size")
    for key in positive:
        if value_at(cfg, key) < 1:
            bad(key, "must be a positive integer")
    check_ranges(cfg, bad)
    # Divisibility rules are meaningless with zero counts (already reported); the rest still runs.
    if min(m.num_attention_heads, m.num_kv_heads, p.tp, p.pp, p.cp, p.rollout_tp, cfg.trainer.nnodes) >= 1:
        _check_layout(cfg, bad)
    _check_contract(cfg, bad)
    check_quant(cfg, bad)
    check_moe(cfg, bad)
    _check_router_replay(cfg, bad)
    check_staleness(cfg, bad)
    _check_cuda_graphs(cfg, bad)
    backend = _backend(cfg)
    if backend is not None and backend.rules is not None:
        backend.rules(cfg, bad)
    check_task(cfg, bad)
    if cfg.mode in ("run", "align"):
        _check_checkpoint(cfg, issues)
    if check_hf and m.hf_config:
        for key, value, rule in hf_config_mismatches(m):
            issues.append(ConfigIssue(key, value, rule))
    if issues:
        raise ConfigError(issues)


def _check_layout(cfg: Config, bad: Any) -> None:
    m, p, c = cfg.model, cfg.parallel, cfg.contract
    # Model-internal consistency.
    if m.num_attention_heads % m.num_kv_heads:
        bad("model.num_kv_heads", f"must divide model.num_attention_heads={m.num_attention_heads} (GQA)")

    # The trainer's layout: its own rules (tonpolicy.config.layout).
    for issue in Layout.from_config(cfg).issues(cfg):
        bad(issue.key, issue.rule)

    # Rollout tensor parallelism: SGLang replicates KV heads when TP > KV heads, so it needs
    # heads % tp == 0 and either kv_heads % tp == 0 or tp % kv_heads == 0.
    rtp = p.rollout_tp
    if m.num_attention_heads % rtp:
        bad("parallel.rollout_tp", f"must divide model.num_attention_heads={m.num_attention_heads}")
    if m.num_kv_heads % rtp and rtp % m.num_kv_heads:
        bad("parallel.rollout_tp", f"must divide or be a multiple of model.num_kv_heads={m.num_kv_heads}")
    backend = _backend(cfg)
    if backend is not None and not backend.sharded and rtp != 1:
        bad("parallel.rollout_tp", "the embedded rollout engine runs unsharded: must be 1 (use rollout=sglang for TP)")

    if cfg.data.train_files and cfg.reward.function is None:
        bad("data.train_files", "needs reward.function (yours): the built-in tasks score only their own prompts")
    if cfg.data.val_files and cfg.reward.function is None:
        bad("data.val_files", "needs reward.function (yours): it scores the held-out prompts")
    if cfg.logger.samples_every < 0:
        bad("logger.samples_every", "must be >= 0 (0: no samples table)")
    if cfg.trainer.eval_every < 0:
        bad("trainer.eval_every", "must be >= 0 (0: after the last step only)")
    if cfg.data.train_files and cfg.task.max_turns > 1:
        bad("data.train_files", f"is for single-turn prompts: task={cfg.task.name} is multi-turn")
    t = cfg.trainer
    if t.nnodes > 1 and cfg.mode == "plan" and t.master_addr in LOOPBACK:
        bad(
            "trainer.master_addr",
            f"is loopback, which the other {t.nnodes - 1} node(s) cannot reach: give node 0's address",
        )
    if t.nnodes > 1 and cfg.mode == "run":  # every node's launcher must agree on these
        if not cfg.model.checkpoint:
            bad("model.checkpoint", "several nodes start from one checkpoint every node can read: give its path")
        if not t.master_port:
            bad("trainer.master_port", "several nodes meet at one port on node 0: give it (0 picks one per node)")
    if t.node_rank is not None and not 0 <= t.node_rank < t.nnodes:
        bad("trainer.node_rank", f"must be in [0, trainer.nnodes={t.nnodes})")
    r = cfg.rollout
    if r.nnodes < 1 or (r.nnodes > 1 and backend is not None and not backend.spans_nodes):
        bad("rollout.nnodes", "must be 1, or more only with rollout=sglang (the embedded engine is one process)")
    elif r.nnodes > 1 and p.rollout_tp % r.nnodes:
        bad("rollout.nnodes", f"must divide parallel.rollout_tp={p.rollout_tp} (SGLang splits TP ranks over nodes)")
    if r.nnodes > 1 and r.nnodes != t.nnodes:
        bad(
            "rollout.nnodes",
            f"a server spanning nodes runs on every node of the plan: must equal trainer.nnodes={t.nnodes}",
        )
    if r.nnodes > 1 and cfg.mode == "run":
        bad("rollout.nnodes", "a server spanning nodes is started by the plan's launch.sh on each node: use mode=plan")
    if r.nnodes > 1 and not r.dist_init_addr:
        bad("rollout.dist_init_addr", "a server spanning nodes needs host:port on its node 0 (SGLang --dist-init-addr)")
    spec = _kernels(cfg)
    if spec is not None:
        _check_kernel_set_fixed(cfg, spec, bad)
    if spec is not None and spec.invariant:
        # The fix is one more override: a shard count both TPs divide (other bits, so a new fingerprint).
        fix = math.lcm(c.canonical_shards, p.tp, rtp) if p.tp > 0 and rtp > 0 else c.canonical_shards
        hint = f" (set contract.canonical_shards={fix}: every TP dividing it gives the same bits)"
        if c.canonical_shards % p.tp:
            bad(
                "parallel.tp",
                f"contract {c.name} reproduces bits only for TP dividing canonical_shards={c.canonical_shards}" + hint,
            )
        if c.canonical_shards % rtp:
            bad(
                "parallel.rollout_tp",
                f"contract {c.name} reproduces bits only for TP dividing canonical_shards={c.canonical_shards}" + hint,
            )


def _check_cuda_graphs(cfg: Config, bad: Any) -> None:
    """rollout.cuda_graphs: the embedded engine's decode graphs (null: on where they apply)."""
    r, c = cfg.rollout, cfg.contract
    if r.cuda_graphs is None:
        return
    backend = _backend(cfg)
    if backend is not None and not backend.decode_graphs:
        bad(
            "rollout.cuda_graphs",
            "applies to the embedded engine; with rollout=sglang, SGLang's decode graphs follow the contract "
            "(leave it null)",
        )
        return
    if not r.cuda_graphs:
        return
    if resolve_device(cfg) != "cuda":
        bad(
            "rollout.cuda_graphs",
            "CUDA graphs need a CUDA device: set trainer.device=cuda or rollout.cuda_graphs=false",
        )
    spec = _kernels(cfg)
    if spec is not None and not spec.cuda_graphs:
        graph_sets = " or ".join(s.name for s in kernel_sets() if s.cuda_graphs)
        bad(
            "rollout.cuda_graphs",
            f"decode graphs need the {graph_sets} kernel set (contract.kernels={c.kernels} sizes its work on the "
            "host): use contract=qwen3_dense_triton_v1 or rollout.cuda_graphs=false",
        )
    if cfg.model.is_moe:
        bad("rollout.cuda_graphs", "decode graphs are for dense models (expert routing is host-planned)")


def _check_kernel_set_fixed(cfg: Config, spec: KernelSetSpec, bad: Any) -> None:
    """What the kernel set fixes: its attention tile, and the GPU when it has no CPU path (a set with an
    interpreter runs on a CPU under its environment variable, for tests)."""
    c = cfg.contract
    if spec.fixed_attention_tile is not None and c.attention_tile != spec.fixed_attention_tile:
        bad("contract.attention_tile", f"the {spec.name} kernel set uses {spec.fixed_attention_tile}-key tiles")
    if "cpu" in spec.devices:
        return
    env = spec.cpu_interpreter_env
    interpreted = env is not None and os.environ.get(env) == "1"
    where = f"on a CPU only under {env}=1, which is for tests" if env else "never on a CPU"
    if cfg.trainer.device == "cpu" and not interpreted:
        bad(
            "trainer.device",
            f"contract {c.name} runs {spec.kernel_language} kernels on CUDA GPUs: set trainer.device=cuda ({where})",
        )
    if cfg.trainer.device == "auto" and not interpreted and resolve_device(cfg) == "cpu":
        bad(
            "trainer.device",
            f"contract {c.name} runs {spec.kernel_language} kernels on CUDA GPUs and this machine has none",
        )


def _check_contract(cfg: Config, bad: Any) -> None:
    m, p, c = cfg.model, cfg.parallel, cfg.contract
    # Contract against model, layout and backends.
    if c.family not in (m.family, ANY_FAMILY):
        bad("contract.family", f"contract {c.name} is for family {c.family!r} but model {m.name} is {m.family!r}")
    if p.cp > 1 and p.cp_type not in c.supported_cp_types:
        bad("parallel.cp_type", f"contract {c.name} supports CP types {c.supported_cp_types}")
    if cfg.rollout.backend not in c.supported_rollout_backends:
        bad("rollout.backend", f"contract {c.name} supports rollout backends {c.supported_rollout_backends}")
    if cfg.trainer.backend not in c.supported_trainer_backends:
        bad("trainer.backend", f"contract {c.name} supports trainer backends {c.supported_trainer_backends}")
    if c.sglang.enable_deterministic_inference and c.sglang.attention_backend not in SGLANG_DETERMINISTIC_BACKENDS:
        bad(
            "contract.sglang.attention_backend",
            f"SGLang deterministic inference accepts only {list(SGLANG_DETERMINISTIC_BACKENDS)}",
        )
    if c.sglang.rl_on_policy_target not in (None, "fsdp"):
        bad("contract.sglang.rl_on_policy_target", "released SGLang accepts only 'fsdp' (or null to omit the flag)")
    if c.logits_dtype not in LOGITS_DTYPES:
        bad("contract.logits_dtype", f"must be one of {list(LOGITS_DTYPES)}")
    elif c.logits_dtype == "bfloat16" and (not _bf16_logits(cfg) or c.dtype != "bfloat16"):
        bad("contract.logits_dtype", "bfloat16 logits are a choice of the contract kernels on a bfloat16 model")
    spec = _kernels(cfg)
    multiple = spec.row_tile_multiple if spec is not None else None
    if multiple is not None and c.row_tile >= 1:
        # Any row count that is a multiple gives the same row bits; fewer rows take another GEMM path.
        if c.row_tile % multiple:
            bad(
                "contract.row_tile",
                f"must be a multiple of {multiple} (GEMMs of 1-{multiple - 1} rows take another path, other bits)",
            )
        if c.prefill_row_tile >= 1 and c.prefill_row_tile % c.row_tile:
            bad("contract.prefill_row_tile", f"must be a multiple of contract.row_tile={c.row_tile}")


def _check_router_replay(cfg: Config, bad: Any) -> None:
    """trainer.router_replay is the off-policy control's tool: it makes megatron's stock router take the
    rollout's routes, leaving the rest of the stock numerics to measure."""
    if not cfg.trainer.router_replay:
        return
    c = cfg.contract
    if c.exact_zero:
        bad(
            "trainer.router_replay",
            f"contract {c.name} promises exact zero: its trainer routes as the rollout does by construction, "
            "and replaying the rollout's routes would hide a routing disagreement the gate must see "
            "(use it with a non-exact contract, e.g. contract=off_policy)",
        )
    if not cfg.model.is_moe:
        bad("trainer.router_replay", f"model {cfg.model.name} is dense: there are no routes to replay")
    spec = _kernels(cfg)
    if (spec is not None and spec.invariant) or cfg.trainer.pack_sequences or cfg.parallel.cp > 1:
        bad(
            "trainer.router_replay",
            "replays through megatron's stock router, which runs only under the stock layer spec "
            "(plain kernels, no packed sequences, no CP)",
        )


def _check_checkpoint(cfg: Config, issues: list[ConfigIssue]) -> None:
    """`model.checkpoint` must be an HF checkpoint of the profile's architecture, checked before start."""
    ckpt = cfg.model.checkpoint
    if not ckpt:
        return
    path = Path(ckpt)
    if not (path / "config.json").is_file():
        issues.append(ConfigIssue("model.checkpoint", ckpt, "must be an HF checkpoint directory with config.json"))
        return
    if not any(path.glob("*.safetensors")):
        issues.append(ConfigIssue("model.checkpoint", ckpt, "holds no *.safetensors weights"))
    for key, value, rule in hf_config_mismatches(cfg.model, path / "config.json", "model.checkpoint"):
        issues.append(ConfigIssue(key, value, rule))


def _bf16_logits(cfg: Config) -> bool:
    spec = _kernels(cfg)
    return spec is not None and spec.bf16_logits
