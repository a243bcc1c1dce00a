"""The real-vocabulary example (experiment=bpe_chat): chat prompts from the shipped JSONL, a byte-level BPE
with a Qwen3-style chat template carried by the random-init checkpoint (model.tokenizer), the built-in
choice_match reward on the decoded answer; a short job holds exact zero and its records read as text."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from support.e2e_common import records, run_job, samples

from tonpolicy.config.assets import ASSETS, asset_path
from tonpolicy.config.compose import compose_config
from tonpolicy.launch.init_checkpoint import write_init_checkpoint
from tonpolicy.model.tokenizer import TextTokenizer
from tonpolicy.rl.rewards import choice_match
from tonpolicy.validation.validate import ConfigError, validate

ROOT = Path(__file__).resolve().parents[2]
TOKENIZER = ASSETS / "bpe_chat" / "tokenizer"


def test_the_shipped_files_are_what_the_script_makes() -> None:
    script = ROOT / "examples" / "bpe_chat" / "make_assets.py"
    proc = subprocess.run([sys.executable, str(script), "--check"], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr


def test_the_answers_are_one_token_and_the_prompt_is_qwen3_chat() -> None:
    tok = TextTokenizer(TOKENIZER)
    text = tok.apply_chat_template([{"role": "user", "content": "Is 37 even or odd?"}])
    assert text == "<|im_start|>user\nIs 37 even or odd?<|im_end|>\n<|im_start|>assistant\n"
    assert [len(tok.encode(w)) for w in ("even", "odd")] == [1, 1]
    assert tok.decode(tok.encode("odd<|im_end|>")) == "odd"  # the EOS is special: left out of the text
    assert tok.stop_token_ids == tuple(sorted({tok.tokenizer.token_to_id("<|im_end|>"), 0}))
    assert compose_config(["experiment=bpe_chat"]).model.vocab_size == tok.tokenizer.get_vocab_size()


def test_asset_paths_stay_inside_the_package() -> None:
    assert asset_path("bpe_chat/train.jsonl") == str(ASSETS / "bpe_chat" / "train.jsonl")
    with pytest.raises(ValueError, match="inside"):
        asset_path("../app.py")
    with pytest.raises(ValueError, match="no bpe_chat/nothing.jsonl"):
        asset_path("bpe_chat/nothing.jsonl")


@pytest.mark.parametrize(
    ("overrides", "rule"),
    [
        (["model.vocab_size=300"], "has 353 tokens, more than model.vocab_size=300"),
        (["model.tokenizer=/nonexistent"], "must be a folder with a tokenizer.json"),
        (["model.checkpoint=/somewhere"], "is for a random init only"),
        (["data.train_files=[]"], "a built-in task (task.name=first_parity) writes its prompts"),
    ],
)
def test_model_tokenizer_rules(overrides: list[str], rule: str) -> None:
    with pytest.raises(ConfigError) as err:
        validate(compose_config(["experiment=bpe_chat", "mode=plan", *overrides]), check_hf=False)
    assert any(i.key == "model.tokenizer" and rule in i.rule for i in err.value.issues), err.value


def test_the_example_itself_is_valid() -> None:  # the rules' control
    validate(compose_config(["experiment=bpe_chat", "mode=plan"]))


def test_the_init_checkpoint_carries_the_bpe_tokenizer(tmp_path: Path) -> None:
    cfg = compose_config(["experiment=bpe_chat"])
    out = write_init_checkpoint(cfg, tmp_path / "init")
    names = {"tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "generation_config.json"}
    for name in names:
        assert (out / name).read_bytes() == (TOKENIZER / name).read_bytes(), name
        assert (out / name).stat().st_mode & 0o777 == 0o644
    assert json.loads((out / "config.json").read_text())["vocab_size"] == 353
    control = write_init_checkpoint(compose_config(["experiment=bpe_chat", "model.tokenizer=null"]), tmp_path / "c")
    assert (control / "tokenizer.json").read_bytes() != (TOKENIZER / "tokenizer.json").read_bytes()


def test_a_short_bpe_chat_job_holds_exact_zero(tmp_path: Path) -> None:
    proc, run_dir = run_job(
        tmp_path,
        "experiment=bpe_chat",
        "experiment.steps=2",
        "experiment.prompts_per_step=2",
        "experiment.max_new_tokens=3",
        "experiment.max_prompt_len=24",
        "experiment.top_k=16",
        "task.graded_tokens=1",
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    recs, steps = records(run_dir), samples(run_dir)
    assert len(recs) == 2 and all(r["mismatched_tokens"] == 0 and r["reward_errors"] == 0 for r in recs)
    assert json.loads((run_dir / "summary.json").read_text())["task"] == "data train.jsonl"  # not the task's
    rows = {json.dumps(r.pop("prompt")): r for r in map(json.loads, (ASSETS / "bpe_chat" / "train.jsonl").open())}
    tok = TextTokenizer(run_dir / "checkpoints" / "init")
    for step in steps:
        for prompt, response, reward in zip(step["prompt_texts"], step["responses"], step["rewards"], strict=True):
            question = prompt.removeprefix("<|im_start|>user\n").partition("<|im_end|>")[0]
            row = rows[json.dumps([{"role": "user", "content": question}])]
            assert prompt == tok.apply_chat_template([{"role": "user", "content": question}])
            # the reward read the answer as text, special tokens (the EOS) left out, and the row's choices
            assert reward == choice_match(tok.decode(response), row["label"], {"choices": row["choices"]})
