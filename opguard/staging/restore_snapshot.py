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
from opguard.staging.bundle import check_relpath
from opguard.staging.layout import BUNDLES_DIRNAME
from opguard.staging.restore_report import Progress, StreamReport, VerifyReport, damaged, guarded
from opguard.staging.restore_tree import READ_ERRORS, Tree, read_chunks

SNAPSHOT_NAME = "sync.tar.gz"


def find_snapshots(source: Path) -> list[str]:
    """Relative paths of every ``sync.tar.gz`` under SOURCE (not under .opguard-bundles), sorted."""
    found = []
    for dirpath, dirs, files in os.walk(source):
        if os.path.samefile(dirpath, source):
            dirs[:] = [d for d in dirs if d != BUNDLES_DIRNAME]
        if SNAPSHOT_NAME in files or SNAPSHOT_NAME in dirs:
            found.append(os.path.relpath(os.path.join(dirpath, SNAPSHOT_NAME), source))
    return sorted(found)


def _member_rel(stream: str, reldir: str, name: str) -> str | None:
    """The restored path of a member (None for the archive's own root entry); refuses unsafe names."""
    stripped = name
    while stripped.startswith("./"):
        stripped = stripped[2:]
    stripped = stripped.rstrip("/") if stripped not in ("/",) else stripped
    if stripped in ("", "."):
        return None
    try:
        check_relpath(stripped)
    except IntegrityError:
        raise damaged(stream, f"member {name!r} has an unsafe path (absolute, '..' or empty components): refused",
                      "the archive was not written by opguard; inspect it by hand, do not extract it") from None
    return f"{reldir}/{stripped}" if reldir else stripped


def _extract_snapshot(source: Path, rel: str, tree: Tree, sr: StreamReport) -> None:
    archive = source / rel
    stream = rel
    reldir = os.path.dirname(rel)

    def unreadable(e: Exception) -> IntegrityError:
        return damaged(stream, f"archive {archive} is unreadable ({type(e).__name__}: {e}): truncated or corrupt")

    if archive.is_symlink() or not archive.is_file():
        raise damaged(stream, f"{archive} is not a regular file (links are refused)")
    files: set[str] = set()
    try:
        tar = tarfile.open(archive, "r|gz")  # noqa: SIM115 (closed by the with below)
    except READ_ERRORS as e:
        raise unreadable(e) from None
    with tar:
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
            n = tree.write(out, read_chunks(f, unreadable), append=False)
            if n != member.size:
                raise damaged(stream, f"member {member.name!r} holds {n} bytes, its header says {member.size}")
            tree.set_meta(out, member.mode, int(member.mtime) * 1_000_000_000)
            files.add(out)
            sr.bytes += n
    sr.files = len(files)
    sr.batches = sr.last_sequence = 1


def run_snapshots(source: Path, tree: Tree, report: VerifyReport, progress: Progress | None) -> None:
    for rel in find_snapshots(source):
        sr = report.add(rel)
        guarded(sr, tree.root is not None, lambda rel=rel, sr=sr: _extract_snapshot(source, rel, tree, sr))  # type: ignore[misc]
        if progress:
            progress(rel, 1, 1)

