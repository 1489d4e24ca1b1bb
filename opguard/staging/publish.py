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

CHUNK = 1 << 20
TARGET_TMP_PREFIX = ".tmp-"


class Bucket(Protocol):
    def consume(self, n: int) -> float: ...


def _publish_error(what: str, path: Path, e: OSError) -> PublishError:
    reason = e.strerror or str(e)
    fix = "the batch is kept locally and the next sync uploads it again"
    if e.errno in (errno.ENOSPC, errno.EDQUOT):
        fix = "free space or quota on the shared target; " + fix
    return PublishError(f"{what} {path} failed: {reason} (errno {e.errno})", fix)


def remove_stale_tmp(sdir: Path) -> int:
    """Remove this stream's abandoned uploads (``.tmp-*``) on the target; returns how many."""
    try:
        names = os.listdir(sdir)
    except FileNotFoundError:
        return 0
    n = 0
    for name in names:
        if name.startswith(TARGET_TMP_PREFIX):
            try:
                os.unlink(sdir / name)
                n += 1
            except FileNotFoundError:
                pass
            except OSError as e:
                raise _publish_error("removing the abandoned upload", sdir / name, e) from None
    return n


def already_published(final: Path, size: int) -> bool:
    try:
        existing = os.stat(final).st_size
    except FileNotFoundError:
        return False
    if existing != size:
        raise IdentityError(
            f"{final} already exists with {existing} bytes, but this batch has {size}: "
            "a batch name carries its digest, so someone else wrote this stream",
            "check for two nodes with one OPGUARD_NODE_ID or two runs with one run ID; use a new output directory")
    return True


def upload(src: Path, sdir: Path, name: str, size: int, bucket: Bucket,
           on_bytes: Callable[[int], None] | None = None) -> bool:
    """Publish ``src`` as ``sdir/name``. True if copied now, False if it was already published."""
    final = sdir / name
    if already_published(final, size):
        try:
            fsync_dir(sdir)  # the crash or error may have come before the directory was durable
        except OSError as e:
            raise _publish_error("fsyncing the directory of", final, e) from None
        return False
    tmp = sdir / f"{TARGET_TMP_PREFIX}{name}.{secrets.token_hex(6)}"
    step = "creating"
    fd = -1
    try:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o644)
        crashpoints.hit("upload-created")
        step = "writing"
        copied = 0
        with open(src, "rb") as f:
            while buf := f.read(CHUNK):
                bucket.consume(len(buf))
                view = memoryview(buf)
                while view:
                    n = os.write(fd, view)
                    view = view[n:]
                copied += len(buf)
                crashpoints.hit("upload-writing")
                if on_bytes:
                    on_bytes(len(buf))
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
