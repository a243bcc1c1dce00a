"""Run megatron-core on CPU (gloo) by redirecting its CUDA-only calls.

megatron-core assumes a GPU in a handful of places (see /work/shared/ENVIRONMENT.md):
`torch.cuda.current_device()` as a tensor device (rotary embedding, p2p communication, grad buffers),
the CUDA RNG tracker (`tensor_parallel/random.py`), `torch.cuda.synchronize()` (p2p communication),
tensors created with `device="cuda"` (pipeline schedules, optimizer, grad clipping, grad buffers) and
`clip_grad_by_total_norm_fp32` asserting `torch.cuda.FloatTensor`, and `weight.data.cuda()` when the
tied embedding is synced across pipeline stages, and the bf16 optimizer checking `param.type()` names.

Rather than editing megatron, each affected module's global name `torch` is replaced by a thin proxy
that forwards everything to the real torch except: factories map a CUDA device to CPU, and
`torch.cuda` becomes a small CPU namespace (current device = cpu, synchronize = no-op, RNG = the CPU
generator). The tracker's private RNG helpers and the grad-clip scaler are swapped for CPU versions.

`apply()` does nothing when a GPU is present, so the same code runs unmodified on CUDA/NCCL.
"""

from __future__ import annotations

import importlib
import types
from typing import Any

import torch

# Modules of megatron-core (0.16) that reach for CUDA on the paths tonpolicy uses.
PATCHED_MODULES = (
    "megatron.core.models.common.embeddings.rotary_pos_embedding",
    "megatron.core.tensor_parallel.random",
    "megatron.core.tensor_parallel.layers",
    "megatron.core.tensor_parallel.mappings",
    "megatron.core.tensor_parallel.utils",
    "megatron.core.pipeline_parallel.schedules",
    "megatron.core.pipeline_parallel.p2p_communication",
    "megatron.core.pipeline_parallel.utils",
    "megatron.core.optimizer.optimizer",
    "megatron.core.optimizer.clip_grads",
    "megatron.core.distributed.param_and_grad_buffer",
    "megatron.core.distributed.distributed_data_parallel",
    "megatron.core.distributed.finalize_model_grads",
    "megatron.core.models.gpt.gpt_model",
    "megatron.core.transformer.module",
    "megatron.core.transformer.attention",
    "megatron.core.transformer.dot_product_attention",
    "megatron.core.transformer.transformer_layer",
    "megatron.core.transformer.utils",
    "megatron.core.transformer.moe.moe_utils",
    "megatron.core.transformer.moe.router",
    "megatron.core.transformer.moe.token_dispatcher",
    "megatron.core.transformer.moe.experts",
    "megatron.core.transformer.moe.moe_layer",
    "megatron.core.utils",
    # The trainer state's distributed checkpoint: its save agrees on failures with a flag tensor on the
    # current CUDA device.
    "megatron.core.dist_checkpointing.strategies.state_dict_saver",
)

_FACTORIES = ("zeros", "ones", "empty", "tensor", "full", "arange", "zeros_like", "ones_like", "empty_like")

_applied = False


def _cpu_device(device: Any) -> Any:
    if device is None:
        return None
    if isinstance(device, int):  # a CUDA ordinal, e.g. from current_device()
        return torch.device("cpu")
    if torch.device(device).type == "cuda":
        return torch.device("cpu")
    return device


def _wrap_factory(fn: Any) -> Any:
    def factory(*args: Any, **kwargs: Any) -> Any:
        if "device" in kwargs:
            kwargs["device"] = _cpu_device(kwargs["device"])
        return fn(*args, **kwargs)

    return factory


class _CpuCuda(types.SimpleNamespace):
    """What megatron sees as `torch.cuda` on a CPU-only machine."""

    def __getattr__(self, name: str) -> Any:
        return getattr(torch.cuda, name)


def _make_cpu_cuda() -> _CpuCuda:
    return _CpuCuda(
        current_device=lambda: torch.device("cpu"),
        synchronize=lambda *a, **k: None,
        empty_cache=lambda: None,
        is_available=lambda: False,
        get_rng_state=lambda *a, **k: torch.get_rng_state(),
        set_rng_state=lambda state, *a, **k: torch.set_rng_state(state),
        manual_seed=lambda seed: torch.manual_seed(seed),
    )


class _TorchProxy(types.ModuleType):
    """Forwards to the real torch; only CUDA-bound entry points are redirected."""

    def __init__(self) -> None:
        super().__init__("torch")
        self.__dict__["cuda"] = _make_cpu_cuda()
        for name in _FACTORIES:
            self.__dict__[name] = _wrap_factory(getattr(torch, name))

    def __getattr__(self, name: str) -> Any:
        return getattr(torch, name)


def _get_rng_state(*args: Any, **kwargs: Any) -> torch.Tensor:
    return torch.get_rng_state()


def _set_rng_state(new_state: torch.Tensor, *args: Any, **kwargs: Any) -> None:
    torch.set_rng_state(new_state)


def _clip_grad_by_total_norm_fp32(
    parameters: Any, max_norm: float, total_norm: float, use_decoupled_grad: bool = False
) -> None:
    """CPU version of megatron's clip: same coefficient, scales the same grads in place."""
    if isinstance(parameters, torch.Tensor):
        parameters = [parameters]
    attr = "decoupled_grad" if use_decoupled_grad else "grad"
    grads = [getattr(p, attr).detach() for p in parameters if getattr(p, attr, None) is not None]
    clip_coeff = max_norm / (total_norm + 1.0e-6)
    if clip_coeff < 1.0 and grads:
        torch._foreach_mul_(grads, clip_coeff)


def _tensor_cuda_is_identity(fn: Any) -> Any:
    """Wrap a megatron method that calls `tensor.cuda()` (a Tensor method the proxy cannot reach):
    during the call, `.cuda()` returns the CPU tensor itself."""

    def wrapped(*args: Any, **kwargs: Any) -> Any:
        orig = torch.Tensor.cuda
        torch.Tensor.cuda = lambda self, *a, **k: self
        try:
            return fn(*args, **kwargs)
        finally:
            torch.Tensor.cuda = orig

    return wrapped


def _tensor_type_reads_cuda(fn: Any) -> Any:
    """Wrap a megatron method that validates `param.type()` against 'torch.cuda.*Tensor' names (the
    bf16/fp16 optimizer): during the call, a CPU tensor's type string carries the cuda prefix."""

    def wrapped(*args: Any, **kwargs: Any) -> Any:
        orig = torch.Tensor.type

        def cuda_named(self: torch.Tensor, *a: Any, **k: Any) -> Any:
            out = orig(self, *a, **k)
            if a or k or not isinstance(out, str) or out.startswith("torch.cuda."):
                return out
            return out.replace("torch.", "torch.cuda.", 1)

        torch.Tensor.type = cuda_named
        try:
            return fn(*args, **kwargs)
        finally:
            torch.Tensor.type = orig

    return wrapped


def _define_missing_te_gemm() -> None:
    """Without TransformerEngine, megatron-core 0.16's moe_utils never defines `te_general_gemm` (its
    import fallback forgets it), and the stock router's gating linear dies on the NameError: define it
    as absent, which sends the router down its torch.mm path. Needed on a GPU without TE as well."""
    mod = importlib.import_module("megatron.core.transformer.moe.moe_utils")
    if not hasattr(mod, "te_general_gemm"):
        mod.te_general_gemm = None


def needed() -> bool:
    return not torch.cuda.is_available()


def apply() -> bool:
    """Install the redirections if there is no GPU. Idempotent; returns whether they are active."""
    global _applied
    _define_missing_te_gemm()
    if _applied or not needed():
        return _applied
    proxy = _TorchProxy()
    for name in PATCHED_MODULES:
        mod = importlib.import_module(name)
        if getattr(mod, "torch", None) is torch:
            mod.torch = proxy
    rnd = importlib.import_module("megatron.core.tensor_parallel.random")
    rnd._get_cuda_rng_state = _get_rng_state
    rnd._set_cuda_rng_state = _set_rng_state
    for name in ("megatron.core.optimizer.optimizer", "megatron.core.optimizer.clip_grads"):
        importlib.import_module(name).clip_grad_by_total_norm_fp32 = _clip_grad_by_total_norm_fp32
    # Tied embeddings under PP: the last stage's copy is synced with `weight.data.cuda()`.
    lm = importlib.import_module("megatron.core.models.common.language_module.language_module")
    lm.LanguageModule.setup_embeddings_and_output_layer = _tensor_cuda_is_identity(
        lm.LanguageModule.setup_embeddings_and_output_layer
    )
    # bf16 training: Float16OptimizerWithFloat16Params checks parameter type names at construction.
    opt = importlib.import_module("megatron.core.optimizer.optimizer")
    opt.Float16OptimizerWithFloat16Params.__init__ = _tensor_type_reads_cuda(
        opt.Float16OptimizerWithFloat16Params.__init__
    )
    _applied = True
    return True
