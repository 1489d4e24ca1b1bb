"""What a verify or restore found: per-stream reports, the errors it raises (``docs/format.md`` §5.2, §8).

Shared by every reader (``restore_v2``, ``restore_v1``, ``restore_snapshot``) and the driver
(``restore``). Imports no reader.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from opguard.errors import IdentityError, IntegrityError

RestoreProgress = Callable[[str, int, int], None]

SEALED = "sealed"
UNSEALED = "unsealed"
DAMAGED = "damaged"

FORMAT_V2 = "opguard-bundles-v2"
FORMAT_V1 = "reference-v1-bundles"
FORMAT_SNAPSHOT = "legacy-snapshot"

FIX_DAMAGED = ("recover the named file from a backup of the shared target; published data cannot be "
               "restored past a damaged batch of its stream")


@dataclass
class StreamVerifyReport:
    """One stream: a v2 stream, a v1 owner directory or one legacy ``sync.tar.gz``."""

    stream: str
    status: str = UNSEALED
    batches: int = 0
    files: int = 0
    bytes: int = 0
    last_sequence: int = 0
    sealed_sequence: int | None = None
    node_id: str | None = None
    error: str | None = None


@dataclass
class VerifyReport:
    source: str
    format: str = ""
    run_id: str | None = None
    streams: list[StreamVerifyReport] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)

    @property
    def batches(self) -> int:
        return sum(s.batches for s in self.streams)

    @property
    def files(self) -> int:
        return sum(s.files for s in self.streams)

    @property
    def bytes(self) -> int:
        return sum(s.bytes for s in self.streams)

    def with_status(self, status: str) -> list[StreamVerifyReport]:
        return [s for s in self.streams if s.status == status]

    @property
    def ok(self) -> bool:
        """True when nothing published is damaged (unsealed streams are not damage)."""
        return not self.with_status(DAMAGED)

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d.update(ok=self.ok, batches=self.batches, files=self.files, bytes=self.bytes,
                 sealed=len(self.with_status(SEALED)), unsealed=len(self.with_status(UNSEALED)),
                 damaged=len(self.with_status(DAMAGED)))
        return d

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=1, sort_keys=True)

    def warn(self, message: str) -> None:
        """Record a warning and print it to stderr at once (a library caller sees it too)."""
        self.warnings.append(message)
        print(f"opguard: WARNING: {message}", file=sys.stderr, flush=True)

    def add(self, stream: str) -> StreamVerifyReport:
        sr = StreamVerifyReport(stream)
        self.streams.append(sr)
        return sr


@dataclass
class RestoreReport(VerifyReport):
    dest: str = ""
    # restored path (as in DEST) -> where its last version came from: {"stream", "sequence", "node_id"}
    # (format 2 only; filled by the replay that wrote the file; docs/format.md §8)
    origins: dict[str, dict[str, Any]] = field(default_factory=dict)
    provenance: str | None = None  # DEST/.opguard-attempts.json when written

    def to_dict(self) -> dict[str, Any]:
        d = super().to_dict()
        d.pop("origins", None)  # in the provenance file, not in the report
        return d


class DamagedSource(IntegrityError):
    """Integrity failure (exit 5) that carries the report of everything that was checked."""

    def __init__(self, message: str, fix: str, report: VerifyReport) -> None:
        super().__init__(message, fix)
        self.report = report


class NothingPublished(IntegrityError):
    """SOURCE is a run's target but holds no published stream yet (exit 5: the data is missing)."""

    def __init__(self, source: Path, what: str) -> None:
        super().__init__(
            f"nothing has been published to {source} yet: {what}; there is nothing to restore",
            "wait for the run's first sync (every OPGUARD_LOCAL_DUMP_SYNC_INTERVAL seconds), or run "
            "`opguard sync --all --final` on each node whose staging directory (OPGUARD_LOCAL_DUMP_BASE) still "
            "exists; if the job has ended and its staging directories are gone, none of its data can be restored")


def damaged(stream: str, what: str, fix: str = FIX_DAMAGED) -> IntegrityError:
    return IntegrityError(f"stream {stream} is damaged: {what}", fix)



def guarded(sr: StreamVerifyReport, fail_fast: bool, fn: Callable[[], None]) -> None:
    """Run ``fn``; an integrity failure marks the stream damaged (and stops a restore at once)."""
    try:
        fn()
    except IdentityError:
        raise
    except IntegrityError as e:
        sr.status = DAMAGED
        sr.error = e.message
        if fail_fast:
            raise


def _unsealed_why(sr: StreamVerifyReport) -> str:
    if sr.sealed_sequence is None:
        return "no seal"
    return f"batches after its seal at {sr.sealed_sequence}"


def warn_unsealed(report: VerifyReport) -> None:
    """Warn loudly about every unsealed stream (once per stream; once per legacy format)."""
    unsealed = report.with_status(UNSEALED)
    if not unsealed:
        return
    if report.format == FORMAT_V2:
        for sr in unsealed:
            report.warn(f"stream {sr.stream} is UNSEALED ({sr.last_sequence} batches, {_unsealed_why(sr)}): "
                        "the job may have died before its final drain; its newest data could be missing")
    else:
        names = ", ".join(sr.stream for sr in unsealed[:5]) + (" ..." if len(unsealed) > 5 else "")
        report.warn(f"{len(unsealed)} stream(s) in {report.format} format are UNSEALED ({names}): this format has "
                    "no seals, so a lost newest batch or a job that died before its final sync cannot be detected; "
                    "the restored data may be incomplete")


def check_require_sealed(report: VerifyReport, require_sealed: bool) -> None:
    unsealed = report.with_status(UNSEALED)
    if require_sealed and unsealed:
        names = ", ".join(sr.stream for sr in unsealed)
        raise DamagedSource(f"--require-sealed: {len(unsealed)} unsealed stream(s): {names}",
                            "if the node's staging directory still exists, run `opguard sync --final` there; "
                            "otherwise drop --require-sealed to restore what was published", report)

