"""Every path a docstring, comment or doc names exists: files (`tonpolicy/kernels/base.py`,
`tests/e2e/test_e2e_run.py`, `docs/PERFORMANCE.md`, ...), dotted modules (`tonpolicy.rl.prompt_data`,
optionally followed by one of the module's top-level names), and the modules a package's `Modules:`
paragraph lists. A rename that leaves a reader pointed at nothing fails here, naming the file."""

from __future__ import annotations

import ast
import re
from functools import cache
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
READ = ["tonpolicy/**/*.py", "tests/**/*.py", "experiments/**/*.py", "scripts/*.py", "docs/**/*.md", "README.md"]
FILE = re.compile(r"(?<![\w./-])((?:tonpolicy|tests|experiments|scripts|docs)/[\w/.-]*\w\.(?:py|md|sh|cpp|yaml|json))")
MODULE = re.compile(r"(?<![\w./-])tonpolicy(?:\.\w+)+")
DUNDER = {"__file__", "__version__", "__main__", "__path__"}


def _sources() -> list[Path]:
    found = {p for pattern in READ for p in ROOT.glob(pattern) if "__pycache__" not in p.parts}
    return sorted(found - {Path(__file__).resolve()})  # this file names missing ones on purpose


@cache
def _top_level_names(path: Path) -> frozenset[str]:
    names = set(DUNDER)
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
            names.add(node.name)
        elif isinstance(node, ast.Assign | ast.AnnAssign):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            names |= {n.id for t in targets for n in ast.walk(t) if isinstance(n, ast.Name)}
        elif isinstance(node, ast.Import | ast.ImportFrom):
            names |= {(a.asname or a.name).split(".")[0] for a in node.names}
    return frozenset(names)


def _module_problem(dotted: str) -> str | None:
    parts = dotted.split(".")
    for k in range(len(parts), 0, -1):
        base = ROOT.joinpath(*parts[:k])
        source = base.with_suffix(".py") if base.with_suffix(".py").is_file() else base / "__init__.py"
        if source.is_file() or base.is_dir():
            break
    rest = parts[k:]
    if not rest:
        return None
    if not source.is_file() or rest[0] not in _top_level_names(source):
        return f"{'.'.join(parts[:k])} has no module or name {rest[0]!r}"
    return None


def test_named_files_and_modules_exist() -> None:
    missing = []
    for path in _sources():
        text, where = path.read_text(), path.relative_to(ROOT)
        missing += [f"{where}: {m}" for m in FILE.findall(text) if not (ROOT / m).exists()]
        for dotted in MODULE.findall(text):
            problem = _module_problem(dotted.rstrip("."))
            if problem:
                missing.append(f"{where}: {dotted}: {problem}")
    assert not missing, "\n".join(sorted(set(missing)))


def test_a_packages_module_list_names_its_modules() -> None:
    missing = []
    for init in sorted(ROOT.glob("tonpolicy/**/__init__.py")):
        doc = ast.get_docstring(ast.parse(init.read_text())) or ""
        listed = doc.partition("Modules:")[2].split("\n\n")[0]
        for name in re.findall(r"`([a-z_][a-z0-9_]*)`", listed):
            if not ((init.parent / f"{name}.py").is_file() or (init.parent / name / "__init__.py").is_file()):
                missing.append(f"{init.relative_to(ROOT)}: Modules: `{name}`")
    assert not missing, "\n".join(missing)


def test_the_check_sees_a_stale_name(tmp_path: Path) -> None:
    assert _module_problem("tonpolicy.rl.prompt_data.load_prompt_data") is None
    assert _module_problem("tonpolicy.rl.prompt_data.no_such_name") is not None
    assert _module_problem("tonpolicy.rl.no_such_module") is not None
    assert FILE.findall("see tonpolicy/rl/no_such.py.") == ["tonpolicy/rl/no_such.py"]
