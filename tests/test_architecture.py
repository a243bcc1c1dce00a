"""Dependencies point only downward, in the layers docs/ARCHITECTURE.md states (read from that page, so
the page stays true): every `tonpolicy` import in the package, lazy ones included, is checked."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "tonpolicy"


def layers() -> list[set[str]]:
    line = next(x for x in (ROOT / "docs" / "ARCHITECTURE.md").read_text().splitlines() if x.startswith("Layers"))
    return [set(group.split()) for group in line.split(":", 1)[1].split("|")]


def room_of(path: Path) -> str:
    parts = path.relative_to(PACKAGE).parts
    return parts[0] if len(parts) > 1 else path.stem


def _type_checking_only(tree: ast.AST) -> set[int]:
    """ids of the import nodes under `if TYPE_CHECKING:` (names for the type checker, never loaded)."""
    out: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and isinstance(node.test, ast.Name) and node.test.id == "TYPE_CHECKING":
            out |= {id(n) for stmt in node.body for n in ast.walk(stmt)}
    return out


def imported_modules(path: Path, root: Path = ROOT, runtime_only: bool = False) -> list[str]:
    """Absolute dotted names of every import (relative ones resolved; `from a import b` counts a.b);
    `runtime_only` leaves out the imports under `if TYPE_CHECKING:`."""
    package = path.relative_to(root).with_suffix("").parts[:-1]
    out = []
    tree = ast.parse(path.read_text())
    skip = _type_checking_only(tree) if runtime_only else set()
    for node in ast.walk(tree):
        if id(node) in skip:
            continue
        if isinstance(node, ast.Import):
            out += [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = ".".join(package[: len(package) - node.level + 1]) if node.level else ""
            module = ".".join(x for x in (base, node.module or "") if x)
            out += [f"{module}.{alias.name}" for alias in node.names]
    return out


def imported_rooms(path: Path, root: Path = ROOT) -> set[str]:
    rooms = {room_of(p) for p in PACKAGE.rglob("*.py")}
    modules = imported_modules(path, root)
    return {n.split(".")[1] for n in modules if n.startswith("tonpolicy.") and n.split(".")[1] in rooms}


def test_every_room_is_on_the_page() -> None:
    on_page = set().union(*layers())
    rooms = {room_of(p) for p in PACKAGE.rglob("*.py")}
    assert rooms <= on_page, f"rooms missing from docs/ARCHITECTURE.md: {sorted(rooms - on_page)}"


def test_imports_point_only_downward() -> None:
    level = {room: i for i, group in enumerate(layers()) for room in group}
    wrong = []
    for path in sorted(PACKAGE.rglob("*.py")):
        room = room_of(path)
        for target in imported_rooms(path) - {room}:
            if level[target] >= level[room]:
                wrong.append(f"{path.relative_to(ROOT)} ({room}) imports {target}")
    assert not wrong, "\n".join(wrong)


def test_the_import_reader_sees_every_form(tmp_path: Path) -> None:
    """The check itself can fail: package-level, from-package and relative imports all count."""
    probe = tmp_path / "tonpolicy" / "model" / "probe.py"
    probe.parent.mkdir(parents=True)
    probe.write_text("from tonpolicy import launch\nimport tonpolicy.align.dump\nfrom ..app import run\n")
    assert imported_rooms(probe, tmp_path) == {"launch", "align", "app"}


# --- sub-rooms: the rollout side split by process and role ------------------------------------------


def _module(path: Path) -> str:
    return ".".join(path.relative_to(ROOT).with_suffix("").parts).removesuffix(".__init__")


def _imports_of(folder: str, runtime_only: bool = False) -> dict[str, list[str]]:
    base = PACKAGE / folder
    paths = sorted(base.rglob("*.py")) if base.is_dir() else [base.with_suffix(".py")]
    return {_module(p): imported_modules(p, runtime_only=runtime_only) for p in paths}


def _offenders(imports: dict[str, list[str]], forbidden: tuple[str, ...]) -> list[str]:
    return [f"{m} imports {n}" for m, names in imports.items() for n in names if n.startswith(forbidden)]


def test_nothing_in_tonpolicy_imports_the_sglang_side() -> None:
    """`inside_sglang/` runs in SGLang's processes and environment; tonpolicy only names it (launch plan)."""
    wrong = []
    for path in sorted(PACKAGE.rglob("*.py")):
        if room_of(path) != "inside_sglang":
            wrong += _offenders({_module(path): imported_modules(path)}, ("tonpolicy.inside_sglang",))
    assert not wrong, "\n".join(wrong)


def test_the_engine_knows_no_server_client_or_wire() -> None:
    forbidden = ("tonpolicy.rollout.server", "tonpolicy.rollout.client", "tonpolicy.rollout.wire")
    assert not _offenders(_imports_of("rollout/engine"), forbidden)


def test_the_wire_format_and_the_client_stand_alone() -> None:
    """The wire format imports nothing of tonpolicy but itself, the client nothing but the wire format, and
    neither imports torch (the type checker's names aside)."""
    wire = _imports_of("rollout/wire", runtime_only=True)
    client = _imports_of("rollout/client", runtime_only=True)
    wrong = [
        f"{m} imports {n}"
        for imports, allowed in ((wire, ("tonpolicy.rollout.wire",)), (client, ("tonpolicy.rollout.wire",)))
        for m, names in imports.items()
        for n in names
        if (n.startswith("tonpolicy.") and not n.startswith(allowed)) or n.split(".")[0] == "torch"
    ]
    assert not wrong, "\n".join(wrong)


def test_the_client_loads_no_torch_and_no_engine() -> None:
    """The same, as the interpreter sees it: importing the client loads neither torch nor the engine."""
    code = (
        "import sys, tonpolicy.rollout.client\n"
        "engine = ('tonpolicy.rollout.engine', 'tonpolicy.model', 'tonpolicy.kernels')\n"
        "bad = [m for m in sys.modules if m == 'torch' or m.startswith(engine)]\n"
        "print(bad); sys.exit(1 if bad else 0)"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT)
    assert done.returncode == 0, done.stdout + done.stderr


# --- the kernels room: no import circles, kernel sets told apart by the registry only ------------------


def _module_graph(folder: str) -> dict[str, set[str]]:
    """Each module of `tonpolicy/<folder>` -> the modules of that folder it imports (lazy imports
    included, the type checker's names not; `from pkg import name` counts the package's own module)."""
    imports = _imports_of(folder, runtime_only=True)
    graph: dict[str, set[str]] = {}
    for module, names in imports.items():
        targets = set()
        for name in names:
            while name and name not in imports:
                name = name.rpartition(".")[0]
            if name and name != module:
                targets.add(name)
        graph[module] = targets
    return graph


def _circle(graph: dict[str, set[str]]) -> list[str]:
    """One import circle of `graph` (the modules on it, the first repeated last), [] when there is none."""
    state: dict[str, int] = {}  # 1 on the current path, 2 done
    path: list[str] = []

    def visit(m: str) -> list[str]:
        state[m] = 1
        path.append(m)
        for t in sorted(graph.get(m, ())):
            if state.get(t) == 1:
                return [*path[path.index(t) :], t]
            if t not in state and (found := visit(t)):
                return found
        state[m] = 2
        path.pop()
        return []

    for m in sorted(graph):
        if m not in state and (found := visit(m)):
            return found
    return []


def test_the_kernels_and_the_trainer_have_no_import_circle() -> None:
    for folder in ("kernels", "trainer"):
        circle = _circle(_module_graph(folder))
        assert not circle, f"tonpolicy/{folder}: " + " -> ".join(circle)


def test_the_circle_finder_finds_a_lazy_circle() -> None:
    """The control: a circle closed by a function-level import is found."""
    assert _circle({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == ["a", "b", "c", "a"]
    assert _circle({"a": {"b"}, "b": set(), "c": {"a", "b"}}) == []


def _kernel_set_name_comparisons(path: Path, names: frozenset[str]) -> list[str]:
    """Lines of `path` comparing something to a kernel set's name (==, !=, in, not in a literal)."""
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if not isinstance(node, ast.Compare):
            continue
        operands = [node.left, *node.comparators]
        literals = [
            e.value
            for o in operands
            for e in ([o] if isinstance(o, ast.Constant) else getattr(o, "elts", []))
            if isinstance(e, ast.Constant)
        ]
        if names & set(literals):
            found.append(f"{path}:{node.lineno}")
    return found


# The kernels room itself: everywhere else reads a field of the set's spec.
NAME_COMPARISONS_ALLOWED = ("kernels/",)


def test_only_the_kernels_room_compares_kernel_set_names() -> None:
    """Everything that differs per kernel set is a field of its spec (tonpolicy.kernels.sets)."""
    from tonpolicy.kernels.sets import kernel_set_names

    names = frozenset(kernel_set_names())
    wrong = [
        hit
        for path in sorted(PACKAGE.rglob("*.py"))
        if not path.relative_to(PACKAGE).as_posix().startswith(NAME_COMPARISONS_ALLOWED)
        for hit in _kernel_set_name_comparisons(path, names)
    ]
    assert not wrong, "compare a kernel-set field instead:\n" + "\n".join(wrong)


def test_the_comparison_finder_sees_each_form(tmp_path: Path) -> None:
    probe = tmp_path / "probe.py"
    probe.write_text('a == "triton"\nb not in ("ordered", "x")\nc in {"plain"}\nd == "tritonx"\n')
    hits = _kernel_set_name_comparisons(probe, frozenset({"triton", "ordered", "plain"}))
    assert [h.rsplit(":", 1)[1] for h in hits] == ["1", "2", "3"]


def test_the_kernel_set_registry_loads_no_torch() -> None:
    code = "import sys, tonpolicy.kernels.sets\nsys.exit(1 if 'torch' in sys.modules else 0)"
    assert subprocess.run([sys.executable, "-c", code], cwd=ROOT).returncode == 0
