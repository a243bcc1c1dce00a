"""`run(cfg, run_dir)`: the testable body behind `python -m tonpolicy`.

Validate first (every error at once, nothing started), then write the resolved config and the
launch plan into the run directory, then dispatch on `cfg.mode`.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

from omegaconf import OmegaConf

from tonpolicy.config.schema import Config
from tonpolicy.files import write_atomic
from tonpolicy.launch.plan import launch_plan, launch_script, resolve_device
from tonpolicy.loop.exit_codes import EXIT_OK
from tonpolicy.validation.validate import ConfigError, ConfigIssue, validate

log = logging.getLogger(__name__)


def write_plan(cfg: Config, run_dir: Path) -> dict:
    run_dir.mkdir(parents=True, exist_ok=True)
    write_atomic(run_dir / "resolved_config.yaml", OmegaConf.to_yaml(OmegaConf.structured(cfg)))
    plan = launch_plan(cfg, run_dir)
    write_atomic(run_dir / "launch_plan.json", json.dumps(plan, indent=2) + "\n")
    write_atomic(run_dir / "launch.sh", launch_script(plan), mode=0o755)
    return plan


def _check_data(cfg: Config) -> None:
    """The training and held-out data read and tokenized as the trainer will, before anything starts."""
    import tempfile

    from tonpolicy.model.tokenizer import load_text_tokenizer, save_tokenizer
    from tonpolicy.rl.prompt_data import DataError, load_prompt_data

    with tempfile.TemporaryDirectory() as tmp:
        if cfg.model.checkpoint is None:  # the run's init checkpoint will carry this tokenizer
            save_tokenizer(tmp, cfg.model.vocab_size)
            if cfg.model.tokenizer:
                from tonpolicy.launch.init_checkpoint import write_tokenizer

                write_tokenizer(cfg.model.tokenizer, Path(tmp))
        tokenizer = load_text_tokenizer(cfg.model.checkpoint or tmp)
        for key, files in (("data.train_files", cfg.data.train_files), ("data.val_files", cfg.data.val_files)):
            if not files:
                continue
            try:
                data = load_prompt_data(cfg, tokenizer, files)
            except DataError as exc:
                raise ConfigError([ConfigIssue(key, files, str(exc))]) from exc
            if data.dropped:
                log.warning(
                    f"tonpolicy: {key}: {data.dropped} of {data.dropped + len(data.rows)} prompts are longer than "
                    f"experiment.max_prompt_len={cfg.experiment.max_prompt_len} tokens: left out"
                )


def _check_task_vocabulary(cfg: Config) -> None:
    """A built-in task writes its prompts in the tiny model's word ids: on a checkpoint whose tokenizer
    reads those ids as other text the run would train on noise, so it is refused before start."""
    from tonpolicy.model.tokenizer import load_tokenizer, task_words_read_otherwise

    tokenizer = load_tokenizer(cfg.model.checkpoint)
    wrong = task_words_read_otherwise(tokenizer) if tokenizer is not None else []
    if wrong:
        reason = (
            f"a built-in task's prompts are ids of the tiny model's word vocabulary, but model.checkpoint="
            f"{cfg.model.checkpoint}'s tokenizer reads them otherwise ({'; '.join(wrong[:3])}): give your "
            "prompts with data.train_files and a reward.function"
        )
        raise ConfigError([ConfigIssue("task.name", cfg.task.name, reason)])


def _resumed(cfg: Config, run_dir: Path) -> Config:
    """checkpoint.resume: the servers and the trainer start from the saved step's weights (the trainer
    also from its optimizer state), and the records after that step are dropped (made again, the same)."""
    from dataclasses import replace

    from tonpolicy.loop.resume import drop_records_from, resume_dir

    path, reason = resume_dir(cfg, run_dir)
    if reason:
        raise ConfigError([ConfigIssue("checkpoint.resume", cfg.checkpoint.resume, reason)])
    if path is None:
        log.info(f"tonpolicy: no saved step to resume in {run_dir / 'checkpoints'}: starting afresh")
        return cfg
    completed = int(path.name.removeprefix("step_"))
    drop_records_from(run_dir, completed)
    log.info(f"tonpolicy: resuming after step {completed - 1} from {path}")
    return replace(cfg, model=replace(cfg.model, checkpoint=str(path)))


def run(cfg: Config, run_dir: Path, unknown: list[ConfigIssue] | None = None) -> int:
    """Return the process exit code. `unknown`: keys the composed config had that the schema lacks."""
    validate(cfg, unknown=unknown)
    if cfg.reward.function is not None and cfg.mode == "run":
        # The user's reward module imports here, before anything starts: a wrong path fails in seconds.
        from tonpolicy.rl.user_reward import RewardError, load_function

        try:
            load_function(cfg.reward.function)
        except RewardError as exc:
            raise ConfigError(
                [ConfigIssue("reward.function", cfg.reward.function, str(exc).partition(": ")[2])]
            ) from exc
    if (cfg.data.train_files or cfg.data.val_files) and cfg.mode == "run":
        _check_data(cfg)
    if not cfg.data.train_files and cfg.model.checkpoint is not None and cfg.mode == "run":
        _check_task_vocabulary(cfg)
    if cfg.mode in ("run", "align") and resolve_device(cfg) == "cpu":
        # This host's invariances at the job's shapes, on a sound config, before anything starts.
        from tonpolicy.contract.host import host_problems

        problems = host_problems(cfg.model, cfg.contract)
        if problems:
            raise ConfigError([ConfigIssue("contract.kernels", cfg.contract.kernels, line) for line in problems])
    if cfg.mode == "run" and cfg.checkpoint.resume is not None:
        cfg = _resumed(cfg, run_dir)
    if cfg.mode == "run":  # which node this launcher is (a scheduler's task, $NODE_RANK, ...)
        from tonpolicy.launch.nodes import node_dir, place, scheduler_task

        cfg = place(cfg, scheduler_task())
        run_dir = node_dir(cfg, run_dir)
    plan = write_plan(cfg, run_dir)
    if cfg.mode == "plan":
        print(json.dumps(plan, indent=2))  # the command's result, asked for with mode=plan: stdout
        log.info(f"launch plan written to {run_dir / 'launch_plan.json'} and {run_dir / 'launch.sh'}")
        return EXIT_OK
    if cfg.mode == "run":
        from tonpolicy.launch.job import run_job

        return run_job(cfg, run_dir, plan)
    from tonpolicy.align.run import run_align

    return run_align(cfg, run_dir)
