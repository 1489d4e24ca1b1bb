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


def test_the_start_line_says_the_dispatch_level_can_change_results() -> None:
    """Under a torch dispatch mode PyTorch computes prod's backward and some linear algebra
    differently (hand tests, docs/capture.md §4): the one level that can change results says so
    before the program runs; the default level says nothing more."""
    from opguard.launcher.capturecheck import start_line

    plain = start_line({}, None)
    assert "\n" not in plain and "level function" in plain
    lines = start_line({"OPGUARD_CAPTURE_LEVEL": "dispatch"}, None).splitlines()
    assert len(lines) == 2 and "level dispatch" in lines[0]
    assert lines[1].startswith("opguard-run: note: under level dispatch") and "docs/capture.md §4" in lines[1]
