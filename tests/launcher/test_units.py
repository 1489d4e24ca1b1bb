"""One byte formatter for staging's and the launcher's progress lines (opguard.staging.units)."""

from __future__ import annotations

import subprocess
import sys

from opguard.launcher import report, sidecar
from opguard.staging import sync, units


def test_format_bytes_values() -> None:
    assert units.format_bytes(0) == "0 B"
    assert units.format_bytes(1023) == "1023 B"
    assert units.format_bytes(1536) == "1.5 KiB"
    assert units.format_bytes(3 * 2**20) == "3.0 MiB"
    assert units.format_bytes(5 * 2**40) == "5120.0 GiB"


def test_one_function_everywhere() -> None:
    for mod in (sidecar, report, sync):
        assert getattr(mod, "format_bytes") is units.format_bytes, mod.__name__  # noqa: B009
    assert not hasattr(sidecar, "fmt_bytes")


def test_units_is_cheap_to_import() -> None:
    code = "import sys, opguard.staging.units; print(sorted(m for m in sys.modules if m.startswith('opguard')))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "['opguard', 'opguard.staging', 'opguard.staging.units']"
