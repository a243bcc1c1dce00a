"""Rules of `model.tokenizer`, the tokenizer a random-init checkpoint carries. Called with validate's
`bad(key, rule)` reporter (through tonpolicy.validation.task_rules, whose tasks it concerns)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from tonpolicy.config.schema import Config


def check_model_tokenizer(cfg: Config, bad: Any) -> None:
    m = cfg.model
    if not m.tokenizer:
        return
    if m.checkpoint:
        bad("model.tokenizer", "is for a random init only: model.checkpoint carries its own tokenizer")
        return
    path = Path(m.tokenizer) / "tokenizer.json"
    if not path.is_file():
        bad("model.tokenizer", "must be a folder with a tokenizer.json (Hugging Face tokenizers format)")
        return
    from tokenizers import Tokenizer

    try:
        size = Tokenizer.from_file(str(path)).get_vocab_size(with_added_tokens=True)
    except Exception as exc:  # noqa: BLE001 - tokenizers raises its own exception kinds for a bad file
        bad("model.tokenizer", f"{path} is not a tokenizer the tokenizers library reads ({exc})")
        return
    if size > m.vocab_size:
        bad("model.tokenizer", f"has {size} tokens, more than model.vocab_size={m.vocab_size} embeds")
    if not cfg.data.train_files:
        bad(
            "model.tokenizer",
            f"a built-in task (task.name={cfg.task.name}) writes its prompts in the tiny model's word ids, "
            "which this tokenizer reads as other text: give your prompts with data.train_files",
        )
