"""`rollout=sglang` with the triton kernel set: released SGLang serving tonpolicy's model package, decode
in CUDA graphs, each returned logprob against tonpolicy's full forward of the same kernels, fp32 bit
for bit. Run by experiments/gpu_check.sh; where SGLang is not importable it writes that it skipped.

Per dtype (bfloat16 and float32 on a GPU): a random-init checkpoint, the server started with the
command and environment tonpolicy's launch plan renders (`--cuda-graph-backend-decode full` etc.),
rounds of 1, 3 and 8 concurrent requests (graph buckets 1, 4 and 8: three of them padded) plus a
prompt whose prefix is in the radix cache; then the full forward of each prompt + response with the
triton set (exact zero expected) and with the plain kernels (the negative control: a mismatch). The
server log's CUDA-graph lines go into the JSON, so the report says whether decode was captured.

    python experiments/gpu/sglang_check.py --out DIR/gpu_sglang.json [--device cpu]

`--device cpu` runs the same on SGLang's CPU engine in Triton's interpreter (tiny: 1 layer, fp32, 3
tokens; graphs are a CUDA feature, so none there): how this script was tested without a GPU
(tests/sglang/test_sglang_triton.py is the CI form of that check).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))


def _skip(out: Path, why: str) -> None:
    report = {"sglang": {"ok": None, "skipped": why}}
    out.write_text(json.dumps(report, indent=2))
    print("gpu_sglang_check:", json.dumps(report), flush=True)


def _bits_differ(ours: Any, served: Any) -> tuple[int, float]:
    import torch

    return int((ours.view(torch.int32) != served.view(torch.int32)).sum()), float((ours - served).abs().max())


def check(dtype: str, device: str, work: Path, tokens: int) -> dict[str, Any]:
    import torch

    from tonpolicy.config.compose import compose_config
    from tonpolicy.config.model import ModelConfig
    from tonpolicy.contract.identity import identity
    from tonpolicy.kernels import get_kernels
    from tonpolicy.launch.plan import sglang_argv
    from tonpolicy.launch.sglang_env import server_environment
    from tonpolicy.model.checkpoint import init_state_dict, load_hf, save_hf
    from tonpolicy.model.qwen3 import Qwen3
    from tonpolicy.ports import free_port
    from tonpolicy.rollout.client import RolloutClient

    mcfg = ModelConfig(num_layers=1) if device == "cpu" else ModelConfig()
    ckpt = work / f"ckpt_{dtype}"
    save_hf(init_state_dict(mcfg, getattr(torch, dtype), 7), mcfg, ckpt)
    cfg = compose_config(
        [
            "rollout=sglang",
            "contract=qwen3_dense_triton_v1",
            f"contract.dtype={dtype}",
            f"trainer.device={device}",
            "rollout.max_running_requests=16",
        ]
    )
    port = free_port()
    argv = sglang_argv(cfg, str(ckpt), device, port)
    env = {**os.environ, **server_environment(cfg, device, identity(cfg.contract).fingerprint)}
    log_path = work / f"sglang_{dtype}.log"
    g = torch.Generator().manual_seed(0)
    shared = torch.randint(0, mcfg.vocab_size, (24,), generator=g).tolist()
    fresh = [torch.randint(0, mcfg.vocab_size, (5 + 3 * i,), generator=g).tolist() for i in range(12)]
    # Batch sizes 1, 3 and 8 (CUDA graph buckets 1, 4, 8), then one prompt extending a cached one.
    rounds = (
        [[shared[:16]], fresh[:3], fresh[3:11], [shared]] if device == "cuda" else [[shared[:16]], [fresh[0], shared]]
    )
    prompts, outs = [], []
    with open(log_path, "w") as log:
        proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, cwd=ROOT, env=env, start_new_session=True)
        try:
            client = RolloutClient(f"http://127.0.0.1:{port}", timeout_s=600)
            t0 = time.perf_counter()
            client.wait_healthy(600, process=proc)
            started_s = time.perf_counter() - t0
            reported = client.contract()
            t0 = time.perf_counter()
            for batch in rounds:
                params = [
                    {"max_new_tokens": tokens, "temperature": 0.8, "sampling_seed": len(prompts) + i}
                    for i in range(len(batch))
                ]
                outs += client.generate(batch, params)
                prompts += batch
            generate_s = time.perf_counter() - t0
        finally:
            proc.terminate()
            try:
                proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                proc.kill()
    graph_lines = [
        line.strip()[:300]
        for line in log_path.read_text(errors="replace").splitlines()
        if ("cuda graph" in line.lower() or "cuda_graph" in line.lower()) and "server_args=" not in line
    ]
    # SGLang's startup timings name the seconds spent capturing decode graphs (0.00: none captured).
    capture = [re.search(r"cuda_graph=\{[^}]*\bdecode=([0-9.]+)", line) for line in graph_lines]
    decode_capture_s = next((float(m.group(1)) for m in capture if m), None)
    cached = sum(1 for o in outs if o.get("cached_tokens"))
    _, sd = load_hf(str(ckpt))
    dt = getattr(torch, dtype)
    result: dict[str, Any] = {
        "argv": argv[3:],
        "server_start_s": round(started_s, 1),
        "generate_s": round(generate_s, 2),
        "runtime_kernels": reported and reported["runtime"]["kernels"].get("kernel_set"),
        "decode_graph_capture_s": decode_capture_s,
        "graph_log": graph_lines[-12:],
        "requests": len(outs),
        "cached_prefix_requests": cached,
    }
    for name in ("triton", "plain"):
        kern = get_kernels(name, attention_tile=64) if name == "triton" else get_kernels(name)
        model = Qwen3(mcfg, kern, dt, sd).to(device)
        bad, worst, total = 0, 0.0, 0
        with torch.no_grad():
            for prompt, out in zip(prompts, outs, strict=True):
                response = out["output_ids"]
                logits = model(torch.tensor(prompt + response, device=device))[len(prompt) - 1 : -1]
                ours = kern.logprobs(logits, torch.tensor(response, device=device), mcfg.vocab_size, 0.8).cpu()
                m, d = _bits_differ(ours, torch.tensor(out["output_logprobs"], dtype=torch.float32))
                bad, worst, total = bad + m, max(worst, d), total + len(response)
        result[name] = {"tokens": total, "mismatched": bad, "max_abs_diff": worst}
        del model
    result["ok"] = result["triton"]["mismatched"] == 0 and result["plain"]["mismatched"] > 0
    if device == "cuda":  # graphs on is part of the claim there
        result["ok"] = result["ok"] and bool(decode_capture_s)
    return result


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="gpu_sglang.json")
    ap.add_argument("--device", choices=("cuda", "cpu"), default=None)
    a = ap.parse_args()
    out = Path(a.out)
    # The server itself, not just the package (an argument-parser-only install has `sglang` too).
    probe = subprocess.run([sys.executable, "-c", "import sglang.srt.entrypoints.http_server"], capture_output=True)
    if probe.returncode != 0:
        _skip(out, f"SGLang's server is not importable by {sys.executable} on this machine")
        return
    import torch

    device = a.device or ("cuda" if torch.cuda.is_available() else "cpu")
    if device == "cpu":
        os.environ["TRITON_INTERPRET"] = "1"  # before Triton is imported; inherited by the server
    # On CPU SGLang runs from its own environment; the reference must run under the same interpreter.
    os.environ.setdefault("TONPOLICY_SGLANG_PYTHON", sys.executable)
    work = Path(tempfile.mkdtemp(prefix="gpu_sglang_"))
    dtypes = ("bfloat16", "float32") if device == "cuda" else ("float32",)
    report: dict[str, Any] = {"device": device, "torch": torch.__version__}
    if device == "cuda":
        report["gpu"] = torch.cuda.get_device_name()
    for dtype in dtypes:
        t = time.perf_counter()
        try:
            report[dtype] = check(dtype, device, work, 16 if device == "cuda" else 3)
        except Exception as e:  # noqa: BLE001 - the report says which dtype failed and why
            report[dtype] = {"ok": False, "error": repr(e)[-3000:]}
        report[dtype]["seconds"] = round(time.perf_counter() - t, 1)
        print(json.dumps({dtype: report[dtype]}, default=str)[:4000], flush=True)
    report["ok"] = all(report[d].get("ok") for d in dtypes)
    out.write_text(json.dumps({"sglang": report}, indent=2, default=str))
    print("gpu_sglang_check:", {d: report[d].get("ok") for d in dtypes}, "logs:", work, flush=True)


if __name__ == "__main__":
    main()
