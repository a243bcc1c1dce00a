"""Every shell command that README.md and docs/**/*.md show in a ```bash block works as written.

A `python -m tonpolicy ...` command is composed and validated with its own overrides (each value of a
`-m` sweep in turn), in process and without starting anything: that is what refuses a bad command
before a job starts. A command that runs a script or a module must name one that exists. The one
command that runs a job, the quickstart's `python -m tonpolicy`, runs for real (2 of its steps) in
tests/kernels/test_isa_matrix.py. A block after `<!-- needs: sglang -->` (or gpu, nodes, slurm) is
checked the same way: the marker says what running it needs, so the reader knows, and lets its
placeholders (`/shared/ckpt`, `$MASTER`, `<p>`) stand where the configuration would need a real value.
"""

from __future__ import annotations

import functools
import importlib.util
import itertools
import re
import shlex
from dataclasses import dataclass
from pathlib import Path

import pytest

from tonpolicy.config.compose import compose_config
from tonpolicy.config.errors import ConfigError, ConfigIssue
from tonpolicy.validation.validate import validate

ROOT = Path(__file__).resolve().parents[1]
SHELL_FENCES = ("bash", "sh", "shell", "console")
NEEDS = {"sglang", "gpu", "nodes", "slurm"}
# Hydra's own launchers that the docs name, beside the package's (tonpolicy/conf/hydra/launcher/).
PLUGIN_LAUNCHERS = {"submitit_slurm", "submitit_local", "basic"}
# A value a reader must replace: the configuration cannot accept it as it stands.
PLACEHOLDER = re.compile(r"<[^>]*>|\$|/path/|/shared/|^CKPT$|SHA256|DUMP_")


@dataclass(frozen=True)
class DocCommand:
    where: str  # file:line
    argv: tuple[str, ...]
    needs: frozenset[str]


def doc_files() -> list[Path]:
    return [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]


def shell_blocks(text: str) -> list[tuple[int, list[str], frozenset[str]]]:
    """(first line number, lines, needs) of each shell-fenced block; needs from the comment above it."""
    lines = text.splitlines()
    blocks = []
    i = 0
    while i < len(lines):
        fence = re.fullmatch(r"\s*```(\w*)\s*", lines[i])
        if not fence:
            i += 1
            continue
        end = next(j for j in range(i + 1, len(lines)) if lines[j].strip().startswith("```"))
        if fence.group(1) in SHELL_FENCES:
            above = next((lines[j] for j in range(i - 1, -1, -1) if lines[j].strip()), "")
            marker = re.fullmatch(r"\s*<!--\s*needs:\s*([\w, ]+?)\s*-->\s*", above)
            needs = frozenset(n.strip() for n in marker.group(1).split(",")) if marker else frozenset()
            assert needs <= NEEDS, f"unknown needs {sorted(needs - NEEDS)} above line {i + 1}"
            blocks.append((i + 2, lines[i + 1 : end], needs))
        i = end + 1
    return blocks


def commands(text: str, name: str) -> list[DocCommand]:
    """One DocCommand per shell command: continuation lines joined, comments dropped, `&&` split."""
    found = []
    for first, lines, needs in shell_blocks(text):
        joined: list[tuple[int, str]] = []
        pending, start = "", first
        for k, line in enumerate(lines):
            line = re.sub(r"(^|\s)#.*$", "", line).rstrip()
            if not pending:
                start = first + k
            if line.endswith("\\"):
                pending += line[:-1] + " "
                continue
            if (pending + line).strip():
                joined.append((start, pending + line))
            pending = ""
        for line_no, command in joined:
            for part in command.split("&&"):
                found.append(DocCommand(f"{name}:{line_no}", tuple(shlex.split(part)), needs))
    return found


def all_commands() -> list[DocCommand]:
    return [c for f in doc_files() for c in commands(f.read_text(), str(f.relative_to(ROOT)))]


def group_option_exists(group: str, option: str) -> bool:
    """An option of a config group: the package's, or the working directory's conf/ (Hydra searches both)."""
    return any((base / group / f"{option}.yaml").is_file() for base in (ROOT / "tonpolicy" / "conf", ROOT / "conf"))


def sweep(args: list[str]) -> list[list[str]]:
    """The override lists a `-m` sweep composes. A swept group's options must exist and its first option
    is composed with the rest of the line (every option alone is validated by the config tests: composing
    each here would cost more than this file may); a swept field is expanded value by value."""
    options = []
    for a in args:
        key, _, value = a.partition("=")
        if "," not in value or value.startswith("["):
            options.append([a])
            continue
        values = value.split(",")
        if (ROOT / "tonpolicy" / "conf" / key).is_dir():
            missing = [v for v in values if not group_option_exists(key, v)]
            assert not missing, f"{key} has no option {missing}"
            values = values[:1]
        options.append([f"{key}={v}" for v in values])
    return [list(c) for c in itertools.product(*options)]


def tonpolicy_overrides(args: list[str]) -> list[list[str]]:
    """The override lists a `python -m tonpolicy` command line composes (Hydra's own keys left to Hydra,
    but its launcher must exist)."""
    multirun = "-m" in args or "--multirun" in args
    kept = []
    skip_next = False
    for a in args:
        if skip_next:
            skip_next = False
            continue
        if a in ("-m", "--multirun", "--help", "-h"):
            continue
        if a == "--cfg":
            skip_next = True
            continue
        if a.startswith("hydra/launcher="):
            launcher = a.split("=", 1)[1]
            own = ROOT / "tonpolicy" / "conf" / "hydra" / "launcher" / f"{launcher}.yaml"
            assert own.exists() or launcher in PLUGIN_LAUNCHERS, f"no Hydra launcher {launcher}"
            continue
        if a.startswith("hydra."):
            continue
        kept.append(a)
    return sweep(kept) if multirun else [kept]


def check_tonpolicy(overrides: list[str]) -> None:
    """Compose and validate; only a placeholder's own key may be refused."""
    placeholders = {o.split("=", 1)[0].lstrip("+") for o in overrides if PLACEHOLDER.search(o.split("=", 1)[-1])}
    real = [i for i in problems(tuple(overrides)) if i.key not in placeholders]
    assert not real, "\n".join(str(i) for i in real)


@functools.cache
def problems(overrides: tuple[str, ...]) -> tuple[ConfigIssue, ...]:
    """Composing is what costs here: several pages show the same command, composed once."""
    try:
        validate(compose_config(list(overrides)))
    except ConfigError as exc:
        return tuple(exc.issues)
    return ()


def check(command: DocCommand) -> None:
    argv = list(command.argv)
    while argv and re.fullmatch(r"[A-Z_]+=\S*", argv[0]):  # NODE_RANK=0 ...
        argv.pop(0)
    program = argv[0]
    if program in ("bash", "sh") or program.endswith("python") or program == "python":
        if program.endswith("python") and argv[1:2] == ["-m"]:
            module = argv[2]
            if module == "tonpolicy":
                for overrides in tonpolicy_overrides(argv[3:]):
                    check_tonpolicy(overrides)
                return
            if module.split(".")[0] in ("tonpolicy", "pytest"):
                assert importlib.util.find_spec(module) is not None, f"no module {module}"
                return
            assert module.startswith("sglang.") and "sglang" in command.needs, f"unchecked module {module}"
            return
        script = argv[1]
        if PLACEHOLDER.search(script):
            assert command.needs, "a placeholder script path needs a needs: marker"
            return
        assert (ROOT / script).is_file(), f"no file {script}"
        return
    if program == "srun":
        assert "slurm" in command.needs, "srun needs a `<!-- needs: slurm -->` marker"
        return
    raise AssertionError(f"no check for `{program}`: add one to tests/test_doc_commands.py")


COMMANDS = all_commands()


@pytest.fixture(autouse=True)
def in_repo(monkeypatch: pytest.MonkeyPatch) -> None:
    """The docs' commands run in the repository root, where Hydra finds its conf/ options."""
    monkeypatch.chdir(ROOT)


@pytest.mark.parametrize("command", COMMANDS, ids=[f"{c.where} {' '.join(c.argv)[:60]}" for c in COMMANDS])
def test_doc_command_works_as_written(command: DocCommand) -> None:
    check(command)


def shown_refusals() -> list[tuple[str, list[str], list[str]]]:
    """(file, overrides, shown problem lines) of each plain block that shows `$ python -m tonpolicy ...`
    and the refusal it prints."""
    found = []
    for f in doc_files():
        for block in re.findall(r"^```\n(\$ python -m tonpolicy [^\n]*)\n(.*?)^```", f.read_text(), re.M | re.S):
            command, output = block
            shown = [line.strip()[2:] for line in output.splitlines() if line.strip().startswith("- ")]
            found.append((str(f.relative_to(ROOT)), shlex.split(command)[4:], shown))
    return found


def test_a_shown_refusal_is_the_one_printed() -> None:
    """The docs' example of a refused command shows the problems validation reports, word for word."""
    shown = shown_refusals()
    assert shown, "README shows no refused command"
    for where, overrides, lines in shown:
        assert [str(i) for i in problems(tuple(overrides))] == lines, where


def test_the_docs_show_commands() -> None:
    """The extraction finds the README's two setup lines and the guides' tonpolicy commands."""
    readme = [c for c in COMMANDS if c.where.startswith("README.md")]
    assert any(c.argv == ("bash", "scripts/setup.sh") for c in readme)
    assert any(c.argv[:3] == (".venv/bin/python", "-m", "pytest") for c in readme)
    assert sum(c.argv[1:3] == ("-m", "tonpolicy") for c in COMMANDS) >= 30


def test_a_broken_command_is_caught() -> None:
    """Controls: a command the validation refuses, a missing script, a joined continuation line."""
    text = "```bash\npython -m tonpolicy parallel.tp=3 \\\n    logger=none\n```\n"
    (bad,) = commands(text, "x.md")
    assert bad.argv == ("python", "-m", "tonpolicy", "parallel.tp=3", "logger=none")
    with pytest.raises(AssertionError, match="parallel.tp=3"):
        check(bad)
    absent = "experiments/" + "absent_bench.py"  # built, so the docs' path check does not read it as a claim
    (missing,) = commands(f"```bash\n.venv/bin/python {absent}\n```\n", "x.md")
    with pytest.raises(AssertionError, match="no file"):
        check(missing)
    (typo,) = commands("```bash\npython -m tonpolicy -m parallel=tp1,tp3\n```\n", "x.md")
    with pytest.raises(AssertionError, match="no option"):
        check(typo)


def test_a_tp_beyond_the_canonical_shards_names_the_fix() -> None:
    """`parallel.tp=8` under a 4-shard contract is refused with the override that fixes it, which works."""
    with pytest.raises(ConfigError) as exc:
        validate(compose_config(["model=qwen3_8b", "parallel.tp=8", "mode=plan"]))
    (issue,) = exc.value.issues
    assert issue.key == "parallel.tp" and "contract.canonical_shards=8" in issue.rule
    validate(compose_config(["model=qwen3_8b", "parallel.tp=8", "mode=plan", "contract.canonical_shards=8"]))
