"""Dependencies point only downward, in the layers docs/ARCHITECTURE.md states (read from that page, so
the page stays true): every `tonpolicy` import in the package, lazy ones included, is checked."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "tonpolicy"


def layers() -> list[set[str]]:
    line = next(x for x in (ROOT / "docs" / "ARCHITECTURE.md").read_text().splitlines() if x.startswith("Layers"))
    return [set(group.split()) for group in line.split(":", 1)[1].split("|")]


def room_of(path: Path) -> str:
    parts = path.relative_to(PACKAGE).parts
    return parts[0] if len(parts) > 1 else path.stem


def imported_modules(path: Path, root: Path = ROOT) -> list[str]:
    """Absolute dotted names of every import (relative ones resolved; `from a import b` counts a.b)."""
    package = path.relative_to(root).with_suffix("").parts[:-1]
    out = []
    for node in ast.walk(ast.parse(path.read_text())):
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
    probe.write_text("from tonpolicy import launch\nimport tonpolicy.parity.dump\nfrom ..app import run\n")
    assert imported_rooms(probe, tmp_path) == {"launch", "parity", "app"}
