"""W&B logging for one job: offline by default, one run per job, grouped by sweep.

Settings follow wandb's own precedence: a value in the config wins, else W&B's environment (WANDB_MODE,
WANDB_PROJECT, WANDB_ENTITY, WANDB_DIR, ...) as wandb reads it, else offline into the run directory.
"""

from __future__ import annotations

import logging
import os
from dataclasses import asdict
from pathlib import Path
from typing import Any

from tonpolicy.config.names import layout_label
from tonpolicy.config.schema import Config
from tonpolicy.contract.identity import identity
from tonpolicy.launch.wandb_keys import NAMESPACES, split_record
from tonpolicy.loop.records import due
from tonpolicy.version import build_info

log = logging.getLogger(__name__)

DEFAULT_MODE = "offline"
DEFAULT_PROJECT = "tonpolicy"


def wandb_settings(cfg: Config, run_dir: Path, env: dict[str, str] | None = None) -> dict[str, Any]:
    """wandb.init's mode, project, entity and dir: the config's value, else the environment's, else ours."""
    env = dict(os.environ) if env is None else env
    lg = cfg.logger
    return {
        "mode": lg.mode or env.get("WANDB_MODE") or _disabled(env) or DEFAULT_MODE,
        "project": lg.project or env.get("WANDB_PROJECT") or DEFAULT_PROJECT,
        # None lets wandb read WANDB_ENTITY / WANDB_DIR itself
        "entity": lg.entity or None,
        "dir": None if env.get("WANDB_DIR") else str(run_dir),
    }


def _disabled(env: dict[str, str]) -> str | None:
    # wandb's older switch, still honoured by wandb itself
    return "disabled" if env.get("WANDB_DISABLED", "").lower() in ("true", "1", "yes") else None


def enabled(cfg: Config, env: dict[str, str] | None = None) -> bool:
    if cfg.logger.backend != "wandb":
        return False
    return wandb_settings(cfg, Path("."), env)["mode"] != "disabled"


class WandbLogger:
    """The step loop's metrics logger (loop.records.MetricsLogger) on W&B: records, samples tables, the run's end;
    nothing where logger.backend is not wandb or W&B is disabled."""

    def __init__(self, cfg: Config, run_dir: Path, group: str | None = None) -> None:
        self.run = None
        self.samples_every = cfg.logger.samples_every
        if not enabled(cfg):
            return
        import wandb

        config = asdict(cfg)
        config["contract_identity"] = identity(cfg.contract).to_dict()
        config["tonpolicy"] = build_info()
        self.run = wandb.init(
            group=cfg.logger.group or group,
            name=f"{cfg.contract.name}-{layout_label(cfg.parallel)}-{run_dir.name}",
            job_type=cfg.mode,
            tags=[cfg.contract.name, layout_label(cfg.parallel), cfg.model.name, *cfg.logger.tags],
            config=config,
            reinit="create_new",
            **wandb_settings(cfg, run_dir),
        )
        if self.run is not None:  # every panel's x axis is the training step, as verl and slime chart theirs
            self.run.define_metric("step")
            for ns in NAMESPACES:
                self.run.define_metric(f"{ns}/*", step_metric="step")
            self.run.define_metric("samples", step_metric="step")

    def log(self, record: dict[str, Any]) -> None:
        if self.run is None:
            return
        charted, summary = split_record(record)
        self.run.log({"step": record["step"], **charted}, step=record["step"])
        for key, value in summary.items():
            self.run.summary[key] = value

    def log_samples(self, samples: dict[str, Any]) -> None:
        """A table of this step's samples (text when the checkpoint has a tokenizer), every
        `logger.samples_every` steps (0: never)."""
        if self.run is None or not due(samples["step"], self.samples_every):
            return
        import wandb

        columns, data = samples_table(samples)
        self.run.log({"samples": wandb.Table(columns=columns, data=data)}, step=samples["step"])

    def sync_command(self) -> str | None:
        """What uploads an offline run later (None when the run is online or there is none)."""
        if self.run is None or self.run.settings.mode != "offline":
            return None
        return f"wandb sync {self.run.settings.sync_dir}"

    def finish(self, exit_code: int) -> None:
        if self.run is None:
            return
        sync = self.sync_command()
        self.run.finish(exit_code=exit_code)
        if sync:
            log.info("W&B offline run; to upload it: %s", sync)


def samples_table(samples: dict[str, Any]) -> tuple[list[str], list[list[Any]]]:
    """Columns and rows: prompt, response, reward and, where the record holds them, per token the
    rollout's logprob, the trainer's and their difference (what a parity user wants to inspect)."""
    prompts = samples.get("prompt_texts") or [str(p) for p in samples["prompts"]]
    responses = samples.get("response_texts") or [str(r) for r in samples["responses"]]
    columns = ["step", "prompt", "response", "reward"]
    data = [[samples["step"], p, r, w] for p, r, w in zip(prompts, responses, samples["rewards"], strict=True)]
    if samples.get("turns"):  # a multi-turn task's: who said what, the environment's turns untrained
        columns.append("turns")
        for row, turns in zip(data, samples["turns"], strict=True):
            row.append(" | ".join(f"{t['who']}: {t.get('text', t['ids'])}" for t in turns))
    if samples.get("rollout_logprobs") is not None:
        columns += ["rollout_logprobs", "trainer_logprobs", "logprob_diff"]
        trainer = samples.get("trainer_logprobs") or [None] * len(data)
        for row, rolled, trained in zip(data, samples["rollout_logprobs"], trainer, strict=True):
            diff = None if trained is None else [t - r for r, t in zip(rolled, trained, strict=True)]
            row += [_tokens(rolled), _tokens(trained), _tokens(diff)]
    return columns, data


def _tokens(values: list[float] | None) -> str:
    # repr keeps every float's exact value: an exact 0 difference reads 0.0, the smallest one does not
    return "" if values is None else " ".join(repr(float(v)) for v in values)
