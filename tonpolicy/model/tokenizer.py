"""The tiny model's tokenizer, in Hugging Face `tokenizers` format, saved beside config.json.

A word-level vocabulary over the model's ids: the task words (tonpolicy.rl.task.WORDS), the ten
digits at ids 10..19 (split one per token, so "3827" is four tokens), and a placeholder <tN> for every
other id. So prompts and responses read as text in samples.jsonl and W&B, and any HF loader
(AutoTokenizer, SGLang) can load the checkpoint's tokenizer.
"""

from __future__ import annotations

import json
from functools import cache
from pathlib import Path
from typing import Any

from tokenizers import Tokenizer, models, pre_tokenizers

from tonpolicy.rl.task import BOS, DIGIT0, EOS, PAD, WORDS

TOKENIZER_FILE = "tokenizer.json"


def build_tokenizer(vocab_size: int) -> Tokenizer:
    vocab = {f"<t{i}>": i for i in range(vocab_size)}
    for i, word in WORDS.items():
        vocab.pop(f"<t{i}>")
        vocab[word] = i
    for d in range(10):
        vocab.pop(f"<t{DIGIT0 + d}>")
        vocab[str(d)] = DIGIT0 + d
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token=WORDS[PAD]))
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.WhitespaceSplit(), pre_tokenizers.Digits(individual_digits=True)]
    )
    return tok


def save_tokenizer(path: str | Path, vocab_size: int) -> None:
    path = Path(path)
    build_tokenizer(vocab_size).save(str(path / TOKENIZER_FILE))
    (path / "tokenizer_config.json").write_text(
        json.dumps(
            {
                "tokenizer_class": "PreTrainedTokenizerFast",
                "bos_token": WORDS[BOS],
                "eos_token": WORDS[EOS],
                "pad_token": WORDS[PAD],
                "unk_token": WORDS[PAD],
                "model_max_length": 1 << 20,
            },
            indent=2,
        )
    )


def task_words_read_otherwise(tokenizer: Tokenizer) -> list[str]:
    """The built-in tasks' words and digits that `tokenizer` does not read as the ids the tasks write
    them with (empty for the tiny model's tokenizer: a real checkpoint's BPE reads the ids as other text)."""
    words = {**WORDS, **{DIGIT0 + d: str(d) for d in range(10)}}
    return [
        f"{word!r} is {tokenizer.token_to_id(word)}, the tasks' id {i}"
        for i, word in sorted(words.items())
        if tokenizer.token_to_id(word) != i
    ]


def load_tokenizer(path: str | Path) -> Tokenizer | None:
    """The checkpoint's tokenizer, or None when it ships none (e.g. a bare safetensors checkpoint)."""
    f = Path(path) / TOKENIZER_FILE
    return Tokenizer.from_file(str(f)) if f.exists() else None


class TextTokenizer:
    """A checkpoint's tokenizer as an HF loader (and so SGLang) uses it: encode, decode skipping the
    special tokens tokenizer_config.json names, its EOS, and its chat template (rendered with Jinja in
    a sandbox, as transformers does)."""

    def __init__(self, path: str | Path) -> None:
        path = Path(path)
        self.tokenizer = Tokenizer.from_file(str(path / TOKENIZER_FILE))
        config_file = path / "tokenizer_config.json"
        config = json.loads(config_file.read_text()) if config_file.exists() else {}
        self.special_tokens = {
            name: _token_text(config.get(name)) for name in ("bos_token", "eos_token", "pad_token", "unk_token")
        }
        specials = [*self.special_tokens.values(), *map(_token_text, config.get("additional_special_tokens") or [])]
        self.special_ids = {i for i in map(self.tokenizer.token_to_id, filter(None, specials)) if i is not None}
        eos = self.special_tokens["eos_token"]
        self.eos_token_id = self.tokenizer.token_to_id(eos) if eos else None
        self.stop_token_ids = _stop_token_ids(path, self.eos_token_id)
        template_file = path / "chat_template.jinja"
        self.chat_template: str | None = (
            template_file.read_text() if template_file.exists() else config.get("chat_template")
        )

    def encode(self, text: str) -> list[int]:
        return self.tokenizer.encode(text).ids

    def decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode([i for i in ids if i not in self.special_ids])

    def apply_chat_template(
        self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None = None, **kwargs: Any
    ) -> str:
        """The prompt text for chat `messages`, ending with the assistant's turn; `tools` (OpenAI's function
        specs) are the template's `tools`, as transformers passes them; `kwargs` are the template's too
        (transformers' chat_template_kwargs, e.g. Qwen3's enable_thinking)."""
        if self.chat_template is None:
            raise ValueError("the tokenizer has no chat template")
        return (
            chat_environment()
            .from_string(self.chat_template)
            .render(
                messages=messages,
                tools=tools,
                add_generation_prompt=True,
                **{k: v for k, v in self.special_tokens.items() if v is not None},
                **kwargs,
            )
        )


@cache
def chat_environment() -> Any:
    """A sandboxed Jinja environment with transformers' chat-template semantics, so a prompt renders here
    as `apply_chat_template` (and SGLang, which calls it) renders it: its `tojson` (key order kept, no
    HTML escaping, non-ASCII kept), loop controls, `{% generation %}` blocks, `raise_exception` and
    `strftime_now`."""
    from datetime import datetime

    import jinja2
    from jinja2.ext import Extension
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    class GenerationBlock(Extension):
        # transformers marks the assistant's tokens with it; a prompt renders its body as is
        tags = {"generation"}

        def parse(self, parser: Any) -> Any:
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            return jinja2.nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

        def _body(self, caller: Any) -> str:
            return caller()

    def raise_exception(message: str) -> None:
        raise jinja2.exceptions.TemplateError(message)

    def tojson(x: Any, ensure_ascii: bool = False, indent: Any = None, separators: Any = None, sort_keys: bool = False):
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[GenerationBlock, "jinja2.ext.loopcontrols"]
    )
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return env


def _stop_token_ids(path: Path, eos_token_id: int | None) -> tuple[int, ...]:
    """Where a response ends: the tokenizer's EOS and generation_config.json's eos_token_id (an id or a
    list: Qwen3's chat models also end at <|im_end|>), as SGLang and transformers' generate read them."""
    ids = {eos_token_id} if eos_token_id is not None else set()
    config_file = path / "generation_config.json"
    if config_file.exists():
        eos = json.loads(config_file.read_text()).get("eos_token_id")
        ids |= set(eos if isinstance(eos, list) else [eos] if isinstance(eos, int) else [])
    return tuple(sorted(ids))


def _token_text(token: Any) -> str | None:
    # tokenizer_config.json writes a special token as a string or as {"content": ...}
    return token.get("content") if isinstance(token, dict) else token


def load_text_tokenizer(path: str | Path | None) -> TextTokenizer | None:
    """The checkpoint's tokenizer, or None when there is no checkpoint or it ships no tokenizer."""
    if path is None or not (Path(path) / TOKENIZER_FILE).exists():
        return None
    return TextTokenizer(path)
