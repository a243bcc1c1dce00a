"""The one table of exit codes is the list README's "A run" gives (codes and meanings), and the
launcher and trainer name no exit code of their own."""

from __future__ import annotations

import re
from pathlib import Path

from tonpolicy.loop import exit_codes
from tonpolicy.loop.exit_codes import EXIT_CODES

ROOT = Path(__file__).resolve().parents[2]


def readme_exit_codes(text: str) -> dict[int, str]:
    """README's "Exit codes: 0 ok; 2 ...; 130 interrupted." paragraph as {code: meaning}, its
    parenthetical details left out."""
    paragraph = re.search(r"^Exit codes: (.*?)\.(?: |\n|$)", text, re.MULTILINE | re.DOTALL)
    assert paragraph, "README has no 'Exit codes:' paragraph"
    flat = re.sub(r"\s*\([^)]*\)", "", " ".join(paragraph.group(1).split()))
    items = [re.fullmatch(r"(\d+) (.+)", item.strip()) for item in flat.split(";")]
    assert all(items), flat
    return {int(m.group(1)): m.group(2) for m in items if m}


def test_the_table_is_readmes_list() -> None:
    assert readme_exit_codes((ROOT / "README.md").read_text()) == EXIT_CODES


def test_every_exit_constant_is_in_the_table() -> None:
    constants = {v for k, v in vars(exit_codes).items() if k.startswith("EXIT_") and isinstance(v, int)}
    assert constants == set(EXIT_CODES)


def test_the_parser_sees_a_disagreement() -> None:
    """The comparison can fail: a README that lists another code or meaning differs from the table."""
    text = "Exit codes: 0 ok; 3 parity gate failed (`x`, y); 7 something else. Every failure ...\n"
    assert readme_exit_codes(text) == {0: "ok", 3: "parity gate failed", 7: "something else"}
    assert readme_exit_codes(text) != EXIT_CODES


def test_the_launcher_and_trainer_use_the_table() -> None:
    """No bare job exit code in the launcher, the app or the loop: `return 3`, `code = 2`, `sys.exit(4)`."""
    paths = [ROOT / "tonpolicy" / p for p in ("app.py", "__main__.py", "launch/job.py", "launch/trainer_main.py")]
    paths += sorted((ROOT / "tonpolicy" / "loop").glob("*.py"))
    bare = re.compile(r"(return|code =|sys\.exit\(|JobFailed\()\s*([0-9]+)\b")
    wrong = [f"{p.name}: {m.group(0)}" for p in paths for m in bare.finditer(p.read_text())]
    assert not wrong, wrong
