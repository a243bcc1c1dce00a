"""tonpolicy's public API: what another framework (verl, slime, your own loop) uses of tonpolicy.

    from tonpolicy import api

    cfg = api.compose(["contract=qwen3_dense_v2", "model.checkpoint=/ckpt"])  # a Config, or its problems
    result = api.run(cfg, "runs/first")                      # a whole job: exit code, run dir, summary
    contract = api.Contract(cfg)
    contract.fingerprint                                     # sha256 of everything that decides bits
    contract.sglang_environment("cuda"), contract.sglang_server_args("/ckpt", "cuda")  # released SGLang
    contract.megatron_block_spec(config)                     # megatron-core GPTModel's layer spec
    contract.logprobs(logits, tokens, temperature)           # the logprob recipe
    api.parity(rollout_logprobs, trainer_logprobs)           # fp32 bit patterns, token by token

Importing this module loads neither torch, nor Hydra, nor megatron, and changes nothing in the process;
each function imports what it needs when called. docs/guides/sglang_integration.md and
docs/guides/megatron_integration.md show both sides in use. Names not in `__all__` are not promised.
"""

from __future__ import annotations

from tonpolicy.api.config import RunResult, compose, run, validate
from tonpolicy.api.contract import SGLANG_VERSION, Contract
from tonpolicy.api.megatron_support import megatron_cpu_support, weights_updated
from tonpolicy.api.parity import bits_differ, parity

__all__ = [
    "SGLANG_VERSION",
    "Contract",
    "ParityReport",
    "RunResult",
    "bits_differ",
    "compose",
    "megatron_cpu_support",
    "parity",
    "run",
    "validate",
    "weights_updated",
]


def __getattr__(name: str) -> object:
    if name == "ParityReport":  # a class of the torch side: loaded when asked for, not at import
        from tonpolicy.contract.gate import ParityReport

        return ParityReport
    raise AttributeError(f"module 'tonpolicy.api' has no attribute {name!r}")
