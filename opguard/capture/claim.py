"""Which process of a command holds a rank's capture (``docs/capture.md`` §1). Imports no torch:
the bootstrap uses it at interpreter start."""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from opguard.errors import ConfigError

RUN_ENV = "OPGUARD_CAPTURE_RUN"  # a token per opguard-run --capture child (bootstrap.child_env), in meta "run"


class HeldByThisRun(ConfigError):
    """This rank's capture is held by another process of the same ``opguard-run --capture``
    command (a script run after another by a shell, a program that re-executed itself, a child
    started before its parent imported torch): the bootstrap then runs this process uncaptured,
    saying so, instead of refusing it (docs/capture.md §1)."""

    def __init__(self, pid: Any) -> None:
        super().__init__(f"the rank's capture is held by pid {pid} of this same command",
                         "one Python process per rank is captured: the first that imports torch")
        self.pid = pid


def holder(meta_path: Path, environ: Mapping[str, str]) -> Any:
    """The pid in ``meta_path`` when that capture was made under this same command (its ``run``
    token equals ours), else None (another run's directory: refused)."""
    token = environ.get(RUN_ENV)
    if not token:
        return None
    meta = meta_of(meta_path)
    return meta.get("pid", "?") if meta.get("run") == token else None


def meta_of(meta_path: Path) -> dict[str, Any]:
    """A capture's ``meta.json`` as a dict (empty when unreadable or not an object)."""
    try:
        meta = json.loads(meta_path.read_text())
    except (OSError, ValueError):
        return {}
    return meta if isinstance(meta, dict) else {}
