"""The run report: the drain's result on stderr and as a small JSON file (never the exit code)."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from opguard.launcher.identity import Identity
from opguard.staging.config import StagingConfig
from opguard.staging.fsutil import atomic_replace_json
from opguard.staging.layout import Layout, node_stream, rank_stream
from opguard.staging.units import format_bytes

if TYPE_CHECKING:
    from opguard.launcher.sidecar import SyncResult

REPORT_VERSION = 1


def default_report_path(config: StagingConfig, identity: Identity) -> Path:
    """``<local base>/state/launcher/<rank stream or node stream>.json``."""
    name = rank_stream(identity.rank) if identity.rank is not None else node_stream(identity.node_id)
    return Layout(config).locks_dir.parent / "launcher" / f"{name}.json"


def write_report(path: Path, doc: dict[str, Any]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    atomic_replace_json(path, doc)


@dataclass
class RunReport:
    command: list[str]
    identity: dict[str, Any]
    started_at: float = field(default_factory=time.time)
    child_pid: int | None = None
    child_returncode: int | None = None
    exit_code: int | None = None
    killed: bool = False
    signals: list[dict[str, Any]] = field(default_factory=list)
    drain_reason: str | None = None
    drain_timed_out: bool = False
    error: str | None = None  # what made the wrapper stop the command (a node ID conflict)
    syncs: int = 0
    sync_failures: int = 0
    uploaded_bytes: int = 0
    final: SyncResult | None = None

    def add_sync(self, res: SyncResult, last_final: bool) -> None:
        self.syncs += 1
        self.sync_failures += 0 if res.ok else 1
        if res.report is not None:
            self.uploaded_bytes += res.report.uploaded_bytes
        if last_final or (res.final and self.final is None):
            self.final = res

    def drain(self) -> dict[str, Any]:
        f = self.final
        if f is None:
            return {"status": "not run", "published_batches": 0, "pending_bytes": None, "sealed_streams": [],
                    "unsealed_streams": [], "errors": [], "seconds": 0.0, "reason": self.drain_reason}
        streams = f.report.streams if f.report is not None else ()
        status = "complete" if f.ok and not self.drain_timed_out else (
            "timed out" if self.drain_timed_out else "failed")
        return {
            "status": status, "exit_code": f.exit_code, "seconds": round(f.seconds, 3), "reason": self.drain_reason,
            "published_batches": f.report.batches if f.report is not None else 0,
            "published_bytes": f.report.uploaded_bytes if f.report is not None else 0,
            "pending_bytes": f.report.backlog_bytes if f.report is not None else None,
            "sealed_streams": sorted(s.stream for s in streams if s.sealed),
            "unsealed_streams": sorted(s.stream for s in streams if not s.sealed),
            "errors": [s.error for s in streams if s.error] or (
                [] if f.ok else [f.stderr_tail.strip()[-500:]]),
        }

    def to_json(self) -> dict[str, Any]:
        return {"version": REPORT_VERSION, "command": self.command, "identity": self.identity,
                "started_at": self.started_at, "ended_at": time.time(), "child_pid": self.child_pid,
                "child_returncode": self.child_returncode, "exit_code": self.exit_code, "killed": self.killed,
                "signals": self.signals, "syncs": self.syncs, "sync_failures": self.sync_failures,
                "uploaded_bytes": self.uploaded_bytes, "drain": self.drain(), "error": self.error}

    def summary(self, staging: bool) -> str:
        code = f"exit {self.exit_code}"
        if not staging:
            return f"opguard-run: child done, {code} (staging disabled: nothing to drain)"
        d = self.drain()
        pending = d["pending_bytes"]
        return (f"opguard-run: drain {d['status']}: {d['published_batches']} batch(es) published in the final "
                f"drain, {len(d['sealed_streams'])} stream(s) sealed, {len(d['unsealed_streams'])} unsealed, "
                f"pending {format_bytes(pending) if pending is not None else 'unknown'}; "
                f"{self.syncs} sync(s), {self.sync_failures} failed; {code}"
                + ("" if d["status"] == "complete" else "; finish with: opguard sync --all --final"))
