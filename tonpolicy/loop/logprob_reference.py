"""Which trainer logprobs a step holds the rollout's against, chosen once per run
(`logprob_reference`): the first training forward (an exact contract's default), a no-grad recompute
before the update (trainer.recompute_logprobs), or, for asynchronous steps, the trainer under the policy
version that sampled each token. Each answers the step's questions: what runs before the update and the
check on it, PPO's old logprobs, the check of the first training forward, and the record's metrics. The
order of the checks: docs/ARCHITECTURE.md "The gate's order"."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from tonpolicy.config.schema import Config
from tonpolicy.loop.collective import broadcast
from tonpolicy.loop.gate_policy import Verdict, model_tokens, recomputes_logprobs
from tonpolicy.loop.records import by_sample
from tonpolicy.loop.rollout_batch import Batch
from tonpolicy.loop.staleness import async_metrics, logprobs_under_sampling_versions, token_versions, with_current
from tonpolicy.rl.objective import train_rollout_metrics
from tonpolicy.rl.train_samples import TrainSamples

if TYPE_CHECKING:
    from tonpolicy.loop.run import Loop


@dataclass
class BeforeUpdate:
    """What a step computed before any update."""

    # the logprobs the first training forward is checked against: the recompute's, else the rollout's
    reference: list[torch.Tensor]
    check: Verdict | None = None  # the check before the update (rank 0's, on every rank); None: none ran
    versions: list[list[int]] = field(default_factory=list)  # asynchronous: each token's policy version
    # asynchronous: each token's trainer logprob under its sampling version (the current one's NaN until
    # the first training forward fills it, where no proximal forward ran)
    sampled: list[torch.Tensor] = field(default_factory=list)

    @property
    def passed(self) -> bool:
        return self.check is None or self.check.passed


@dataclass
class FirstForward:
    """The gate's check of the first training forward (`may_update`, ppo_step's hook) and what it saw:
    the samples of the first minibatch and their logprobs (autograd on)."""

    check: Callable[[list[int], list[torch.Tensor]], Verdict]
    samples: list[int] = field(default_factory=list)
    logprobs: list[torch.Tensor] = field(default_factory=list)
    verdict: Verdict | None = None

    def may_update(self, samples: list[int], logprobs: list[torch.Tensor]) -> bool:
        self.verdict = self.check(samples, logprobs)
        self.samples, self.logprobs = list(samples), list(logprobs)
        return self.verdict.passed


def _masks(batch: Batch, samples: list[int]) -> list[torch.Tensor] | None:
    """The model-token masks of `samples` (a multi-turn task's), None when every token is the model's."""
    return None if batch.response_masks is None else [batch.response_masks[i] for i in samples]


class LogprobReference(ABC):
    """What a step holds the rollout's logprobs against; one per run (`logprob_reference`)."""

    recompute = False  # the record's `recompute`: a no-grad forward before the update gives PPO's old logprobs

    @abstractmethod
    def before_update(self, loop: Loop, batch: Batch, step: int) -> BeforeUpdate:
        """The forwards before any update and their check (every rank; rank 0's verdict)."""

    @abstractmethod
    def _check(self, loop: Loop) -> Callable[..., Verdict]:
        """The gate's check of the first training forward against `BeforeUpdate.reference`."""

    def before_training(self, loop: Loop, step: int) -> None:  # noqa: B027 (most references do nothing here)
        """Just before the update (after the checks before it passed)."""

    def train_samples(self, batch: Batch, before: BeforeUpdate) -> TrainSamples:
        return TrainSamples(
            batch.prompts,
            batch.responses,
            before.reference,
            batch.rollout_logprobs,
            batch.advantages,
            batch.response_masks,  # a multi-turn task's: the environment's tokens carry no loss
        )

    def first_forward(self, loop: Loop, batch: Batch, before: BeforeUpdate, step: int) -> FirstForward:
        def check(samples: list[int], logprobs: list[torch.Tensor]) -> Verdict:
            ref = [before.reference[i] for i in samples]
            return self._check(loop)(ref, logprobs, _masks(batch, samples))

        return FirstForward(check)

    def metrics(self, loop: Loop, batch: Batch, before: BeforeUpdate, seen: FirstForward, step: int) -> dict[str, Any]:
        """The record's metrics beside ppo_step's (train_rollout_* replace its own where it computed them)."""
        assert seen.verdict is not None
        out: dict[str, Any] = {
            "first_forward_mismatched": seen.verdict.report.mismatched_tokens,
            "first_forward_max_abs_diff": seen.verdict.report.max_abs_logprob_diff,
        }
        if not self.recompute:  # the trainer's logprobs of the checked samples are their first forward's
            ref = [before.reference[i] for i in seen.samples]
            trained, rolled = model_tokens(seen.logprobs, ref, _masks(batch, seen.samples))
            out.update(train_rollout_metrics(torch.cat(trained), torch.cat(rolled)))
        return out

    def compared(
        self, batch: Batch, before: BeforeUpdate, seen: FirstForward
    ) -> tuple[list[int], list[torch.Tensor] | list[torch.Tensor | None]]:
        """The samples whose rollout logprobs the gate compared with the trainer's, and per sample (None
        where not compared) the trainer's logprobs it compared: the recompute's, else the first forward's."""
        if self.recompute:
            return list(range(len(batch.prompts))), before.reference
        return seen.samples, by_sample(len(batch.prompts), seen.samples, seen.logprobs)


class FirstForwardReference(LogprobReference):
    """No forward before the update: PPO's old logprobs are the rollout's, and the one check is
    rollout == the first training forward."""

    def before_update(self, loop: Loop, batch: Batch, step: int) -> BeforeUpdate:
        return BeforeUpdate(batch.rollout_logprobs)

    def _check(self, loop: Loop) -> Callable[..., Verdict]:
        return loop.gate.rollout_vs_first_forward


class RecomputeReference(LogprobReference):
    """A no-grad recompute at the trainer's layout before the update: PPO's old logprobs; checks
    rollout == recompute, then recompute == the first training forward."""

    recompute = True

    def before_update(self, loop: Loop, batch: Batch, step: int) -> BeforeUpdate:
        old = loop.worker.logprobs(batch.prompts, batch.responses)
        check = (
            loop.gate.rollout_vs_recompute(batch.rollout_logprobs, old, batch.response_masks) if loop.rank0 else None
        )
        return BeforeUpdate(old, broadcast(check))

    def _check(self, loop: Loop) -> Callable[..., Verdict]:
        return loop.gate.recompute_vs_first_forward


class SamplingVersionsReference(LogprobReference):
    """Asynchronous steps: the trainer's logprobs under the version that sampled each token (older
    versions' kept weights; the current version's from the first training forward, or with `proximal`
    from a no-grad forward before the update, then itself checked == the first training forward).
    Decoupled PPO: the proximal logprobs are PPO's old ones, the rollout's the behaviour policy's."""

    def __init__(self, proximal: bool, max_staleness: int, tis_cap: float | None) -> None:
        self.recompute, self.max_staleness, self.tis_cap = proximal, max_staleness, tis_cap

    def before_update(self, loop: Loop, batch: Batch, step: int) -> BeforeUpdate:
        assert batch.weight_versions is not None
        versions = token_versions(batch.weight_versions)
        prompts, responses = batch.prompts, batch.responses
        if not self.recompute:
            sampled = logprobs_under_sampling_versions(loop.snapshots, prompts, responses, versions, step, None)
            return BeforeUpdate(batch.rollout_logprobs, None, versions, sampled)
        old = loop.worker.logprobs(prompts, responses)
        sampled = logprobs_under_sampling_versions(loop.snapshots, prompts, responses, versions, step, old)
        rollout, masks = batch.rollout_logprobs, batch.response_masks
        check = loop.gate.rollout_vs_sampling_version(rollout, sampled, masks) if loop.rank0 else None
        return BeforeUpdate(old, broadcast(check), versions, sampled)

    def before_training(self, loop: Loop, step: int) -> None:
        loop.snapshots.keep(step)  # this version's weights, for samples still in flight

    def train_samples(self, batch: Batch, before: BeforeUpdate) -> TrainSamples:
        old = before.reference if self.recompute else None  # None: the first training forward's
        return TrainSamples(
            batch.prompts,
            batch.responses,
            old,
            batch.rollout_logprobs,
            batch.advantages,
            batch.response_masks,
            behaviour_logprobs=batch.rollout_logprobs,
        )

    def first_forward(self, loop: Loop, batch: Batch, before: BeforeUpdate, step: int) -> FirstForward:
        if self.recompute:
            return super().first_forward(loop, batch, before, step)

        def check(samples: list[int], logprobs: list[torch.Tensor]) -> Verdict:
            # every token against the version that sampled it, before any update
            pairs = zip(samples, logprobs, strict=True)
            under = [with_current(before.sampled[i], lp, before.versions[i], step) for i, lp in pairs]
            ref = [before.reference[i] for i in samples]
            return loop.gate.rollout_vs_sampling_version(ref, under, _masks(batch, samples))

        return FirstForward(check)

    def _check(self, loop: Loop) -> Callable[..., Verdict]:
        return loop.gate.recompute_vs_first_forward

    def metrics(self, loop: Loop, batch: Batch, before: BeforeUpdate, seen: FirstForward, step: int) -> dict[str, Any]:
        out = super().metrics(loop, batch, before, seen, step)
        proximal = before.reference if self.recompute else [lp.detach() for lp in seen.logprobs]
        first = dict(zip(seen.samples, seen.logprobs, strict=True))
        out.update(
            async_metrics(
                before.versions, step, proximal, batch.rollout_logprobs, first, self.tis_cap, batch.response_masks
            ),
            max_staleness=self.max_staleness,
            trainer_policy_version=step,  # the weights this step trains (the samples' may be older)
            kept_versions=sorted(loop.snapshots.kept),
        )
        return out


def logprob_reference(cfg: Config) -> LogprobReference:
    """The run's logprob reference, from trainer.recompute_logprobs and experiment.max_staleness."""
    stale = cfg.experiment.max_staleness
    if stale:
        # The proximal (current-policy) logprobs: with one update per step (the default) the first
        # training forward is that forward; with several, a no-grad forward before them.
        single_update = cfg.trainer.ppo_minibatches * cfg.trainer.ppo_epochs == 1
        proximal = recomputes_logprobs(cfg) or not single_update
        return SamplingVersionsReference(proximal, stale, cfg.trainer.tis_cap)
    return RecomputeReference() if recomputes_logprobs(cfg) else FirstForwardReference()
