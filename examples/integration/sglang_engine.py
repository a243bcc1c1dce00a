"""tonpolicy's contract in SGLang's in-process engine (`sglang.Engine`), as verl runs it.

    python examples/integration/sglang_engine.py CHECKPOINT SAMPLES.json [tonpolicy overrides...]

Run it with the Python of SGLang's environment with tonpolicy installed in it (`pip install -e .`: the
model package, and the SGLang plugin that registers the contract sampler in each SGLang process). It
creates the engine from the contract's flags, samples one response with its logprobs, shuts the engine
down and writes SAMPLES.json for megatron_gpt.py to score.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import torch

from tonpolicy import api

PROMPT = [11, 4, 27, 9, 3, 18, 5]
SAMPLING = {"max_new_tokens": 32, "temperature": 0.8, "sampling_seed": 1, "ignore_eos": True}


def main() -> None:
    checkpoint, samples_file, *overrides = sys.argv[1:]
    cfg = api.compose([f"model.checkpoint={checkpoint}", *overrides])
    if isinstance(cfg, list):
        sys.exit("\n".join(map(str, cfg)))
    contract = api.Contract(cfg)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    # SGLang's processes read these when they start: set them before the engine is created. On a CPU
    # host PYTHONPATH names tonpolicy's stand-in for sgl_kernel's CPU ops, which this process imports too.
    environment = contract.sglang_environment(device)
    os.environ.update(environment)
    if device == "cpu":
        sys.path[:0] = environment["PYTHONPATH"].split(os.pathsep)
    import sglang
    from sglang.srt.server_args import prepare_server_args

    engine = sglang.Engine(server_args=prepare_server_args(contract.sglang_server_args(checkpoint, device)))
    try:
        out = engine.generate(input_ids=PROMPT, sampling_params=SAMPLING, return_logprob=True)
    finally:
        engine.shutdown()
    logprobs = [lp for lp, _token, _text in out["meta_info"]["output_token_logprobs"]]
    sample = {
        "prompt": PROMPT,
        "response": out["output_ids"],
        "logprobs": logprobs,
        "temperature": SAMPLING["temperature"],
        "sampled_by": "sglang.Engine",
    }
    Path(samples_file).write_text(json.dumps([sample]))
    print(f"{contract.name}: {len(sample['response'])} tokens sampled by SGLang's engine")


if __name__ == "__main__":  # SGLang starts its schedulers with `spawn`, which imports this file again
    main()
