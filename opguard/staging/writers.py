"""Producers' API: append-only JSON-lines writers and atomic whole-file writers.

Files written here are what the uploader publishes (``docs/format.md`` §4): JSON-lines files
(``.jsonl``/``.ndjson``) only ever grow by whole, newline-terminated records, and every other
file is published by an atomic rename, so the uploader never sees a torn file. When local
staging is enabled but unusable, these helpers raise :class:`~opguard.errors.ConfigError`;
they never fall back to writing shared storage directly.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator, Mapping
from contextlib import AbstractContextManager, contextmanager
from pathlib import Path
from typing import Any, BinaryIO

from opguard.errors import ConfigError
from opguard.staging.config import StagingConfig
from opguard.staging.dirs import LOCAL_BASE_MODE, creatable_problem, ensure_dir
from opguard.staging.fsutil import fsync_dir, tmp_name
from opguard.staging.layout import NODE_COPY_DIRNAME, WRITER_TMP_PREFIX, Layout, current_node_id, current_rank

JSONL_SUFFIXES = (".jsonl", ".ndjson")


def is_jsonl(name: str) -> bool:
    return name.endswith(JSONL_SUFFIXES)


def check_relpath(relpath: str | os.PathLike[str]) -> str:
    """A producer's path relative to its rank/node dir: no absolute paths, ``..``, NUL or temp names."""
    p = os.fspath(relpath)
    parts = p.split("/")
    if (not p or p.startswith("/") or "\\" in p or "\0" in p
            or any(part in ("", ".", "..") for part in parts)):
        raise ConfigError(f"trace path {p!r} is not a plain relative path",
                          "pass a path relative to the rank directory without '..', '.', '//' or a leading '/'")
    if parts[-1].startswith(WRITER_TMP_PREFIX):
        raise ConfigError(f"trace path {p!r} starts with {WRITER_TMP_PREFIX!r}, which the uploader never uploads",
                          f"choose a file name that does not start with {WRITER_TMP_PREFIX!r}")
    return p


def segment_path(path: Path, n: int) -> Path:
    """Segment ``n`` of a rotated JSON-lines file: 0 is ``path`` itself, then ``stem.000001.jsonl``..."""
    if n == 0:
        return path
    suffix = next(s for s in JSONL_SUFFIXES if path.name.endswith(s))
    return path.with_name(f"{path.name[: -len(suffix)]}.{n:06d}{suffix}")


def parse_segment(name: str) -> tuple[str, int] | None:
    """The inverse of :func:`segment_path` on a file name: (the name of segment 0, n), or None for
    a name that is not a JSON-lines file. ``trace.000003.jsonl`` -> (``trace.jsonl``, 3)."""
    suffix = next((s for s in JSONL_SUFFIXES if name.endswith(s)), None)
    if suffix is None:
        return None
    stem = name[: -len(suffix)]
    head, dot, digits = stem.rpartition(".")
    if dot and len(digits) == 6 and all(c in "0123456789" for c in digits):
        return head + suffix, int(digits)
    return name, 0


class JsonlWriter:
    """Append whole records to a JSON-lines file (O_APPEND, one ``write()`` per record, or per
    batch of records with :meth:`write_lines`).

    ``rotate()`` closes the current segment and continues in the next segment file
    (``name.000001.jsonl``, ``name.000002.jsonl``, ...): nothing is renamed, so nothing already
    uploaded is uploaded again. Reopening resumes the highest existing segment. ``fsync=True``
    makes every :meth:`flush` durable; ``rotate_bytes`` rotates automatically before a record
    that would make the segment larger than that.
    """

    def __init__(self, path: str | os.PathLike[str], *, fsync: bool = False, rotate_bytes: int | None = None) -> None:
        self.path = Path(path)
        if not is_jsonl(self.path.name):
            raise ConfigError(f"{self.path} is not a JSON-lines file name",
                              f"name it *{JSONL_SUFFIXES[0]} or *{JSONL_SUFFIXES[1]} (other files: write_file_atomic)")
        if rotate_bytes is not None and rotate_bytes < 1:
            raise ConfigError(f"rotate_bytes={rotate_bytes} must be >= 1", "pass a positive size or None")
        self.fsync = fsync
        self.rotate_bytes = rotate_bytes
        self.segment = 0
        while segment_path(self.path, self.segment + 1).exists():
            self.segment += 1
        self._fd: int | None = None
        self._size = 0
        self._open()

    @property
    def current_path(self) -> Path:
        return segment_path(self.path, self.segment)

    def _open(self) -> None:
        p = self.current_path
        try:
            p.parent.mkdir(parents=True, exist_ok=True)
            self._fd = os.open(p, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_CLOEXEC, 0o644)
        except OSError as e:
            raise ConfigError(f"cannot open trace file {p} for appending: {e.strerror}",
                              "check that the directory exists, is writable and has free space") from None
        self._size = os.fstat(self._fd).st_size

    def write(self, obj: Any) -> None:
        """JSON-encode ``obj`` as one record (compact, one line) and append it."""
        self.write_line(json.dumps(obj, separators=(",", ":"), ensure_ascii=False).encode() + b"\n")

    def write_line(self, line: bytes) -> None:
        """Append one record; ``line`` must end in exactly one newline and contain no other."""
        if not line.endswith(b"\n") or b"\n" in line[:-1]:
            raise ValueError("write_line() takes exactly one record ending in a single b'\\n'")
        if self._fd is None:
            raise ValueError(f"{self.path} is closed")
        if self.rotate_bytes is not None and self._size > 0 and self._size + len(line) > self.rotate_bytes:
            self.rotate()
        self._append(line)

    def write_lines(self, lines: list[bytes]) -> None:
        """Append many records with one ``write()`` per segment they land in (the capture flush).

        Each line must end in exactly one newline and contain no other. Rotation is decided per
        record exactly as by :meth:`write_line` (the same segment boundaries); a failed write leaves
        none of the records of the failing ``write()`` in the file (ENOSPC mid-batch: the partial
        tail is cut off, as for one record) and raises."""
        if not lines:
            return
        for line in lines:
            if not line.endswith(b"\n"):
                raise ValueError("write_lines() takes records each ending in a single b'\\n'")
        data = b"".join(lines)
        if data.count(b"\n") != len(lines):
            raise ValueError("write_lines() takes records each ending in a single b'\\n' and containing no other")
        if self._fd is None:
            raise ValueError(f"{self.path} is closed")
        limit = self.rotate_bytes
        if limit is None or self._size + len(data) <= limit:
            self._append(data)
            return
        start = end = 0  # data[start:end] is the chunk for the current segment
        size = self._size
        for line in lines:
            n = len(line)
            if size > 0 and size + n > limit:
                if end > start:
                    self._append(data[start:end])
                self.rotate()
                start, size = end, 0
            size += n
            end += n
        if end > start:
            self._append(data[start:end])

    def _append(self, data: bytes) -> None:
        """One ``write()`` (more only on a short write) of whole records at the end of the segment."""
        assert self._fd is not None
        view = memoryview(data)
        written = 0
        try:
            while view:
                n = os.write(self._fd, view)  # O_APPEND: each write lands at the end
                view = view[n:]
                written += n
        except OSError:
            if written:
                self._rollback(written)
            raise
        self._size += len(data)

    def _rollback(self, written: int) -> None:
        """Cut off a partially written record (ENOSPC mid-record) so later records stay whole."""
        assert self._fd is not None
        try:
            size = os.fstat(self._fd).st_size
            if size == self._size + written:  # nobody else appended since: the tail is ours
                os.ftruncate(self._fd, self._size)
        except OSError:
            pass

    def flush(self) -> None:
        """Records are written unbuffered; with ``fsync=True`` this makes them durable."""
        if self._fd is not None and self.fsync:
            os.fsync(self._fd)

    def rotate(self) -> Path:
        """Finish the current segment and continue in the next one; returns the new path."""
        if self._fd is None:
            raise ValueError(f"{self.path} is closed")
        self.flush()
        os.close(self._fd)
        self._fd = None
        self.segment += 1
        self._open()
        if self.fsync:
            fsync_dir(self.current_path.parent)
        return self.current_path

    def close(self) -> None:
        if self._fd is not None:
            try:
                self.flush()
            finally:
                os.close(self._fd)
                self._fd = None

    def __enter__(self) -> JsonlWriter:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


@contextmanager
def atomic_file(path: str | os.PathLike[str]) -> Iterator[BinaryIO]:
    """Write a whole file through a file object (e.g. ``torch.save(obj, f)``), published atomically.

    The data goes to ``.opguard-tmp-<name>.<random>`` in the same directory; on a clean exit it is
    fsynced, renamed to ``path`` and the directory fsynced. On an exception the temporary is
    removed and ``path`` is untouched.
    """
    final = Path(path)
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = tmp_name(final, WRITER_TMP_PREFIX)
    f = open(tmp, "xb")  # noqa: SIM115 (closed on every path below)
    try:
        yield f
        f.flush()
        os.fsync(f.fileno())
        f.close()
        os.replace(tmp, final)
    except BaseException:
        f.close()
        tmp.unlink(missing_ok=True)
        raise
    fsync_dir(final.parent)


def write_file_atomic(path: str | os.PathLike[str], data: bytes | bytearray | memoryview) -> Path:
    """Publish ``data`` at ``path`` atomically: temp ``.opguard-tmp-*`` in the same directory,
    fsync, rename, fsync the directory. Readers (the uploader) see the old or the new file."""
    with atomic_file(path) as f:
        f.write(data)
    return Path(path)


# ---- resolving where this process writes ------------------------------------------------------

def check_staging_usable(config: StagingConfig, layout: Layout, *, create_state: bool = True) -> None:
    """Staging is enabled: the local base must exist and be writable, the state dir creatable
    (created unless ``create_state`` is false)."""
    base = config.local_base
    assert base is not None
    if not create_state:
        missing = creatable_problem(base, "OPGUARD_LOCAL_DUMP_BASE")
        if missing is not None:
            raise missing
        if not base.is_dir():
            return  # created with the state directory (docs/format.md §1.1)
    else:
        ensure_dir(base, "OPGUARD_LOCAL_DUMP_BASE", LOCAL_BASE_MODE)
    if not os.access(base, os.W_OK | os.X_OK):
        raise ConfigError(f"OPGUARD_LOCAL_DUMP_BASE={base} is not writable by this user",
                          "fix its permissions or point OPGUARD_LOCAL_DUMP_BASE at a writable node-local directory")
    state = layout.state_dir
    assert state is not None
    if not create_state:
        if state.exists() and not state.is_dir():
            raise ConfigError(f"the uploader state directory {state} exists but is not a directory",
                              "the state directory is mandatory; remove what is in its place")
        return
    try:
        state.mkdir(exist_ok=True)
    except OSError as e:
        raise ConfigError(f"cannot create the uploader state directory {state}: {e.strerror}",
                          "the state directory is mandatory; make OPGUARD_LOCAL_DUMP_BASE writable") from None


def _resolve(env: Mapping[str, str] | None) -> tuple[StagingConfig, Layout]:
    config = StagingConfig.from_env(env)
    layout = Layout(config)
    if config.enabled:
        check_staging_usable(config, layout)
    return config, layout


def rank_dir(rank: int | None = None, env: Mapping[str, str] | None = None) -> Path:
    """This rank's trace directory (created), validated; ConfigError if staging is broken."""
    _config, layout = _resolve(env)
    r = current_rank(env) if rank is None else rank
    if r < 0:
        raise ConfigError(f"rank {r} is negative", "pass a global rank >= 0")
    d = layout.rank_dir(r)
    try:
        d.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise ConfigError(f"cannot create the rank directory {d}: {e.strerror}",
                          "make the staging base (or OPGUARD_TRACE_OUTPUT_BASE) writable") from None
    return d


def node_dir(env: Mapping[str, str] | None = None) -> Path:
    """This node's metadata directory (created), validated."""
    config, layout = _resolve(env)
    d = layout.node_dir(current_node_id(config, env))
    try:
        d.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise ConfigError(f"cannot create the node metadata directory {d}: {e.strerror}",
                          "make the staging base (or OPGUARD_TRACE_OUTPUT_BASE) writable") from None
    return d


def _rank_relpath(relpath: str | os.PathLike[str]) -> str:
    rel = check_relpath(relpath)
    if rel.split("/", 1)[0] == NODE_COPY_DIRNAME:
        raise ConfigError(f"trace path {rel!r} is under {NODE_COPY_DIRNAME}/, which a restore reserves for the "
                          "node's metadata", "write node metadata with write_node_file(), or choose another directory")
    return rel


def open_jsonl(relpath: str | os.PathLike[str], rank: int | None = None, env: Mapping[str, str] | None = None,
               *, fsync: bool = False, rotate_bytes: int | None = None) -> JsonlWriter:
    """A :class:`JsonlWriter` for ``relpath`` under this rank's directory."""
    rel = _rank_relpath(relpath)
    return JsonlWriter(rank_dir(rank, env) / rel, fsync=fsync, rotate_bytes=rotate_bytes)


def write_rank_file(relpath: str | os.PathLike[str], data: bytes | bytearray | memoryview,
                    rank: int | None = None, env: Mapping[str, str] | None = None) -> Path:
    """Atomically write a whole file (tensor, callsite, ...) under this rank's directory."""
    rel = _rank_relpath(relpath)
    return write_file_atomic(rank_dir(rank, env) / rel, data)


def write_node_file(relpath: str | os.PathLike[str], data: bytes | bytearray | memoryview,
                    env: Mapping[str, str] | None = None) -> Path:
    """Atomically write a whole file under this node's metadata directory."""
    rel = check_relpath(relpath)
    return write_file_atomic(node_dir(env) / rel, data)


def atomic_rank_file(relpath: str | os.PathLike[str], rank: int | None = None,
                     env: Mapping[str, str] | None = None) -> AbstractContextManager[BinaryIO]:
    """:func:`atomic_file` for ``relpath`` under this rank's directory (``with ... as f: torch.save(x, f)``)."""
    rel = _rank_relpath(relpath)
    return atomic_file(rank_dir(rank, env) / rel)
