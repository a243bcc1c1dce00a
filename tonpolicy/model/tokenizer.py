"""The tiny model's tokenizer, in Hugging Face `tokenizers` format, saved beside config.json.

A word-level vocabulary over the model's ids: the task words (tonpolicy.launch.task.WORDS), the ten
digits at ids 10..19 (split one per token, so "3827" is four tokens), and a placeholder <tN> for every
other id. So prompts and responses read as text in samples.jsonl and W&B, and any HF loader
(AutoTokenizer, SGLang) can load the checkpoint's tokenizer.
"""

from __future__ import annotations

import json
from pathlib import Path

from tokenizers import Tokenizer, models, pre_tokenizers

from tonpolicy.launch.task import BOS, DIGIT0, EOS, PAD, WORDS

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
    tok.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.WhitespaceSplit(),
                                                 pre_tokenizers.Digits(individual_digits=True)])
    return tok


def save_tokenizer(path: str | Path, vocab_size: int) -> None:
    path = Path(path)
    build_tokenizer(vocab_size).save(str(path / TOKENIZER_FILE))
    (path / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "bos_token": WORDS[BOS], "eos_token": WORDS[EOS],
        "pad_token": WORDS[PAD], "unk_token": WORDS[PAD], "model_max_length": 1 << 20,
    }, indent=2))


def load_tokenizer(path: str | Path) -> Tokenizer | None:
    """The checkpoint's tokenizer, or None when it ships none (e.g. a bare safetensors checkpoint)."""
    f = Path(path) / TOKENIZER_FILE
    return Tokenizer.from_file(str(f)) if f.exists() else None
