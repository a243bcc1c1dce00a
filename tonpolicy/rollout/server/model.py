"""What the rollout server needs from the embedded engine: build it, reload weights, map requests."""

from __future__ import annotations

import logging

import torch

from tonpolicy.config.model import ModelConfig, check_same_architecture
from tonpolicy.families import family, resolve
from tonpolicy.kernels import get_kernels
from tonpolicy.model.checkpoint import load_hf, param_shapes
from tonpolicy.rollout.engine import Engine
from tonpolicy.rollout.engine.generation import GenRequest
from tonpolicy.rollout.engine.graphs import DecodeGraphs
from tonpolicy.rollout.server.args import ServerArgs
from tonpolicy.rollout.wire.request import GenerateItem

log = logging.getLogger(__name__)


def build_engine(args: ServerArgs) -> tuple[Engine, ModelConfig]:
    kernels = get_kernels(args.kernels, **args.kernel_params)
    dtype = getattr(torch, args.dtype)
    if args.model_path:
        cfg, state_dict = load_hf(args.model_path, dtype)  # an FP8 checkpoint dequantized into the served dtype
        if args.model is not None:  # a wrong --model-path must not serve another model silently
            check_same_architecture(args.model, cfg, args.model_path)
    else:  # the profile's deterministic random init (same seed as the trainer's)
        cfg, state_dict = args.model or ModelConfig(), None
    if args.device == "cpu":  # the contract's invariances on this host, before serving a token
        from tonpolicy.contract.host import kernel_problems

        problems = kernel_problems(cfg, args.kernels, args.kernel_params, args.dtype)
        if problems:
            raise RuntimeError("; ".join(problems))
    model = resolve(family(cfg.family).engine_model)(cfg, kernels, dtype, state_dict).to(args.device)
    graphs = DecodeGraphs(model, args.max_running_requests, capture=True) if args.cuda_graphs else None
    if graphs is not None:
        log.info(f"tonpolicy rollout server: decode in CUDA graphs, batch-size buckets {graphs.buckets}")
    engine = Engine(
        model,
        max_running_requests=args.max_running_requests,
        chunked_prefill_size=args.chunked_prefill_size,
        prefix_cache=not args.disable_radix_cache,
        decode_graphs=graphs,
    )
    return engine, cfg


def reload_weights(engine: Engine, path: str, current: ModelConfig) -> None:
    """Load an HF checkpoint into the running model. Everything is checked before the first tensor
    is copied, so a refused checkpoint leaves the served weights untouched."""
    cfg, state_dict = load_hf(path, getattr(engine.model, "dtype", torch.float32))
    check_same_architecture(current, cfg, path)
    load_checked(engine, state_dict, current, f"checkpoint {path}")


def load_checked(
    engine: Engine, state_dict: dict[str, torch.Tensor], current: ModelConfig, source: str, partial: bool = False
) -> None:
    """Load HF-named tensors into the running model once every name and shape is checked, so refused
    weights leave the served ones untouched. `partial`: a subset (one bucket of a distributed update)."""
    shapes = param_shapes(current)
    unknown = sorted(set(state_dict) - set(shapes))
    if unknown:
        raise ValueError(f"{source} has tensors the model does not have: {unknown[:8]}")
    bad = {k: tuple(v.shape) for k, v in state_dict.items() if tuple(v.shape) != shapes[k]}
    if bad:
        raise ValueError(f"{source} has tensors of the wrong shape: {bad}")
    engine.model.load_weights(state_dict, partial=partial)
    forget = getattr(engine, "forget_prefixes", None)
    if forget is not None:  # cached keys/values were computed with the old weights
        forget()


def flush_cache(engine: Engine) -> None:
    # Frees the engine's KV pool and its prefix cache; the loop runs this with nothing in flight.
    flush = getattr(engine, "flush_cache", None)
    if flush is not None:
        flush()


def to_gen_request(item: GenerateItem, seed: int) -> GenRequest:
    s = item.sampling
    return GenRequest(
        prompt_ids=list(item.input_ids),
        max_new_tokens=s.max_new_tokens,
        temperature=s.temperature,
        top_p=s.top_p,
        top_k=s.top_k,
        seed=seed,
        stop_token_ids=s.stop_token_ids,
        ignore_eos=s.ignore_eos,
        top_logprobs_num=item.top_logprobs_num if item.return_logprob else 0,
        prompt_logprobs_from=item.logprob_start_len if item.return_logprob and item.logprob_start_len >= 0 else None,
        return_routed_experts=item.return_routed_experts,
    )
