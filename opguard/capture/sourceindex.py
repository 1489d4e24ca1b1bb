"""The source index: files that appear in call sites, for the node metadata uploader (§9)."""

from __future__ import annotations

import hashlib
import os
from typing import Any


class SourceIndex:
    """Hashes each call-site file once; ``as_json`` is what ``capture/sources.json`` holds."""

    def __init__(self) -> None:
        self._files: dict[str, dict[str, Any]] = {}

    def add(self, paths: set[str]) -> bool:
        """Index new paths; True when something was added."""
        new = [p for p in paths if p not in self._files and not p.startswith("<")]
        for p in new:
            self._files[p] = describe(p)
        return bool(new)

    def as_json(self, rank: int) -> dict[str, Any]:
        return {"version": 1, "rank": rank, "files": [self._files[p] for p in sorted(self._files)]}


def describe(path: str) -> dict[str, Any]:
    try:
        with open(path, "rb") as f:
            st = os.fstat(f.fileno())
            data = f.read()
    except OSError as e:
        return {"path": path, "sha256": None, "size": None, "mtime_ns": None, "error": f"{e.strerror}"}
    return {"path": path, "sha256": hashlib.sha256(data).hexdigest(), "size": len(data), "mtime_ns": st.st_mtime_ns}
