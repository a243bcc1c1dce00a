"""`trainer.device=auto` resolved, in one place: the launch plan, validation, the SGLang rules and the
embedded server (whose engine follows the trainer) all ask this."""

from __future__ import annotations

from tonpolicy.config.schema import Config
from tonpolicy.kernels.sets import kernel_set


def resolve_device(cfg: Config) -> str:
    """trainer.device as given ("cpu" or "cuda"), or for "auto" CUDA when this process sees a GPU."""
    if cfg.trainer.device != "auto":
        return cfg.trainer.device
    import torch  # lazily: validation of an explicit device needs no torch

    return "cuda" if torch.cuda.is_available() else "cpu"


def cuda_graphs_on(cfg: Config) -> bool:
    """Whether the embedded engine decodes in CUDA graphs: rollout.cuda_graphs, or where it is null,
    on exactly where graphs apply (embedded engine, a kernel set whose decode needs no host work, CUDA,
    dense model)."""
    # Lazily: the backend registry's SGLang rules resolve the device through this module.
    from tonpolicy.config.rollout_backends import rollout_backend

    if cfg.rollout.cuda_graphs is not None:
        return bool(cfg.rollout.cuda_graphs)
    return (
        rollout_backend(cfg.rollout.backend).decode_graphs
        and kernel_set(cfg.contract.kernels).cuda_graphs
        and cfg.contract.quant == "none"  # fp8_block's activation quantizer reads a value back (non-finite check)
        and not cfg.model.is_moe
        and resolve_device(cfg) == "cuda"
    )
