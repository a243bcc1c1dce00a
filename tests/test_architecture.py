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


def imported_rooms(path: Path) -> set[str]:
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        names = [node.module] if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module else []
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        out |= {n.split(".")[1] for n in names if n.startswith("tonpolicy.")}
    return out


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
