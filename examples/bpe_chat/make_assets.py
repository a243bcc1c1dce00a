"""Write the bpe_chat example's data and tokenizer into tonpolicy/assets/bpe_chat/ (committed; run again
to check that the files are what this script makes: `python examples/bpe_chat/make_assets.py --check`).

- train.jsonl / val.jsonl: chat questions "Is 7 even or odd?" about the ten one-digit numbers, with the
  label "even" or "odd" and the allowed answers `choices` (read by the choice_match reward); val.jsonl
  holds the same ten questions (one digit leaves none to hold out);
- tokenizer/: a byte-level BPE (the Qwen family's kind) trained with the `tokenizers` library on a small
  generated English text about numbers, with Qwen3's special tokens and a Qwen3-style chat template, so
  the answers "even" and "odd" are one token each where a response starts.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import tempfile
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

ROOT = Path(__file__).resolve().parents[2]
OUT = ROOT / "tonpolicy" / "assets" / "bpe_chat"
VOCAB_SIZE = 384
SPECIAL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<think>", "</think>"]
SEED = 0
# Qwen3's template, cut to what a text chat uses (no tools): user/assistant/system turns, and the empty
# think block that enable_thinking=false puts before the answer.
CHAT_TEMPLATE = """{%- for message in messages %}
{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}
{%- endfor %}
{%- if add_generation_prompt %}
{{- '<|im_start|>assistant\\n' }}
{%- if enable_thinking is defined and enable_thinking is false %}
{{- '<think>\\n\\n</think>\\n\\n' }}
{%- endif %}
{%- endif %}
"""
WORDS = ["zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine"]


def question(n: int) -> str:
    return f"Is {n} even or odd?"


def answer(n: int) -> str:
    return "odd" if n % 2 else "even"


def rows(numbers: list[int]) -> list[dict]:
    return [
        {"prompt": [{"role": "user", "content": question(n)}], "label": answer(n), "choices": ["even", "odd"]}
        for n in numbers
    ]


def corpus(rng: random.Random) -> list[str]:
    """The text the BPE is trained on: questions, answers at the start of a line (as a response starts),
    and sentences about numbers, so the merges are English words and digits stay one per token."""
    lines = []
    for n in range(1000):
        lines += [question(n), answer(n), f"{n} is {answer(n)}.", f"The number {n} is an {answer(n)} number."]
        lines += ["system", "user", "assistant"]  # the chat template's role names, one token each
    for _ in range(2000):
        a, b = rng.randrange(10), rng.randrange(10)
        lines.append(f"{WORDS[a]} plus {WORDS[b]} is {a + b}, which is {answer(a + b)}.")
        lines.append(f"Twice {WORDS[a]} is {2 * a}: always even. The answer is {answer(a * b)}.")
    return lines


def train_tokenizer(lines: list[str]) -> Tokenizer:
    tok = Tokenizer(models.BPE())
    # Qwen's pre-tokenization in short: digits one per token, then byte-level (a space is "Ġ")
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Digits(individual_digits=True),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        special_tokens=SPECIAL,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(lines, trainer=trainer)
    return tok


def write(out: Path) -> None:
    rng = random.Random(SEED)
    rng.shuffle(list(range(1000)))  # the draws the tokenizer's corpus followed when the data had 3 digits
    # One-digit numbers, as the default run's first_parity task: the digit the parity is read from is the
    # only number token; with up to three digits the policy settled on one answer word for every number.
    numbers = list(range(10))
    (out / "tokenizer").mkdir(parents=True, exist_ok=True)
    for name in ("train.jsonl", "val.jsonl"):
        (out / name).write_text("".join(json.dumps(r) + "\n" for r in rows(numbers)))
    tok = train_tokenizer(corpus(rng))
    for word in ("even", "odd"):
        if len(tok.encode(word).ids) != 1:
            sys.exit(f"the BPE did not learn {word!r} as one token: raise VOCAB_SIZE")
    tok.save(str(out / "tokenizer" / "tokenizer.json"))
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": None,
        "eos_token": "<|im_end|>",
        "pad_token": "<|endoftext|>",
        "unk_token": None,
        "additional_special_tokens": SPECIAL[1:],
        "model_max_length": 1024,
        "clean_up_tokenization_spaces": False,
    }
    (out / "tokenizer" / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")
    (out / "tokenizer" / "chat_template.jinja").write_text(CHAT_TEMPLATE)
    ends = {"eos_token_id": [tok.token_to_id("<|im_end|>"), tok.token_to_id("<|endoftext|>")]}
    generation = {**ends, "pad_token_id": tok.token_to_id("<|endoftext|>"), "do_sample": True, "top_k": 16}
    (out / "tokenizer" / "generation_config.json").write_text(json.dumps(generation, indent=2) + "\n")


def differing(a: Path, b: Path) -> list[str]:
    names = sorted({p.relative_to(d) for d in (a, b) for p in d.rglob("*") if p.is_file()})
    return [str(n) for n in names if not ((a / n).is_file() and (b / n).is_file() and _same(a / n, b / n))]


def _same(x: Path, y: Path) -> bool:
    return x.read_bytes() == y.read_bytes()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, default=OUT)
    ap.add_argument("--check", action="store_true", help="compare with --out instead of writing it")
    args = ap.parse_args(argv)
    if not args.check:
        write(args.out)
        print(args.out)
        return 0
    with tempfile.TemporaryDirectory() as tmp:
        write(Path(tmp))
        diff = differing(Path(tmp), args.out)
    if diff:
        print(f"{args.out} is not what this script makes: {diff}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
