"""docs/architecture.md holds against the package: its rooms, their floors and their imports.

A room is a top-level module or sub-package of ``mrl_lightning``. The page lists each with
a floor and the rooms it imports; the code must import exactly those, each on a lower
floor (so there is no cycle and no import running back up).
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "mrl_lightning"
PAGE = ROOT / "docs" / "architecture.md"
ROW = re.compile(r"^\| (\d+) \| `([a-z_]+)(\.py|/)` \| .* \| ([a-z_, -]+) \|$")


def documented() -> dict[str, tuple[int, set[str]]]:
    rooms = {}
    for line in PAGE.read_text().splitlines():
        m = ROW.match(line)
        if m:
            imports = {x.strip() for x in m.group(4).split(",") if x.strip() not in ("", "-")}
            rooms[m.group(2)] = (int(m.group(1)), imports)
    return rooms


def package_rooms() -> set[str]:
    files = {p.stem for p in PACKAGE.glob("*.py") if p.name != "__init__.py"}
    folders = {p.name for p in PACKAGE.iterdir() if p.is_dir() and (p / "__init__.py").exists()}
    return files | folders


def imported_rooms(room: str) -> set[str]:
    path = PACKAGE / room
    files = sorted(path.rglob("*.py")) if path.is_dir() else [PACKAGE / f"{room}.py"]
    out = set()
    for file in files:
        for node in ast.walk(ast.parse(file.read_text())):
            names = []
            if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                names = [node.module]
            elif isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            for name in names:
                parts = name.split(".")
                if parts[0] == "mrl_lightning" and len(parts) > 1 and parts[1] != room:
                    out.add(parts[1])
    return out


def test_the_page_lists_every_room_of_the_package_and_no_other():
    rooms = documented()
    assert len(rooms) > 20, "the table of rooms was not found in docs/architecture.md"
    assert set(rooms) == package_rooms()


@pytest.mark.parametrize("room", sorted(package_rooms()))
def test_a_room_imports_what_the_page_says_and_only_lower_floors(room):
    rooms = documented()
    floor, listed = rooms[room]
    actual = imported_rooms(room)
    assert actual == listed, f"{room}: imports {sorted(actual)}, the page says {sorted(listed)}"
    upward = sorted(other for other in actual if rooms[other][0] >= floor)
    assert not upward, f"{room} (floor {floor}) imports {upward} on the same or a higher floor"


def test_no_file_of_the_package_is_longer_than_450_lines():
    long = {str(p.relative_to(ROOT)): n for p in PACKAGE.rglob("*.py")
            if (n := len(p.read_text().splitlines())) > 450}
    assert not long, long


def test_callbacks_find_each_other_by_what_they_declare_not_by_class_name():
    offenders = [str(p.relative_to(ROOT)) for p in (PACKAGE / "callbacks").glob("*.py")
                 if "__name__ ==" in p.read_text() or "__name__ in" in p.read_text()]
    assert not offenders


def test_mwra_names_no_metric_tag():
    """How a metric combines over ranks is said where it is produced (mrl_lightning.metrics), not in MWRA."""
    tags = []
    for file in (PACKAGE / "mwra").glob("*.py"):
        tree = ast.parse(file.read_text())
        docstrings = {id(n.body[0].value) for n in ast.walk(tree)
                      if isinstance(n, (ast.Module, ast.FunctionDef, ast.ClassDef)) and n.body
                      and isinstance(n.body[0], ast.Expr) and isinstance(n.body[0].value, ast.Constant)}
        for node in ast.walk(tree):
            if isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in docstrings:
                if re.match(r"(probe|rollout|train|eval|thl|exchange)/", node.value) or node.value in (
                        "transfers", "rescue_set_size", "peers_pooled", "loss", "zero_var_groups"):
                    tags.append((file.name, node.value))
    assert not tags
