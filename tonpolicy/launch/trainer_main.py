"""Trainer ranks' entry point (`torchrun -m tonpolicy.launch.trainer_main --config ...`): reads the
arguments and the config, and runs `tonpolicy.loop.run.run_trainer` (the step loop)."""

from __future__ import annotations

import argparse
import json
import logging
import time
from pathlib import Path

from tonpolicy.config.compose import load_config
from tonpolicy.launch.rank_prefix import prefix_rank_output
from tonpolicy.log_setup import configure_process
from tonpolicy.loop.exit_codes import EXIT_SERVER_UNHEALTHY
from tonpolicy.process_exit import exit_now

log = logging.getLogger(__name__)

# Where the launcher writes the rollout's address ({url, replica_urls}) once it is healthy, in the run dir.
ROLLOUT_ADDRESS_FILE = "rollout_address.json"


def wait_for_address(path: Path, timeout_s: float) -> tuple[str, list[str]] | None:
    """The rollout's url and replica urls once the launcher has written them (atomically) to `path`;
    None after `timeout_s` (the launcher stops the trainer sooner when the rollout never gets healthy)."""
    deadline = time.monotonic() + timeout_s
    while not path.exists():
        if time.monotonic() > deadline:
            return None
        time.sleep(0.05)
    address = json.loads(path.read_text())
    return address["url"], address["replica_urls"]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--config", required=True)
    ap.add_argument("--run-dir", required=True)
    # The rollout's url, or @FILE: the launcher starts the trainer while the rollout starts, and writes
    # the address ({url, replica_urls}) there once every server is healthy.
    ap.add_argument("--server-url", required=True)
    ap.add_argument("--checkpoint", required=True)
    # A fleet (rollout.replicas > 1): --server-url is the router's, these the replicas' (comma-separated).
    ap.add_argument("--replica-urls", default="")
    args = ap.parse_args(argv)
    cfg = load_config(args.config)
    run_dir = Path(args.run_dir)

    from tonpolicy.launch.plan import resolve_device
    from tonpolicy.launch.wandb_log import WandbLogger
    from tonpolicy.loop.run import run_trainer
    from tonpolicy.trainer import worker  # noqa: F401 - Megatron's imports, while the rollout starts

    url, replica_urls = args.server_url, [u for u in args.replica_urls.split(",") if u]
    if url.startswith("@"):
        address = wait_for_address(Path(url[1:]), 2 * cfg.rollout.health_timeout_s + 60)
        if address is None:
            log.error(f"tonpolicy trainer: no rollout address in {url[1:]} (was the rollout started?)")
            return EXIT_SERVER_UNHEALTHY
        url, replica_urls = address
    return run_trainer(
        cfg,
        run_dir,
        url,
        args.checkpoint,
        resolve_device(cfg),
        new_logger=lambda: WandbLogger(cfg, run_dir, group=run_dir.parent.name),
        replica_urls=replica_urls,
    )


if __name__ == "__main__":
    # The verdict, records and W&B run are written and the process groups destroyed when main returns.
    prefix_rank_output()  # the ranks share one log: each line says whose it is
    configure_process()  # after the prefix: log records go through it
    exit_now(main())
