"""tonpolicy's contract in released SGLang started by SGLang's own launcher, as slime starts it.

    python examples/integration/sglang_server.py CHECKPOINT SAMPLES.json [tonpolicy overrides...]

Run it with the Python of SGLang's environment with tonpolicy installed in it (`pip install -e .`: the
model package, and the SGLang plugin that registers the contract sampler). It starts
`python -m sglang.launch_server` with the contract's environment and flags, samples one response with
its logprobs, stops the server and writes SAMPLES.json for megatron_gpt.py to score.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import torch

from tonpolicy import api

PROMPT = [11, 4, 27, 9, 3, 18, 5]
SAMPLING = {"max_new_tokens": 32, "temperature": 0.8, "sampling_seed": 1, "ignore_eos": True}


def serve(contract: api.Contract, checkpoint: str, device: str, port: int) -> subprocess.Popen:
    command = [sys.executable, "-m", "sglang.launch_server", *contract.sglang_server_args(checkpoint, device, port)]
    # A session of its own, so that stopping it stops SGLang's scheduler processes too.
    return subprocess.Popen(command, env={**os.environ, **contract.sglang_environment(device)}, start_new_session=True)


def wait_healthy(url: str, server: subprocess.Popen, timeout_s: float = 600) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if server.poll() is not None:
            sys.exit(f"SGLang exited with {server.returncode} before it was healthy")
        try:
            with urllib.request.urlopen(f"{url}/health", timeout=5) as reply:
                if reply.status == 200:
                    return
        except OSError:
            time.sleep(0.5)
    sys.exit(f"SGLang was not healthy within {timeout_s} s")


def generate(url: str, prompt: list[int]) -> dict:
    body = {"input_ids": prompt, "sampling_params": SAMPLING, "return_logprob": True}
    request = urllib.request.Request(f"{url}/generate", json.dumps(body).encode(), {"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=300) as reply:
        out = json.loads(reply.read())
    logprobs = [lp for lp, _token, _text in out["meta_info"]["output_token_logprobs"]]
    return {
        "prompt": prompt,
        "response": out["output_ids"],
        "logprobs": logprobs,
        "temperature": SAMPLING["temperature"],
        "sampled_by": "sglang.launch_server",
    }


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main() -> None:
    checkpoint, samples_file, *overrides = sys.argv[1:]
    cfg = api.compose([f"model.checkpoint={checkpoint}", *overrides])
    if isinstance(cfg, list):
        sys.exit("\n".join(map(str, cfg)))
    contract = api.Contract(cfg)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    port = free_port()
    server = serve(contract, checkpoint, device, port)
    try:
        wait_healthy(f"http://127.0.0.1:{port}", server)
        sample = generate(f"http://127.0.0.1:{port}", PROMPT)
    finally:
        server.terminate()  # SGLang stops its scheduler processes itself
        try:
            server.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(server.pid, signal.SIGKILL)
            server.wait()
    Path(samples_file).write_text(json.dumps([sample]))
    print(f"{contract.name}: {len(sample['response'])} tokens sampled by released SGLang")


if __name__ == "__main__":
    main()
