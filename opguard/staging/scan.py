"""Change detection for one stream's directory (``docs/format.md`` §4, §6, §7).

Unchanged files are only ``stat()``ed (``os.scandir``), never read. JSON-lines files yield only
new complete, newline-terminated records past the checkpoint's offset; a truncation, a new inode
or a changed tail before the offset starts a new version from offset 0. Every other regular file
is a whole-file object, published as a new version whenever its identity
``(dev, ino, size, mtime_ns, ctime_ns)`` changed.
"""

from __future__ import annotations

import hashlib
import os
import stat as st
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import NamedTuple

from opguard.staging.checkpoint import FileRecord
from opguard.staging.layout import WRITER_TMP_PREFIX
from opguard.staging.writers import is_jsonl

TAIL_BYTES = 4096
_READ = 1 << 20


class FileStat(NamedTuple):
    dev: int
    ino: int
    size: int
    mtime_ns: int
    ctime_ns: int
    mode: int

    @classmethod
    def of(cls, s: os.stat_result) -> FileStat:
        return cls(s.st_dev, s.st_ino, s.st_size, s.st_mtime_ns, s.st_ctime_ns, s.st_mode & 0o7777)

    @property
    def identity(self) -> tuple[int, int, int, int, int]:
        return (self.dev, self.ino, self.size, self.mtime_ns, self.ctime_ns)


@dataclass(frozen=True)
class Walk:
    files: dict[str, FileStat]
    skipped: dict[str, str]  # relpath -> what it is (symlink, socket, ...)


def _kind(mode: int) -> str:
    if st.S_ISLNK(mode):
        return "symbolic link"
    if st.S_ISSOCK(mode):
        return "socket"
    if st.S_ISFIFO(mode):
        return "FIFO"
    if st.S_ISCHR(mode) or st.S_ISBLK(mode):
        return "device"
    return "special file"


def walk(root: Path) -> Walk:
    """Every regular file under ``root`` (relative POSIX paths), skipping writers' temporaries."""
    files: dict[str, FileStat] = {}
    skipped: dict[str, str] = {}
    stack: list[tuple[str, str]] = [(os.fspath(root), "")]
    while stack:
        d, prefix = stack.pop()
        try:
            it = os.scandir(d)
        except FileNotFoundError:
            continue
        with it:
            for e in it:
                rel = prefix + e.name
                if e.name.startswith(WRITER_TMP_PREFIX):
                    continue
                try:
                    if e.is_dir(follow_symlinks=False):  # d_type: no stat() for directories
                        stack.append((e.path, rel + "/"))
                        continue
                    s = e.stat(follow_symlinks=False)
                except FileNotFoundError:
                    continue
                if st.S_ISREG(s.st_mode):
                    files[rel] = FileStat(s.st_dev, s.st_ino, s.st_size, s.st_mtime_ns, s.st_ctime_ns,
                                          s.st_mode & 0o7777)
                elif st.S_ISDIR(s.st_mode):
                    stack.append((e.path, rel + "/"))
                else:
                    skipped[rel] = _kind(s.st_mode)
    return Walk(files, skipped)


@dataclass(frozen=True)
class Change:
    """New data for one path: ``[start, end)`` of version ``version`` (whole file: start 0, end size)."""

    path: str
    kind: str  # "append" | "file"
    version: int
    start: int
    end: int  # append: end of the last complete record visible; file: size
    first_record: int  # append: length of the first complete record past start (0 if none); file: size
    stat: FileStat
    new_version: bool

    @property
    def size(self) -> int:
        return self.end - self.start


def tail_sha256(fd: int, offset: int) -> str:
    start = max(0, offset - TAIL_BYTES)
    data = os.pread(fd, offset - start, start)
    return hashlib.sha256(data).hexdigest()


def last_newline_end(fd: int, start: int, end: int) -> int:
    """Position just after the last b'\\n' in ``[start, end)`` of ``fd``, or ``start`` if none."""
    pos = end
    while pos > start:
        n = min(_READ, pos - start)
        buf = os.pread(fd, n, pos - n)
        if len(buf) != n:
            return start  # shrank under us: the next scan sees the truncation
        i = buf.rfind(b"\n")
        if i >= 0:
            return pos - n + i + 1
        pos -= n
    return start


def first_newline_end(fd: int, start: int, end: int) -> int:
    """Position just after the first b'\\n' in ``[start, end)``, or ``start`` if none."""
    pos = start
    while pos < end:
        buf = os.pread(fd, min(_READ, end - pos), pos)
        if not buf:
            return start
        i = buf.find(b"\n")
        if i >= 0:
            return pos + i + 1
        pos += len(buf)
    return start


def _append_change(root: Path, rel: str, s: FileStat, rec: FileRecord | None) -> Change | None:
    live = rec if rec is not None and not rec.deleted else None
    if live is not None and s[:5] == live.identity:
        return None  # unchanged: never read
    try:
        fd = os.open(root / rel, os.O_RDONLY | os.O_CLOEXEC)
    except FileNotFoundError:
        return None
    try:
        s = FileStat.of(os.fstat(fd))
        new_version = (live is None or (s.dev, s.ino) != (live.dev, live.ino) or s.size < live.offset
                       or (live.offset > 0 and tail_sha256(fd, live.offset) != live.tail_sha256))
        if new_version:
            version = (rec.version + 1) if rec is not None else 1
            start = 0
        else:
            assert live is not None
            version, start = live.version, live.offset
        end = last_newline_end(fd, start, s.size)
        first = first_newline_end(fd, start, end) - start if end > start else 0
    finally:
        os.close(fd)
    if end == start and not new_version:
        return None  # only a partial trailing record: it waits
    return Change(rel, "append", version, start, end, first, s, new_version)


def detect(root: Path, files: Mapping[str, FileRecord], walked: Walk) -> tuple[list[Change], list[str]]:
    """Changes since the checkpoint ``files`` (sorted by path) and the paths deleted since."""
    changes: list[Change] = []
    for rel in sorted(walked.files):
        s = walked.files[rel]
        rec = files.get(rel)
        if is_jsonl(rel):
            c = _append_change(root, rel, s, rec)
            if c is not None:
                changes.append(c)
            continue
        if rec is not None and not rec.deleted and s[:5] == rec.identity:
            continue
        version = rec.version + 1 if rec is not None else 1
        changes.append(Change(rel, "file", version, 0, s.size, s.size, s, True))
    gone = files.keys() - walked.files.keys()
    deleted = sorted(p for p in gone if not files[p].deleted)
    return changes, deleted
