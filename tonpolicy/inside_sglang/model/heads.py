"""The output side inside SGLang: contract logits and the contract logprob of the sampled token.

`ContractLogitsProcessor` keeps SGLang's LogitsProcessor (pruning to the rows that are sampled,
input-logprob chunking, the fp32 logits buffer, truncation to the real vocab) and replaces only the
LM head matmul with the model's contract head: fp32 logits over the TP-independent padded vocab,
gathered in rank order by the model itself (so SGLang's own TP gather is switched off).

`ContractSampler` keeps SGLang's sampling (temperature, top-p/top-k, seeds, TP token sync) and makes
the returned logprob the contract's: it hands the unmodified logits to SGLang's `logprob_logits`
route, which returns fp32 `log_softmax(logits / T)` (plain `log_softmax(logits)` for greedy batches,
as the trainer's temperature-1 rule), instead of the default `log(softmax(...))`, which differs in
the last bits. SGLang resolves the sampling backend itself (on CPU it forces "pytorch" whatever the
flag says), so the contract sampler is registered under the built-in names a CPU or CUDA server
resolves to ("pytorch", "flashinfer"; both build a plain `Sampler`) and under "tonpolicy".

SGLang's route computes torch's fp32 log_softmax, which is the `invariant` set's recipe. The `ordered`
set's recipe (its own exp, log and sums) and the `triton` set's (exp/log in 1024-wide lanes) are not:
under them SGLang only samples (no logprob of SGLang's is computed, greedy batch or not) and the sampled
tokens' logprobs are computed by that kernel from the same logits, per row and per temperature. A set that
also gives whole rows (`log_softmax`, and the normalizer (m, L) with logprob = (x - m) - L: the `ordered`
set) gives top-k and token-id logprobs from its rows, prefill-only requests' (max_new_tokens 0, what
SGLang's /v1/score sends) from its rows at temperature 1, and prompt logprobs through SGLang's own
normalizer route (its "fast input logprobs": top-k of the raw logits, values (x - m) - L), whose
normalizer is then the set's; under the `triton` set those stay SGLang's log_softmax. SGLang's two
scoring routes that read rows at chosen positions (multi-item delimiters, score-extraction anchors) stay
SGLang's log_softmax. The sampler runs outside CUDA graphs.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch
from sglang.srt.layers.logits_processor import LogitsProcessor
from sglang.srt.layers.sampler import Sampler, register_sampler_backend

from tonpolicy.inside_sglang.model.report import contract_from_env
from tonpolicy.kernels import get_kernels, logprob_temperature
from tonpolicy.kernels.sets import kernel_set

SAMPLING_BACKENDS = ("tonpolicy", "pytorch", "flashinfer")


@functools.cache
def _logprob_kernels():  # noqa: ANN202 - a KernelSet or None
    contract = contract_from_env()
    if not kernel_set(contract["kernels"]).own_logprobs:
        return None
    return get_kernels(contract["kernels"], **contract["kernel_params"])


def _row_kernels():  # noqa: ANN202 - a KernelSet or None
    """The contract's kernel set where it gives whole logprob rows of its own recipe."""
    kernels = _logprob_kernels()
    return kernels if kernels is not None and hasattr(kernels, "log_softmax") else None


def kernel_log_softmax(
    kernels,  # noqa: ANN001 - a KernelSet
    logits: torch.Tensor,
    temperatures: list[float],
) -> torch.Tensor:
    """fp32 [rows, vocab]: every token's logprob by the kernel set's recipe, rows grouped by temperature."""
    out = torch.empty(logits.shape, dtype=torch.float32, device=logits.device)
    temps = torch.tensor(temperatures)
    for t in sorted(set(temperatures)):
        rows = torch.nonzero(temps == t).flatten().to(logits.device)
        out[rows] = kernels.log_softmax(logits[rows], logits.shape[-1], logprob_temperature(t))
    return out


def install_contract_log_normalizer() -> None:
    """Make SGLang's per-row logprob normalizer the contract's (input logprobs: values (x - m) - L)."""
    from sglang.srt.layers import logprob_processor

    if getattr(logprob_processor.compute_row_log_normalizer, "contract", False):
        return

    def contract_row_log_normalizer(logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return _row_kernels().log_normalizer(logits, logits.shape[-1], 1.0)

    contract_row_log_normalizer.contract = True
    logprob_processor.compute_row_log_normalizer = contract_row_log_normalizer


def kernel_token_logprobs(
    kernels,  # noqa: ANN001 - a KernelSet
    logits: torch.Tensor,
    tokens: torch.Tensor,
    temperatures: list[float],
) -> torch.Tensor:
    """fp32 logprobs of `tokens` by the kernel set's recipe, rows grouped by temperature (a row's bits do
    not depend on the rows beside it)."""
    out = torch.empty(tokens.shape[0], dtype=torch.float32, device=logits.device)
    temps = torch.tensor(temperatures)
    for t in sorted(set(temperatures)):
        rows = torch.nonzero(temps == t).flatten().to(logits.device)
        out[rows] = kernels.logprobs(logits[rows], tokens[rows], logits.shape[-1], logprob_temperature(t))
    return out


class ContractLogitsProcessor(LogitsProcessor):
    def __init__(self, config, head: Callable[[torch.Tensor], torch.Tensor]) -> None:  # noqa: ANN001
        super().__init__(config, skip_all_gather=True)
        self._head = head
        if _row_kernels() is not None:
            # Input logprobs from the contract's normalizer, not a full log_softmax (a CPU set: SGLang's
            # fused CUDA top-k kernel on this route is never reached).
            install_contract_log_normalizer()
            self.input_logprob_processor.enable_fast_input_logprobs = True

    def _compute_lm_head(self, hidden_states: torch.Tensor, lm_head, embedding_bias=None, *, out=None):  # noqa: ANN001
        if embedding_bias is not None:
            raise ValueError("the contract LM head has no bias")
        return self._head(hidden_states)


class ContractSampler(Sampler):
    def forward(
        self,
        logits_output,
        sampling_info,
        return_logprob,
        top_logprobs_nums,
        token_ids_logprobs,  # noqa: ANN001
        positions,
        *,
        logprob_logits=None,
    ):
        kernels = _logprob_kernels() if return_logprob else None
        if return_logprob and logprob_logits is None:
            # A copy: the default path divides the logits by T in place before sampling.
            logprob_logits = logits_output.next_token_logits.clone()
        if kernels is None:
            return super().forward(
                logits_output,
                sampling_info,
                return_logprob,
                top_logprobs_nums,
                token_ids_logprobs,
                positions,
                logprob_logits=logprob_logits,
            )
        # The set owns the logprobs: SGLang samples only (its log_softmax is never computed, whatever the
        # batch: greedy or not), and every reported logprob is the set's, from the same logits SGLang's
        # route would have used (custom logit processors applied, as SGLang applies them there).
        ids = super().forward(logits_output, sampling_info, False, top_logprobs_nums, token_ids_logprobs, positions)
        logprob_logits = self._preprocess_logits(logprob_logits, sampling_info)
        greedy = sampling_info.is_all_greedy
        temps = [1.0] * ids.shape[0] if greedy else sampling_info.temperatures.flatten().tolist()
        rows_asked = any(k > 0 for k in top_logprobs_nums or []) or any(t is not None for t in token_ids_logprobs or [])
        if rows_asked and _row_kernels() is not None:
            rows = kernel_log_softmax(kernels, logprob_logits, temps)
            result = self.output_logprob_processor.compute_logprobs(rows, top_logprobs_nums, token_ids_logprobs, ids)
            result.write_output_to(logits_output)
        else:
            logits_output.next_token_logprobs = kernel_token_logprobs(kernels, logprob_logits, ids, temps)
        return ids

    def compute_logprobs_only(self, logits_output, sampling_info, top_logprobs_nums, token_ids_logprobs) -> None:  # noqa: ANN001
        """Prefill-only requests (max_new_tokens 0, SGLang's /v1/score): their next-token top-k and token-id
        logprobs from the set's rows (temperature 1, as SGLang reports them), not SGLang's log_softmax."""
        kernels = _row_kernels()
        logits = logits_output.next_token_logits
        if kernels is None or logits is None:
            return super().compute_logprobs_only(logits_output, sampling_info, top_logprobs_nums, token_ids_logprobs)
        if not (any(k > 0 for k in top_logprobs_nums) or any(t for t in token_ids_logprobs)):
            return None
        rows = kernel_log_softmax(kernels, self._preprocess_logits(logits, sampling_info), [1.0] * logits.shape[0])
        no_ids = torch.zeros(logits.shape[0], dtype=torch.long, device=logits.device)
        result = self.output_logprob_processor.compute_logprobs(rows, top_logprobs_nums, token_ids_logprobs, no_ids)
        result.token_logprobs = None  # nothing was sampled
        result.write_output_to(logits_output)
        return None


def register_contract_sampler() -> None:
    """Route SGLang's sampler construction to the contract sampler (before SGLang parses its
    arguments, and in every SGLang process before it creates its sampler). Registering twice (the
    plugin and the server entry in one process) changes nothing."""
    from sglang.srt.layers import sampler

    for backend in SAMPLING_BACKENDS:
        if sampler._CUSTOM_SAMPLER_FACTORIES.get(backend) is not ContractSampler:
            register_sampler_backend(backend, ContractSampler)


def contract_sampler_active() -> bool:
    """Whether the sampler this SGLang process built is the contract sampler."""
    from sglang.srt.layers import sampler
    from sglang.srt.runtime_context import get_exec

    return sampler._CUSTOM_SAMPLER_FACTORIES.get(get_exec().kernel.sampling_backend) is ContractSampler
