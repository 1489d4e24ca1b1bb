"""The output tree of a restore: the one writer every reader goes through (``docs/format.md`` §8).

:class:`Tree` creates only directories and regular files under its root (or, with root None,
simulates them for ``verify`` with the same checks); :func:`copy_tree` copies a restored
directory within it; :func:`rename_noreplace` publishes the finished tree.
"""

from __future__ import annotations

import ctypes
import errno
import os
import shutil
import tarfile
import threading
import zlib
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import IO, Any

from opguard.errors import ConfigError, IntegrityError
from opguard.staging.bundle import CHUNK, check_relpath
from opguard.staging.fsutil import fsync_dir, syncfs


class Tree:
    """Regular files and directories under ``root``; with ``root`` None only simulated (same checks).

    Every path is checked with :func:`check_relpath`; only directories and regular files are ever
    created, so no path can leave the root. A path that was a file and later a directory (or the
    reverse: the producer deleted one and created the other) follows the **latest wins** rule of
    ``docs/format.md`` §8: the older file, or the older directory with every file under it, is
    left out of the result and reported through ``warn``.
    """

    def __init__(self, root: Path | None, warn: Callable[[str], None] | None = None) -> None:
        self.root = root
        self.warn = warn or (lambda _msg: None)
        self.sizes: dict[str, int] = {}
        self.dirs: set[str] = set()  # every directory holding a restored file or made by mkdir
        self.meta: dict[str, tuple[int | None, int | None]] = {}
        self._lock = threading.Lock()  # streams are restored by parallel threads (disjoint subtrees)

    def size(self, rel: str) -> int | None:
        return self.sizes.get(rel)

    def _make_parents(self, rel: str) -> None:
        """Register (and create) the directories above ``rel``, replacing older files in the way."""
        parent = rel.rpartition("/")[0]
        if not parent or parent in self.dirs:
            return  # invariant: every ancestor of a registered directory is a registered directory
        parts = parent.split("/")
        with self._lock:
            for k in range(1, len(parts) + 1):
                d = "/".join(parts[:k])
                if d in self.sizes:
                    self._drop_file(d, f"{rel!r}")
                self.dirs.add(d)
        if self.root is not None:
            (self.root / parent).mkdir(parents=True, exist_ok=True)

    def _drop_file(self, old: str, new: str) -> None:
        """``new``: what the later directory holds, for the report."""
        del self.sizes[old]
        self.meta.pop(old, None)
        if self.root is not None:
            (self.root / old).unlink()
        self.warn(f"{old!r} was a file and later a directory holding {new} at the source: the restore keeps "
                  f"the later directory and leaves out the older file {old!r} (docs/format.md §8: the latest "
                  "wins; the older file stays in the published batches)")

    def _drop_dir(self, old: str, new: str) -> None:
        below = [p for p in self.sizes if p.startswith(old + "/")]
        for p in below:
            del self.sizes[p]
            self.meta.pop(p, None)
        self.dirs = {d for d in self.dirs if d != old and not d.startswith(old + "/")}
        if self.root is not None:
            shutil.rmtree(self.root / old)
        shown = ", ".join(repr(p) for p in sorted(below)[:5]) + (" ..." if len(below) > 5 else "")
        self.warn(f"{old!r} was a directory and later {new} at the source: the restore keeps the later "
                  f"{new} and leaves out the older directory with its {len(below)} file(s) ({shown or 'none'}) "
                  "(docs/format.md §8: the latest wins; the older files stay in the published batches)")

    def write(self, rel: str, chunks: Iterable[bytes], *, append: bool) -> int:
        """Replace (``append`` False) or extend ``rel`` with ``chunks``; returns bytes written."""
        check_relpath(rel)
        self._make_parents(rel)
        if rel in self.dirs:
            with self._lock:
                self._drop_dir(rel, "a file")
        n = 0
        if self.root is None:
            for buf in chunks:
                n += len(buf)
        else:
            with open(self.root / rel, "ab" if append else "wb") as f:
                for buf in chunks:
                    f.write(buf)
                    n += len(buf)
        self.sizes[rel] = (self.sizes.get(rel, 0) if append else 0) + n
        return n

    def mkdir(self, rel: str) -> None:
        check_relpath(rel)
        self._make_parents(rel)
        with self._lock:
            if rel in self.sizes:
                self._drop_file(rel, "files")
            self.dirs.add(rel)
        if self.root is not None:
            (self.root / rel).mkdir(exist_ok=True)

    def set_meta(self, rel: str, mode: int | None, mtime_ns: int | None) -> None:
        self.meta[rel] = (mode, mtime_ns)

    def apply_meta(self) -> None:
        """Apply recorded modes (always owner read/write) and mtimes; call once all content is in."""
        if self.root is not None:
            for rel, (mode, mtime_ns) in self.meta.items():
                path = self.root / rel
                if mode is not None:
                    os.chmod(path, (mode & 0o777) | 0o600)
                if mtime_ns is not None:
                    os.utime(path, ns=(mtime_ns, mtime_ns))
        self.meta.clear()

    def fsync_all(self) -> None:
        """Make every restored file and directory durable (before the publishing rename): one
        ``syncfs`` of DEST's filesystem where it reports errors, else an fsync of each."""
        if self.root is None or syncfs(self.root):
            return
        for dirpath, _dirs, files in os.walk(self.root, topdown=False):
            for name in files:
                fd = os.open(os.path.join(dirpath, name), os.O_RDONLY)
                try:
                    os.fsync(fd)
                finally:
                    os.close(fd)
            fsync_dir(Path(dirpath))


def copy_tree(src: Path, dst: Path) -> None:
    """Copy a restored directory (only directories and regular files) into ``dst``, merging."""
    for dirpath, _dirs, files in os.walk(src):
        rel = os.path.relpath(dirpath, src)
        out = dst / rel if rel != "." else dst
        out.mkdir(parents=True, exist_ok=True)
        for name in files:
            shutil.copy2(os.path.join(dirpath, name), out / name)



_AT_FDCWD = -100
_RENAME_NOREPLACE = 1


def rename_noreplace(src: Path, dst: Path) -> None:
    """rename(2) that fails if ``dst`` exists (renameat2 RENAME_NOREPLACE where supported)."""
    exists = ConfigError(f"restore destination {dst} appeared while the restore was running",
                         "choose a destination that does not exist")
    fn = getattr(ctypes.CDLL(None, use_errno=True), "renameat2", None)
    if fn is not None:
        if fn(_AT_FDCWD, os.fsencode(src), _AT_FDCWD, os.fsencode(dst), _RENAME_NOREPLACE) == 0:
            return
        err = ctypes.get_errno()
        if err == errno.EEXIST:
            raise exists
        if err not in (errno.ENOSYS, errno.EINVAL, errno.ENOTSUP):
            raise OSError(err, os.strerror(err), str(src), None, str(dst))
    if os.path.lexists(dst):
        raise exists
    os.rename(src, dst)


READ_ERRORS = (tarfile.TarError, EOFError, zlib.error, OSError)  # what reading a (gzip) tar member raises


def read_chunks(f: IO[bytes], on_error: Callable[[Exception], IntegrityError],
                 sha: Any = None) -> Iterator[bytes]:
    while True:
        try:
            buf = f.read(CHUNK)
        except READ_ERRORS as e:
            raise on_error(e) from None
        if not buf:
            return
        if sha is not None:
            sha.update(buf)
        yield buf
