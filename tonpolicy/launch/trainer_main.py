"""Trainer ranks' entry point (`torchrun -m tonpolicy.launch.trainer_main --config ...`): reads the
arguments and the config, and runs `tonpolicy.loop.run.run_trainer` (the step loop)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from tonpolicy.config.compose import load_config


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--config", required=True)
    ap.add_argument("--run-dir", required=True)
    ap.add_argument("--server-url", required=True)
    ap.add_argument("--checkpoint", required=True)
    # A fleet (rollout.replicas > 1): --server-url is the router's, these the replicas' (comma-separated).
    ap.add_argument("--replica-urls", default="")
    args = ap.parse_args(argv)
    cfg = load_config(args.config)
    run_dir = Path(args.run_dir)

    from tonpolicy.launch.plan import resolve_device
    from tonpolicy.launch.wandb_log import MetricsLogger
    from tonpolicy.loop.run import run_trainer

    return run_trainer(
        cfg,
        run_dir,
        args.server_url,
        args.checkpoint,
        resolve_device(cfg),
        new_logger=lambda: MetricsLogger(cfg, run_dir, group=run_dir.parent.name),
        replica_urls=[u for u in args.replica_urls.split(",") if u],
    )


if __name__ == "__main__":
    sys.exit(main())
