"""A plain megatron-core GPTModel that computes tonpolicy's contract, built from `tonpolicy.api` the way
slime or Megatron-LM build theirs, scoring responses another engine sampled.

    python examples/integration/megatron_gpt.py CHECKPOINT SAMPLES.json [tonpolicy overrides...]

SAMPLES.json: a list of {"prompt": ids, "response": ids, "logprobs": floats, "temperature": T} (what
sglang_server.py and sglang_engine.py write). Prints one JSON line per sample: tokens scored, mismatched
tokens (fp32 bit patterns), the largest |Δ| and `exact`. One process, TP 1 here; at TP/PP > 1 every rank runs the same
code after `initialize_model_parallel` (the block spec and the logprob recipe read megatron's groups).
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from megatron.core import parallel_state
from megatron.core.models.gpt import GPTModel
from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed
from safetensors.torch import load_file

from tonpolicy import api

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def build_model(contract: api.Contract, checkpoint: Path) -> GPTModel:
    """GPTModel on the contract: its TransformerConfig, the block spec, GPTModel's arguments, the LM head,
    and the checkpoint's weights."""
    config = contract.megatron_transformer_config()
    model = GPTModel(
        config=config,
        transformer_layer_spec=contract.megatron_block_spec(config),
        pre_process=parallel_state.is_pipeline_first_stage(),
        post_process=parallel_state.is_pipeline_last_stage(),
        **contract.megatron_gpt_kwargs(),
    )
    contract.megatron_install_head(model)
    contract.megatron_load_hf(model, load_file(checkpoint / "model.safetensors"))
    return model.to(DEVICE, config.params_dtype).eval()


@torch.no_grad()
def score(model: GPTModel, contract: api.Contract, prompt: list[int], response: list[int], temperature: float):
    """fp32 logprob of each response token, as tonpolicy's trainer computes it."""
    tokens = torch.tensor([prompt + response], device=DEVICE)
    positions = torch.arange(tokens.shape[1], device=DEVICE)[None]
    logits = model(tokens, positions, None, **contract.megatron_forward_kwargs(positions))  # [1, S, V_pad / TP]
    targets = torch.tensor([response], device=DEVICE)
    return contract.megatron_logprobs(logits[:, len(prompt) - 1 : -1], targets, temperature)[0].cpu()


def main() -> None:
    checkpoint, samples_file, *overrides = sys.argv[1:]
    cfg = api.compose([f"model.checkpoint={checkpoint}", *overrides])
    if isinstance(cfg, list):
        sys.exit("\n".join(map(str, cfg)))
    contract = api.Contract(cfg)
    backend = "nccl" if torch.cuda.is_available() else "gloo"
    if "WORLD_SIZE" in os.environ:  # under torchrun: every rank runs this, the rendezvous is torchrun's
        dist.init_process_group(backend)
    else:  # one process, nothing to rendezvous with
        dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1)
    api.megatron_cpu_support()  # megatron-core's CUDA-only calls redirected on a CPU host; no-op with CUDA
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=1)
    model_parallel_cuda_manual_seed(0)  # megatron's RNG tracker, which its layer construction reads
    model = build_model(contract, Path(checkpoint))
    for i, s in enumerate(json.loads(Path(samples_file).read_text())):
        ours = score(model, contract, s["prompt"], s["response"], s["temperature"])
        report = api.parity([s["logprobs"]], [ours])
        print(json.dumps({"sample": i, "sampled_by": s.get("sampled_by"), **report.to_dict()}))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
