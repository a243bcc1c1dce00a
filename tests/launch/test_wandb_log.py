"""The W&B boundary: namespaced keys, wandb's environment honoured, the samples table's per-token
logprobs and its cadence, and a real offline run (wandb itself) that charts only numbers by step."""

from __future__ import annotations

from pathlib import Path

import pytest

from tonpolicy.config.compose import compose_config
from tonpolicy.config.schema import Config
from tonpolicy.launch.wandb_keys import split_record, wandb_key
from tonpolicy.launch.wandb_log import WandbLogger, samples_table, wandb_settings
from tonpolicy.loop.records import due
from tonpolicy.validation.validate import ConfigError, validate

RECORD = {
    "step": 3,
    "tokens_scored": 96,
    "mismatched_tokens": 0,
    "max_abs_logprob_diff": 0.0,
    "exact": True,
    "gate": "passed",
    "reward_mean": 0.5,
    "grad_norm": 1.25,
    "rollout_s": 0.7,
    "step_s": 2.0,
    "rollout_tokens_per_s": 137.1,
    "peak_rss_mib": 900.0,
    "time": 1764943200.0,
    "eval/pass_rate": 0.25,
    "staleness": {"0": 96},
}


def test_keys_are_namespaced() -> None:
    assert wandb_key("mismatched_tokens") == "parity/mismatched_tokens"
    assert wandb_key("reward_mean") == "rollout/reward_mean"
    assert wandb_key("step_s") == "timing/step_s"
    assert wandb_key("train_tokens_per_s") == "perf/train_tokens_per_s"
    assert wandb_key("peak_rss_mib") == "perf/peak_rss_mib"
    assert wandb_key("grad_norm") == "train/grad_norm"
    assert wandb_key("eval/pass_rate") == "eval/pass_rate"


def test_booleans_strings_and_the_timestamp_are_not_charted() -> None:
    charted, summary = split_record(RECORD)
    assert all("/" in k for k in charted)
    assert "parity/exact" not in charted and summary["parity/exact"] is True
    assert summary["parity/gate"] == "passed"
    assert not any(k.endswith("time") or k.endswith("step") for k in charted)
    assert "train/staleness" not in charted and "train/staleness" not in summary
    assert charted["parity/mismatched_tokens"] == 0 and charted["perf/peak_rss_mib"] == 900.0


def _cfg(*overrides: str) -> Config:
    return compose_config(list(overrides))


def test_environment_is_honoured_and_the_config_wins(tmp_path: Path) -> None:
    env = {"WANDB_MODE": "online", "WANDB_PROJECT": "theirs", "WANDB_DIR": "/somewhere"}
    got = wandb_settings(_cfg(), tmp_path, env)
    assert (got["mode"], got["project"], got["dir"]) == ("online", "theirs", None)  # None: wandb reads WANDB_DIR
    got = wandb_settings(_cfg("logger.mode=disabled", "logger.project=mine"), tmp_path, env)
    assert (got["mode"], got["project"]) == ("disabled", "mine")
    got = wandb_settings(_cfg(), tmp_path, {})
    assert (got["mode"], got["project"], got["entity"], got["dir"]) == ("offline", "tonpolicy", None, str(tmp_path))
    assert wandb_settings(_cfg(), tmp_path, {"WANDB_DISABLED": "true"})["mode"] == "disabled"


def test_samples_every_is_validated() -> None:
    with pytest.raises(ConfigError, match="logger.samples_every"):
        validate(_cfg("logger.samples_every=-1"), check_hf=False)
    assert [s for s in range(7) if due(s, 3)] == [0, 3, 6]
    assert not any(due(s, 0) for s in range(4))


def test_samples_table_has_per_token_logprobs() -> None:
    samples = {
        "step": 1,
        "prompts": [[1, 2]],
        "responses": [[3, 4]],
        "rewards": [1.0],
        "rollout_logprobs": [[-0.5, -1.25]],
        "trainer_logprobs": [[-0.5, -1.0]],
    }
    columns, rows = samples_table(samples)
    row = dict(zip(columns, rows[0], strict=True))
    assert row["rollout_logprobs"] == "-0.5 -1.25"
    assert row["trainer_logprobs"] == "-0.5 -1.0"
    assert row["logprob_diff"] == "0.0 0.25"  # trainer - rollout
    columns, _ = samples_table({k: v for k, v in samples.items() if "logprobs" not in k})
    assert "logprob_diff" not in columns


def test_offline_run_charts_namespaced_numbers(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("WANDB_MODE", raising=False)  # nothing set: offline is the default
    # wandb puts its service's address into os.environ; setting it here first makes the monkeypatch
    # restore the environment afterwards, so later tests do not see a W&B variable the suite never set
    monkeypatch.setenv("WANDB_SERVICE", "")
    monkeypatch.delenv("WANDB_SERVICE")
    cfg = _cfg("logger.samples_every=2")
    logger = WandbLogger(cfg, tmp_path)
    assert logger.run is not None and logger.run.settings.mode == "offline"
    charted: list[dict] = []
    log = logger.run.log
    logger.run.log = lambda data, step=None: (charted.append(data), log(data, step=step))  # type: ignore[method-assign]
    logger.log(RECORD)
    assert charted[0]["step"] == 3 and charted[0]["parity/mismatched_tokens"] == 0
    assert not {"mismatched_tokens", "time", "parity/exact", "parity/gate"} & set(charted[0])
    assert logger.run.summary["parity/exact"] is True
    logger.log_samples({"step": 3, "prompts": [[1]], "responses": [[2]], "rewards": [0.0]})  # 3 % 2: not due
    assert len(charted) == 1
    sync = logger.sync_command()
    assert sync is not None and sync.startswith("wandb sync ") and str(tmp_path) in sync
    logger.finish(0)
