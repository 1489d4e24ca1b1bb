"""The durable local checkpoint and publish intent of one stream (``docs/format.md`` §6).

Both are JSON files replaced atomically (temp, fsync, rename, fsync directory). The checkpoint
says what has been published; ``pending.json`` says which complete local batch is about to be.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from opguard.errors import IdentityError
from opguard.staging.bundle import FORMAT_VERSION
from opguard.staging.fsutil import atomic_replace_json, read_json

# The stream state directory's two files (docs/format.md §6).
CHECKPOINT_FILE = "checkpoint.json"
PENDING_FILE = "pending.json"


@dataclass(slots=True)
class FileRecord:
    """What has been published of one source path (the last version and, for JSON lines, how far)."""

    kind: str  # "append" | "file"
    version: int
    dev: int = 0
    ino: int = 0
    size: int = 0
    mtime_ns: int = 0
    ctime_ns: int = 0
    offset: int = 0  # append: bytes of this version published (always at a record boundary)
    tail_sha256: str | None = None  # append: sha256 of the <=4096 bytes before offset
    deleted: bool = False  # tombstone: keeps the version counter when a path disappears

    @property
    def identity(self) -> tuple[int, int, int, int, int]:
        return (self.dev, self.ino, self.size, self.mtime_ns, self.ctime_ns)

    # written as the object of all its fields (``fsutil.dumps_json``: orjson encodes the dataclass itself)

    def clone(self) -> FileRecord:
        return FileRecord(self.kind, self.version, self.dev, self.ino, self.size, self.mtime_ns, self.ctime_ns,
                          self.offset, self.tail_sha256, self.deleted)

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> FileRecord:
        g = d.get
        return cls(d["kind"], d["version"], g("dev", 0), g("ino", 0), g("size", 0), g("mtime_ns", 0),
                   g("ctime_ns", 0), g("offset", 0), g("tail_sha256"), g("deleted", False))


@dataclass
class Checkpoint:
    run_id: str
    stream: str
    target: str
    next_sequence: int = 1
    head_digest: str | None = None
    sealed_sequence: int | None = None
    files: dict[str, FileRecord] = field(default_factory=dict)
    skipped: list[str] = field(default_factory=list)  # links/special files already reported

    def to_json(self) -> dict[str, Any]:
        return {"version": FORMAT_VERSION, "run_id": self.run_id, "stream": self.stream, "target": self.target,
                "next_sequence": self.next_sequence, "head_digest": self.head_digest,
                "sealed_sequence": self.sealed_sequence,
                # FileRecord objects: encoded by dump_json (orjson natively, in C; keys sorted there)
                "files": self.files,
                "skipped": sorted(self.skipped)}

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> Checkpoint:
        return cls(run_id=str(d["run_id"]), stream=str(d["stream"]), target=str(d["target"]),
                   next_sequence=int(d["next_sequence"]), head_digest=d.get("head_digest"),
                   sealed_sequence=d.get("sealed_sequence"),
                   files={p: FileRecord.from_json(r) for p, r in d.get("files", {}).items()},
                   skipped=list(d.get("skipped", [])))

    def copy(self) -> Checkpoint:
        """An independent copy (what ``from_json(to_json())`` gives, without the JSON round trip)."""
        return Checkpoint(self.run_id, self.stream, self.target, self.next_sequence, self.head_digest,
                          self.sealed_sequence, {p: r.clone() for p, r in self.files.items()}, list(self.skipped))


@dataclass
class Pending:
    sequence: int
    name: str
    digest: str
    size: int
    final: bool
    checkpoint: Checkpoint
    payload: int | None = None  # payload bytes, known to the sync that built it (not stored: in the manifest)

    def to_json(self) -> dict[str, Any]:
        return {"version": FORMAT_VERSION, "sequence": self.sequence, "name": self.name, "digest": self.digest,
                "size": self.size, "final": self.final, "checkpoint": self.checkpoint.to_json()}

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> Pending:
        return cls(sequence=int(d["sequence"]), name=str(d["name"]), digest=str(d["digest"]), size=int(d["size"]),
                   final=bool(d["final"]), checkpoint=Checkpoint.from_json(d["checkpoint"]))


def _load(path: Path, what: str) -> dict[str, Any] | None:
    try:
        d = read_json(path)
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as e:
        raise IdentityError(f"{what} {path} is unreadable ({e})",
                            "restore the staging directory from a backup, or choose a new run ID "
                            "(OPGUARD_RUN_ID) and a new output directory") from None
    if not isinstance(d, dict):
        raise IdentityError(f"{what} {path} is not a JSON object",
                            "restore the staging directory or choose a new run ID")
    if int(d.get("version", 0)) > FORMAT_VERSION:
        raise IdentityError(f"{what} {path} has version {d.get('version')}, newer than {FORMAT_VERSION}",
                            "use the opguard version that wrote it")
    return d


def load_checkpoint(path: Path) -> Checkpoint | None:
    d = _load(path, "checkpoint")
    try:
        return None if d is None else Checkpoint.from_json(d)
    except (KeyError, TypeError, ValueError) as e:
        raise IdentityError(f"checkpoint {path} is malformed ({e!r})",
                            "restore the staging directory or choose a new run ID") from None


def save_checkpoint(path: Path, cp: Checkpoint) -> None:
    atomic_replace_json(path, cp.to_json())


def load_pending(path: Path) -> Pending | None:
    d = _load(path, "pending batch record")
    try:
        return None if d is None else Pending.from_json(d)
    except (KeyError, TypeError, ValueError) as e:
        raise IdentityError(f"pending batch record {path} is malformed ({e!r})",
                            "restore the staging directory or choose a new run ID") from None


def save_pending(path: Path, pending: Pending) -> None:
    atomic_replace_json(path, pending.to_json())
