"""Megatron-core trainer that reproduces the numerics contract.

Entry point: `worker.TrainerWorker(cfg, checkpoint_dir)` inside an initialized process group
(torchrun, or `dist.spawn` in tests): `.logprobs(prompts, responses)`, `.ppo_step(...)`, `.save_hf(dir)`.

Modules: `model` (GPTModel for a ModelConfig), `layer_spec` (the kernel layer spec: Megatron modules
that call the kernel set), `cp_attention`, `ring_attention` and `cp` (Ulysses / zigzag-ring context
parallelism, the one response slicer), `comm` (autograd collectives), `kernel_autograd` (kernel forward,
plain backward), `logprobs` (the recipe with `comm.replicated_all_gather`), `forward` (megatron schedules
over samples), `weights` (HF <-> Megatron), `dist` (process groups, spawn), `cpu_compat` (megatron on
CPU). The RL objective lives in `tonpolicy.rl`; the trainer-vs-rollout harness in `tonpolicy.align.harness`.
"""

import sys as _sys


def _hide_unloadable_cuda_extensions() -> None:
    """Without a GPU driver, CUDA-only wheels that SGLang's environment brings (flash_mla) raise
    OSError at import; megatron-core probes them with `except ImportError`, so the trainer would die
    importing megatron. A module that cannot be loaded is made to read as absent."""
    for name in ("flash_mla",):
        if name in _sys.modules:
            continue
        try:
            __import__(name)
        except ImportError:
            pass
        except OSError:
            _sys.modules[name] = None  # `import flash_mla` now raises ImportError


_hide_unloadable_cuda_extensions()
