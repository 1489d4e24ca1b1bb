"""Helpers for the restore/verify tests: build real format-2 targets exactly as docs/format.md says.

Batches are written with the real :class:`opguard.staging.bundle.BatchWriter`, named
``<seq12>-<sha256>.ogb`` under ``.opguard-bundles/streams/<stream>/``, with ``format.json`` and
``<seq12>.seal`` records; nothing is mocked.
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
from pathlib import Path
from typing import Any

from opguard.staging.bundle import BatchWriter, batch_name, parse_batch_name
from tests.conftest import BIN, REPO

RUN_ID = "experiment-001"

# (op, path, version, offset, data)
Entry = tuple[str, str, int, int, bytes]


def make_target(root: Path, run_id: str = RUN_ID, version: int = 2) -> Path:
    bundles = root / ".opguard-bundles"
    (bundles / "streams").mkdir(parents=True)
    (bundles / "format.json").write_text(json.dumps(
        {"format": "opguard-bundles", "version": version, "run_id": run_id, "created_at": 1.0, "created_by": "node-a"}))
    return root


def stream_dir(root: Path, stream: str) -> Path:
    return root / ".opguard-bundles" / "streams" / stream


def batches(root: Path, stream: str) -> list[Path]:
    d = stream_dir(root, stream)
    return sorted(p for p in d.iterdir() if parse_batch_name(p.name)) if d.is_dir() else []


def add_batch(root: Path, stream: str, entries: list[Entry], *, node_id: str = "node-a", run_id: str = RUN_ID,
              deleted: list[str] | None = None, final: bool = False, **override: Any) -> Path:
    """Publish the next batch of ``stream`` (sequence and prev_digest follow the existing ones)."""
    d = stream_dir(root, stream)
    d.mkdir(parents=True, exist_ok=True)
    existing = batches(root, stream)
    seq = len(existing) + 1
    prev = parse_batch_name(existing[-1].name)[1] if existing else None  # type: ignore[index]
    kind = "rank" if stream.startswith("rank-") else "node"
    manifest = {"run_id": run_id, "stream": stream, "kind": kind,
                "rank": int(stream[5:]) if kind == "rank" else None, "node_id": node_id, "sequence": seq,
                "prev_digest": prev, "final": final, "created_at": 1.0, "deleted": deleted or []}
    manifest.update(override)
    tmp = d / f".tmp-build-{seq}"
    w = BatchWriter(tmp, manifest)
    for op, path, version, offset, data in entries:
        w.add_bytes({"op": op, "path": path, "version": version, "offset": offset, "mode": 0o640,
                     "mtime_ns": 1_700_000_000_000_000_000}, data)
    digest, _size = w.finish()
    final_path = d / batch_name(int(manifest["sequence"]), digest)
    os.rename(tmp, final_path)
    return final_path


def seal(root: Path, stream: str, run_id: str = RUN_ID) -> Path:
    existing = batches(root, stream)
    last = len(existing)
    digest = parse_batch_name(existing[-1].name)[1] if existing else None  # type: ignore[index]
    path = stream_dir(root, stream) / f"{last:012d}.seal"
    path.write_text(json.dumps({"version": 2, "stream": stream, "run_id": run_id, "last_sequence": last,
                                "last_digest": digest, "sealed_at": 1.0, "host": "node-a"}))
    return path


def rename_to_digest(path: Path) -> Path:
    """After editing a batch in place, give it the name its new content has (a 'well-formed' forgery)."""
    seq, _ = parse_batch_name(path.name)  # type: ignore[misc]
    new = path.with_name(batch_name(seq, hashlib.sha256(path.read_bytes()).hexdigest()))
    os.rename(path, new)
    return new


def tree_of(root: Path) -> dict[str, bytes | None]:
    """Every path under root: file -> content, directory -> None. Fails on anything else."""
    out: dict[str, bytes | None] = {}
    for p in sorted(root.rglob("*")):
        rel = p.relative_to(root).as_posix()
        if p.is_symlink():
            raise AssertionError(f"{rel} is a symlink")
        if p.is_dir():
            out[rel] = None
        else:
            assert p.is_file(), f"{rel} is not a regular file"
            out[rel] = p.read_bytes()
    return out


def files_of(root: Path) -> dict[str, bytes]:
    return {k: v for k, v in tree_of(root).items() if v is not None}


def leftovers(parent: Path) -> list[str]:
    return sorted(p.name for p in parent.iterdir() if ".opguard-partial-" in p.name)


def cli(*args: str, module: bool = False, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    cmd = ([str(BIN / "python"), "-m", "opguard.local_sync.materialize"] if module else [str(BIN / "opguard")])
    return subprocess.run([*cmd, *args], capture_output=True, text=True, timeout=timeout, cwd=REPO)
