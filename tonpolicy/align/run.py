"""`python -m tonpolicy mode=align ...`: dump one sample from both engines and report where the bits
first part.

The rollout side generates the sample with the embedded engine (prefill + KV-cached decode, the path
that sampled the tokens); the reference is Megatron's full-sequence forward at `parallel.*` (or, with
`align.reference=full_forward`, a full forward of the rollout model). Files in the run directory:
align/rollout/ and align/<reference>/ (dumps), align_report.json and align_report.png.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import torch

from tonpolicy.align.names import ALL_OPS, Checkpoint, parse_name
from tonpolicy.align.recorder import Selection
from tonpolicy.config.errors import ConfigError, ConfigIssue
from tonpolicy.config.schema import Config

log = logging.getLogger(__name__)

REFERENCES = ("trainer", "full_forward")
# Checkpoints the engines compute with plain tensor ops (lookup, residual adds), not kernel calls.
NOT_KERNEL_OPS = ("embed", "attn_residual", "residual")


def parse_perturb(
    spec: str | None, num_layers: int, kernel_params: dict[str, int]
) -> tuple[str, dict[Checkpoint, Any]]:
    """ "[side:]<checkpoint>:<kernel set>" -> (side, {checkpoint: kernel set})."""
    from tonpolicy.kernels import get_kernels

    if not spec:
        return "rollout", {}
    parts = spec.split(":")
    if len(parts) == 2:
        parts = ["rollout", *parts]
    if len(parts) != 3 or parts[0] not in ("rollout", "trainer"):
        raise ValueError("expected [rollout:|trainer:]<checkpoint>:<kernel set>")
    side, name, kernels = parts
    ck = parse_name(name, num_layers)
    if ck.op in NOT_KERNEL_OPS:
        raise ValueError(f"{ck.op} is not computed by a kernel call (nothing to perturb)")
    return side, {ck: get_kernels(kernels, **kernel_params)}


def check(cfg: Config) -> None:
    """The align-specific rules (every violation at once, like config validation)."""
    from tonpolicy.contract.identity import kernel_params

    a, n = cfg.align, cfg.model.num_layers
    issues = []
    if a.reference not in REFERENCES:
        issues.append(ConfigIssue("align.reference", a.reference, f"must be one of {list(REFERENCES)}"))
    if a.sample < 0:
        issues.append(ConfigIssue("align.sample", a.sample, "must be >= 0"))
    if a.prompt is not None and (not a.prompt or any(not 0 <= t < cfg.model.vocab_size for t in a.prompt)):
        issues.append(
            ConfigIssue("align.prompt", a.prompt, f"must be non-empty token ids in [0, {cfg.model.vocab_size})")
        )
    if a.layers is not None and any(not 0 <= x < n for x in a.layers):
        issues.append(ConfigIssue("align.layers", a.layers, f"layers must be in [0, {n})"))
    if a.positions is not None and any(p < 0 for p in a.positions):
        issues.append(ConfigIssue("align.positions", a.positions, "positions must be >= 0"))
    if a.ops is not None and set(a.ops) - set(ALL_OPS):
        issues.append(ConfigIssue("align.ops", a.ops, f"ops must be among {list(ALL_OPS)}"))
    try:
        parse_perturb(a.perturb, n, kernel_params(cfg.contract))
    except ValueError as exc:
        issues.append(ConfigIssue("align.perturb", a.perturb, str(exc)))
    if issues:
        raise ConfigError(issues)


def sample_request(cfg: Config) -> Any:
    """Sample `align.sample` of a run's first step: same prompt and sampling seed as the run's."""
    from tonpolicy.rl.batch import sampling_seed
    from tonpolicy.rl.task import EOS, make_prompts
    from tonpolicy.rollout.engine.generation import GenRequest

    e, i = cfg.experiment, cfg.align.sample
    prompt = cfg.align.prompt
    if prompt is None:
        prompt = make_prompts(
            cfg.task.name,
            0,
            i // e.samples_per_prompt + 1,
            seed=e.seed,
            max_prompt_len=e.max_prompt_len,
            target=cfg.task.target_digit,
            max_digits=cfg.task.max_digits,
        )[-1]
    return GenRequest(
        list(prompt),
        e.max_new_tokens,
        e.temperature,
        e.top_p,
        e.top_k,
        seed=sampling_seed(e.seed, 0, i),
        stop_token_ids=(EOS,),
    )


def run_align(cfg: Config, run_dir: Path) -> int:
    from tonpolicy.align.compare import compare_dumps, format_report
    from tonpolicy.align.dump import save_dump
    from tonpolicy.align.report import write_report
    from tonpolicy.align.rollout_dump import decode_dump, full_forward_dump
    from tonpolicy.align.trainer_dump import trainer_dump
    from tonpolicy.contract.identity import kernel_params
    from tonpolicy.kernels import get_kernels
    from tonpolicy.model.qwen3 import Qwen3

    check(cfg)
    a, params = cfg.align, kernel_params(cfg.contract)
    side, perturb = parse_perturb(a.perturb, cfg.model.num_layers, params)
    dtype = getattr(torch, cfg.contract.dtype)
    model = Qwen3(cfg.model, get_kernels(cfg.contract.kernels, **params), dtype, _weights(cfg, dtype))
    selection = Selection(
        set(a.layers) if a.layers is not None else None,
        set(a.positions) if a.positions is not None else None,
        set(a.ops) if a.ops is not None else None,
    )
    req = sample_request(cfg)
    out = run_dir / "align"
    rollout, response, engine_lps = decode_dump(
        model,
        req,
        selection,
        chunked_prefill_size=cfg.rollout.chunked_prefill_size,
        perturb=perturb if side == "rollout" else None,
        meta={"sample": a.sample, "contract": cfg.contract.name},
    )
    save_dump(rollout, out / "rollout")
    tokens, prompt_len = rollout.tokens, len(req.prompt_ids)
    log.info(
        f"align: sample {a.sample}: prompt {prompt_len} tokens, response {len(response)} tokens; "
        f"rollout dump ({len(rollout.tensors)} checkpoints) in {out / 'rollout'}"
    )
    # The reference holds the sample's real tokens only (no padding rows).
    # The reference keeps the sample's real tokens only (the trainer never feeds the last one: it
    # predicts nothing; anything past it is padding).
    real = set(range(len(tokens) - 1 if a.reference == "trainer" else len(tokens)))
    ref_sel = Selection(selection.layers, real & (selection.positions or real), selection.ops)
    ref_perturb = perturb if side == "trainer" else None
    if a.reference == "trainer":
        ref = trainer_dump(cfg, tokens, prompt_len, ref_sel, out, perturb=ref_perturb, timeout=cfg.trainer.timeout_s)
    else:
        ref = full_forward_dump(model, tokens, prompt_len, req.temperature, ref_sel, perturb=ref_perturb)
    ref_dir = save_dump(ref, out / a.reference)
    report = compare_dumps(rollout, ref, str(out / "rollout"), str(ref_dir))
    print(format_report(report))  # the command's result
    _check_engine_logprobs(rollout, engine_lps)
    js, png = write_report(report, run_dir)
    log.info(f"report written to {js} and {png}")
    return 0 if report.match else 1


def _weights(cfg: Config, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """The weights both engines start from: the user's checkpoint or the seeded random init."""
    from tonpolicy.model.checkpoint import init_state_dict, load_hf

    if cfg.model.checkpoint:
        return load_hf(cfg.model.checkpoint)[1]
    return init_state_dict(cfg.model, dtype, cfg.model.init_seed)


def _check_engine_logprobs(rollout: Any, engine_lps: torch.Tensor) -> None:
    """The dumped logprobs must be the ones the engine reported (else the dump is not of that run)."""
    lp = next((t for ck, t in rollout.tensors.items() if ck.op == "logprobs"), None)
    if lp is None:
        return
    pos = rollout.positions[next(ck for ck in rollout.tensors if ck.op == "logprobs")]
    idx = torch.tensor([p - (rollout.prompt_len - 1) for p in pos], dtype=torch.long)
    if not torch.equal(lp.flatten(), engine_lps[idx]):
        raise RuntimeError("the dumped rollout logprobs differ from the engine's reported logprobs")
