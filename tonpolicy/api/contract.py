"""The contract as another framework uses it: its identity, what released SGLang needs to run tonpolicy's
model package, the pieces of a megatron-core GPTModel that computes the contract's bits, and the
logprob recipe. One object per composed configuration (contract, model and dtype decide the bits)."""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from tonpolicy.config.sglang_release import SGLANG_VERSION

if TYPE_CHECKING:
    import torch
    from megatron.core.models.gpt import GPTModel
    from megatron.core.transformer import TransformerConfig
    from megatron.core.transformer.transformer_block import TransformerBlockSubmodules

    from tonpolicy.config.schema import Config

__all__ = ["SGLANG_VERSION", "Contract"]


@dataclass(frozen=True)
class Contract:
    """`config`: a Config from `api.compose` (its contract, model and parallel groups are read)."""

    config: Config

    # --- identity ---------------------------------------------------------------------------------

    @property
    def name(self) -> str:
        return self.config.contract.name

    @property
    def version(self) -> int:
        return self.config.contract.version

    @functools.cached_property
    def fingerprint(self) -> str:
        """sha256 over everything that decides the bits (kernels, dtypes, tiles, shards, logprob recipe)."""
        from tonpolicy.contract.identity import fingerprint

        return fingerprint(self.config.contract)

    @property
    def exact(self) -> bool:
        """Whether the contract promises bit-identical logprobs (False for the off-policy control)."""
        return self.config.contract.exact_zero

    # --- released SGLang ---------------------------------------------------------------------------

    def sglang_environment(self, device: str = "cuda") -> dict[str, str]:
        """Variables SGLang's processes need (set them before SGLang starts: its schedulers read them at
        start): the model package (SGLANG_EXTERNAL_MODEL_PACKAGE), the contract it builds its kernels from
        (TONPOLICY_CONTRACT), SGLang's input-logprob route, and on a CPU host its CPU engine's settings,
        including the PYTHONPATH entry of tonpolicy's stand-in for sgl_kernel's CPU ops. The contract
        sampler comes from tonpolicy's SGLang plugin, which SGLang finds in an installed tonpolicy."""
        from tonpolicy.launch.sglang_env import server_environment

        return server_environment(self.config, _device(device), self.fingerprint)

    def sglang_server_args(self, model_path: str, device: str = "cuda", port: int = 30000) -> list[str]:
        """`python -m sglang.launch_server` flags (also `sglang.Engine`'s, through SGLang's
        `prepare_server_args`): dtype, TP/DP sizes from `parallel.rollout_*`, the attention backend and
        the CUDA-graph or CPU settings the contract needs, `rollout.*` (host, seeds, running requests)."""
        from tonpolicy.launch.plan import sglang_argv

        argv = sglang_argv(self.config, model_path, _device(device), port)
        return argv[argv.index("-m") + 2 :]  # after `PYTHON -m ENTRY`

    # --- megatron-core -----------------------------------------------------------------------------

    @functools.cached_property
    def kernels(self) -> Any:
        """The contract's kernel set (tonpolicy.kernels), the one source of its numerics."""
        from tonpolicy.contract.identity import kernel_params
        from tonpolicy.kernels import get_kernels

        return get_kernels(self.config.contract.kernels, **kernel_params(self.config.contract))

    @property
    def layer_spec(self) -> str:
        """'kernels' (tonpolicy's modules on the kernel set) or 'stock' (megatron's own: the control)."""
        from tonpolicy.contract.megatron_args import layer_spec

        return layer_spec(self.config.contract.kernels)

    def megatron_transformer_config(self, **build: Any) -> TransformerConfig:
        """The TransformerConfig of the model at megatron's current TP/PP/CP/EP sizes (initialize_model_parallel
        first): the architecture, dtype, and the fusions that would reorder arithmetic switched off.
        `build`: settings that change no numerics (e.g. use_cpu_initialization)."""
        from dataclasses import replace

        from tonpolicy.config.dtypes import torch_dtype
        from tonpolicy.trainer.model import transformer_config

        c = self.config.contract
        cfg = transformer_config(self.config.model, torch_dtype(c.dtype), exact_zero=c.exact_zero)
        return replace(cfg, **build) if build else cfg

    def megatron_block_spec(self, config: TransformerConfig) -> TransformerBlockSubmodules:
        """GPTModel's `transformer_layer_spec` for this pipeline stage: the model family's layers, every
        module routed to the kernel set (or megatron's own under a stock contract)."""
        from tonpolicy.families import family, resolve

        return resolve(family(self.config.model.family).layer_spec)(config, self._provider())

    def megatron_gpt_kwargs(self) -> dict[str, Any]:
        """GPTModel's other arguments: the padded vocab (fixed by the canonical shard count, not by TP),
        positions (RoPE inside the kernel attention), tied embeddings, a TP-sharded output."""
        from tonpolicy.contract.megatron_args import gpt_model_kwargs

        return gpt_model_kwargs(self.config.model, self.config.contract.canonical_shards, self.layer_spec)

    def megatron_install_head(self, model: GPTModel) -> None:
        """After GPTModel(...): the LM head onto the kernel set (GPTModel builds its head itself)."""
        self._provider().install_head(model)

    def megatron_forward_kwargs(self, positions: torch.Tensor) -> dict[str, Any]:
        """Extra keyword arguments of GPTModel's forward: the kernel attention takes the tokens' absolute
        positions [batch, seq] (a packed row restarts at 0 per sample)."""
        if self.layer_spec != "kernels":
            return {}
        from tonpolicy.trainer.cp_layout import TokenPositions

        return {"packed_seq_params": TokenPositions(positions=positions)}

    def megatron_load_hf(self, model: GPTModel, hf_state_dict: dict[str, torch.Tensor]) -> None:
        """Load an HF checkpoint's tensors into this rank's GPTModel (its TP/PP/EP slice; strict)."""
        from tonpolicy.families import megatron_weights
        from tonpolicy.kernels import padded_vocab_size

        vocab = padded_vocab_size(self.config.model.vocab_size, self.config.contract.canonical_shards)
        megatron_weights(self.config.model.family).load_into(model, hf_state_dict, self.config.model, vocab)

    # --- the logprob recipe ------------------------------------------------------------------------

    def logprobs(self, logits: torch.Tensor, tokens: torch.Tensor, temperature: float) -> torch.Tensor:
        """fp32 logprob of `tokens` [...] from full padded-vocab logits [..., V_pad]: truncated to the real
        vocab, the kernel set's log_softmax(logits / T) (T <= 0, greedy: plain log_softmax)."""
        from tonpolicy.kernels import logprob_temperature

        t, vocab = logprob_temperature(temperature), self.config.model.vocab_size
        if self.layer_spec == "kernels":
            return self.kernels.logprobs(logits, tokens, vocab, t)
        return _plain().logprobs(logits.float(), tokens, vocab, t)  # megatron's own head may give bf16

    def megatron_logprobs(self, local_logits: torch.Tensor, tokens: torch.Tensor, temperature: float) -> torch.Tensor:
        """The same from this TP rank's vocab shard (GPTModel's output): gathered in rank order, with a
        backward that narrows the gradient to the shard (every rank computes the same loss)."""
        from tonpolicy.kernels import logprob_temperature
        from tonpolicy.trainer.logprobs import token_logprobs

        kernels = self.kernels if self.layer_spec == "kernels" else None
        t = logprob_temperature(temperature)
        return token_logprobs(local_logits, tokens, self.config.model.vocab_size, t, kernels)

    def _provider(self) -> Any:
        from tonpolicy.trainer.model import spec_provider

        p = self.config.parallel
        cp_type = p.cp_type if p.cp_type in ("ulysses", "ring") else "ulysses"
        return spec_provider(self.layer_spec, self.kernels, self.config.model.rope_theta, cp_type)


def _device(device: str) -> str:
    if device not in ("cpu", "cuda"):
        raise ValueError(f"device={device!r}: must be 'cpu' or 'cuda'")
    return device


def _plain() -> Any:
    from tonpolicy.kernels import get_kernels

    return get_kernels("plain")
