"""Layering rules: staging imports neither launcher nor cli (nor runs them from a string); no library
module imports or runs the cli; nothing light imports torch or mpi4py."""

from __future__ import annotations

import ast
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import REPO

PKG = REPO / "opguard"


def _imports(path: Path) -> set[str]:
    tree = ast.parse(path.read_text())
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module)
    return names


def _modules(sub: str) -> list[Path]:
    return sorted((PKG / sub).rglob("*.py"))


@pytest.mark.parametrize("path", _modules("staging"), ids=lambda p: p.name)
def test_staging_imports_neither_launcher_nor_cli(path: Path) -> None:
    bad = {n for n in _imports(path) if n.startswith(("opguard.launcher", "opguard.cli"))}
    assert not bad, f"{path.relative_to(REPO)} imports {bad}"


@pytest.mark.parametrize("path", [p for p in PKG.rglob("*.py") if not p.name.startswith("cli")],
                         ids=lambda p: str(p.relative_to(PKG)))
def test_no_library_module_imports_cli(path: Path) -> None:
    bad = {n for n in _imports(path) if n == "opguard.cli" or n.startswith(("opguard.cli.", "opguard.cli_"))}
    assert not bad, f"{path.relative_to(REPO)} imports {bad}"


def _docstrings(tree: ast.AST) -> set[int]:
    ids: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and node.body:
            first = node.body[0]
            if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant):
                ids.add(id(first.value))
    return ids


_MODULE_NAME = re.compile(r"opguard(\.[A-Za-z_][A-Za-z0-9_]*)+")


def _executed_imports(path: Path) -> set[str]:
    """Modules named inside strings that can be executed: a string that parses as Python code with
    imports (``python -c "..."``, ``exec``), or a string that is exactly a dotted ``opguard.*`` module
    name (``python -m NAME``, ``importlib.import_module(NAME)``). Docstrings are prose."""
    tree = ast.parse(path.read_text())
    skip = _docstrings(tree)
    names: set[str] = set()
    for node in ast.walk(tree):
        if not isinstance(node, ast.Constant) or not isinstance(node.value, str) or id(node) in skip:
            continue
        text = node.value
        if _MODULE_NAME.fullmatch(text.strip()):
            names.add(text.strip())
        if "import" not in text:
            continue
        try:
            code = ast.parse(text)
        except SyntaxError:
            continue
        for sub in ast.walk(code):
            if isinstance(sub, ast.Import):
                names.update(a.name for a in sub.names)
            elif isinstance(sub, ast.ImportFrom) and sub.module and sub.level == 0:
                names.add(sub.module)
    return names


def _cli_names(names: set[str]) -> set[str]:
    return {n for n in names if n == "opguard.cli" or n.startswith(("opguard.cli.", "opguard.cli_"))}


@pytest.mark.parametrize("path", _modules("staging"), ids=lambda p: p.name)
def test_staging_executes_neither_launcher_nor_cli(path: Path) -> None:
    bad = {n for n in _executed_imports(path) if n.startswith(("opguard.launcher", "opguard.cli"))}
    assert not bad, f"{path.relative_to(REPO)} runs {bad} from a string"


@pytest.mark.parametrize("path", [p for p in PKG.rglob("*.py") if not p.name.startswith("cli")],
                         ids=lambda p: str(p.relative_to(PKG)))
def test_no_library_module_executes_cli(path: Path) -> None:
    bad = _cli_names(_executed_imports(path))
    assert not bad, f"{path.relative_to(REPO)} runs {bad} from a string (use a library entry point instead)"


def test_executed_strings_are_seen(tmp_path: Path) -> None:
    """The check above sees the forms that slipped past the import check: a ``python -c`` program and
    a ``-m`` module name (the sidecar once ran ``opguard.cli.main()`` this way)."""
    src = tmp_path / "m.py"
    src.write_text('"""Docstrings may name opguard.cli freely."""\n'
                   'ENTRY = ("import sys; from opguard.launcher.claim import check; "\n'
                   '         "from opguard.cli import main; main()")\n'
                   'ARGV = ["python", "-m", "opguard.cli_staging"]\n'
                   'NOTE = "use opguard.launcher.mpi.mpi_identity() in the program"\n')
    assert _executed_imports(src) == {"sys", "opguard.launcher.claim", "opguard.cli", "opguard.cli_staging"}


def _loaded_after(code: str) -> set[str]:
    out = subprocess.run([sys.executable, "-c", code + "\nimport sys; print(' '.join(sorted(sys.modules)))"],
                         capture_output=True, text=True, check=True, cwd=REPO)
    return set(out.stdout.split())


def test_import_opguard_and_staging_stays_light() -> None:
    staging = " ".join(f"import opguard.staging.{p.stem};" for p in _modules("staging") if p.stem != "__init__")
    mods = _loaded_after("import opguard, opguard.cli; " + staging)
    heavy = {m for m in mods if m.split(".")[0] in ("torch", "mpi4py", "numpy")}
    assert not heavy, f"importing opguard/staging/cli loaded {sorted(heavy)[:5]}"


def test_launcher_stays_light() -> None:
    launcher = " ".join(f"import opguard.launcher.{p.stem};" for p in _modules("launcher") if p.stem != "__init__")
    mods = _loaded_after("import opguard.cli_run; " + launcher if (PKG / "cli_run.py").exists() else launcher)
    heavy = {m for m in mods if m.split(".")[0] in ("torch", "mpi4py", "numpy")}
    assert not heavy, f"importing the launcher loaded {sorted(heavy)[:5]}"
