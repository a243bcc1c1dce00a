"""PPO's loss on the trainer's side: each sample's per-token inputs (advantage, loss mask and, where
given, the old and behaviour logprobs) and the clipped loss, importance-weighted under decoupled PPO.

The pipeline schedule carries per-token inputs as dicts of full-length tensors it slices to the tokens a
rank holds (`schedule.make_microbatches` `extras`); `TokenInputs.extras` / `TokenInputs.of` are the one
place those keys are written and read."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from tonpolicy.rl.objective import PPOConfig, importance_weights, mean_loss, token_loss
from tonpolicy.rl.train_samples import TrainSamples


@dataclass(frozen=True)
class TokenInputs:
    """One sample's (or its slice's) per-token inputs to the loss."""

    advantage: torch.Tensor
    mask: torch.Tensor  # float, 1.0 where the token carries loss
    old: torch.Tensor | None = None  # None: the training forward's own logprobs, detached
    behaviour: torch.Tensor | None = None  # decoupled PPO's behaviour policy; None: plain PPO

    def extras(self) -> dict[str, torch.Tensor]:
        out = {"adv": self.advantage, "mask": self.mask}
        if self.old is not None:
            out["old"] = self.old
        if self.behaviour is not None:
            out["behav"] = self.behaviour
        return out

    @classmethod
    def of(cls, extras: dict[str, torch.Tensor]) -> TokenInputs:
        return cls(extras["adv"], extras["mask"], extras.get("old"), extras.get("behav"))

    def old_or(self, lp: torch.Tensor) -> torch.Tensor:
        """PPO's old logprobs: the given ones, else this forward's (detached)."""
        return self.old if self.old is not None else lp.detach()


def token_inputs(samples: TrainSamples) -> list[TokenInputs]:
    masks = samples.loss_masks or [torch.ones(len(r)) for r in samples.responses]
    out = []
    for i, (r, a, m) in enumerate(zip(samples.responses, samples.advantages, masks, strict=True)):
        old = None if samples.old_logprobs is None else torch.as_tensor(samples.old_logprobs[i], dtype=torch.float32)
        behaviour = samples.behaviour_logprobs
        behav = None if behaviour is None else torch.as_tensor(behaviour[i], dtype=torch.float32)
        out.append(TokenInputs(torch.full((len(r),), float(a)), m.float(), old, behav))
    return out


@dataclass(frozen=True)
class PPOLoss:
    """The clipped PPO loss; with behaviour logprobs, each token's weighted by pi_old / pi_behaviour
    truncated at `tis_cap` (None: untruncated)."""

    ppo: PPOConfig
    tis_cap: float | None = None

    def weight(self, t: TokenInputs, lp: torch.Tensor) -> torch.Tensor:
        assert t.behaviour is not None
        return importance_weights([t.old_or(lp)], [t.behaviour], self.tis_cap)[0]

    def per_token(self, t: TokenInputs, lp: torch.Tensor) -> torch.Tensor:
        loss = token_loss(lp, t.old_or(lp), t.advantage, self.ppo)
        return loss * self.weight(t, lp) if t.behaviour is not None else loss

    def mean(self, inputs: list[TokenInputs], lps: list[torch.Tensor]) -> float:
        """The token-mean loss one update of these samples minimizes (their loss-masked tokens)."""
        pairs = list(zip(inputs, lps, strict=True))
        weights = [self.weight(t, lp) for t, lp in pairs] if inputs[0].behaviour is not None else None
        return mean_loss(
            lps,
            [t.old_or(lp) for t, lp in pairs],
            [t.advantage for t in inputs],
            [t.mask for t in inputs],
            self.ppo,
            weights,
        )
