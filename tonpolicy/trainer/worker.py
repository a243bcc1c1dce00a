"""The trainer's entry for an orchestrator: inside an initialized process group (torchrun or
`dist.spawn`), build GPTModel from an HF checkpoint at the configured layout, recompute per-sample
fp32 logprobs, take PPO/GRPO steps, and export HF weights. Every rank calls every method (they are
collective); results are returned on every rank.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from megatron.core import parallel_state as ps

from tonpolicy.config.dtypes import dtype_name, torch_dtype
from tonpolicy.config.learning_rate import learning_rate
from tonpolicy.config.model import check_same_architecture
from tonpolicy.config.schema import Config
from tonpolicy.config.sizes import micro_batch_size
from tonpolicy.contract.identity import kernel_params
from tonpolicy.contract.megatron_args import transformer_kwargs
from tonpolicy.families import megatron_weights
from tonpolicy.kernels import (
    get_kernels,
    logprob_temperature,
    padded_vocab_size,
    weights_updated,
)
from tonpolicy.kernels.sets import kernel_set
from tonpolicy.rl.objective import PPOConfig, metrics
from tonpolicy.rl.train_samples import TrainSamples
from tonpolicy.trainer import routes, schedule
from tonpolicy.trainer.model import build_gpt
from tonpolicy.trainer.moe_weights import is_expert_param
from tonpolicy.trainer.ppo_loss import PPOLoss, TokenInputs, token_inputs
from tonpolicy.trainer.process_groups import Layout, init_distributed


class TrainerWorker:
    """`spec`: 'kernels' (the kernel layer spec), 'stock' (megatron's local spec) or None: kernel spec
    for the contract kernels; for `plain` kernels the stock spec, or at CP > 1 (megatron's own CP
    needs TransformerEngine) the kernel spec running the `plain` kernels."""

    def __init__(
        self,
        cfg: Config,
        checkpoint: str | Path | None = None,
        *,
        spec: str | None = None,
        state_dict: dict[str, torch.Tensor] | None = None,
    ) -> None:
        from tonpolicy.model.checkpoint import init_state_dict, load_hf

        self.cfg, self.layout = cfg, Layout.of(cfg.parallel)
        self.dtype = torch_dtype(cfg.contract.dtype)
        if not ps.model_parallel_is_initialized():
            init_distributed(self.layout, seed=cfg.experiment.seed + 1)
        c = cfg.contract
        # The kernel set this worker built (the runtime fingerprint is computed from it) and the layer
        # spec that runs it: the two facts every other choice follows from.
        self.kernels = kernels = get_kernels(c.kernels, **kernel_params(c))
        if spec is None:
            # Megatron's local spec has neither CP (TransformerEngine's) nor packed rows (THD, TE's too).
            needs_kernel_spec = self.layout.cp > 1 or cfg.trainer.pack_sequences
            spec = "kernels" if needs_kernel_spec else kernel_set(c.kernels).trainer_layer_spec
        self.spec = spec
        if state_dict is not None:
            self.model_cfg, hf = cfg.model, state_dict
        elif checkpoint is not None:
            self.model_cfg, hf = load_hf(checkpoint, self.dtype)  # an FP8 checkpoint dequantized to masters
            check_same_architecture(cfg.model, self.model_cfg, str(checkpoint))
        else:
            self.model_cfg, hf = cfg.model, init_state_dict(cfg.model, self.dtype, cfg.model.init_seed)
        # TP-independent, so every layout (and the rollout) sees the same logits width.
        self.vocab_padded = padded_vocab_size(self.model_cfg.vocab_size, c.canonical_shards)
        self.module = build_gpt(
            self.model_cfg,
            self.dtype,
            spec,
            self.layout.cp_type,
            kernels,
            canonical_shards=c.canonical_shards,
            pp_layers=self.layout.pp_layers,
            exact_zero=c.exact_zero,
            moe_capacity_factor=cfg.trainer.moe_capacity_factor,
        )
        megatron_weights(self.model_cfg.family).load_into(
            self.module, hf, self.model_cfg, self.vocab_padded, self.layout.pp_layers
        )
        self.tile = kernels.attention_tile
        # The rollout reports greedy (temperature <= 0) logprobs at temperature 1; so do we.
        self.temperature = logprob_temperature(cfg.experiment.temperature)
        self.ppo = PPOConfig(cfg.trainer.clip_eps, cfg.trainer.clip_eps_high, cfg.trainer.kl_coef)
        self.loss = PPOLoss(self.ppo, cfg.trainer.tis_cap)
        # Megatron's DDP wrapper of `module` (its grad buffers), made with the optimizer by the first ppo_step
        self.ddp: Any = None
        self.optimizer: Any = None
        self.last_share: list[int] = []
        # An MoE model's: the last recompute's routes per sample (global rank 0; `routes.gather_routes`),
        # and the rollout's routes the stock router replays (`replay_routes`, trainer.router_replay).
        self.last_routes: list[torch.Tensor] | None = None
        self.replayed: list[torch.Tensor] | None = None
        self.lr = learning_rate(cfg)  # a task may set its own

    @property
    def runnable(self) -> Any:
        """What the pipeline schedule runs: `ddp` once training began, else the GPTModel (`module`)."""
        return self.module if self.ddp is None else self.ddp

    @property
    def logprob_kernels(self) -> Any:
        """The logprob recipe's kernel set: the model's own under the kernel spec; None under megatron's
        stock spec (plain torch on fp32 logits: its output layer may hand over bf16)."""
        return self.kernels if self.spec == "kernels" else None

    # --- logprobs -----------------------------------------------------------------------------------
    def _lp_loss(self, mb: schedule.Microbatch, logits: torch.Tensor) -> tuple[torch.Tensor, dict]:
        lps, _ = schedule.local_logprobs(mb, logits, self.model_cfg.vocab_size, self.temperature, self.logprob_kernels)
        return logits.new_zeros(()), {"lp": lps, "resp": [s.resp for s in mb.slices]}

    def _microbatches(
        self, prompts: list[list[int]], responses: list[list[int]], extras: list[dict[str, torch.Tensor]] | None = None
    ) -> tuple[list[schedule.Microbatch], int]:
        t = self.cfg.trainer
        return schedule.make_microbatches(
            prompts, responses, self.layout, self.tile, extras, micro_batch_size(self.cfg), t.pack_sequences
        )

    def replay_routes(self, rollout_routes: list[torch.Tensor] | None) -> None:
        """Router replay (the off-policy control): the next `logprobs` and `ppo_step` route every token
        by `routes` (per sample int32 [fed positions, layers, k], the rollout's) instead of the router's
        own top-k. Only megatron's stock router replays; validation allows it only there."""
        if rollout_routes is None:
            raise ValueError("trainer.router_replay: the rollout server returned no routed_experts to replay")
        self.replayed = rollout_routes

    def _before_forward(self) -> Callable[[schedule.Microbatch], None] | None:
        if self.replayed is None:
            return None
        return routes.replayer(self.module, self.replayed, self.model_cfg.num_experts_per_tok)

    @torch.no_grad()
    def logprobs(self, prompts: list[list[int]], responses: list[list[int]]) -> list[torch.Tensor]:
        """fp32 logprob of every response token (temperature from the experiment config). An MoE
        model's routes at the positions that predicted them land in `last_routes` (global rank 0)."""
        self.runnable.eval()
        mbs, seq_len = self._microbatches(prompts, responses)
        lengths = [len(r) for r in responses]
        if not self.model_cfg.is_moe:
            outs = schedule.run(self.runnable, mbs, seq_len, self._lp_loss, True, self.spec == "kernels")
            return schedule.assemble(outs, mbs, lengths)
        with routes.RouteRecorder(self.module) as recorder:
            try:
                outs = schedule.run(
                    self.runnable, mbs, seq_len, self._lp_loss, True, self.spec == "kernels", self._before_forward()
                )
            finally:
                routes.end_replay(self.module)
        lps = schedule.assemble(outs, mbs, lengths)
        m = self.model_cfg
        self.last_routes = routes.gather_routes(recorder, mbs, lengths, m.num_layers, m.num_experts_per_tok)
        return lps

    # --- training -----------------------------------------------------------------------------------
    def _setup_optimizer(self) -> None:
        from megatron.core.distributed import (
            DistributedDataParallel,
            DistributedDataParallelConfig,
            finalize_model_grads,
        )
        from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

        t = self.cfg.trainer
        ddp_cfg = DistributedDataParallelConfig(
            grad_reduce_in_fp32=True, overlap_grad_reduce=False, use_distributed_optimizer=False
        )
        self.ddp = DistributedDataParallel(config=self.module.config, ddp_config=ddp_cfg, module=self.module)
        opt_cfg = OptimizerConfig(
            optimizer="adam",
            lr=self.lr,
            weight_decay=t.weight_decay,
            clip_grad=t.clip_grad,
            bf16=self.dtype == torch.bfloat16,
            params_dtype=self.dtype,
        )
        self.optimizer = get_megatron_optimizer(opt_cfg, [self.ddp])
        self.module.config.finalize_model_grads_func = finalize_model_grads

    def ppo_step(
        self,
        samples: TrainSamples,
        may_update: Callable[[list[int], list[torch.Tensor]], bool] | None = None,
        record_routes: bool = False,
    ) -> dict[str, Any]:
        """trainer.ppo_epochs x trainer.ppo_minibatches clipped policy-gradient updates (verl's and
        slime's loop): one optimizer update per minibatch (`TrainSamples.minibatches`) on its token-mean
        loss, all of it repeated ppo_epochs times. Computed identically on every rank.

        `may_update` is the gate's check of the first training forward (docs/ARCHITECTURE.md "The gate's
        order"): it gets the first minibatch's sample indices and that forward's logprobs (autograd on);
        False drops the gradients and ends the step with no update (`update_successful` 0, grad_norm
        NaN). `record_routes`: an MoE model's routes of that same forward land in `last_routes`.

        Metrics: `rl.objective.metrics` over each sample's first training forward (epoch 0); grad_norm
        is the first update's; with more than one update, grad_norms and minibatch_losses list each."""
        if self.optimizer is None:
            self._setup_optimizer()
        self.ddp.train()
        t = self.cfg.trainer
        minibatches = samples.minibatches(t.ppo_minibatches)
        if samples.old_logprobs is None and len(minibatches) * t.ppo_epochs != 1:
            raise ValueError("old_logprobs=None (the first training forward's) needs exactly one update per step")
        inputs = token_inputs(samples)
        first: dict[int, torch.Tensor] = {}  # each sample's first training forward (epoch 0)
        losses: list[float] = []
        norms: list[float] = []
        ok = True
        replayed, self.replayed = self.replayed, None  # one batch's routes: the next step brings its own
        self.last_share = []
        updates = [(epoch, idx) for epoch in range(t.ppo_epochs) for idx in minibatches]
        try:
            for u, (epoch, idx) in enumerate(updates):
                lp = self._train_forward(samples, inputs, idx, replayed, epoch == 0, record_routes and u == 0)
                if epoch == 0:
                    first.update(zip(idx, lp, strict=True))
                losses.append(self.loss.mean([inputs[i] for i in idx], lp))
                if u == 0 and may_update is not None and not may_update(idx, lp):
                    self.optimizer.zero_grad()  # refused: no update at all this step
                    ok = False
                    break
                ok = self._update(norms) and ok
        finally:
            routes.end_replay(self.module)
        out = self._step_metrics(samples, inputs, first)
        out.update(grad_norm=norms[0] if norms else float("nan"), update_successful=float(ok), lr=self.lr)
        if len(updates) > 1:
            out.update(updates=len(norms), grad_norms=norms, minibatch_losses=losses)
        return out

    def _update(self, norms: list[float]) -> bool:
        """One optimizer step on the gradients in the buffers; its grad norm appended to `norms`."""
        updated, grad_norm, _ = self.optimizer.step()
        weights_updated()  # the optimizer writes the params through `.data`
        norms.append(float(grad_norm))
        return bool(updated)

    def _step_metrics(
        self, samples: TrainSamples, inputs: list[TokenInputs], first: dict[int, torch.Tensor]
    ) -> dict[str, Any]:
        """`rl.objective.metrics` over the samples' first training forwards (`first`: sample -> logprobs)."""
        seen = sorted(first)
        return metrics(
            [first[i] for i in seen],
            [inputs[i].old_or(first[i]) for i in seen],
            [torch.as_tensor(samples.rollout_logprobs[i], dtype=torch.float32) for i in seen],
            [inputs[i].advantage for i in seen],
            [inputs[i].mask for i in seen],
            self.ppo,
        )

    def _train_forward(
        self,
        samples: TrainSamples,
        inputs: list[TokenInputs],
        idx: list[int],
        replayed: list[torch.Tensor] | None,
        count_share: bool,
        record_routes: bool,
    ) -> list[torch.Tensor]:
        """Forward and backward of the minibatch `idx` (gradients of its token-mean loss left in the
        grad buffers); returns its samples' logprobs of this forward, on every rank."""
        prompts, responses = samples.prompts, samples.responses
        mbs, seq_len = self._microbatches(
            [prompts[i] for i in idx], [responses[i] for i in idx], [inputs[i].extras() for i in idx]
        )
        total = max(float(sum(inputs[i].mask.sum() for i in idx)), 1.0)  # the minibatch's tokens, every replica
        n_mb, dp = len(mbs), ps.get_data_parallel_world_size()
        if count_share:  # the samples this replica trained on
            self.last_share += [idx[i] for mb in mbs if mb.weight for i in mb.samples]

        def loss_fn(mb: schedule.Microbatch, logits: torch.Tensor) -> tuple[torch.Tensor, dict]:
            lps, exs = schedule.local_logprobs(
                mb, logits, self.model_cfg.vocab_size, self.temperature, self.logprob_kernels
            )
            tokens = [TokenInputs.of(ex) for ex in exs]
            local = sum((self.loss.per_token(t, lp) * t.mask).sum() for lp, t in zip(lps, tokens, strict=True)) / total
            # megatron's schedule multiplies this by CP and divides it by the microbatch count, and DDP
            # averages gradients over DP x CP: the update is the gradient of the minibatch's token mean.
            return local * n_mb * dp * mb.weight, {
                "lp": [lp.detach() for lp in lps],
                "resp": [s.resp for s in mb.slices],
            }

        self.ddp.zero_grad_buffer()
        self.optimizer.zero_grad()
        replay = None
        if replayed is not None:
            replay = routes.replayer(self.module, [replayed[i] for i in idx], self.model_cfg.num_experts_per_tok)
        aux = routes.aux_loss_shares(
            self.module, n_mb, schedule.real_microbatches(len(idx), micro_batch_size(self.cfg))
        )
        hooks = [h for h in (aux, replay) if h is not None]
        before = (lambda mb: [h(mb) for h in hooks]) if hooks else None
        kernel_spec, lengths = self.spec == "kernels", [len(responses[i]) for i in idx]
        if not (record_routes and self.model_cfg.is_moe):
            outs = schedule.run(self.ddp, mbs, seq_len, loss_fn, False, kernel_spec, before)
            return schedule.assemble(outs, mbs, lengths)
        with routes.RouteRecorder(self.module) as recorder:
            outs = schedule.run(self.ddp, mbs, seq_len, loss_fn, False, kernel_spec, before)
        m = self.model_cfg
        self.last_routes = routes.gather_routes(recorder, mbs, lengths, m.num_layers, m.num_experts_per_tok)
        return schedule.assemble(outs, mbs, lengths)

    # --- weights ------------------------------------------------------------------------------------
    def hf_state_dict(self, tensors: dict[str, torch.Tensor] | None = None) -> dict[str, torch.Tensor] | None:
        """Merged HF-named weights on global rank 0 (None elsewhere); `tensors`: other Megatron-named
        tensors of the parameters' shapes to merge instead (the optimizer's state). A MoE model's experts
        come from the first expert-data-parallel replica of every (expert-TP, EP, pp) rank, the rest
        from the first DP/CP one."""
        if tensors is None:
            tensors = {k: v for k, v in self.module.state_dict().items() if not k.endswith("_extra_state")}
        sd = {k: v.detach().cpu() for k, v in tensors.items()}
        own = {k: v for k, v in sd.items() if not is_expert_param(k)}
        experts = {k: v for k, v in sd.items() if is_expert_param(k)}
        pp_rank = ps.get_pipeline_model_parallel_rank()
        key = (ps.get_tensor_model_parallel_rank(), pp_rank)
        ekey = (ps.get_expert_tensor_parallel_rank(), ps.get_expert_model_parallel_rank(), pp_rank)
        keep = ps.get_context_parallel_rank() == 0 and ps.get_data_parallel_rank() == 0
        keep_experts = bool(experts) and ps.get_expert_data_parallel_rank() == 0
        mine = ((key, own) if keep else None, (ekey, experts) if keep_experts else None)
        gathered: list[Any] = [None] * dist.get_world_size() if dist.get_rank() == 0 else []
        dist.gather_object(mine, gathered if dist.get_rank() == 0 else None, dst=0)
        if dist.get_rank() != 0:
            return None
        shards = dict(d for d, _ in gathered if d is not None)
        expert_shards = dict(e for _, e in gathered if e is not None) or None
        return megatron_weights(self.model_cfg.family).megatron_to_hf(
            shards, self.model_cfg, self.layout.tp, self.layout.pp, self.layout.pp_layers, expert_shards
        )

    def built_config(self) -> dict[str, Any]:
        """The built model's TransformerConfig and GPTModel settings in the plan's terms (the test that
        the plan describes what runs compares the two)."""
        c, m = self.module.config, self.module
        names = {
            "activation_func": c.activation_func.__name__,
            "params_dtype": dtype_name(c.params_dtype),
            "pipeline_dtype": dtype_name(c.pipeline_dtype),
        }
        keys = transformer_kwargs(self.model_cfg, self.cfg.contract.dtype, Layout(), True)
        gpt = {
            k: getattr(m, k)
            for k in (
                "vocab_size",
                "max_sequence_length",
                "position_embedding_type",
                "share_embeddings_and_output_weights",
                "parallel_output",
            )
        }
        if m.position_embedding_type == "rope":
            gpt["rotary_base"] = m.rotary_base
        return {
            "transformer_config": {k: names.get(k, getattr(c, k)) for k in keys},
            "gpt_model": gpt,
            "stage_layers": self.stage_layers(),
        }

    def stage_layers(self) -> list[int]:
        """Transformer layers actually built on each pipeline stage (from the modules, not the config)."""
        built: list[Any] = [None] * ps.get_pipeline_model_parallel_world_size()
        dist.all_gather_object(built, len(self.module.decoder.layers), group=ps.get_pipeline_model_parallel_group())
        return built

    def save_hf(self, path: str | Path, quant: str = "none") -> None:
        """The weights as an HF model directory (a collective; rank 0 writes); `quant="fp8_block"`: in the
        published FP8 format (tonpolicy.model.fp8_checkpoint)."""
        from tonpolicy.model.checkpoint import save_hf

        hf = self.hf_state_dict()
        if hf is not None:
            save_hf(hf, self.model_cfg, path, quant=quant)
        dist.barrier()

    def save_trainer_state(self, path: str | Path, completed_steps: int) -> None:
        """The optimizer's state beside the weights, in megatron's distributed checkpoint format (a collective:
        each rank writes the shards it owns)."""
        from tonpolicy.trainer.optimizer_state import save_trainer_state

        save_trainer_state(self, Path(path), completed_steps)

    def load_trainer_state(self, path: str | Path, optimizer: bool = True) -> int:
        """Restore `save_trainer_state`'s state for this rank's layout; returns the steps completed."""
        from tonpolicy.trainer.optimizer_state import load_trainer_state

        return load_trainer_state(self, Path(path), optimizer)

    def close(self) -> None:
        from tonpolicy.trainer.process_groups import reset_model_parallel

        reset_model_parallel()
