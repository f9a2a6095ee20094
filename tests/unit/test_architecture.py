"""docs/architecture.md's import rule, checked on every module of aggd/ (and the table kept true)."""
from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
AGGD = ROOT / "aggd"
DOC = ROOT / "docs" / "architecture.md"


def allowed() -> dict[str, set[str]]:
    """The "may import" table of docs/architecture.md: folder -> folders ("*": everything)."""
    text = DOC.read_text()
    section = text[text.index("## Import rule"):]
    rows = re.findall(r"^\| `(\w+)` \| (.+?) \|$", section, re.M)
    return {folder: ({"*"} if "everything" in cell else set(re.findall(r"`(\w+)`", cell)))
            for folder, cell in rows}


def imports(path: Path) -> set[str]:
    """The aggd folders a module imports (absolute imports; relative ones stay inside a folder)."""
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names = [node.module]
        elif isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        else:
            continue
        out |= {n.split(".")[1] for n in names if n.startswith("aggd.") and n.count(".") >= 1}
    return out


def test_every_folder_is_in_the_table_and_every_module_in_a_folder():
    table = allowed()
    folders = {p.name for p in AGGD.iterdir() if p.is_dir() and (p / "__init__.py").exists()}
    assert folders == set(table), (folders ^ set(table))
    loose = [p.name for p in AGGD.glob("*.py") if p.name != "__init__.py"]
    assert not loose, f"modules outside a folder of concern: {loose}"


def test_imports_follow_the_rule():
    table = allowed()
    broken = []
    for path in AGGD.rglob("*.py"):
        if path.parent == AGGD:
            continue       # aggd/__init__.py
        folder = path.relative_to(AGGD).parts[0]
        may = table[folder]
        for target in imports(path) - {folder}:
            if "*" not in may and target not in may:
                broken.append(f"{path.relative_to(ROOT)} imports aggd.{target}")
    assert not broken, "imports against docs/architecture.md:\n" + "\n".join(sorted(broken))


def test_the_rule_catches_a_daemon_importing_the_lab(tmp_path):
    bad = tmp_path / "service.py"
    bad.write_text("from aggd.lab.namespaces import Lab\n")
    assert "lab" in imports(bad) and "lab" not in allowed()["daemon"]


def test_where_to_find_names_files_that_exist():
    for path in re.findall(r"`((?:aggd|xdp|client)/[\w/]+\.(?:py|c|h))`", DOC.read_text()):
        assert (ROOT / path).exists(), path


def test_no_test_module_imports_another():
    """Shared fixtures and harnesses live in tests/fixtures and tests/harness (docs/architecture.md,
    "Tests"), so a test module never imports a test module."""
    broken = []
    for path in (ROOT / "tests").rglob("test_*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom):
                names = [node.module or ""] + [a.name for a in node.names]
            elif isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            else:
                continue
            if any(n.split(".")[-1].startswith("test_") for n in names):
                broken.append(f"{path.relative_to(ROOT)}:{node.lineno}")
    assert not broken, "test modules importing test modules:\n" + "\n".join(broken)
