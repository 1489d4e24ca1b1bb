"""Fault injection at the use site for subprocesses (loaded via ``PYTHONPATH=tests/staging/faultinject``).

Used only where no real mechanism exists (EIO; a rename that fails but happened): the real ENOSPC
cases use a really full tmpfs. ``OPGUARD_TEST_FAULT=CALL:ERRNO`` makes ``os.CALL`` fail with
``ERRNO`` for uploads in progress on the target (files named ``.tmp-*`` under
``OPGUARD_TEST_FAULT_UNDER``; ``fsync_dir`` targets the directory itself):

* ``write``, ``fsync``, ``close`` (the fd is closed, then the error is raised, as the kernel does),
* ``rename`` (nothing renamed), ``rename-happened`` (renamed, then the error: a lost NFS reply),
* ``fsync-dir`` (the fsync of a directory under the target).

Every injected call is appended to ``OPGUARD_TEST_FAULT_LOG`` (``CALL PATH`` per line) if set.
"""

from __future__ import annotations

import errno
import os
from typing import Any

_spec = os.environ.get("OPGUARD_TEST_FAULT", "")
_under = os.environ.get("OPGUARD_TEST_FAULT_UNDER", "")


def _install(call: str, code: int) -> None:
    real_write, real_fsync, real_close, real_rename = os.write, os.fsync, os.close, os.rename
    log = os.environ.get("OPGUARD_TEST_FAULT_LOG")

    def note(what: str, path: str) -> None:
        if log:
            with open(log, "a") as f:
                f.write(f"{what} {path}\n")

    def fd_path(fd: int) -> str:
        try:
            return os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            return ""

    def upload(path: str) -> bool:
        return path.startswith(_under + "/") and os.path.basename(path).startswith(".tmp-")

    def fail(what: str, path: str) -> OSError:
        note(what, path)
        return OSError(code, os.strerror(code), path)

    if call == "write":
        def write(fd: int, data: Any) -> int:
            if upload(fd_path(fd)):
                raise fail("write", fd_path(fd))
            return real_write(fd, data)
        os.write = write
        if hasattr(os, "copy_file_range"):  # the upload's copy primitive where the kernel offers it
            real_cfr = os.copy_file_range

            def copy_file_range(src: int, dst: int, count: int, *a: Any, **k: Any) -> int:
                if upload(fd_path(dst)):
                    raise fail("write", fd_path(dst))
                return real_cfr(src, dst, count, *a, **k)
            os.copy_file_range = copy_file_range
    elif call in ("fsync", "fsync-dir"):
        def fsync(fd: Any) -> None:
            p = fd_path(fd if isinstance(fd, int) else fd.fileno())
            if (call == "fsync" and upload(p)) or (call == "fsync-dir" and os.path.isdir(p)
                                                     and p.startswith(_under + "/")):
                raise fail(call, p)
            real_fsync(fd)
        os.fsync = fsync
    elif call == "close":
        def close(fd: int) -> None:
            p = fd_path(fd)
            real_close(fd)
            if upload(p):
                raise fail("close", p)
        os.close = close
    elif call in ("rename", "rename-happened"):
        def rename(src: Any, dst: Any, *a: Any, **k: Any) -> None:
            s = os.fspath(src)
            if upload(str(s)):
                if call == "rename-happened":
                    real_rename(src, dst, *a, **k)
                raise fail(call, str(s))
            real_rename(src, dst, *a, **k)
        os.rename = rename
    else:
        raise SystemExit(f"OPGUARD_TEST_FAULT={_spec!r}: unknown call {call!r}")


if _spec:
    _call, _, _name = _spec.partition(":")
    _install(_call, getattr(errno, _name or "EIO"))
