"""Human-readable byte counts for progress and report lines (imports nothing: cheap to load)."""

from __future__ import annotations


def format_bytes(n: float) -> str:
    """``512 B``, ``1.5 KiB``, ``3.0 MiB``, ... up to GiB (binary units, one decimal)."""
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{int(n)} B"
        n /= 1024
    return f"{n:.1f} GiB"
