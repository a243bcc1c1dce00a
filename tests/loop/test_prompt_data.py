"""Training prompts from the user's JSON Lines: every unreadable row is named (file, line, key) before
anything starts; prompts longer than experiment.max_prompt_len are left out and counted; chat messages
go through the checkpoint's chat template with its kwargs; the draw is a pure function of (seed,
epoch, position), so a step draws the same prompts whatever ran before it."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tonpolicy.app import run
from tonpolicy.config.compose import compose_config
from tonpolicy.model.tokenizer import load_text_tokenizer, save_tokenizer
from tonpolicy.rl.prompt_data import DataError, PromptData, Row, load_prompt_data, read_rows
from tonpolicy.validation.validate import ConfigError


def _jsonl(path: Path, rows: list[object]) -> str:
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return str(path)


def test_every_bad_row_is_named(tmp_path: Path) -> None:
    good = _jsonl(tmp_path / "good.jsonl", [{"prompt": "first 3 :", "label": "1", "source": "x"}])
    bad = _jsonl(tmp_path / "bad.jsonl", [{"prompt": "ok"}, "{not json", {"question": "no prompt"}, {"prompt": 7}])
    with pytest.raises(DataError) as e:
        read_rows([good, bad, str(tmp_path / "missing.jsonl")], "prompt", "label")
    text = str(e.value)
    assert f"{bad}:2: not JSON" in text and f"{bad}:3: no key data.prompt_key='prompt'" in text
    assert f"{bad}:4: 'prompt' must be a string or a list" in text and "missing.jsonl: no such file" in text
    (row,) = read_rows([good], "prompt", "label")
    assert row == Row("first 3 :", "1", {"source": "x"})


def test_the_draw_is_a_function_of_seed_epoch_and_position() -> None:
    rows = [Row(f"p{i}") for i in range(5)]
    data = PromptData(rows, lambda t: [1] * len(t), str, max_len=99, seed=3, chat_template=False)
    steps = [data.draw(s, 3) for s in range(4)]  # 12 positions: epochs 0, 1 and part of 2
    fresh = PromptData(rows, lambda t: [1] * len(t), str, max_len=99, seed=3, chat_template=False)
    assert fresh.draw(3, 3) == steps[3]  # step 3 alone draws what it drew after steps 0-2
    flat = [i for s in steps for i in s]
    assert sorted(flat[:5]) == list(range(5)) and sorted(flat[5:10]) == list(range(5))  # whole epochs
    other = PromptData(rows, lambda t: [1] * len(t), str, max_len=99, seed=4, chat_template=False)
    assert [other.draw(s, 3) for s in range(4)] != steps


def test_long_prompts_are_left_out_and_chat_messages_use_the_template(tmp_path: Path) -> None:
    save_tokenizer(tmp_path, 2003)
    (tmp_path / "chat_template.jinja").write_text(
        "{% for m in messages %}{{ m['content'] }} {% endfor %}{% if shout %}say{% endif %}"
    )
    messages = [{"role": "user", "content": "first 3 :"}]
    files = _jsonl(tmp_path / "d.jsonl", [{"prompt": messages}, {"prompt": "first 1 2 3 4 5 6 7 :"}])
    cfg = compose_config(
        ["experiment.max_prompt_len=5", f"data.train_files=[{files}]", "+data.chat_template_kwargs.shout=true"]
    )
    data = load_prompt_data(cfg, load_text_tokenizer(tmp_path))
    assert data.dropped == 1 and data.ids == [[5, 13, 4, 6]]  # "first 3 : say"


def test_data_is_checked_before_anything_starts(tmp_path: Path) -> None:
    bad = _jsonl(tmp_path / "bad.jsonl", [{"question": "x"}])
    with pytest.raises(ConfigError) as e:
        run(compose_config([f"data.train_files=[{bad}]", "reward.function=math:sqrt"]), tmp_path / "run")
    assert f"{bad}:1: no key data.prompt_key='prompt'" in str(e.value) and not (tmp_path / "run").exists()
    with pytest.raises(ConfigError) as e:
        run(compose_config([f"data.train_files=[{bad}]"]), tmp_path / "run")
    assert "data.train_files=" in str(e.value) and "needs reward.function" in str(e.value)


def test_parquet_rows_read_as_jsonl_rows_and_a_broken_file_is_named(tmp_path: Path) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    messages = [{"role": "user", "content": "first 3 :"}]
    pq.write_table(pa.Table.from_pylist([{"prompt": "say 4", "label": "4", "source": "a"}]), tmp_path / "s.parquet")
    pq.write_table(pa.Table.from_pylist([{"prompt": messages, "label": None}]), tmp_path / "chat.parquet")
    first, second = read_rows([str(tmp_path / "s.parquet"), str(tmp_path / "chat.parquet")], "prompt", "label")
    assert first == Row("say 4", "4", {"source": "a"}) and second.prompt == messages
    (tmp_path / "broken.parquet").write_bytes(b"PAR1 not really")
    pq.write_table(pa.Table.from_pylist([{"question": "x"}]), tmp_path / "nokey.parquet")
    with pytest.raises(DataError) as e:
        read_rows([str(tmp_path / "broken.parquet"), str(tmp_path / "nokey.parquet")], "prompt", None)
    assert "broken.parquet: not a Parquet file" in str(e.value)
    assert "nokey.parquet: row 1: no key data.prompt_key='prompt'" in str(e.value)


def test_responses_end_at_the_checkpoints_end_of_response_ids(tmp_path: Path) -> None:
    save_tokenizer(tmp_path, 2003)
    files = _jsonl(tmp_path / "d.jsonl", [{"prompt": "say 4"}])
    cfg = compose_config([f"data.train_files=[{files}]"])
    assert load_prompt_data(cfg, load_text_tokenizer(tmp_path)).stop_ids == (2,)  # the tokenizer's <eos>
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [7, 2]}))
    assert load_prompt_data(cfg, load_text_tokenizer(tmp_path)).stop_ids == (2, 7)  # as Qwen3's <|im_end|>


def test_a_built_in_task_on_a_tokenizer_that_reads_its_ids_otherwise_is_refused(tmp_path: Path) -> None:
    import torch
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    from tonpolicy.model.checkpoint import init_state_dict, save_hf
    from tonpolicy.model.tokenizer import build_tokenizer, task_words_read_otherwise

    cfg = compose_config([])
    ckpt = tmp_path / "ckpt"
    save_hf(init_state_dict(cfg.model, torch.bfloat16, 0), cfg.model, ckpt)
    assert task_words_read_otherwise(build_tokenizer(cfg.model.vocab_size)) == []  # the tiny model's: accepted
    bpe = Tokenizer(models.BPE(unk_token="<unk>"))
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel()
    bpe.train_from_iterator(["first say copy add call 0 1 2 3 4 5 6 7 8 9 : ="] * 50, trainers.BpeTrainer())
    bpe.save(str(ckpt / "tokenizer.json"))
    with pytest.raises(ConfigError) as e:
        run(compose_config([f"model.checkpoint={ckpt}"]), tmp_path / "run")
    assert "task.name='first_parity'" in str(e.value) and "data.train_files" in str(e.value)
    assert not (tmp_path / "run").exists()
