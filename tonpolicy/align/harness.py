"""Trainer-vs-rollout parity runs, shared by the tests, the benchmark and the GPU check (a harness:
no production path imports it).

`rollout()` samples responses with the embedded engine (rollout TP=1) from an HF checkpoint;
`layouts_worker()` runs inside a spawned/torchrun process group and, for each layout in turn, builds
the trainer from the same checkpoint and compares its logprobs with the engine's decode logprobs.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from tonpolicy.config.model import ModelConfig
from tonpolicy.config.schema import Config, ContractConfig, ExperimentConfig, TrainerConfig
from tonpolicy.contract.gate import compare_logprobs
from tonpolicy.rl.train_samples import TrainSamples
from tonpolicy.trainer.process_groups import Layout

CONTRACTS = {
    "exact": dict(name="qwen3_dense_v2", version=2, kernels="ordered", exact_zero=True),
    "off_policy": dict(name="off_policy", kernels="plain", exact_zero=False),
    # GPU (or Triton's interpreter in tests); not part of the default job lists.
    "triton": dict(name="qwen3_dense_triton_v1", kernels="triton", exact_zero=True, attention_tile=64),
    "triton_fp8": dict(
        name="qwen3_dense_triton_fp8_v1", kernels="triton", exact_zero=True, attention_tile=64, quant="fp8_block"
    ),
}
CPU_CONTRACTS = ("exact", "off_policy")
# The exact contract of each model family (the same kernel set and parameters; the name says whose).
FAMILY_CONTRACTS = {"qwen3": "qwen3_dense_v2", "qwen3_moe": "qwen3_moe_v2"}


def make_config(
    layout: Layout, dtype: str, contract: str, temperature: float, checkpoint: str | Path | None = None, **trainer: Any
) -> Config:
    """A run config for a layout; the model profile is the checkpoint's own (the trainer refuses a
    checkpoint whose architecture is not the profile's)."""
    from tonpolicy.model.checkpoint import read_config

    model = read_config(checkpoint) if checkpoint is not None else ModelConfig()
    params = dict(CONTRACTS[contract])
    if contract == "exact":
        params.update(name=FAMILY_CONTRACTS[model.family], family=model.family)
    return Config(
        model=model,
        contract=ContractConfig(dtype=dtype, **params),
        parallel=layout.to_parallel(),
        experiment=ExperimentConfig(temperature=temperature),
        # One sample per microbatch unless asked: the harness's batches are not the experiment's.
        trainer=TrainerConfig(**{"micro_batch_size": 1, **trainer}),
    )


def rollout(
    checkpoint: str | Path,
    kernels: str,
    n: int,
    prompt_len: int,
    max_new_tokens: int,
    temperature: float,
    seed: int = 0,
    device: str = "cpu",
    quant: str = "none",
) -> dict[str, Any]:
    """Sample `n` responses (varied prompt lengths) with the embedded engine (the checkpoint family's
    engine model, kernels with contract.quant `quant`); decode logprobs."""
    from tonpolicy.families import family, resolve
    from tonpolicy.kernels import get_kernels
    from tonpolicy.model.checkpoint import load_hf
    from tonpolicy.rollout.engine import Engine, GenRequest

    cfg, sd = load_hf(checkpoint)
    dtype = next(iter(sd.values())).dtype
    from tonpolicy.kernels.sets import kernel_set

    tile = kernel_set(kernels).fixed_attention_tile
    params: dict[str, Any] = {"attention_tile": tile} if tile is not None else {}
    if quant != "none":
        params["quant"] = quant
    engine_model = resolve(family(cfg.family).engine_model)
    model = engine_model(cfg, get_kernels(kernels, **params), dtype, sd).to(device)
    engine = Engine(model, max_running_requests=max(2, n // 2))
    g = torch.Generator().manual_seed(seed)
    prompts = [torch.randint(0, cfg.vocab_size, (prompt_len - 3 * i,), generator=g).tolist() for i in range(n)]
    reqs = [GenRequest(p, max_new_tokens, temperature=temperature, seed=seed * 100 + i) for i, p in enumerate(prompts)]
    res = engine.generate(reqs)
    return {"prompts": prompts, "responses": [r.output_ids for r in res], "logprobs": [r.output_logprobs for r in res]}


def checkpoints_and_rollouts(
    root: Path, cfg: Any, seed: int, n: int, prompt_len: int, max_new_tokens: int, temperature: float, prefix: str = ""
) -> tuple[dict[str, str], dict[tuple[str, str], Any]]:
    """An fp32 and a bf16 checkpoint of `cfg` under `root`, each rolled out with the contract and the
    plain kernels: ({dtype: path}, {(dtype, contract): rollout}) as `layout_jobs` takes them."""
    from tonpolicy.model.checkpoint import init_state_dict, save_hf

    cks, ros = {}, {}
    for name, dtype in (("float32", torch.float32), ("bfloat16", torch.bfloat16)):
        cks[name] = str(Path(root) / f"{prefix}{name}")
        save_hf(init_state_dict(cfg, dtype, seed), cfg, cks[name])
        for contract, kernels in (("exact", CONTRACTS["exact"]["kernels"]), ("off_policy", "plain")):
            ros[(name, contract)] = rollout(cks[name], kernels, n, prompt_len, max_new_tokens, temperature)
    return cks, ros


def compare(a: list[torch.Tensor], b: list[torch.Tensor]) -> dict[str, float]:
    """Bitwise comparison of fp32 logprob lists (the gate's rule) with the size of any difference."""
    from tonpolicy.contract.gate import compare_logprobs

    rep = compare_logprobs([torch.as_tensor(x) for x in a], [torch.as_tensor(y) for y in b])
    return {
        "equal": float(rep.exact),
        "mismatched": float(rep.mismatched_tokens),
        "tokens": float(rep.tokens_scored),
        "max_abs_diff": rep.max_abs_logprob_diff,
    }


def job_config(job: dict[str, Any]) -> Config:
    return make_config(
        job["layout"], job["dtype"], job["contract"], job["temperature"], job["checkpoint"], **job.get("trainer", {})
    )


def layouts_worker(jobs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Each job: layout, dtype, contract, checkpoint, rollout (dict from `rollout`), temperature.
    Returns one result per job (logprob comparison and timings)."""
    from tonpolicy.trainer.process_groups import reset_model_parallel
    from tonpolicy.trainer.worker import TrainerWorker

    out = []
    for job in jobs:
        cfg = job_config(job)
        t0 = time.perf_counter()
        worker = TrainerWorker(cfg, job["checkpoint"])
        t1 = time.perf_counter()
        ro = job["rollout"]
        lps = worker.logprobs(ro["prompts"], ro["responses"])
        t2 = time.perf_counter()
        verdicts: list[Any] = [None] * dist.get_world_size()  # every rank's own comparison
        dist.all_gather_object(verdicts, compare(lps, ro["logprobs"])["equal"])
        res = {
            **{k: v for k, v in job.items() if k not in ("rollout", "checkpoint")},
            **compare(lps, ro["logprobs"]),
            "spec": worker.spec,
            "build_s": t1 - t0,
            "logprobs_s": t2 - t1,
            "export_equal": _export_round_trips(worker, job["checkpoint"]),
            "stage_layers": worker.stage_layers(),
            "ranks_equal": verdicts,
        }
        out.append(res)
        worker.close()
        reset_model_parallel()
    return out


def _export_round_trips(worker: Any, checkpoint: str | Path) -> bool | None:
    """Megatron shards -> merged HF state dict equals the checkpoint it was loaded from (rank 0)."""
    from tonpolicy.model.checkpoint import load_hf

    hf = worker.hf_state_dict()
    if hf is None:
        return None
    _, ref = load_hf(checkpoint)
    return hf.keys() == ref.keys() and all(torch.equal(hf[k], ref[k]) for k in ref)


def layout_jobs(
    layouts: list[Layout],
    checkpoints: dict[str, str],
    rollouts: dict[tuple[str, str], Any],
    temperature: float,
    contracts: tuple[str, ...] = CPU_CONTRACTS,
) -> list[dict[str, Any]]:
    """Every layout x dtype x contract (rollouts keyed by (dtype, contract))."""
    return [
        dict(
            layout=lay,
            dtype=dt,
            contract=c,
            checkpoint=checkpoints[dt],
            rollout=rollouts[(dt, c)],
            temperature=temperature,
        )
        for lay in layouts
        for dt in checkpoints
        for c in contracts
    ]


def built_config_worker(configs: list[Config]) -> list[dict[str, Any]]:
    """Build the trainer for each config in turn; return what was built (TrainerWorker.built_config)."""
    from tonpolicy.trainer.process_groups import reset_model_parallel
    from tonpolicy.trainer.worker import TrainerWorker

    out = []
    for cfg in configs:
        worker = TrainerWorker(cfg)
        out.append(worker.built_config())
        worker.close()
        reset_model_parallel()
    return out


def _first_forward_check(
    old: list[torch.Tensor], enforce: bool, into: dict[str, Any]
) -> Callable[[list[int], list[torch.Tensor]], bool]:
    """The gate's second check for `ppo_step`: the first training forward (of the samples it names)
    against `old`, bit for bit; its counts go `into` the metrics, and with `enforce` a mismatch refuses
    the update."""

    def may_update(samples: list[int], first_forward: list[torch.Tensor]) -> bool:
        report = compare_logprobs([old[i] for i in samples], first_forward)
        into.update(first_forward_mismatched=report.mismatched_tokens)
        into.update(first_forward_max_abs_diff=report.max_abs_logprob_diff)
        return report.exact or not enforce

    return may_update


def ppo_worker(jobs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Each job as in `layouts_worker` plus `advantages`: recompute logprobs, take one PPO step, and
    recompute again. Returns the step metrics, grad_norm, timings and post-step logprobs."""
    from tonpolicy.trainer.process_groups import reset_model_parallel
    from tonpolicy.trainer.worker import TrainerWorker

    out = []
    for job in jobs:
        cfg = job_config(job)
        worker = TrainerWorker(cfg, job["checkpoint"], spec=job.get("spec"))
        ro = job["rollout"]
        t0 = time.perf_counter()
        old = worker.logprobs(ro["prompts"], ro["responses"])
        if job.get("old_from_rollout"):  # control for the first-forward check: "old" that is not the recompute
            old = [torch.as_tensor(x, dtype=torch.float32) for x in ro["logprobs"]]
        t1 = time.perf_counter()
        first: dict[str, Any] = {}
        check = _first_forward_check(old, job.get("exact_first_forward", False), first)
        samples = TrainSamples(ro["prompts"], ro["responses"], old, ro["logprobs"], job["advantages"])
        m = worker.ppo_step(samples, may_update=check)
        m.update(first)
        t2 = time.perf_counter()
        new = worker.logprobs(ro["prompts"], ro["responses"])
        shares: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(shares, worker.last_share)
        out.append(
            {
                "layout": job["layout"],
                "dtype": job["dtype"],
                "contract": job["contract"],
                "spec": worker.spec,
                **m,
                "old_vs_rollout": compare(old, ro["logprobs"]),
                "new_logprobs": new,
                "logprobs_s": t1 - t0,
                "step_s": t2 - t1,
                "shares": shares,
            }
        )
        worker.close()
        reset_model_parallel()
    return out


def jobs_worker(jobs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """`layouts_worker`'s jobs and `ppo_worker`'s (those with `advantages`) in one process group, in order
    (one spawn instead of two)."""
    return [(ppo_worker if "advantages" in job else layouts_worker)([job])[0] for job in jobs]
