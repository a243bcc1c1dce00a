"""Weight sync per step, disk vs distributed, measured side by side against one embedded server.

    .venv/bin/python experiments/bench/bench_weight_sync.py [--models tiny,qwen3_0_6b] [--reps 3]

disk: the trainer writes an HF checkpoint (safetensors) and the server loads it
(`/update_weights_from_disk`), what `rollout.weight_sync=disk` does each step. distributed: the trainer
broadcasts the same tensors over a gloo group (`/begin_weight_update`,
`/update_weights_from_distributed`, `/end_weight_update`), what `rollout.weight_sync=distributed` does:
one broadcast per tensor (`rollout.weight_sync_bucket_mb=0`) and flat byte buckets (`--bucket-mb`,
default 32 as the config's; SGLang's "flattened_bucket"). All end with the server serving the new weights; this process
plays the trainer's rank 0. Prints seconds per sync (median of --reps) and the ratios, for each model
shape (bf16 weights).
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from tonpolicy.config.compose import compose_config
from tonpolicy.config.model import ModelConfig
from tonpolicy.loop.weight_sync import WeightPusher
from tonpolicy.model.checkpoint import init_state_dict, save_hf
from tonpolicy.rollout.client import RolloutClient

IDENTITY = ["--contract-name", "bench", "--contract-version", "1", "--contract-fingerprint", "0" * 64]


def profile(name: str) -> ModelConfig:
    if name == "tiny":
        return ModelConfig()
    model = compose_config([f"model={name}"]).model
    return ModelConfig(**{k: getattr(model, k) for k in ModelConfig.__dataclass_fields__ if hasattr(model, k)})


def timed(fn, reps: int) -> float:  # noqa: ANN001
    times = []
    for i in range(reps):
        t0 = time.perf_counter()
        fn(i)
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def bench(name: str, reps: int, bucket_mb: int, tmp: Path) -> tuple[float, float, float, float]:
    cfg = profile(name)
    sd = init_state_dict(cfg, torch.bfloat16, 1)
    gigabytes = sum(t.numel() * t.element_size() for t in sd.values()) / 1e9
    save_hf(sd, cfg, tmp / "init")
    port_file = tmp / "port"
    proc = subprocess.Popen(
        [sys.executable, "-m", "tonpolicy.rollout.server", "--model-path", str(tmp / "init"), "--dtype", "bfloat16",
         "--skip-tokenizer-init", "--port-file", str(port_file), *IDENTITY],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )  # fmt: skip
    try:
        while not port_file.exists():
            time.sleep(0.1)
        client = RolloutClient(f"http://127.0.0.1:{int(port_file.read_text())}", timeout_s=1800)
        client.wait_healthy(1800, process=proc)

        def disk(i: int) -> None:
            path = tmp / f"step_{i}"
            save_hf(sd, cfg, path)
            client.update_weights_from_disk(str(path), weight_version=f"disk_{i}")

        def distributed(bucket_bytes: int) -> float:
            pusher = WeightPusher(client, engine_ranks=1, backend="gloo", timeout_s=1800, bucket_bytes=bucket_bytes)
            try:
                return timed(lambda i: pusher.push(sd, weight_version=f"dist_{bucket_bytes}_{i}"), reps)
            finally:
                pusher.close()

        return gigabytes, timed(disk, reps), distributed(0), distributed(bucket_mb << 20)
    finally:
        proc.terminate()
        proc.wait(timeout=60)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", default="tiny,qwen3_0_6b")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--bucket-mb", type=int, default=32, help="bucket size of the bucketed mode (MiB)")
    args = ap.parse_args()
    print(
        "| model | weights (GB, bf16) | disk s/sync | distributed per tensor s/sync | distributed "
        f"{args.bucket_mb} MiB buckets s/sync | disk / per tensor | disk / buckets |"
    )
    print("|---|---|---|---|---|---|---|")
    for name in args.models.split(","):
        with tempfile.TemporaryDirectory() as tmp:
            gb, disk, per_tensor, bucketed = bench(name, args.reps, args.bucket_mb, Path(tmp))
        print(
            f"| {name} | {gb:.3f} | {disk:.3f} | {per_tensor:.3f} | {bucketed:.3f} | {disk / per_tensor:.2f}x | "
            f"{disk / bucketed:.2f}x |",
            flush=True,
        )


if __name__ == "__main__":
    main()
