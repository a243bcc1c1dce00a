"""Training prompts from the user's JSON Lines or Parquet files (`data.train_files`), instead of a
built-in task's.

Each row (a JSONL line's object, a Parquet table's row) maps column names to values: `data.prompt_key`
holds the prompt (a string, or a list of chat messages rendered by the checkpoint's chat template),
`data.label_key` (optional) the label the reward function receives; every other column reaches it as
`extra`. Prompts longer than experiment.max_prompt_len tokens are left out (counted). The order is a
pure function of (seed, epoch, position): epoch e is the rows in a permutation drawn from a generator
seeded with (seed, e), so step k always draws the same prompts, whatever ran before it.
"""

from __future__ import annotations

import json
import random
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from tonpolicy.config.schema import Config


class DataError(ValueError):
    """A data file that cannot be read as the config says; names the file, the line and the key."""


@dataclass(frozen=True)
class Row:
    prompt: str | list[dict[str, Any]]
    label: Any = None
    extra: dict[str, Any] = field(default_factory=dict)


def read_rows(files: list[str], prompt_key: str, label_key: str | None) -> list[Row]:
    """Every row of every file, in order; raises DataError listing every problem found (at most 20)."""
    rows, problems = [], []
    for name in files:
        path = Path(name)
        if not path.is_file():
            problems.append(f"{name}: no such file")
            continue
        if path.suffix not in READERS:
            problems.append(f"{name}: must be JSON Lines (.jsonl) or Parquet (.parquet)")
            continue
        for where, obj in READERS[path.suffix](path, problems):
            if not isinstance(obj, dict) or prompt_key not in obj:
                problems.append(f"{where}: no key data.prompt_key={prompt_key!r}")
                continue
            prompt = obj.pop(prompt_key)
            if not (isinstance(prompt, str) or _is_messages(prompt)):
                problems.append(f"{where}: {prompt_key!r} must be a string or a list of {{role, content}} messages")
                continue
            label = obj.pop(label_key, None) if label_key else None
            rows.append(Row(prompt, label, obj))
    if not rows and not problems:
        problems.append(f"{files}: no rows")
    if problems:
        more = f"\n  ... and {len(problems) - 20} more" if len(problems) > 20 else ""
        raise DataError("\n  ".join(["the data cannot be used:", *problems[:20]]) + more)
    return rows


def _jsonl_rows(path: Path, problems: list[str]) -> Iterator[tuple[str, Any]]:
    for n, line in enumerate(path.read_text().splitlines(), start=1):
        if not line.strip():
            continue
        try:
            yield f"{path}:{n}", json.loads(line)
        except ValueError as exc:
            problems.append(f"{path}:{n}: not JSON ({exc})")


def _parquet_rows(path: Path, problems: list[str]) -> Iterator[tuple[str, Any]]:
    try:
        import pyarrow.parquet as pq
    except ImportError:
        problems.append(f"{path}: reading Parquet needs pyarrow: pip install 'tonpolicy[data]'")
        return
    try:
        table = pq.read_table(path)
    except Exception as exc:  # noqa: BLE001 - pyarrow raises several kinds for a broken file
        problems.append(f"{path}: not a Parquet file ({exc})")
        return
    for n, obj in enumerate(table.to_pylist(), start=1):
        yield f"{path}: row {n}", obj


READERS = {".jsonl": _jsonl_rows, ".json": _jsonl_rows, ".parquet": _parquet_rows}


def _is_messages(prompt: Any) -> bool:
    return isinstance(prompt, list) and all(isinstance(m, dict) and "role" in m and "content" in m for m in prompt)


class PromptData:
    """The rows tokenized once (`encode`: text -> ids; `render`: messages -> text, the chat template),
    those within `max_len` tokens kept, drawn `per_step` at a time in the seeded order."""

    def __init__(
        self,
        rows: list[Row],
        encode: Any,
        render: Any,
        *,
        max_len: int,
        seed: int,
        chat_template: bool,
        stop_ids: tuple[int, ...] = (),
    ) -> None:
        self.stop_ids = stop_ids  # the checkpoint's end-of-response ids, not the built-in tasks' <eos>
        self.rows: list[Row] = []
        self.ids: list[list[int]] = []
        for row in rows:
            text = row.prompt
            if not isinstance(text, str) or chat_template:
                messages = text if not isinstance(text, str) else [{"role": "user", "content": text}]
                text = render(messages)
            ids = encode(text)
            if 0 < len(ids) <= max_len:
                self.rows.append(row)
                self.ids.append(ids)
        self.dropped = len(rows) - len(self.rows)
        if not self.rows:
            raise DataError(f"no prompt of the training data fits experiment.max_prompt_len={max_len} tokens")
        self.seed = seed
        self._orders: dict[int, list[int]] = {}

    def order(self, epoch: int) -> list[int]:
        if epoch not in self._orders:
            indices = list(range(len(self.rows)))
            random.Random(self.seed * 1_000_003 + epoch).shuffle(indices)
            self._orders = {epoch: indices}  # steps move forward: one epoch's order at a time
        return self._orders[epoch]

    def draw(self, step: int, per_step: int) -> list[int]:
        """Row indices of step `step`: positions step*per_step ... of the concatenated epochs."""
        out, n = [], len(self.rows)
        for position in range(step * per_step, (step + 1) * per_step):
            epoch, k = divmod(position, n)
            out.append(self.order(epoch)[k])
        return out


def load_prompt_data(cfg: Config, tokenizer: Any, files: list[str] | None = None) -> PromptData:
    """The config's training data (or `files`: the held-out ones) through the checkpoint's `tokenizer`
    (tonpolicy.model.tokenizer.TextTokenizer: its encode and chat template; None when it has none)."""
    d = cfg.data
    rows = read_rows(d.train_files if files is None else files, d.prompt_key, d.label_key)
    if tokenizer is None:
        raise DataError("the model's checkpoint has no tokenizer.json: prompts need the model's tokenizer")

    def render(messages: list[dict[str, Any]]) -> str:
        if tokenizer.chat_template is None:
            raise DataError("the model's tokenizer has no chat template (data.chat_template, chat prompts)")
        return tokenizer.apply_chat_template(messages, **d.chat_template_kwargs)

    e = cfg.experiment
    return PromptData(
        rows,
        tokenizer.encode,
        render,
        max_len=e.max_prompt_len,
        seed=e.seed,
        chat_template=d.chat_template,
        stop_ids=tokenizer.stop_token_ids,
    )
