"""The weights of policy versions still in flight (experiment.max_staleness=k >= 1).

A sample of step j may come from version j - k .. j. To compare its rollout logprobs with the trainer's
under the version that sampled it, every rank keeps a copy of its own parameter shards of the last k
versions (taken just before each update: the weights the step before exported and pushed). Memory: k
copies of the rank's parameters (model dtype; no gradients, no optimizer state), on the model's device.
`logprobs_under(v, ...)` swaps version v's copy in, runs the ordinary logprob forward, and swaps the
current weights back: the same kernels, layout and code path as every other trainer forward.
"""

from __future__ import annotations

from typing import Any

import torch

from tonpolicy.kernels import weights_updated


class PolicySnapshots:
    """`worker`: a TrainerWorker (every rank calls every method: they run collective forwards)."""

    def __init__(self, worker: Any, max_staleness: int) -> None:
        self.worker, self.max_staleness = worker, max_staleness
        self.kept: dict[int, list[torch.Tensor]] = {}

    def _params(self) -> list[torch.Tensor]:
        return list(self.worker.module.parameters())

    def keep(self, version: int) -> None:
        """Copy the current weights as `version` (call before its update); versions no sample can still
        carry once `version + 1` is current (older than version + 1 - k) are dropped first."""
        for old in [v for v in self.kept if v < version + 1 - self.max_staleness]:
            del self.kept[old]
        self.kept[version] = [p.detach().clone() for p in self._params()]

    def bytes(self) -> int:
        return sum(t.numel() * t.element_size() for ts in self.kept.values() for t in ts)

    @torch.no_grad()
    def logprobs_under(self, version: int, prompts: list[list[int]], responses: list[list[int]]) -> list[torch.Tensor]:
        if version not in self.kept:
            raise KeyError(f"policy version {version} is not kept (kept: {sorted(self.kept)})")
        params = self._params()
        current = [p.detach().clone() for p in params]
        try:
            self._load(params, self.kept[version])
            return self.worker.logprobs(prompts, responses)
        finally:
            self._load(params, current)

    @staticmethod
    def _load(params: list[torch.Tensor], values: list[torch.Tensor]) -> None:
        for p, v in zip(params, values, strict=True):
            p.data.copy_(v)
        weights_updated()  # `.data` writes bump no version: forget the cached weights
