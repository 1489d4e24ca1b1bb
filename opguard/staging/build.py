"""Building one batch from a stream's changes (``docs/format.md`` §7, ``docs/protocol.md`` steps 7–8).

Sources are streamed through :class:`~opguard.staging.bundle.BatchWriter` (never held in memory).
A whole file is published only if ``fstat()`` is the same before and after it was read; a JSON-lines
range only if the file is the same inode, still holds the range and its tail before the range is
unchanged. Otherwise :class:`Torn` is raised and the caller rescans.
"""

from __future__ import annotations

import os
import secrets
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from opguard.staging import crashpoints
from opguard.staging.batchplan import Take
from opguard.staging.bundle import ZSTD_THREADS, BatchWriteError, BatchWriter, batch_name
from opguard.staging.checkpoint import PENDING_FILE, Checkpoint, FileRecord, Pending, save_pending
from opguard.staging.fsutil import fsync_dir
from opguard.staging.scan import Change, FileStat, last_newline_end, tail_sha256


class Torn(Exception):
    """A source changed while it was being read; the batch was not built."""

    def __init__(self, path: str) -> None:
        super().__init__(path)
        self.path = path


@dataclass(frozen=True)
class BatchSource:
    """Where a stream's data comes from and what its manifests say about it."""

    root: Path
    stream: str
    kind: str  # "rank" | "node"
    rank: int | None
    node_id: str
    state_dir: Path  # STATE/streams/<stream>
    zstd_threads: int = ZSTD_THREADS  # zstd workers (sync.zstd_workers); 0: compress inline


SMALL_FILE = 1 << 20  # read whole in one os.read and handed to the compressor as one buffer


def add_file(w: BatchWriter, root: str, c: Change, cp: Checkpoint) -> None:
    """Add the whole file ``root/c.path`` as one entry; :class:`Torn` if it changed while read.

    Hot path for many small files (``bench/staging_bench.py files``): a raw ``os.open`` of a joined
    string, one ``fstat`` before and one after, and for a small file one ``read`` into one buffer.
    """
    try:
        fd = os.open(f"{root}/{c.path}", os.O_RDONLY | os.O_CLOEXEC)
    except FileNotFoundError:
        raise Torn(c.path) from None
    try:
        s = os.fstat(fd)
        size = s.st_size
        entry = {"op": "file", "path": c.path, "version": c.version, "offset": 0,
                 "mode": s.st_mode & 0o7777, "mtime_ns": s.st_mtime_ns}
        if size <= SMALL_FILE:
            data = _read_exactly(fd, size)
            if data is None:
                raise Torn(c.path)
            w.add_bytes(entry, data)
        else:
            with os.fdopen(fd, "rb", closefd=False) as f:
                try:
                    w.add_stream(entry, f, size)
                except OSError:
                    raise Torn(c.path) from None
        a = os.fstat(fd)
    finally:
        os.close(fd)
    if (a.st_dev, a.st_ino, a.st_size, a.st_mtime_ns, a.st_ctime_ns) != (
            s.st_dev, s.st_ino, size, s.st_mtime_ns, s.st_ctime_ns):
        raise Torn(c.path)  # changed while being read (a path replaced by rename is fine: new version next)
    cp.files[c.path] = FileRecord("file", c.version, s.st_dev, s.st_ino, size, s.st_mtime_ns, s.st_ctime_ns)


def _read_exactly(fd: int, size: int) -> bytes | None:
    """``size`` bytes from ``fd``'s start, or None if the file is now shorter or longer."""
    data = os.read(fd, size + 1)  # one more byte: a file that grew is detected here already
    if len(data) == size:
        return data
    if len(data) > size:
        return None
    parts = [data]
    got = len(data)
    while got < size:  # a short read of a regular file (rare: a signal, a network filesystem)
        more = os.read(fd, size - got + 1)
        if not more:
            return None
        parts.append(more)
        got += len(more)
    return b"".join(parts) if got == size else None


def add_append(w: BatchWriter, root: Path, c: Change, nbytes: int, cp: Checkpoint) -> int:
    try:
        f = open(root / c.path, "rb")  # noqa: SIM115 (closed by the with below)
    except FileNotFoundError:
        raise Torn(c.path) from None
    with f:
        fd = f.fileno()
        s = FileStat.of(os.fstat(fd))
        if (s.dev, s.ino) != (c.stat.dev, c.stat.ino) or s.size < c.end:
            raise Torn(c.path)
        end = c.start + nbytes
        if end < c.end:
            end = last_newline_end(fd, c.start, end)
        if end > c.start and os.pread(fd, 1, end - 1) != b"\n":
            raise Torn(c.path)
        f.seek(c.start)
        entry = {"op": "append", "path": c.path, "version": c.version, "offset": c.start,
                 "mode": s.mode, "mtime_ns": s.mtime_ns}
        try:
            w.add_stream(entry, f, end - c.start)
        except OSError:
            raise Torn(c.path) from None
        prev = cp.files.get(c.path)
        if (not c.new_version and prev is not None and c.start > 0
                and tail_sha256(fd, c.start) != prev.tail_sha256):
            raise Torn(c.path)  # rewritten (not appended to) since the scan: rescan, it is a new version
        tail = tail_sha256(fd, end)
    # record the stat only when everything complete was taken; otherwise the next scan looks again
    size = c.stat.size if end == c.end else end
    cp.files[c.path] = FileRecord("append", c.version, s.dev, s.ino, size, c.stat.mtime_ns, c.stat.ctime_ns,
                                  offset=end, tail_sha256=tail)
    return end - c.start


def build_batch(src: BatchSource, cp: Checkpoint, changes: Sequence[Change], deleted: Sequence[str],
                takes: Sequence[Take], final: bool) -> tuple[Pending, int]:
    """Stream the selected data into ``pending/.build-*``, fsync, rename it to its final name and
    write ``pending.json`` durably (the intent, before any upload). Returns (pending, bytes taken).

    Raises :class:`Torn` (the half-built file removed) when a source changed under the read, and
    :class:`~opguard.staging.bundle.BatchWriteError` (nothing left behind) when writing the local
    batch or ``pending.json`` failed (e.g. a full staging disk).
    """
    by_path = {c.path: c for c in changes}
    new = cp.copy()
    new.next_sequence = cp.next_sequence + 1
    manifest: dict[str, Any] = {
        "run_id": cp.run_id, "stream": src.stream, "kind": src.kind, "rank": src.rank, "node_id": src.node_id,
        "sequence": cp.next_sequence, "prev_digest": cp.head_digest, "final": final,
        "created_at": time.time(), "deleted": list(deleted)}
    pending_dir = src.state_dir / "pending"
    try:
        pending_dir.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise BatchWriteError(pending_dir, e) from None
    build = pending_dir / f".build-{secrets.token_hex(6)}"
    w = BatchWriter(build, manifest, threads=src.zstd_threads)
    root = os.fspath(src.root)
    taken = 0
    try:
        for t in takes:
            c = by_path[t.item.path]
            if c.kind == "file":
                add_file(w, root, c, new)
                taken += c.size
            else:
                taken += add_append(w, src.root, c, t.nbytes, new)
            crashpoints.hit("building")
        for p in deleted:
            new.files[p].deleted = True
        digest, size = w.finish()
        crashpoints.hit("built")
    except BaseException:
        w.abort()
        raise
    name = batch_name(cp.next_sequence, digest)
    new.head_digest = digest
    pending = Pending(cp.next_sequence, name, digest, size, final, new, payload=w.payload_size)
    try:
        os.rename(build, pending_dir / name)
    except OSError as e:
        w.abort()
        raise BatchWriteError(pending_dir / name, e) from None
    try:
        fsync_dir(pending_dir)
        crashpoints.hit("batch-renamed")
        save_pending(src.state_dir / PENDING_FILE, pending)  # the intent is durable before any upload
    except OSError as e:
        # no pending.json names the batch: nothing was promised, do not leave it behind (a full disk)
        (src.state_dir / PENDING_FILE).unlink(missing_ok=True)  # none existed before this build
        (pending_dir / name).unlink(missing_ok=True)
        raise BatchWriteError(src.state_dir / PENDING_FILE, e) from None
    crashpoints.hit("pending-saved")
    return pending, taken
