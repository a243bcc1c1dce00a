"""A job scored by the user's reward function (a file of theirs, named by reward.function): it sees the
decoded text, its rewards are the ones recorded, a call that raises is counted in the step record and
scores 0.0, and the run still holds exact zero. A job on the user's prompts (data.train_files): drawn in
the seeded order, each row's label and columns reach the reward function."""

from __future__ import annotations

import json
from pathlib import Path

from support.e2e_common import records, run_job, samples

from tonpolicy.model.tokenizer import load_tokenizer
from tonpolicy.rl.prompt_data import PromptData, Row

REWARD = """
def score(prompt, response, response_ids):
    assert isinstance(prompt, str) and isinstance(response, str)  # decoded by the checkpoint's tokenizer
    if response_ids[0] % 3 == 0:
        raise RuntimeError("the user's bug")
    return len(response.split()) / 10 + (response_ids[0] % 2)
"""


def _expected(response: list[int], text: str) -> float:
    return 0.0 if response[0] % 3 == 0 else len(text.split()) / 10 + response[0] % 2


def test_a_users_reward_function_scores_the_run(tmp_path: Path) -> None:
    (tmp_path / "my_reward.py").write_text(REWARD)
    proc, run_dir = run_job(tmp_path, "experiment.steps=2", f"reward.function={tmp_path / 'my_reward.py'}:score")
    assert proc.returncode == 0, proc.stderr[-3000:]
    recs, steps = records(run_dir), samples(run_dir)
    assert len(recs) == 2 and all(r["mismatched_tokens"] == 0 for r in recs)
    for rec, step in zip(recs, steps, strict=True):
        raised = sum(r[0] % 3 == 0 for r in step["responses"])
        assert rec["reward_errors"] == raised
        expected = [_expected(r, t) for r, t in zip(step["responses"], step["response_texts"], strict=True)]
        assert step["rewards"] == expected
    assert sum(r["reward_errors"] for r in recs) > 0, "the draw had no failing call: pick another rule"
    assert "the user's bug" in proc.stderr or "the user's bug" in (run_dir / "logs" / "trainer.log").read_text()


LABELLED = """
def exact(response, label, extra):
    assert extra == {"source": "mine"}, extra
    return float(response.split()[:1] == [label])
"""
ROWS = [{"prompt": f"first {d} :", "label": str(d % 2), "source": "mine"} for d in (3, 8, 5)]
VAL = [{"prompt": f"first {d} :", "label": str(d % 2), "source": "mine"} for d in (2, 7)]


def test_a_job_on_the_users_prompts_and_labels(tmp_path: Path) -> None:
    (tmp_path / "mine.py").write_text(LABELLED)
    (tmp_path / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in ROWS))
    (tmp_path / "val.jsonl").write_text("".join(json.dumps(r) + "\n" for r in VAL))
    proc, run_dir = run_job(
        tmp_path,
        "experiment.steps=2",
        f"data.train_files=[{tmp_path / 'train.jsonl'}]",
        f"data.val_files=[{tmp_path / 'val.jsonl'}]",
        "trainer.eval_every=1",
        f"reward.function={tmp_path / 'mine.py'}:exact",
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    recs, steps = records(run_dir), samples(run_dir)
    assert all(r["mismatched_tokens"] == 0 and r["reward_errors"] == 0 for r in recs) and len(recs) == 2
    order = PromptData([Row(r["prompt"]) for r in ROWS], str.split, str, max_len=99, seed=0, chat_template=False)
    for k, step in enumerate(steps):
        drawn = [ROWS[i]["prompt"] for i in order.draw(k, 2) for _ in range(4)]
        assert step["prompt_texts"] == drawn
        labels = [str(int(p.split()[1]) % 2) for p in step["prompt_texts"]]
        expected = [float(t.split()[:1] == [lab]) for t, lab in zip(step["response_texts"], labels, strict=True)]
        assert step["rewards"] == expected
    # Held-out prompts, greedily decoded after each step: the recorded rewards are the function's.
    evals = [json.loads(line) for line in (run_dir / "eval.jsonl").read_text().splitlines()]
    assert [e["step"] for e in evals] == [0, 1]
    tokenizer = load_tokenizer(run_dir / "checkpoints" / "init")
    for e in evals:
        texts = [tokenizer.decode(r, skip_special_tokens=True) for r in e["responses"]]
        assert e["rewards"] == [float(t.split()[:1] == [v["label"]]) for t, v in zip(texts, VAL, strict=True)]
        assert len(e["responses"]) == len(VAL) and e["reward_errors"] == 0
        assert e["reward_mean"] == sum(e["rewards"]) / len(VAL)
        assert e["pass_rate"] == sum(r > 0 for r in e["rewards"]) / len(VAL)
