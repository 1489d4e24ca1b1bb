"""The output tree of a restore: the one writer every reader goes through (``docs/format.md`` §8, §11).

:class:`OutputTree` creates only directories and regular files under its root (or, with root None,
simulates them for ``verify`` with the same checks); :func:`rename_noreplace` publishes the
finished tree.

No path is ever resolved by the kernel from the root down: every directory is opened relative to
its parent's file descriptor with ``O_NOFOLLOW``, so no symbolic link is followed (not even one
planted while the restore runs), a path may be as deep as the format allows (no recursion, no
``ENAMETOOLONG`` whatever DEST's own length), and the root's descriptor stays valid whatever
happens to its name.
"""

from __future__ import annotations

import ctypes
import errno
import os
import stat
import tarfile
import threading
import zlib
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import IO, Any

from opguard.errors import ConfigError, IntegrityError
from opguard.staging import names
from opguard.staging.bundle import CHUNK
from opguard.staging.fsutil import syncfs_fd

_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
_CACHED = 64  # directory descriptors one thread keeps open (well under any RLIMIT_NOFILE)


def _parent(rel: str) -> str:
    return rel.rpartition("/")[0]


class OutputTree:
    """Regular files and directories under ``root``; with ``root`` None only simulated (same checks).

    Every path is checked with :func:`names.relpath`; only directories and regular files are ever
    created, each relative to its parent directory's descriptor without following links, so no
    path can leave the root. A path that was a file and later a directory (or the reverse: the
    producer deleted one and created the other) follows the **latest wins** rule of
    ``docs/format.md`` §8: the older file, or the older directory with every file under it, is
    left out of the result and reported through ``warn``. Dropping a directory costs the size of
    its subtree (an index of children is kept), so a restore is linear in its entries.
    """

    def __init__(self, root: Path | None, warn: Callable[[str], None] | None = None) -> None:
        self.root = root
        self.warn = warn or (lambda _msg: None)
        self.sizes: dict[str, int] = {}
        self.dirs: set[str] = set()  # every directory holding a restored file or made by mkdir
        self.children: dict[str, set[str]] = {"": set()}  # directory ("" the root) -> its files and directories
        self.meta: dict[str, tuple[int | None, int | None]] = {}
        self._lock = threading.RLock()  # streams are restored by parallel threads (disjoint subtrees)
        self._root_fd = -1 if root is None else os.open(root, _DIR_FLAGS)
        # per thread: directory -> an open descriptor of it (the parents files are written into);
        # dropped whenever a directory is removed (the generation changes)
        self._tls = threading.local()
        self._caches: dict[int, dict[str, int]] = {}
        self._generation = 0

    def close(self) -> None:
        with self._lock:
            for cache in self._caches.values():
                for fd in cache.values():
                    os.close(fd)
            self._caches.clear()
        if self._root_fd >= 0:
            os.close(self._root_fd)
            self._root_fd = -1

    def size(self, rel: str) -> int | None:
        return self.sizes.get(rel)

    def is_dir(self, rel: str) -> bool:
        return rel in self.dirs

    # ---- the file system, relative to the root's descriptor ----

    def _open_dir(self, rel: str, create: bool) -> int:
        """A new descriptor of directory ``rel`` ("" the root), walked one component at a time."""
        fd = os.dup(self._root_fd)
        if not rel:
            return fd
        try:
            for part in rel.split("/"):
                try:
                    nfd = os.open(part, _DIR_FLAGS, dir_fd=fd)
                except FileNotFoundError:
                    if not create:
                        raise
                    try:
                        os.mkdir(part, 0o777, dir_fd=fd)
                    except FileExistsError:
                        pass  # another stream's thread made it (the shared ranks/ or nodes/)
                    nfd = os.open(part, _DIR_FLAGS, dir_fd=fd)
                os.close(fd)
                fd = nfd
        except BaseException:
            os.close(fd)
            raise
        return fd

    def _dir(self, rel: str, create: bool) -> int:
        """A *borrowed* descriptor of directory ``rel`` (do not close it), from this thread's cache of
        up to _CACHED directories: files of one directory do not walk the path again each."""
        cache: dict[str, int] | None = getattr(self._tls, "cache", None)
        if cache is None or self._tls.generation != self._generation:
            with self._lock:
                if cache is not None:
                    for stale in cache.values():
                        os.close(stale)
                cache = {}
                self._caches[threading.get_ident()] = cache
                self._tls.cache, self._tls.generation = cache, self._generation
        cached = cache.get(rel)
        if cached is not None:
            return cached
        fd = self._open_dir(rel, create)
        if len(cache) >= _CACHED:
            for old in cache.values():
                os.close(old)
            cache.clear()
        cache[rel] = fd
        return fd

    def _invalidate(self) -> None:
        """A directory is being removed: no thread may use a cached descriptor of it (under the lock)."""
        self._generation += 1

    def _open_file(self, rel: str, flags: int, create_parents: bool = False) -> int:
        pfd = self._dir(_parent(rel), create_parents)
        return os.open(rel.rpartition("/")[2], flags | os.O_NOFOLLOW | os.O_CLOEXEC, 0o666, dir_fd=pfd)

    def _unlink(self, rel: str) -> None:
        os.unlink(rel.rpartition("/")[2], dir_fd=self._dir(_parent(rel), False))

    def _rmtree(self, rel: str, subdirs: list[str]) -> None:
        """Remove directory ``rel``; ``subdirs``: its directories in pre-order (``rel`` first)."""
        for d in reversed(subdirs):  # children before parents; each opened afresh (no descriptor stack)
            fd = self._open_dir(d, False)
            try:
                for name in os.listdir(fd):
                    if stat.S_ISDIR(os.stat(name, dir_fd=fd, follow_symlinks=False).st_mode):
                        os.rmdir(name, dir_fd=fd)
                    else:
                        os.unlink(name, dir_fd=fd)
            finally:
                os.close(fd)
        pfd = self._open_dir(_parent(rel), False)
        try:
            os.rmdir(rel.rpartition("/")[2], dir_fd=pfd)
        finally:
            os.close(pfd)

    def free_bytes(self) -> int | None:
        """Bytes available to this user on DEST's file system (None when only simulating)."""
        if self._root_fd < 0:
            return None
        st = os.fstatvfs(self._root_fd)
        return st.f_bavail * st.f_frsize

    def reserve(self, nbytes: int, what: str) -> None:
        """Refuse, before writing, ``what`` declaring ``nbytes`` when DEST's file system lacks the space."""
        free = self.free_bytes()
        if free is not None and nbytes > free:
            raise ConfigError(
                f"{what} declares {nbytes} bytes but the file system of the restore destination has only "
                f"{free} bytes free: refused before writing it",
                "free space there or choose a DEST on a larger file system; if that size is implausible the "
                "source is damaged or forged: run `opguard verify SOURCE`")

    # ---- the registry (what the tree holds), under the lock ----

    def _add(self, rel: str) -> None:
        self.children.setdefault(_parent(rel), set()).add(rel)

    def _make_parents(self, rel: str) -> None:
        """Register the directories above ``rel``, replacing older files in the way."""
        parent = _parent(rel)
        if not parent or parent in self.dirs:
            return  # invariant: every ancestor of a registered directory is a registered directory
        parts = parent.split("/")
        with self._lock:
            for k in range(1, len(parts) + 1):
                d = "/".join(parts[:k])
                if d in self.dirs:
                    continue
                if d in self.sizes:
                    self._drop_file(d, f"{rel!r}")
                self.dirs.add(d)
                self.children.setdefault(d, set())
                self._add(d)

    def _drop_file(self, old: str, new: str) -> None:
        """``new``: what the later directory holds, for the report."""
        del self.sizes[old]
        self.meta.pop(old, None)
        self.children[_parent(old)].discard(old)
        if self._root_fd >= 0:
            self._unlink(old)
        self.warn(f"{old!r} was a file and later a directory holding {new} at the source: the restore keeps "
                  f"the later directory and leaves out the older file {old!r} (docs/format.md §8: the latest "
                  "wins; the older file stays in the published batches)")

    def _subtree(self, top: str) -> tuple[list[str], list[str]]:
        """(directories in pre-order, ``top`` first; files) under directory ``top``."""
        dirs: list[str] = []
        files: list[str] = []
        stack = [top]
        while stack:
            d = stack.pop()
            dirs.append(d)
            for child in self.children.get(d, ()):
                (stack if child in self.dirs else files).append(child)
        return dirs, files

    def _drop_dir(self, old: str, new: str) -> None:
        subdirs, below = self._subtree(old)
        for p in below:
            del self.sizes[p]
            self.meta.pop(p, None)
        for d in subdirs:
            self.dirs.discard(d)
            self.children.pop(d, None)
        self.children[_parent(old)].discard(old)
        self._invalidate()
        if self._root_fd >= 0:
            self._rmtree(old, subdirs)
        shown = ", ".join(repr(p) for p in sorted(below)[:5]) + (" ..." if len(below) > 5 else "")
        self.warn(f"{old!r} was a directory and later {new} at the source: the restore keeps the later "
                  f"{new} and leaves out the older directory with its {len(below)} file(s) ({shown or 'none'}) "
                  "(docs/format.md §8: the latest wins; the older files stay in the published batches)")

    # ---- what the readers call ----

    def write(self, rel: str, chunks: Iterable[bytes], *, append: bool) -> int:
        """Replace (``append`` False) or extend ``rel`` with ``chunks``; returns bytes written."""
        names.relpath(rel, "restored path")
        self._make_parents(rel)
        with self._lock:
            if rel in self.dirs:
                self._drop_dir(rel, "a file")
        n = 0
        if self._root_fd < 0:
            for buf in chunks:
                n += len(buf)
        else:
            try:
                fd = self._open_file(rel, os.O_WRONLY | os.O_CREAT | (os.O_APPEND if append else os.O_TRUNC), True)
                with open(fd, "wb") as f:
                    for buf in chunks:  # a read error of SOURCE arrives as an IntegrityError (exit 5)
                        f.write(buf)
                        n += len(buf)
            except OSError as e:
                raise ConfigError(
                    f"writing {rel!r} into the restore destination failed: {e.strerror or e} (errno {e.errno})",
                    "free space on the destination's file system, or choose a DEST where you can write; "
                    "nothing was published") from None
        with self._lock:
            self.sizes[rel] = (self.sizes.get(rel, 0) if append else 0) + n
            self._add(rel)
        return n

    def mkdir(self, rel: str) -> None:
        names.relpath(rel, "restored path")
        self._make_parents(rel)
        with self._lock:
            if rel in self.sizes:
                self._drop_file(rel, "files")
            if rel not in self.dirs:
                self.dirs.add(rel)
                self.children.setdefault(rel, set())
                self._add(rel)
        if self._root_fd >= 0:
            self._dir(rel, True)

    def set_meta(self, rel: str, mode: int | None, mtime_ns: int | None) -> None:
        self.meta[rel] = (mode, mtime_ns)

    def _apply(self, rel: str, mode: int | None, mtime_ns: int | None) -> None:
        fd = self._open_file(rel, os.O_RDONLY)
        try:
            if mode is not None:
                os.fchmod(fd, (mode & 0o777) | 0o600)
            if mtime_ns is not None:
                os.utime(fd, ns=(mtime_ns, mtime_ns))
        finally:
            os.close(fd)

    def apply_meta(self) -> None:
        """Apply recorded modes (always owner read/write) and mtimes; call once all content is in."""
        if self._root_fd >= 0:
            for rel, (mode, mtime_ns) in self.meta.items():
                self._apply(rel, mode, mtime_ns)
        self.meta.clear()

    def copy_dir(self, src: str, dst: str) -> None:
        """Copy restored directory ``src`` (its directories and regular files, modes and mtimes) into
        ``dst``, merging. Only what this tree created is read, through descriptors (no link followed)."""
        if self._root_fd < 0 or src not in self.dirs:
            return
        subdirs, files = self._subtree(src)
        for d in sorted(subdirs):
            self.mkdir(dst + d[len(src):])
        for rel in sorted(files):
            fd = self._open_file(rel, os.O_RDONLY)
            with open(fd, "rb") as f:
                st = os.fstat(f.fileno())
                if not stat.S_ISREG(st.st_mode):
                    continue
                out = dst + rel[len(src):]
                self.write(out, iter(lambda f=f: f.read(CHUNK), b""), append=False)  # type: ignore[misc]
            self._apply(out, st.st_mode, st.st_mtime_ns)

    def remove_all(self) -> None:
        """Remove everything under the root (a failed restore), without recursion or links followed."""
        if self._root_fd < 0:
            return
        with self._lock:
            self._invalidate()
            for child in sorted(self.children.get("", ())):
                try:
                    if child in self.dirs:
                        self._rmtree(child, self._subtree(child)[0])
                    else:
                        self._unlink(child)
                except OSError:
                    pass  # what is left is removed by the caller's rmtree, or reported by it
            self.sizes.clear()
            self.dirs.clear()
            self.children = {"": set()}

    def fsync_all(self) -> None:
        """Make every restored file and directory durable (before the publishing rename): one
        ``syncfs`` of DEST's filesystem where it reports errors, else an fsync of each."""
        if self._root_fd < 0 or syncfs_fd(self._root_fd):
            return
        for rel in self.sizes:
            fd = self._open_file(rel, os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
        for d in ["", *self.dirs]:
            fd = self._open_dir(d, False)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)


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
