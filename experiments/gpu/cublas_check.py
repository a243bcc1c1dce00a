"""GPU check for the trainer (run by experiments/gpu_check.sh under torchrun, one process per GPU).

On one GPU (NCCL, TP1) it records, stage by stage (a failing stage is reported, the rest still run):
  env        torch/CUDA/megatron versions, whether the CPU compatibility layer stayed off;
  parity     trainer logprobs on the GPU (kernel spec, bf16 and fp32) vs the embedded engine's decode
             logprobs computed on CPU, and vs the stock spec (negative control);
  invariance the contract trainer on the GPU scoring each sample alone (short padding) vs in the batch;
  step       one PPO step, contract vs stock spec: step time, ratio, grad_norm.
Also runs on CPU (gloo), which is how it was tested. Writes JSON to --out.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import tempfile
import time
import traceback
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

sys.path[:0] = [str(Path(__file__).resolve().parents[i]) for i in (1, 2)]  # experiments/ (shared helpers), repo root

from tonpolicy.align import harness  # noqa: E402
from tonpolicy.trainer.process_groups import Layout, reset_model_parallel  # noqa: E402

REPORT: dict[str, Any] = {}


def stage(name: str):  # noqa: ANN201
    def deco(fn):  # noqa: ANN001, ANN202
        def run(*a: Any) -> Any:
            t = time.perf_counter()
            try:
                REPORT[name] = {"ok": True, **(fn(*a) or {})}
            except Exception:  # noqa: BLE001 - the report must say which stage failed and why
                REPORT[name] = {"ok": False, "error": traceback.format_exc()[-3000:]}
                if dist.is_initialized():
                    reset_model_parallel()
            REPORT[name]["seconds"] = round(time.perf_counter() - t, 2)
            print(json.dumps({name: REPORT[name]}, default=str)[:4000], flush=True)

        return run

    return deco


@stage("env")
def env() -> dict:
    import megatron.core

    from tonpolicy.trainer import cpu_compat

    return {
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "gpu": torch.cuda.is_available() and torch.cuda.get_device_name(),
        "megatron_core": megatron.core.__version__,
        "cpu_compat_needed": cpu_compat.needed(),
    }


def _worker(dtype: str, spec: str, ck: str) -> Any:
    from tonpolicy.trainer.worker import TrainerWorker

    cfg = harness.make_config(Layout(), dtype, "exact", 0.8, ck)
    # The set under test is contract v1's (`invariant`: it runs on any torch device), as the engine's side.
    v1 = dataclasses.replace(cfg.contract, name="qwen3_dense_v1", version=1, kernels="invariant")
    return TrainerWorker(dataclasses.replace(cfg, contract=v1), ck, spec=spec)


@stage("parity")
def parity(cks: dict, ros: dict) -> dict:
    out = {}
    for dtype, ck in cks.items():
        ro = ros[dtype]
        for spec in ("kernels", "stock"):
            w = _worker(dtype, spec, ck)
            lps = w.logprobs(ro["prompts"], ro["responses"])
            out[f"{dtype}_{spec}"] = harness.compare(lps, ro["logprobs"])
            w.close()
    return out


@stage("invariance")
def invariance(cks: dict, ros: dict) -> dict:
    out = {}
    for dtype, ck in cks.items():
        ro = ros[dtype]
        w = _worker(dtype, "kernels", ck)
        batch = w.logprobs(ro["prompts"], ro["responses"])
        alone = [w.logprobs([p], [r])[0] for p, r in zip(ro["prompts"], ro["responses"], strict=True)]
        out[dtype] = harness.compare(alone, batch)
        w.close()
    return out


@stage("step")
def step(cks: dict, ros: dict, steps: int) -> dict:
    from tonpolicy.rl.train_samples import TrainSamples

    out = {}
    for dtype, ck in cks.items():
        ro = ros[dtype]
        adv = [(-1.0) ** i * (0.5 + 0.1 * i) for i in range(len(ro["prompts"]))]
        for spec in ("kernels", "stock"):
            w = _worker(dtype, spec, ck)
            old = w.logprobs(ro["prompts"], ro["responses"])
            samples = TrainSamples(ro["prompts"], ro["responses"], old, ro["logprobs"], adv)
            times, m = [], {}
            for i in range(steps + 1):
                if torch.cuda.is_available():
                    torch.cuda.synchronize()
                t = time.perf_counter()
                m = w.ppo_step(samples)
                if torch.cuda.is_available():
                    torch.cuda.synchronize()
                if i:  # the first step builds DDP and the optimizer
                    times.append(time.perf_counter() - t)
                if i == 0:
                    out[f"{dtype}_{spec}_grad_norm"] = m["grad_norm"]
                    out[f"{dtype}_{spec}_train_rollout_logprob_abs_diff"] = m["train_rollout_logprob_abs_diff"]
            out[f"{dtype}_{spec}_step_s"] = sorted(times)[len(times) // 2]
            w.close()
        out[f"{dtype}_contract_over_stock"] = out[f"{dtype}_kernels_step_s"] / out[f"{dtype}_stock_step_s"]
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="gpu_check.json")
    ap.add_argument("--samples", type=int, default=8)
    ap.add_argument("--new-tokens", type=int, default=24)
    ap.add_argument("--steps", type=int, default=3)
    a = ap.parse_args()
    from tonpolicy.config.model import ModelConfig
    from tonpolicy.model.checkpoint import init_state_dict, save_hf

    dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo")
    if torch.cuda.is_available():
        torch.cuda.set_device(0)
    env()
    cfg = ModelConfig()
    root = Path(tempfile.mkdtemp())
    cks, ros = {}, {}
    for name, dt in (("bfloat16", torch.bfloat16), ("float32", torch.float32)):
        cks[name] = str(root / name)
        save_hf(init_state_dict(cfg, dt, 11), cfg, cks[name])
        ros[name] = harness.rollout(cks[name], "invariant", a.samples, 64, a.new_tokens, 0.8)  # engine on CPU
    parity(cks, ros)
    invariance(cks, ros)
    step(cks, ros, a.steps)
    Path(a.out).write_text(json.dumps(REPORT, indent=2, default=str))
    print("gpu_check:", {k: v["ok"] for k, v in REPORT.items()}, flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
