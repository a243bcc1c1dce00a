"""Schema dataclasses, one per config group, registered in Hydra's ConfigStore.

Each YAML option under tonpolicy/conf/<group>/ extends its group's `base_<group>` schema, so typos
and wrong types are rejected by OmegaConf at composition time. Cross-group rules live in
tonpolicy.validation.validate, which reports every violation at once.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass, field
from typing import Any

from hydra.core.config_store import ConfigStore

from tonpolicy.config.model import ModelConfig


@dataclass
class SGLangSettings:
    """How the contract maps onto released SGLang."""

    # Out-of-tree model package SGLang loads (SGLANG_EXTERNAL_MODEL_PACKAGE) in place of its own
    # Qwen3: tonpolicy.inside_sglang.model runs every op on the contract kernels. null: SGLang's own
    # model and kernels (stock SGLang).
    model_package: str | None = "tonpolicy.inside_sglang.model"
    enable_deterministic_inference: bool = False
    # null: SGLang's default on GPUs, torch_native on CPU (the one CPU backend that needs no AMX).
    attention_backend: str | None = None
    # Released SGLang accepts only "fsdp"; null leaves the flag out.
    rl_on_policy_target: str | None = None
    disable_radix_cache: bool = False


@dataclass
class ContractConfig:
    name: str = "qwen3_dense_v2"
    version: int = 2
    family: str = "qwen3"
    # Promise of the contract: rollout and trainer logprobs are bitwise equal.
    exact_zero: bool = True
    kernels: str = "ordered"  # "ordered" (v2) | "invariant" (v1) | "triton" | "plain" (the negative control)
    dtype: str = "bfloat16"  # "bfloat16" | "float32": weights and activations
    accumulate_dtype: str = "float32"  # matmuls, norms' statistics, softmax, logprobs
    attention_tile: int = 32  # split-KV key tile shared by prefill, decode and ring CP
    row_tile: int = 4  # every GEMM row count is a multiple of this (decode pads 1 row to 4, not more)
    prefill_row_tile: int = 512  # GEMM row tile for long inputs (same row bits, proven by tests)
    canonical_shards: int = 4  # row-parallel K-shards; any TP dividing this gives the same bits
    # The LM head's output: "float32" (an fp32 GEMM: unrounded logits) or "bfloat16" (the native bf16
    # GEMM, logits rounded to bf16 as stock SGLang and Megatron do; half the bandwidth). Logprobs are
    # fp32 either way, and both engines compute the same bits either way.
    logits_dtype: str = "float32"
    # "fp8_block": the attention and MLP linears (and MoE experts) in block-scaled e4m3 on both engines,
    # quantized from the master weights by one function (docs/REDUCTION_RULES.md); "none": v2 as is.
    quant: str = "none"
    logprob_recipe: str = "fp32_log_softmax_real_vocab_at_sampling_decode"
    supported_cp_types: list[str] = field(default_factory=lambda: ["ulysses", "ring"])
    supported_rollout_backends: list[str] = field(default_factory=lambda: ["embedded", "sglang"])
    supported_trainer_backends: list[str] = field(default_factory=lambda: ["megatron"])
    sglang: SGLangSettings = field(default_factory=SGLangSettings)


@dataclass
class ParallelConfig:
    name: str = "tp1"
    tp: int = 1
    pp: int = 1
    cp: int = 1
    cp_type: str = "none"  # "none" | "ulysses" | "ring" (zigzag)
    dp: int = 1
    rollout_tp: int = 1
    # SGLang's --ep-size (MoE models): experts split over ep of the rollout_tp ranks. The contract's bits
    # do not depend on it (an expert's output is taken from the one rank that holds it).
    rollout_ep: int = 1
    rollout_dp: int = 1
    # Expert parallelism (Megatron's expert_model_parallel_size): the experts of a MoE layer split over
    # ep ranks carved out of tp*cp*dp as Megatron lays them out, so it adds no ranks of its own.
    ep: int = 1
    # Declared uneven pipeline split: layers per stage (len == pp, sum == num_layers).
    pp_layers: list[int] | None = None
    # Microbatches per replica per step; null: derived, batch / (dp * micro batch size).
    num_microbatches: int | None = None


@dataclass
class RolloutConfig:
    backend: str = "embedded"  # a registered rollout backend (tonpolicy.config.rollout_backends)
    host: str = "127.0.0.1"
    # Binding anything but loopback exposes unauthenticated /generate and /update_weights_from_disk:
    # it takes this explicit opt-in.
    allow_remote: bool = False
    # The server takes requests only with `Authorization: Bearer $TONPOLICY_API_KEY` (SGLang's
    # --api-key; /health stays open). The key is read from the environment at launch; tonpolicy never
    # writes it to the config, the plan or launch.sh (released SGLang takes it on its command line and
    # prints its arguments to its log). Required with a non-loopback host.
    require_api_key: bool = False
    port: int = 0  # 0 = pick a free port
    max_running_requests: int = 8
    chunked_prefill_size: int | None = None
    # The embedded engine's decode steps in CUDA graphs, one per batch-size bucket up to
    # max_running_requests (rollout/engine/graphs.py). null: on where they apply (embedded engine,
    # triton kernel set, CUDA, dense model), off elsewhere; true where they cannot apply is refused.
    # (rollout=sglang: SGLang's own decode graphs, rendered from the contract.)
    cuda_graphs: bool | None = None
    health_timeout_s: float = 120.0
    # Once healthy, a server that answers no /health for this long is dead (hung, stopped): the
    # launcher ends the run with exit 4.
    liveness_timeout_s: float = 60.0
    mem_fraction_static: float | None = None
    # KV pool size in tokens (SGLang --max-total-tokens). null: SGLang sizes it from free memory on
    # GPUs; on CPU (where it would size it from RAM) tonpolicy renders CPU_MAX_TOTAL_TOKENS.
    max_total_tokens: int | None = None
    # The trainer sends token ids, so by default neither server loads a tokenizer (SGLang's
    # --skip-tokenizer-init). false: serve text too (SGLang's clients, the OpenAI API), with the
    # checkpoint's tokenizer; the server then also stops at the tokenizer's EOS, as SGLang does.
    skip_tokenizer_init: bool = True
    # No prefix cache (SGLang's --disable-radix-cache; the embedded engine's too). A later turn of a
    # multi-turn task then prefills its whole context instead of reusing the earlier turns' keys/values.
    disable_radix_cache: bool = False
    # A fleet: this many rollout servers (each at parallel.rollout_tp) behind sglang-router, which the
    # trainer sends its samples to; weight updates and the handshake reach every replica. 1: one server,
    # no router. (Replaces parallel.rollout_dp, SGLang's in-server --dp-size, which must stay 1.)
    replicas: int = 1
    # sglang-router's --policy: how it spreads the samples over the replicas.
    router_policy: str = "round_robin"
    # Re-sends of one rollout request that failed on the way (connection refused or reset, a 5xx from a
    # restarting server or router, a duplicate rid) before the step fails; 0: none.
    client_retries: int = 5
    # A fleet's members (replicas, router) the launcher starts again per run when one dies; the next
    # death ends the job (exit 4). A replica is replaced only under weight_sync=disk.
    max_restarts: int = 2
    # How the trainer hands each step's weights to the server: "disk" (an HF checkpoint per step and
    # /update_weights_from_disk; needs a file system both see) or "distributed" (a broadcast over a
    # process group of the trainer's rank 0 and the engine ranks, SGLang's
    # /init_weights_update_group + /update_weights_from_distributed; nothing written).
    weight_sync: str = "disk"
    # Nodes one SGLang server spans (its --nnodes; each node runs the command with its --node-rank),
    # meeting at dist_init_addr (host:port on the server's node 0).
    nnodes: int = 1
    dist_init_addr: str | None = None
    # The weight-update group's backend; null: gloo on CPU, nccl on CUDA.
    weight_sync_backend: str | None = None
    # Distributed sync sends the weights as flat byte buckets of at most this many MiB, one broadcast
    # each (SGLang's load_format "flattened_bucket"); 0: one broadcast per tensor. The default is the
    # fastest size experiments/bench/bench_weight_sync.py measured (results/bench_weight_sync.json): few
    # broadcasts for many small tensors, no single huge copy for a large model.
    weight_sync_bucket_mb: int = 32
    # Interpreter of the SGLang environment (scripts/setup_sglang.sh). null: $TONPOLICY_SGLANG_PYTHON,
    # else .venv-sglang/bin/python beside the source tree or the working directory, else this Python.
    # With rollout=sglang the trainer runs under it too, so both engines share one torch build.
    python: str | None = None


@dataclass
class TrainerConfig:
    backend: str = "megatron"
    device: str = "auto"  # "auto" | "cpu" | "cuda"
    nnodes: int = 1
    # Node 0's address, where every node's torchrun meets (static rendezvous: global rank 0, which
    # talks to the rollout server, is on node 0). With nnodes > 1 it must be reachable from every node.
    master_addr: str = "127.0.0.1"
    # This node's rank when the launcher runs one of several nodes; null: $NODE_RANK, else SLURM's
    # $SLURM_NODEID, else 0. Node 0 hosts the rollout server; the others run trainer ranks only.
    node_rank: int | None = None
    # None: derived as tp*pp*cp*dp / nnodes. When set, the layout must match it.
    nproc_per_node: int | None = None
    master_port: int = 0
    lr: float = 1e-3
    weight_decay: float = 0.0
    clip_grad: float = 1.0
    # Samples per microbatch (padded rows, or packed into one row); null: derived, see
    # config.sizes.micro_batch_size. Set it for long sequences: activation memory grows with it.
    micro_batch_size: int | None = None
    eval_every: int = 0  # evaluate data.val_files every this many steps (0: after the last step only)
    # Pack each microbatch's samples into one row (positions restart at 0 per sample; the contract
    # attention splits the row there), instead of padding each to the longest. Not with CP.
    pack_sequences: bool = False
    clip_eps: float = 0.2
    clip_eps_high: float = 0.28
    kl_coef: float = 0.0
    # Pad training sequences to a multiple of this (None: the layout's minimum, 2*CP*tile for ring).
    seq_pad_multiple: int | None = None
    # Megatron's moe_expert_capacity_factor: tokens past an expert's capacity are dropped, so a token's
    # output would depend on the others routed with it; only null (dropless) keeps exact zero.
    moe_capacity_factor: float | None = None
    # Router replay, for the off-policy control of an MoE model: megatron's stock router routes each token
    # by the experts the rollout chose (meta_info.routed_experts) instead of its own top-k, in the
    # recompute and the training forward. Not with an exact contract (its routes agree by construction,
    # and replay would hide a disagreement the gate must see).
    router_replay: bool = False
    # The "old logprob" recompute before the update. null: off where the contract promises exact zero
    # (the rollout's logprobs are the trainer's bits, so the gate compares them with the first training
    # forward and PPO's old logprobs are the rollout's), on otherwise. false under a contract without
    # exact zero uses the rollout's logprobs as PPO's old ones (slime's --use-rollout-logprobs).
    recompute_logprobs: bool | None = None
    # verl/slime's PPO loop: the step's batch split into ppo_minibatches (contiguous, in batch order),
    # one optimizer update each, the whole repeated ppo_epochs times.
    ppo_epochs: int = 1
    ppo_minibatches: int = 1
    # Truncated importance sampling under experiment.max_staleness >= 1: each token's loss is weighted by
    # min(pi_proximal / pi_behaviour, tis_cap) (behaviour: the rollout's logprobs). null: no truncation.
    tis_cap: float | None = None
    timeout_s: float = 900.0


@dataclass
class LoggerConfig:
    backend: str = "wandb"  # "wandb" | "none"
    # None: W&B's environment (WANDB_MODE, WANDB_PROJECT, WANDB_ENTITY, ...) as wandb reads it, else
    # offline into the run directory and the project "tonpolicy"; a value given here wins.
    mode: str | None = None  # "offline" | "online" | "disabled"
    project: str | None = None
    entity: str | None = None
    group: str | None = None
    tags: list[str] = field(default_factory=list)
    samples_every: int = 1  # the samples table (per-token logprobs) every N steps; 0: never


@dataclass
class TaskConfig:
    """A built-in task (tonpolicy.rl.task.TASKS): prompts and a verifiable reward."""

    name: str = "constant"  # a registered task (tonpolicy.rl.task.TASKS)
    graded_tokens: int = 4  # the reward grades the first N response tokens
    target_digit: int = 7  # the constant task's answer
    max_digits: int | None = None  # digits per prompt (1..max_digits); None: as many as max_prompt_len allows
    lr: float | None = None  # this task's learning rate when set (a trainer.lr given on the command line wins)
    # Model turns of a multi-turn task (tonpolicy.rl.multi_turn; the environment replies between them);
    # a single-turn task takes 1.
    max_turns: int = 1


@dataclass
class ExperimentConfig:
    name: str = "parity_smoke"
    seed: int = 0
    steps: int = 2
    prompts_per_step: int = 4
    samples_per_prompt: int = 2
    max_prompt_len: int = 24
    max_new_tokens: int = 12
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    # Asynchronous steps (tonpolicy.loop.producer): 0 is the synchronous loop; k >= 1 generates the next
    # batches while the trainer trains, and a sample may be at most k policy versions older than the
    # weights it trains (decoupled PPO with the rollout's logprobs as the behaviour policy).
    max_staleness: int = 0


@dataclass
class GateConfig:
    # None: fail exactly when the contract promises exact zero.
    fail_on_mismatch: bool | None = None


@dataclass
class DataConfig:
    # Your training prompts (JSON Lines), instead of the task's: tonpolicy.rl.prompt_data says how.
    # They need a reward function of yours (reward.function), which receives each row's label and columns.
    train_files: list[str] = field(default_factory=list)
    # Held-out prompts (same format), decoded greedily through the rollout server every
    # trainer.eval_every steps and after the last; reward mean and pass rate in eval.jsonl and W&B.
    val_files: list[str] = field(default_factory=list)
    prompt_key: str = "prompt"  # a string, or a list of {role, content} chat messages
    label_key: str | None = "label"
    # Render a string prompt as one user message through the checkpoint's chat template (a list of
    # messages always is); chat_template_kwargs reach the template (e.g. enable_thinking: false).
    chat_template: bool = False
    chat_template_kwargs: dict[str, Any] = field(default_factory=dict)


@dataclass
class RewardConfig:
    # Your own reward function, 'package.module:function' or 'path/to/file.py:function', or a built-in
    # (exact_match, choice_match, math_answer: tonpolicy.rl.rewards), called on every sample instead of the task's
    # (tonpolicy.rl.user_reward says how); null: the task's reward.
    function: str | None = None
    batched: bool = False  # one call per step with lists (prompts, responses, ...) instead of one per sample
    timeout_s: float = 30.0  # per call
    on_error: str = "zero"  # a call that raises, times out or returns no finite number: "zero" | "fail"


@dataclass
class CheckpointConfig:
    # The trained weights, as a complete HF model directory under <run dir>/checkpoints/step_<k>, every
    # this many steps and after the last step whatever the weight sync; 0: after the last step only.
    save_every: int = 0
    # Saved checkpoints kept, newest first (the final one is always among them); with
    # rollout.weight_sync=disk the per-step checkpoints the server loads are deleted once superseded.
    keep_last: int = 2
    # Continue a run from a saved step (its weights and optimizer state; the step records after it are
    # dropped and made again, bit for bit): "auto", the run directory's newest (a fresh start when there
    # is none: give the same hydra.run.dir), or the path of a step_<k> directory. Same layout only.
    resume: str | None = None


@dataclass
class AlignConfig:
    # Which sample: index i reproduces sample i of a run's first step (its prompt and sampling seed).
    sample: int = 0
    # Explicit prompt token ids instead (the sampling seed still comes from `sample`).
    prompt: list[int] | None = None
    # Bounded dumps: keep only these layers / absolute token positions / ops (None keeps all).
    layers: list[int] | None = None
    positions: list[int] | None = None
    ops: list[str] | None = None
    # What the rollout's decode path is compared with: "trainer" (Megatron at parallel.*) or
    # "full_forward" (one full-sequence forward of the rollout model, no KV cache).
    reference: str = "trainer"
    # Test hook: "[rollout:|trainer:]layers.<L>.<op>:<kernel set>" runs that checkpoint's kernel calls
    # on another kernel set (e.g. "layers.1.mlp_act:plain"), so the report must point at it.
    perturb: str | None = None


@dataclass
class Config:
    mode: str = "run"  # "plan" | "run" | "align"
    contract: ContractConfig = field(default_factory=ContractConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    logger: LoggerConfig = field(default_factory=LoggerConfig)
    experiment: ExperimentConfig = field(default_factory=ExperimentConfig)
    task: TaskConfig = field(default_factory=TaskConfig)
    gate: GateConfig = field(default_factory=GateConfig)
    data: DataConfig = field(default_factory=DataConfig)
    reward: RewardConfig = field(default_factory=RewardConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    align: AlignConfig = field(default_factory=AlignConfig)


GROUPS: dict[str, type] = {
    "contract": ContractConfig,
    "model": ModelConfig,
    "parallel": ParallelConfig,
    "rollout": RolloutConfig,
    "trainer": TrainerConfig,
    "logger": LoggerConfig,
    "experiment": ExperimentConfig,
    "task": TaskConfig,
}


def register_configs() -> None:
    from tonpolicy.config.assets import register_asset_resolver
    from tonpolicy.config.names import register_resolvers

    register_resolvers()
    register_asset_resolver()
    # The user's own conf/ (hydra.searchpath in config.yaml) is optional: a directory without one is
    # not worth a warning on every composition.
    warnings.filterwarnings("ignore", message=r"provider=hydra\.searchpath in main, path=conf is not available")
    cs = ConfigStore.instance()
    cs.store(name="base_config", node=Config)
    for group, node in GROUPS.items():
        cs.store(group=group, name=f"base_{group}", node=node)


def value_at(cfg: Config, dotted: str) -> Any:
    """The value of a dotted config key (`trainer.lr`)."""
    obj: Any = cfg
    for part in dotted.split("."):
        obj = getattr(obj, part)
    return obj
