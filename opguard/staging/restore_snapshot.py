"""Reader of legacy snapshot archives (``docs/format.md`` §9, ``docs/legacy.md`` §2), read only.

One ``sync.tar.gz`` per rank directory (``exec_trace/gpu_003/sync.tar.gz``), a gzip tar of that
directory's files, restored under that directory. Unlike the reference's compare (``extractall``
with no filter) every member is checked: absolute names, ``..``, links, devices and FIFOs are
refused. The format has no seals: its streams are always reported unsealed.
"""

from __future__ import annotations

import os
import tarfile
from pathlib import Path

from opguard.errors import IntegrityError
from opguard.staging import names
from opguard.staging.fsutil import open_beneath, open_regular
from opguard.staging.layout import BUNDLES_DIRNAME, SNAPSHOT_NAME
from opguard.staging.restore_report import RestoreProgress, StreamVerifyReport, VerifyReport, damaged, guarded
from opguard.staging.restore_tree import READ_ERRORS, OutputTree, read_chunks

LONG_NAME_MAX = names.PATH_MAX  # a GNU long name or link name: one path, NUL-terminated
PAX_HEADER_MAX = 2 * names.PATH_MAX + 1024  # path= and linkpath= records, plus the short fixed ones


def find_snapshots(source: Path) -> list[str]:
    """Relative paths of every ``sync.tar.gz`` under SOURCE (not under .opguard-bundles), sorted.

    Walked with an explicit stack (any depth, no recursion), never into a linked directory."""
    found = []
    stack = [""]
    while stack:
        rel = stack.pop()
        try:
            with os.scandir(source / rel if rel else source) as it:
                entries = list(it)
        except OSError as e:
            raise IntegrityError(f"{source / rel} cannot be listed ({e.strerror or e})",
                                 "check that SOURCE is the run's output directory") from None
        for entry in entries:
            child = f"{rel}/{entry.name}" if rel else entry.name
            if entry.name == SNAPSHOT_NAME:
                found.append(child)
            elif entry.is_dir(follow_symlinks=False) and not (not rel and entry.name == BUNDLES_DIRNAME):
                stack.append(child)
    return sorted(found)


def _member_rel(stream: str, reldir: str, name: str) -> str | None:
    """The restored path of a member (None for the archive's own root entry); refuses unsafe names."""
    stripped = name
    while stripped.startswith("./"):
        stripped = stripped[2:]
    stripped = stripped.rstrip("/") if stripped not in ("/",) else stripped
    if stripped in ("", "."):
        return None
    out = f"{reldir}/{stripped}" if reldir else stripped
    try:
        names.relpath(stripped, "member name")
        names.relpath(out, "restored path")
    except IntegrityError as e:
        raise damaged(stream, f"member {names.show(name)} has an unsafe path: refused ({e.message})",
                      "the archive was not written by opguard; inspect it by hand, do not extract it") from None
    return out


class CappedTarInfo(tarfile.TarInfo):
    """A tar header whose GNU long name/link or pax extended header may not exceed the format's
    limits (docs/format.md §11), checked before tarfile reads it into memory."""

    def _proc_member(self, tarfile_: tarfile.TarFile) -> tarfile.TarInfo:
        if self.type in (tarfile.GNUTYPE_LONGNAME, tarfile.GNUTYPE_LONGLINK) and self.size > LONG_NAME_MAX:
            raise tarfile.HeaderError(f"a GNU long name of {self.size} bytes (at most {LONG_NAME_MAX}: PATH_MAX)")
        if self.type in (tarfile.XHDTYPE, tarfile.XGLTYPE, tarfile.SOLARIS_XHDTYPE) and self.size > PAX_HEADER_MAX:
            raise tarfile.HeaderError(f"a pax extended header of {self.size} bytes (at most {PAX_HEADER_MAX}: a path "
                                      "and a link name of PATH_MAX each, and 1 KiB of other records)")
        info: tarfile.TarInfo = super()._proc_member(tarfile_)  # type: ignore[misc]
        return info


def _mtime_ns(mtime: object) -> int | None:
    """A member's mtime in ns, or None when it is not a finite time a file can take."""
    try:
        ns = int(mtime) * 1_000_000_000  # type: ignore[call-overload]
    except (TypeError, ValueError, OverflowError):
        return None
    return ns if -(1 << 63) <= ns < (1 << 63) else None


def _extract_snapshot(source: Path, source_fd: int, rel: str, tree: OutputTree, sr: StreamVerifyReport) -> None:
    archive = source / rel
    stream = rel
    reldir = os.path.dirname(rel)

    def unreadable(e: Exception) -> IntegrityError:
        return damaged(stream, f"archive {archive} is unreadable ({type(e).__name__}: {e}): truncated or corrupt")

    try:
        dfd = open_beneath(source_fd, reldir)
        try:
            fd = open_regular(SNAPSHOT_NAME, dfd)
        finally:
            os.close(dfd)
    except OSError as e:
        raise damaged(stream, f"{archive} cannot be opened as a regular file without following links "
                              f"({e.strerror or e})") from None
    files: set[str] = set()
    raw = os.fdopen(fd, "rb")
    try:
        tar = tarfile.open(fileobj=raw, mode="r|gz", tarinfo=CappedTarInfo)  # noqa: SIM115 (closed below)
    except READ_ERRORS as e:
        raw.close()
        raise unreadable(e) from None
    with raw, tar:
        members = iter(tar)
        while True:
            try:
                member = next(members)
            except StopIteration:
                break
            except READ_ERRORS as e:
                raise unreadable(e) from None
            out = _member_rel(stream, reldir, member.name)
            if member.isdir():
                if out is not None:
                    tree.mkdir(out)
                continue
            if not member.isfile() or out is None:
                kind = ("a symbolic link" if member.issym() else "a hard link" if member.islnk()
                        else "a FIFO" if member.isfifo() else "a device" if member.isdev() else "not a regular file")
                raise damaged(stream, f"member {member.name!r} is {kind}: refused (a restore creates only "
                                      "directories and regular files)",
                              "the archive was not written by opguard; inspect it by hand, do not extract it")
            try:
                f = tar.extractfile(member)
            except READ_ERRORS as e:
                raise unreadable(e) from None
            assert f is not None
            tree.reserve(member.size, f"member {names.show(member.name)} of {archive}")
            n = tree.write(out, read_chunks(f, unreadable), append=False)
            if n != member.size:
                raise damaged(stream, f"member {member.name!r} holds {n} bytes, its header says {member.size}")
            tree.set_meta(out, member.mode, _mtime_ns(member.mtime))
            files.add(out)
            sr.bytes += n
    sr.files = len(files)
    sr.batches = sr.last_sequence = 1


def run_snapshots(source: Path, tree: OutputTree, report: VerifyReport, progress: RestoreProgress | None) -> None:
    source_fd = os.open(source, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)  # SOURCE itself is the caller's
    try:
        for rel in find_snapshots(source):
            sr = report.add(rel)
            guarded(sr, tree.root is not None,
                    lambda rel=rel, sr=sr: _extract_snapshot(source, source_fd, rel, tree, sr))  # type: ignore[misc]
            if progress:
                progress(rel, 1, 1)
    finally:
        os.close(source_fd)

