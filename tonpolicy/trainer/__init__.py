"""Megatron-core trainer that reproduces the numerics contract.

Entry point: `worker.TrainerWorker(cfg, checkpoint_dir)` inside an initialized process group
(torchrun, or `dist.spawn` in tests): `.logprobs(prompts, responses)`, `.ppo_step(...)`, `.save_hf(dir)`.

Modules: `model` (GPTModel for a ModelConfig), `layer_spec` (the contract ModuleSpec), `cp_attention`,
`ring_attention` and `cp` (Ulysses / zigzag-ring context parallelism, the one response slicer), `comm`
(autograd collectives), `fast_backward` (contract forward, plain backward), `logprobs` (the recipe with
`_ReplicatedLossAllGatherLastDim`), `forward` (megatron schedules over samples), `ppo` (loss, metrics),
`weights` (HF <-> Megatron), `grads` (grad norm), `dist` (process groups, spawn), `cpu_compat` (megatron
on CPU), `parity_check` (trainer-vs-rollout runs shared by tests, benchmark and GPU check).
"""
