"""Helpers for the compare tests: run the CLI as a real process, read an export back."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from opguard.compare.perfetto_export import Export, ExportedOp, read_export

FIXTURES = Path(__file__).resolve().parent / "fixtures"
REFERENCE = FIXTURES / "reference"
OPGUARD = [str(Path(sys.executable).parent / "opguard")]


def run_compare(a: Path | str, b: Path | str, out: Path, env: dict[str, str] | None = None,
                extra: list[str] | None = None) -> subprocess.CompletedProcess[str]:
    e = dict(os.environ if env is None else env)
    return subprocess.run([*OPGUARD, "compare", str(a), str(b), "-o", str(out), *(extra or [])], capture_output=True,
                          text=True, env=e, timeout=120)


def ops_of(export: Export, run: str, rank: int = 0) -> list[ExportedOp]:
    ops = [op for op in export.ops if op.args["run"] == run and op.args["rank"] == rank]
    return sorted(ops, key=lambda op: int(op.args["index"]))


def load(path: Path) -> Export:
    return read_export(path)
