"""`trainer.device=auto` resolved, in one place: the launch plan, validation, the SGLang rules and the
embedded server (whose engine follows the trainer) all ask this."""

from __future__ import annotations

from tonpolicy.config.schema import Config


def resolve_device(cfg: Config) -> str:
    """trainer.device as given ("cpu" or "cuda"), or for "auto" CUDA when this process sees a GPU."""
    if cfg.trainer.device != "auto":
        return cfg.trainer.device
    import torch  # lazily: validation of an explicit device needs no torch

    return "cuda" if torch.cuda.is_available() else "cpu"
