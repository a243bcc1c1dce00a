"""W&B logging for one job: offline by default, one run per job, grouped by sweep."""

from __future__ import annotations

from dataclasses import asdict
from pathlib import Path
from typing import Any

from tonpolicy.config.names import layout_label
from tonpolicy.config.schema import Config
from tonpolicy.contract.identity import identity
from tonpolicy.version import build_info


class MetricsLogger:
    def __init__(self, cfg: Config, run_dir: Path, group: str | None = None) -> None:
        self.run = None
        if cfg.logger.backend != "wandb" or cfg.logger.mode == "disabled":
            return
        import wandb

        config = asdict(cfg)
        config["contract_identity"] = identity(cfg.contract).to_dict()
        config["tonpolicy"] = build_info()
        self.run = wandb.init(
            project=cfg.logger.project,
            entity=cfg.logger.entity,
            group=cfg.logger.group or group,
            name=f"{cfg.contract.name}-{layout_label(cfg.parallel)}-{run_dir.name}",
            job_type=cfg.mode,
            tags=[cfg.contract.name, layout_label(cfg.parallel), cfg.model.name, *cfg.logger.tags],
            mode=cfg.logger.mode,
            dir=str(run_dir),
            config=config,
            reinit="create_new",
        )

    def log(self, record: dict[str, Any]) -> None:
        if self.run is not None:
            self.run.log({k: v for k, v in record.items() if isinstance(v, int | float)}, step=record["step"])

    def log_samples(self, samples: dict[str, Any]) -> None:
        """A table of this step's samples (text when the checkpoint has a tokenizer)."""
        if self.run is None:
            return
        import wandb

        prompts = samples.get("prompt_texts") or [str(p) for p in samples["prompts"]]
        responses = samples.get("response_texts") or [str(r) for r in samples["responses"]]
        columns = ["step", "prompt", "response", "reward"]
        data = [[samples["step"], p, r, w] for p, r, w in zip(prompts, responses, samples["rewards"], strict=True)]
        if samples.get("turns"):  # a multi-turn task's: who said what, the environment's turns untrained
            columns.append("turns")
            for row, turns in zip(data, samples["turns"], strict=True):
                row.append(" | ".join(f"{t['who']}: {t.get('text', t['ids'])}" for t in turns))
        table = wandb.Table(columns=columns, data=data)
        self.run.log({"samples": table}, step=samples["step"])

    def finish(self, exit_code: int) -> None:
        if self.run is not None:
            self.run.finish(exit_code=exit_code)
