"""A one-rank trainer taking PPO steps with a response mask (tests/loop/test_multi_turn.py), importable
by the spawned process."""

from __future__ import annotations

from typing import Any

import torch

from tonpolicy.align import harness
from tonpolicy.rl.train_samples import TrainSamples
from tonpolicy.trainer.process_groups import Layout


def masked_loss_worker(ck: str, prompts: list[list[int]], responses: list[list[int]], masks: list[torch.Tensor]):
    """(loss, grad_norm) of one PPO step per variant of the old logprobs, at lr 0 (the weights stay put,
    so every variant's gradient is taken at the same point): as recomputed; changed at the masked
    (environment) tokens; changed at a model token; changed at the masked tokens with no mask given."""
    from tonpolicy.trainer.worker import TrainerWorker

    cfg = harness.make_config(Layout(), "bfloat16", "exact", 1.0, ck)
    worker = TrainerWorker(cfg, ck)
    worker.lr = 0.0  # Adam's step is lr * (...): exactly no change to the weights
    old = worker.logprobs(prompts, responses)
    adv = [1.0, -1.0]

    def shifted(where: str) -> list[torch.Tensor]:
        out = [o.clone() for o in old]
        for o, m in zip(out, masks, strict=True):
            if where == "env":
                o[~m] -= 3.0
            else:
                o[int(m.nonzero()[0])] -= 0.5
        return out

    results: dict[str, Any] = {}
    for name, o, mk in [
        ("recomputed", old, masks),
        ("env_changed", shifted("env"), masks),
        ("model_changed", shifted("model"), masks),
        ("env_changed_unmasked", shifted("env"), None),
    ]:
        m = worker.ppo_step(TrainSamples(prompts, responses, o, o, adv, loss_masks=mk))
        results[name] = (m["loss"], m["grad_norm"])
    worker.close()
    return results
