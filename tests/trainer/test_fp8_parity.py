"""contract.quant=fp8_block: the Megatron trainer's first forward (fake quantization with the rollout's own
quantized weights and activations, through the kernel spec) gives the embedded FP8 engine's decode
logprobs bit for bit. Control: the v2 trainer without quantization against the same FP8 rollout
mismatches (FP8 changes the model's numerics; only the shared definition makes them equal). At trainer TP 2
the default model's k/v weights (128 rows) split their 128-row blocks across the ranks, and the MoE model's
experts (96 rows) have partial blocks: exact zero there too (the kernel tests hold the reduce's control)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from tonpolicy.config.compose import compose_config
from tonpolicy.config.model import ModelConfig
from tonpolicy.model.checkpoint import init_state_dict, save_hf
from tonpolicy.trainer.process_groups import spawn

TEMPERATURE = 0.8


def fp8_rollout(checkpoint: str) -> dict:
    from tonpolicy.kernels import get_kernels
    from tonpolicy.model.checkpoint import load_hf
    from tonpolicy.model.qwen3 import Qwen3
    from tonpolicy.rollout.engine import Engine, GenRequest

    cfg, sd = load_hf(checkpoint)
    from tonpolicy.model.qwen3_moe import Qwen3Moe

    family = Qwen3Moe if cfg.num_experts else Qwen3
    model = family(cfg, get_kernels("ordered", quant="fp8_block"), torch.bfloat16, sd)
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, cfg.vocab_size, (9 - 3 * i,), generator=g).tolist() for i in range(2)]
    reqs = [GenRequest(p, 4, temperature=TEMPERATURE, seed=i) for i, p in enumerate(prompts)]
    res = Engine(model, max_running_requests=2).generate(reqs)
    return {"prompts": prompts, "responses": [r.output_ids for r in res], "logprobs": [r.output_logprobs for r in res]}


def trainer_logprobs(checkpoint: str, rollout: dict, layout: Any = None, quants: tuple = ("fp8_block", "none")) -> dict:
    from tonpolicy.align import harness
    from tonpolicy.trainer.process_groups import Layout, reset_model_parallel
    from tonpolicy.trainer.worker import TrainerWorker

    out = {}
    for quant in quants:
        cfg = harness.make_config(layout or Layout(), "bfloat16", "exact", TEMPERATURE, checkpoint)
        cfg.contract.quant = quant
        worker = TrainerWorker(cfg, checkpoint)
        out[quant] = harness.compare(worker.logprobs(rollout["prompts"], rollout["responses"]), rollout["logprobs"])
        worker.close()
        reset_model_parallel()
    return out


def _jobs(jobs: list[tuple]) -> list[dict]:
    return [trainer_logprobs(*job) for job in jobs]


def test_fp8_trainer_forward_equals_fp8_rollout(tmp_path: Path) -> None:
    cfg = ModelConfig(num_layers=2)
    save_hf(init_state_dict(cfg, torch.bfloat16, 5), cfg, tmp_path / "ckpt")
    rollout = fp8_rollout(str(tmp_path / "ckpt"))
    got = spawn(trainer_logprobs, 1, str(tmp_path / "ckpt"), rollout)
    assert got["fp8_block"]["tokens"] == 8
    assert got["fp8_block"]["equal"] == 1.0 and got["fp8_block"]["max_abs_diff"] == 0.0, got
    # The control: the unquantized trainer is close to the FP8 rollout but not its bits.
    assert got["none"]["mismatched"] > 0 and 0 < got["none"]["max_abs_diff"] < 1.0, got


def test_fp8_trainer_tp2_and_moe_ep2_equal_fp8_rollout(tmp_path: Path) -> None:
    from tonpolicy.config.layout import Layout

    dense = ModelConfig(num_layers=1)  # qwen3_tiny's sizes: k/v 128 rows, 64 per TP 2 rank
    moe = compose_config(["model=qwen3_moe_tiny", "model.num_layers=1"]).model  # experts of 96 rows
    jobs = []
    for name, cfg, layout, quants in (
        ("dense", dense, Layout(tp=2), ("fp8_block",)),
        ("moe", moe, Layout(dp=2, ep=2), ("fp8_block", "none")),
    ):
        save_hf(init_state_dict(cfg, torch.bfloat16, 6), cfg, tmp_path / name)
        jobs.append((str(tmp_path / name), fp8_rollout(str(tmp_path / name)), layout, quants))
    tp2, ep2 = spawn(_jobs, 2, jobs)
    for got in (tp2, ep2):
        assert got["fp8_block"]["tokens"] == 8 and got["fp8_block"]["max_abs_diff"] == 0.0, got
    assert ep2["none"]["mismatched"] > 0, ep2  # control: the unquantized trainer
