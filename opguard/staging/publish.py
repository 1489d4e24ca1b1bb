"""Publishing one complete local batch to the shared target (``docs/protocol.md``).

copy to ``streams/<stream>/.tmp-<name>.<random>`` through the node's token bucket, fsync,
close (checked), rename to ``<name>``, fsync the directory. Any failure unlinks the temporary
and raises :class:`~opguard.errors.PublishError`; the local batch stays for the next sync,
which copies it again (an fsync is never retried). A final name that already exists with the
batch's size is the same batch (names carry the digest): publishing is idempotent.
"""

from __future__ import annotations

import errno
import os
import secrets
from collections.abc import Callable
from pathlib import Path
from typing import Protocol

from opguard.errors import IdentityError, PublishError
from opguard.staging import crashpoints
from opguard.staging.fsutil import fsync_dir
from opguard.staging.layout import TARGET_TMP_PREFIX

CHUNK = 1 << 20


class Bucket(Protocol):
    def consume(self, n: int) -> float: ...


def _publish_error(what: str, path: Path, e: OSError) -> PublishError:
    reason = e.strerror or str(e)
    fix = "the batch is kept locally and the next sync uploads it again"
    if e.errno in (errno.ENOSPC, errno.EDQUOT):
        fix = "free space or quota on the shared target; " + fix
    return PublishError(f"{what} {path} failed: {reason} (errno {e.errno})", fix)


def remove_stale_tmp(sdir: Path, dir_fd: int | None = None) -> int:
    """Remove this stream's abandoned uploads (``.tmp-*``) on the target; returns how many.

    ``dir_fd``: ``sdir`` opened without following links (then names are resolved in it)."""
    try:
        names = os.listdir(sdir if dir_fd is None else dir_fd)
    except FileNotFoundError:
        return 0
    n = 0
    for name in names:
        if name.startswith(TARGET_TMP_PREFIX):
            try:
                if dir_fd is None:
                    os.unlink(sdir / name)
                else:
                    os.unlink(name, dir_fd=dir_fd)
                n += 1
            except FileNotFoundError:
                pass
            except OSError as e:
                raise _publish_error("removing the abandoned upload", sdir / name, e) from None
    return n


def already_published(final: Path, size: int, dir_fd: int | None = None) -> bool:
    try:
        existing = (os.stat(final) if dir_fd is None else
                    os.stat(final.name, dir_fd=dir_fd, follow_symlinks=False)).st_size
    except FileNotFoundError:
        return False
    if existing != size:
        raise IdentityError(
            f"{final} already exists with {existing} bytes, but this batch has {size}: "
            "a batch name carries its digest, so someone else wrote this stream",
            "check for two nodes with one OPGUARD_NODE_ID or two runs with one run ID; use a new output directory")
    return True


# copy_file_range errors meaning "not between these files" (another filesystem, an old kernel):
# the copy falls back to read/write. Any other error is a real I/O error of the upload.
_NO_CFR = frozenset({errno.EXDEV, errno.ENOSYS, errno.EOPNOTSUPP, errno.EINVAL, errno.EBADF})


def _copy(src: Path, fd: int, bucket: Bucket, on_bytes: Callable[[int], None] | None) -> int:
    """Copy ``src`` to ``fd`` in CHUNK pieces through the token bucket; returns bytes copied.

    ``os.copy_file_range`` where the kernel can copy between the two files (no user-space copy:
    bench/staging_bench.py (a)); else ``read`` + ``write``. Both are real writes to the target file
    (tests/staging/faultinject wraps both).
    """
    copied = 0
    cfr = hasattr(os, "copy_file_range")
    with open(src, "rb", buffering=0) as f:  # closed by the file object: os.close is the target's alone
        sfd = f.fileno()
        while True:
            if cfr:
                try:
                    n = os.copy_file_range(sfd, fd, CHUNK)
                except OSError as e:
                    if copied == 0 and e.errno in _NO_CFR:
                        cfr = False
                        continue
                    raise
                if n == 0:
                    break
                bucket.consume(n)
            else:
                buf = os.read(sfd, CHUNK)
                if not buf:
                    break
                n = len(buf)
                bucket.consume(n)
                view = memoryview(buf)
                while view:
                    view = view[os.write(fd, view):]
            copied += n
            crashpoints.hit("upload-writing")
            if on_bytes:
                on_bytes(n)
    return copied


def upload(src: Path, sdir: Path, name: str, size: int, bucket: Bucket,
           on_bytes: Callable[[int], None] | None = None, dir_fd: int | None = None) -> bool:
    """Publish ``src`` as ``sdir/name``. True if copied now, False if it was already published.

    ``dir_fd``: ``sdir`` opened without following links (``target.open_stream_dir``). The temporary
    is then created in that very directory, and the rename by path can only succeed there: if
    ``sdir`` was replaced by a link meanwhile, the temporary is not found through it and the upload
    fails (exit 4) instead of publishing where the link points."""
    final = sdir / name
    if already_published(final, size, dir_fd):
        try:
            fsync_dir(sdir)  # the crash or error may have come before the directory was durable
        except OSError as e:
            raise _publish_error("fsyncing the directory of", final, e) from None
        return False
    tmp = sdir / f"{TARGET_TMP_PREFIX}{name}.{secrets.token_hex(6)}"
    step = "creating"
    fd = -1
    try:
        flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
        fd = os.open(tmp, flags, 0o644) if dir_fd is None else os.open(tmp.name, flags, 0o644, dir_fd=dir_fd)
        crashpoints.hit("upload-created")
        step = "writing"
        copied = _copy(src, fd, bucket, on_bytes)
        if copied != size:
            raise OSError(errno.EIO, f"local batch {src} has {copied} bytes, expected {size}")
        step = "fsyncing"
        os.fsync(fd)
        crashpoints.hit("upload-fsynced")
        step = "closing"
        fd, closing = -1, fd
        os.close(closing)
        crashpoints.hit("upload-closed")
        step = "renaming"
        try:
            os.rename(tmp, final)
        except OSError:
            # a rename that reports failure may still have happened (e.g. NFS retransmission)
            if not (final.exists() and os.stat(final).st_size == size):
                raise
            tmp.unlink(missing_ok=True)
        if dir_fd is not None:
            os.stat(name, dir_fd=dir_fd, follow_symlinks=False)  # renamed in the directory that was checked
        crashpoints.hit("upload-renamed")
        step = "fsyncing the directory of"
        fsync_dir(sdir)
    except OSError as e:
        if fd >= 0:
            try:
                os.close(fd)
            except OSError:
                pass
        try:
            tmp.unlink(missing_ok=True)
        except OSError:
            pass
        raise _publish_error(f"{step} the upload", final if step.startswith("fsyncing the dir") else tmp,
                             e) from None
    return True
