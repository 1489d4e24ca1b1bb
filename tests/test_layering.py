"""Layering rules: staging imports neither launcher nor cli; nothing light imports torch or mpi4py."""

from __future__ import annotations

import ast
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
