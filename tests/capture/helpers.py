"""Reading traces in the capture tests."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any


def trace_dir(base: Path, rank: int = 0) -> Path:
    return base / "ranks" / f"rank-{rank:06d}" / "capture"


def read_trace(d: Path) -> list[dict[str, Any]]:
    recs: list[dict[str, Any]] = []
    for seg in sorted(d.glob("trace*.jsonl")):
        recs += [json.loads(line) for line in seg.read_text().splitlines()]
    return recs


def ops(recs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [r for r in recs if r["kind"] == "op"]
