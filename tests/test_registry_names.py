"""Rollout backends and tasks are told apart by their registry entries only: no code outside the
registry compares a value to a backend's or a task's name (what differs is a field of the entry)."""

from __future__ import annotations

import ast
from pathlib import Path

from tonpolicy.config.rollout_backends import rollout_backend_names
from tonpolicy.rl.task import TASKS

PACKAGE = Path(__file__).resolve().parents[1] / "tonpolicy"
REGISTRIES = {PACKAGE / "config" / "rollout_backends.py", PACKAGE / "rl" / "task.py"}


def name_comparisons(path: Path, names: frozenset[str]) -> list[str]:
    """Lines of `path` comparing something to one of `names` (==, !=, in, not in a literal or a
    literal tuple, list or set)."""
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if not isinstance(node, ast.Compare):
            continue
        operands = [node.left, *node.comparators]
        literals = {
            e.value
            for o in operands
            for e in ([o] if isinstance(o, ast.Constant) else getattr(o, "elts", []))
            if isinstance(e, ast.Constant)
        }
        if names & literals:
            found.append(f"{path}:{node.lineno}")
    return found


def test_no_backend_or_task_name_is_compared_outside_its_registry() -> None:
    names = frozenset(rollout_backend_names()) | frozenset(TASKS)
    wrong = [
        hit for path in sorted(PACKAGE.rglob("*.py")) if path not in REGISTRIES for hit in name_comparisons(path, names)
    ]
    assert not wrong, "read a field of the registry entry instead:\n" + "\n".join(wrong)


def test_the_comparison_finder_sees_each_form(tmp_path: Path) -> None:
    """The control: each form of comparison is found, a mere mention is not."""
    probe = tmp_path / "probe.py"
    probe.write_text('a == "sglang"\nb not in ("embedded", "x")\nc in {"calculator"}\nd = "sglang"\ne != "sglangx"\n')
    hits = name_comparisons(probe, frozenset({"sglang", "embedded", "calculator"}))
    assert [h.rsplit(":", 1)[1] for h in hits] == ["1", "2", "3"]
