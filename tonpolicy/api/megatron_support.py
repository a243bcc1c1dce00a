"""What a megatron-core training loop needs besides the model: megatron on a CPU host, and the kernels'
weight caches told about weights written in place."""

from __future__ import annotations


def megatron_cpu_support() -> bool:
    """Redirect megatron-core's CUDA-only calls (RNG tracker, current device, synchronize, tensors made on
    "cuda") to the CPU, so a GPTModel runs over gloo; call it before `initialize_model_parallel`. It does
    nothing where CUDA is available (returns False then) and changes only megatron's modules."""
    from tonpolicy.trainer import cpu_compat

    return cpu_compat.apply()


def weights_updated() -> None:
    """Call after writing the model's weights in place (megatron's optimizer step writes them through
    `.data`, which bumps no tensor version): the kernel sets' cached weight forms are rebuilt."""
    from tonpolicy.kernels import weights_updated as forget

    forget()
