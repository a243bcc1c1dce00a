"""Megatron-core trainer that reproduces the numerics contract.

Entry point: `worker.TrainerWorker(cfg, checkpoint_dir)` inside an initialized process group
(torchrun, or `process_groups.spawn` in tests): `.logprobs(prompts, responses)`, `.ppo_step(...)`,
`.save_hf(dir)`.

Modules: `model` (GPTModel for a ModelConfig), `layer_spec` (the block specs), `spec_providers` (the
kernel and stock spec providers they are filled from), `kernel_modules` and `moe_layer` (the Megatron
modules that call the kernel set), `cp_layout`, `cp_attention` and `ring_attention` (Ulysses /
zigzag-ring context parallelism, the one response slicer), `ep_exchange` (expert parallelism's token
exchange), `comm` (autograd collectives), `kernel_autograd` (kernel forward, plain backward), `logprobs`
(the recipe with `comm.replicated_all_gather`), `ppo_loss` (PPO's per-token inputs and clipped loss),
`schedule` (megatron's schedules over samples), `weights` and `moe_weights` (HF <-> Megatron),
`optimizer_state` (the trainer state a checkpoint keeps), `routes` (MoE routes recorded and replayed),
`snapshots` (weights of versions still in flight), `process_groups` (process groups, spawn), `cpu_compat`
(megatron on CPU). The RL objective lives in `tonpolicy.rl`; the trainer-vs-rollout harness in
`tonpolicy.align.harness`.
"""

import importlib.abc as _abc
import importlib.machinery as _machinery
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


class _MegatronJitFuserOff(_abc.MetaPathFinder):
    """megatron-core decorates its fused elementwise functions with `torch.compile` while it imports,
    which imports dynamo and inductor (seconds of CPU in every trainer rank). The trainer's contract path
    calls none of them, so megatron's own switch `jit.disable_jit_fuser()` is thrown the moment its `jit`
    module has run, before any fusion module reads `jit_fuser`."""

    def find_spec(self, name, path, target=None):  # type: ignore[no-untyped-def]
        if name != "megatron.core.jit":
            return None
        spec = _machinery.PathFinder.find_spec(name, path, target)
        if spec is None or spec.loader is None:
            return spec
        run_module = spec.loader.exec_module

        def run_then_disable(module):  # type: ignore[no-untyped-def]
            run_module(module)
            module.disable_jit_fuser()

        spec.loader.exec_module = run_then_disable  # type: ignore[method-assign]
        return spec


if "megatron.core.jit" not in _sys.modules and not any(
    isinstance(finder, _MegatronJitFuserOff) for finder in _sys.meta_path
):
    _sys.meta_path.insert(0, _MegatronJitFuserOff())
