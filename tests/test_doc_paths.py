"""Every path a docstring, comment or doc names exists: files (`tonpolicy/kernels/base.py`,
`tests/e2e/test_e2e_run.py`, `docs/PERFORMANCE.md`, ...), a test named after its file (`tests/x.py::test_y`),
dotted modules (`tonpolicy.rl.prompt_data`, optionally followed by one of the module's top-level names),
the modules a package's `Modules:` paragraph lists, and every module, path or `module.name` a package's
`__init__` docstring names in backticks. A rename that leaves a reader pointed at nothing fails here,
naming the file. Also: the experiments carry no issue numbers (the issue tracker is not their reader's)."""

from __future__ import annotations

import ast
import re
from functools import cache
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
READ = ["tonpolicy/**/*.py", "tests/**/*.py", "experiments/**/*.py", "scripts/*.py", "docs/**/*.md", "README.md"]
FILE = re.compile(r"(?<![\w./-])((?:tonpolicy|tests|experiments|scripts|docs)/[\w/.-]*\w\.(?:py|md|sh|cpp|yaml|json))")
MODULE = re.compile(r"(?<![\w./-])tonpolicy(?:\.\w+)+")
TEST = re.compile(r"(?<![\w./-])(tests/[\w/.-]*\.py)::(\w+)")
TICKED = re.compile(r"`([^`]+)`")
ISSUE = re.compile(r"\bissues? \d+", re.IGNORECASE)
# An __init__ whose docstring names an outside package's functions (the stand-in's), not its own modules.
NAMES_ANOTHER_API = {"tonpolicy/inside_sglang/cpu_standin/sgl_kernel/__init__.py"}
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
        for test_file, name in TEST.findall(text):
            if (ROOT / test_file).is_file() and name not in _top_level_names(ROOT / test_file):
                missing.append(f"{where}: {test_file}::{name}")
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
    ((test_file, name),) = TEST.findall("as tests/test_doc_paths.py::no_such_test shows")
    assert name not in _top_level_names(ROOT / test_file)


@cache
def _modules_under(package: Path) -> frozenset[str]:
    """The package's own name and the modules and subpackages anywhere under its folder."""
    return frozenset({package.name} | {p.stem for p in package.rglob("*") if p.suffix in ("", ".py")})


@cache
def _defined_under(package: Path) -> frozenset[str]:
    """The functions and classes anywhere under a package's folder."""
    return frozenset(
        node.name
        for source in package.rglob("*.py")
        for node in ast.walk(ast.parse(source.read_text()))
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef)
    )


def _init_name_problem(package: Path, ticked: str, kernel_sets: frozenset[str]) -> str | None:
    """Why a backticked name in a package's docstring names nothing there (None: it names something, or
    is not a name of the package: a flag, an assignment, an outside module)."""
    name = re.sub(r"\(.*\)$", "", ticked.strip())
    if re.fullmatch(r"[a-z_][\w/]*(\.py)?/?", name) and ("/" in name or name.endswith(".py")):
        bases = (package, ROOT / "tonpolicy", ROOT)
        found = any((b / name).exists() or (b / name).with_suffix(".py").exists() for b in bases)
        return None if found else "no such file or folder"
    if re.fullmatch(r"[a-z][a-z0-9_]*", name):
        known = name in kernel_sets or name in _modules_under(package) or name in _defined_under(package)
        return None if known else "no such module or name"
    first, _, rest = name.partition(".")
    module = package / f"{first}.py"
    if rest and re.fullmatch(r"\w+(\.\w+)*", name) and module.is_file():
        return None if rest.split(".")[0] in _top_level_names(module) else f"{first} has no {rest.split('.')[0]!r}"
    return None


def test_an_init_docstring_names_what_its_package_holds() -> None:
    from tonpolicy.kernels.sets import kernel_set_names

    kernel_sets = frozenset(kernel_set_names())
    missing = []
    for init in sorted(ROOT.glob("tonpolicy/**/__init__.py")):
        where = init.relative_to(ROOT).as_posix()
        if where in NAMES_ANOTHER_API:
            continue
        doc = ast.get_docstring(ast.parse(init.read_text())) or ""
        for ticked in TICKED.findall(doc):
            problem = _init_name_problem(init.parent, ticked, kernel_sets)
            if problem:
                missing.append(f"{where}: `{ticked}`: {problem}")
    assert not missing, "\n".join(missing)


def test_the_init_check_sees_a_stale_name() -> None:
    trainer, kernel_sets = ROOT / "tonpolicy" / "trainer", frozenset({"plain"})
    for fine in ("worker", "worker.TrainerWorker(cfg, checkpoint_dir)", "plain", "dist.spawn", "--ep-size", "a=b"):
        assert _init_name_problem(trainer, fine, kernel_sets) is None, fine
    for stale in ("cp", "worker.NoSuchWorker(cfg)", "no_such/", "forward.py"):
        assert _init_name_problem(trainer, stale, kernel_sets) is not None, stale


def test_the_experiments_carry_no_issue_numbers() -> None:
    """Issue numbers belong to the tracker and the lead's notes; a script says what it measures."""
    found = []
    for path in sorted([*ROOT.glob("experiments/**/*.py"), *ROOT.glob("experiments/**/*.sh")]):
        for n, line in enumerate(path.read_text().splitlines(), 1):
            if ISSUE.search(line):
                found.append(f"{path.relative_to(ROOT)}:{n}: {line.strip()}")
    assert not found, "\n".join(found)
    assert ISSUE.findall("targets (issue 13); on CUDA (issues 9, 35)") == ["issue 13", "issues 9"]
    assert not ISSUE.search("for issue in e.issues:")
