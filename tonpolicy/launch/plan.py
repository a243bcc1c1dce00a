"""Kernel policy -> launch plan: the SGLang server command, Megatron configuration and environment.

The plan is data (launch_plan.json) plus a runnable shell script; the orchestrator and a user's
cluster scripts read the same plan, so what runs is what was validated.
"""

from __future__ import annotations

import json
import shlex
from pathlib import Path
from typing import Any

from tonpolicy.config.device import resolve_device  # its callers import it from here too
from tonpolicy.config.layout import Layout
from tonpolicy.config.rollout_backends import rollout_backend
from tonpolicy.config.schema import Config
from tonpolicy.config.sglang_rules import sglang_python
from tonpolicy.config.sizes import (
    micro_batch_size,
    microbatches_per_replica,
    padded_seq_len,
    seq_pad_multiple,
)
from tonpolicy.contract.identity import identity, kernel_params
from tonpolicy.contract.megatron_args import gpt_model_kwargs, layer_spec, transformer_kwargs
from tonpolicy.cpu_memory import CPU_ALLOCATOR_ENV
from tonpolicy.kernels.sets import kernel_set
from tonpolicy.launch.memory import memory_per_rank
from tonpolicy.launch.sglang_env import (
    CPU_MAX_TOTAL_TOKENS,
    trainer_python,
)

SGLANG_DEFAULT_PORT = 30000
# Megatron's cp_comm_type names for our CP types (we implement both inside the contract attention).


API_KEY_PLACEHOLDER = "${TONPOLICY_API_KEY}"
NODE_RANK_PLACEHOLDER = "${NODE_RANK}"


def sglang_argv(cfg: Config, model_path: str, device: str | None = None, port: int | None = None) -> list[str]:
    """Released SGLang's server command (on `port`, default the plan's). With a model package (the
    contract inside SGLang) it is `python -m tonpolicy.inside_sglang.server`, which takes exactly
    SGLang's flags."""
    c, r, p = cfg.contract, cfg.rollout, cfg.parallel
    device = device or resolve_device(cfg)
    entry = "tonpolicy.inside_sglang.server" if c.sglang.model_package else "sglang.launch_server"
    argv = [
        sglang_python(cfg),
        "-m",
        entry,
        "--model-path",
        model_path,
        "--host",
        r.host,
        "--port",
        str(port or rollout_port(cfg)),
        "--tp-size",
        str(p.rollout_tp),
        "--dp-size",
        str(p.rollout_dp),
        "--dtype",
        c.dtype,
        "--random-seed",
        str(cfg.experiment.seed),
        "--max-running-requests",
        str(r.max_running_requests),
        "--skip-server-warmup",
    ]
    if r.skip_tokenizer_init:  # the trainer sends token ids; a checkpoint needs no tokenizer
        argv += ["--skip-tokenizer-init"]
    if r.nnodes > 1:  # the server spans nodes: launch.sh runs it on each with that node's rank
        argv += [
            "--nnodes",
            str(r.nnodes),
            "--node-rank",
            NODE_RANK_PLACEHOLDER,
            "--dist-init-addr",
            str(r.dist_init_addr),
        ]
    if r.require_api_key:  # a placeholder: the launcher (or launch.sh's shell) puts the key in at exec
        argv += ["--api-key", API_KEY_PLACEHOLDER]
    if device == "cpu":
        # --sleep-on-idle: an idle SGLang scheduler on a CPU busy-polls a core (measured: 22 of 20 s at
        # TP 2, 2 s with it), which the trainer needs while the server waits for the next step.
        argv += ["--device", "cpu", "--sleep-on-idle"]
    max_tokens = r.max_total_tokens or (CPU_MAX_TOTAL_TOKENS if device == "cpu" else None)
    if max_tokens:
        argv += ["--max-total-tokens", str(max_tokens)]
    if r.chunked_prefill_size is not None:
        argv += ["--chunked-prefill-size", str(r.chunked_prefill_size)]
    if r.mem_fraction_static is not None:
        argv += ["--mem-fraction-static", str(r.mem_fraction_static)]
    if c.sglang.enable_deterministic_inference:
        argv += ["--enable-deterministic-inference"]
    backend = c.sglang.attention_backend or _default_attention_backend(cfg, device)
    if backend:
        argv += ["--attention-backend", backend]
    if c.sglang.model_package and device == "cuda":
        argv += _model_package_cuda_flags(cfg)
    if c.sglang.rl_on_policy_target:
        argv += ["--rl-on-policy-target", c.sglang.rl_on_policy_target]
    if c.sglang.disable_radix_cache or r.disable_radix_cache:
        argv += ["--disable-radix-cache"]
    if cfg.parallel.rollout_ep > 1:
        argv += ["--ep-size", str(cfg.parallel.rollout_ep)]
    if cfg.model.is_moe and (c.sglang.model_package or device == "cuda"):
        # Each token's experts come back for the gate's routing_agreement (stock SGLang's capturer needs
        # CUDA host memory; tonpolicy's server entry gives it plain memory on a CPU host).
        argv += ["--enable-return-routed-experts"]
    return argv


# With the triton set SGLang shares the GPU with the trainer ranks: it takes this fraction (weights,
# KV pool, CUDA graphs) unless rollout.mem_fraction_static says otherwise.
TRITON_MEM_FRACTION_STATIC = 0.5


def _default_attention_backend(cfg: Config, device: str) -> str | None:
    """torch_native on a CPU (the one CPU backend that needs no AMX); with the triton set on CUDA,
    SGLang's triton backend: the model package's own kernel reads the pool, so SGLang's backend only
    keeps its per-batch metadata, and this one needs nothing beyond Triton and captures CUDA graphs."""
    if device == "cpu":
        return "torch_native"
    if cfg.contract.sglang.model_package:
        return kernel_set(cfg.contract.kernels).sglang_attention_backend
    return None


def _model_package_cuda_flags(cfg: Config) -> list[str]:
    c, r = cfg.contract, cfg.rollout
    if not kernel_set(c.kernels).cuda_graphs:
        return ["--disable-cuda-graph"]  # the set picks shapes per batch on the host
    # The triton set's decode does no host work (inside_sglang/model/attention.py, TritonPoolAttention),
    # so SGLang captures decode in CUDA graphs, one per batch-size bucket up to the server's running
    # requests (a token's bits do not depend on the bucket it is padded into: the kernels' rows are
    # independent). Prefill (host-sized: chunks, radix-cache hits) runs eagerly.
    flags = [
        "--cuda-graph-backend-decode",
        "full",
        "--cuda-graph-max-bs-decode",
        str(r.max_running_requests),
        "--cuda-graph-backend-prefill",
        "disabled",
    ]
    if r.mem_fraction_static is None:
        flags += ["--mem-fraction-static", str(TRITON_MEM_FRACTION_STATIC)]
    return flags


def megatron_config(cfg: Config) -> dict[str, Any]:
    """What the trainer builds (tonpolicy.contract.megatron_args, the one source both use)."""
    m, c, layout = cfg.model, cfg.contract, Layout.from_config(cfg)
    transformer = transformer_kwargs(m, c.dtype, layout, c.exact_zero, cfg.trainer.moe_capacity_factor)
    spec = layer_spec(c.kernels)
    return {
        "transformer_config": transformer,
        "gpt_model": gpt_model_kwargs(m, c.canonical_shards, spec),
        "layer_spec": {
            "name": spec,  # contract: tonpolicy.trainer.layer_spec on the kernel set; stock: megatron's local spec
            "rope": {"theta": m.rope_theta, "applied_by": "core attention" if spec == "kernels" else "GPTModel"},
            "context_parallel": layout.cp_type if layout.cp > 1 else None,  # inside the core attention, not TE
            "real_vocab_size": m.vocab_size,
            "transformer_engine": False,
        },
        "parallel_state": {
            "tensor_model_parallel_size": layout.tp,
            "pipeline_model_parallel_size": layout.pp,
            "context_parallel_size": layout.cp,
            "data_parallel_size": layout.dp,
            "world_size": layout.world_size,
        },
        "schedule": {
            "num_microbatches": microbatches_per_replica(cfg),
            "pack_sequences": cfg.trainer.pack_sequences,
            "micro_batch_size": micro_batch_size(cfg),
            "seq_pad_multiple": seq_pad_multiple(cfg),
            "padded_seq_len": padded_seq_len(cfg),  # per sample (positions never exceed it)
            # A packed row holds up to micro_batch_size samples, each restarting at position 0.
            "max_row_len": padded_seq_len(cfg) * (micro_batch_size(cfg) if cfg.trainer.pack_sequences else 1),
        },
        "kernels": {"name": c.kernels, **kernel_params(c)},
    }


def environment(cfg: Config, device: str) -> dict[str, str]:
    env = {"PYTHONHASHSEED": str(cfg.experiment.seed)}
    if device == "cpu":
        env |= CPU_ALLOCATOR_ENV  # glibc's heap settings (tonpolicy.cpu_memory)
    if device == "cuda":
        env["CUDA_DEVICE_MAX_CONNECTIONS"] = "1"
        if cfg.contract.exact_zero:
            # Fixed collective algorithm/protocol and deterministic cuBLAS/TE: reductions in one order.
            env |= {
                "NCCL_ALGO": "Ring",
                "NCCL_PROTO": "Simple",
                "NCCL_NVLS_ENABLE": "0",
                "CUBLAS_WORKSPACE_CONFIG": ":4096:8",
                "NVTE_ALLOW_NONDETERMINISTIC_ALGO": "0",
                "TORCH_NCCL_AVOID_RECORD_STREAMS": "1",
            }
    return env


def torchrun_argv(cfg: Config, run_dir: Path, model_path: str) -> list[str]:
    t = cfg.trainer
    nproc = t.nproc_per_node or Layout.from_config(cfg).world_size // t.nnodes
    # With real SGLang the trainer runs in SGLang's environment: one torch build for both engines.
    py = trainer_python(cfg) if rollout_backend(cfg.rollout.backend).interpreter else "python"
    # One node: as before. Several: each node runs this with its own NODE_RANK (launch.sh sets it from
    # $NODE_RANK or SLURM's $SLURM_NODEID); static rendezvous keeps global rank 0 on node 0.
    nodes = ["--node-rank", NODE_RANK_PLACEHOLDER] if t.nnodes > 1 else []
    return [
        py,
        "-m",
        "torch.distributed.run",
        "--nnodes",
        str(t.nnodes),
        "--nproc-per-node",
        str(nproc),
        *nodes,
        "--master-addr",
        t.master_addr,
        "--master-port",
        str(t.master_port or 29500),
        "--max-restarts",
        "0",
        "-m",
        "tonpolicy.launch.trainer_main",
        "--config",
        str(run_dir / "resolved_config.yaml"),
        "--run-dir",
        str(run_dir),
        "--server-url",
        f"http://{cfg.rollout.host}:{rollout_port(cfg)}",
        "--checkpoint",
        model_path,
        # a fleet: the router is --server-url; weights and the handshake go to each replica
        *(["--replica-urls", ",".join(f"http://{cfg.rollout.host}:{p}" for p in replica_ports(cfg))]
          if cfg.rollout.replicas > 1 else []),
    ]  # fmt: skip


def server_argv(cfg: Config, run_dir: Path, model_path: str, device: str, port: int) -> list[str]:
    """One rollout server's command, as its backend renders it (tonpolicy.config.rollout_backends)."""
    return rollout_backend(cfg.rollout.backend).command(cfg, run_dir, model_path, device, port)


def sglang_server_argv(cfg: Config, run_dir: Path, model_path: str, device: str, port: int) -> list[str]:
    return sglang_argv(cfg, model_path, device, port)


def embedded_server_argv(cfg: Config, run_dir: Path, model_path: str, device: str, port: int) -> list[str]:
    return [
        "python",
        "-m",
        "tonpolicy.rollout.server",
        "--config",
        str(run_dir / "resolved_config.yaml"),
        "--model-path",
        model_path,
        "--host",
        cfg.rollout.host,
        "--port",
        str(port),
    ]


ROUTER_PROMETHEUS_PORT = 29000  # sglang-router's default; the launcher picks a free one


def router_argv(cfg: Config, worker_urls: list[str], port: int | None = None) -> list[str]:
    """sglang-router (the PyPI package, in tonpolicy's environment) in front of the replicas. It binds
    rollout.host (its own default is every interface), its metrics on the same host."""
    r = cfg.rollout
    argv = ["python", "-m", "sglang_router.launch_router", "--host", r.host, "--port", str(port or rollout_port(cfg))]
    argv += ["--policy", r.router_policy, "--prometheus-host", r.host, "--prometheus-port", str(ROUTER_PROMETHEUS_PORT)]
    argv += ["--log-level", "warn"]
    if r.require_api_key:  # the router checks the trainer's key and forwards it to the replicas
        argv += ["--api-key", API_KEY_PLACEHOLDER]
    return argv + ["--worker-urls", *worker_urls]


def replica_ports(cfg: Config) -> list[int]:
    """A hand-run launch.sh's replica ports: the ones after the router's."""
    return [rollout_port(cfg) + 1 + i for i in range(cfg.rollout.replicas)]


def rollout_port(cfg: Config) -> int:
    """The port a hand-run launch.sh uses; the launcher itself picks a free one when port=0."""
    return cfg.rollout.port or SGLANG_DEFAULT_PORT


def launch_plan(cfg: Config, run_dir: Path) -> dict[str, Any]:
    device = resolve_device(cfg)
    model_path = cfg.model.checkpoint or str(run_dir / "checkpoints" / "init")
    ident = identity(cfg.contract)
    plan: dict[str, Any] = {
        "contract": ident.to_dict(),
        "model": cfg.model.name,
        "layout": Layout.from_config(cfg).label,
        "device": device,
        "dist_backend": "nccl" if device == "cuda" else "gloo",
        "environment": environment(cfg, device),
        "rollout": {"backend": cfg.rollout.backend},
        "nodes": {"trainer": cfg.trainer.nnodes, "rollout": cfg.rollout.nnodes},
        "megatron": megatron_config(cfg),
        "memory_per_rank": memory_per_rank(cfg),
        "trainer_command": torchrun_argv(cfg, run_dir, model_path),
    }
    if cfg.rollout.replicas == 1:
        plan["rollout"]["command"] = server_argv(cfg, run_dir, model_path, device, rollout_port(cfg))
    else:  # a fleet: the replicas on the ports after the router's, the router in front
        ports = replica_ports(cfg)
        plan["rollout"]["replica_commands"] = [server_argv(cfg, run_dir, model_path, device, p) for p in ports]
        plan["rollout"]["router_command"] = router_argv(cfg, [f"http://{cfg.rollout.host}:{p}" for p in ports])
    server_env = rollout_backend(cfg.rollout.backend).environment(cfg, device, ident.fingerprint)
    if server_env is not None:
        plan["rollout"]["environment"] = server_env
    # The SGLang command is always rendered so a GPU user can take it to a cluster.
    plan["sglang_command"] = sglang_argv(cfg, model_path, device)
    if not cfg.model.checkpoint:  # a seeded random init, written before the engines start
        plan["init_checkpoint_command"] = [
            "python",
            "-m",
            "tonpolicy.launch.init_checkpoint",
            "--config",
            str(run_dir / "resolved_config.yaml"),
            "--out",
            model_path,
        ]
    return plan


def _shell(argv: list[str]) -> str:
    """argv as a shell line; a leading `python` becomes "$PY" so the script runs any interpreter."""
    line = '"$PY" ' + shlex.join(argv[1:]) if argv[0] == "python" else shlex.join(argv)
    # The API key placeholder is the one thing the shell expands (the key is never in the script).
    line = line.replace(shlex.quote(NODE_RANK_PLACEHOLDER), '"$NODE_RANK"')
    return line.replace(shlex.quote(API_KEY_PLACEHOLDER), '"${TONPOLICY_API_KEY:?set TONPOLICY_API_KEY}"')


def _server_env(plan: dict[str, Any]) -> str:
    """`env K=V ... ` for the variables only the rollout server gets (SGLang's model package, CPU engine)."""
    env = plan["rollout"].get("environment") or {}
    return "env " + " ".join(f"{k}={shlex.quote(v)}" for k, v in sorted(env.items())) + " " if env else ""


def _rollout_lines(plan: dict[str, Any], guard: str, end: str) -> str:
    """Start the rollout server, or a fleet's replicas and its router, in the background; killed on exit."""
    r, env = plan["rollout"], _server_env(plan)
    backend = json.dumps(r["backend"])
    if "command" in r:
        return (
            f"# Rollout server ({backend}); the trainer waits for its /health.\n"
            f"{guard}{env}{_shell(r['command'])} &\nROLLOUT_PID=$!{end}\n"
            "trap 'kill ${ROLLOUT_PID:-} 2>/dev/null || true' EXIT"
        )
    lines = [f"# A fleet of {len(r['replica_commands'])} rollout servers ({backend}) behind sglang-router."]
    lines += [f"{guard}{env}{_shell(c)} &\nROLLOUT_PIDS+=($!){end}" for c in r["replica_commands"]]
    lines += [f"{guard}{_shell(r['router_command'])} &\nROLLOUT_PIDS+=($!){end}"]
    return "ROLLOUT_PIDS=()\n" + "\n".join(lines) + "\ntrap 'kill ${ROLLOUT_PIDS[@]:-} 2>/dev/null || true' EXIT"


def launch_script(plan: dict[str, Any]) -> str:
    env = "\n".join(f"export {k}={shlex.quote(v)}" for k, v in sorted(plan["environment"].items()))
    nodes = plan.get("nodes", {"trainer": 1, "rollout": 1})
    multi = nodes["trainer"] > 1 or nodes["rollout"] > 1
    # On several nodes: every node runs this script with its NODE_RANK; node 0 writes the initial
    # weights and hosts the rollout server (all nodes do when the server spans them).
    node0 = 'if [ "$NODE_RANK" = 0 ]; then ' if multi else ""
    fi = "; fi" if multi else ""
    node_line = 'NODE_RANK="${NODE_RANK:-${SLURM_NODEID:-0}}"\n' if multi else ""
    init = plan.get("init_checkpoint_command")
    init_line = f"\n# Initial weights (seeded random init in HF format).\n{node0}{_shell(init)}{fi}\n" if init else ""
    server_guard, server_end = (node0, fi) if nodes["rollout"] == 1 else ("", "")
    c = plan["contract"]
    contract = f"{json.dumps(c['name'])} v{c['version']} ({c['fingerprint'][:16]})"
    return f"""#!/usr/bin/env bash
# tonpolicy launch plan: contract {contract}, layout {json.dumps(plan["layout"])}
# Run it from an environment with tonpolicy installed; PYTHON picks the interpreter.
set -euo pipefail
PY="${{PYTHON:-python}}"
{node_line}{env}
{init_line}
{_rollout_lines(plan, server_guard, server_end)}

# Trainer ranks ({plan["dist_backend"]}).
{_shell(plan["trainer_command"])}
"""
