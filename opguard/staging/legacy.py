"""Legacy formats, read only (``docs/format.md`` §9, ``docs/legacy.md``).

* **Snapshot**: one ``sync.tar.gz`` per rank directory (``exec_trace/gpu_003/sync.tar.gz``), a
  gzip tar of that directory's files, restored under that directory. Unlike the reference's
  compare (``extractall`` with no filter) every member is checked: absolute names, ``..``,
  links, devices and FIFOs are refused.
* **Reference v1 bundles**: ``.opguard-bundles/<node16>-rank<NNNNNN>/<seq12>-<sha256>.tar``
  (uncompressed tar holding ``manifest.json`` and ``data/<i>`` members), restored to exactly the
  tree the reference's own materialize produces, node-metadata copies into
  ``exec_trace/gpu_<rank:03d>/`` included.

Neither format has seals: their streams are always reported unsealed.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import tarfile
import zlib
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import IO, Any

from opguard.errors import IdentityError, IntegrityError
from opguard.staging.bundle import CHUNK, check_relpath, file_sha256
from opguard.staging.layout import BUNDLES_DIRNAME
from opguard.staging.restore import (
    Progress,
    StreamReport,
    Tree,
    VerifyReport,
    _guarded,
    copy_tree,
    damaged,
)

SNAPSHOT_NAME = "sync.tar.gz"
V1_VERSION = 1
V1_OWNER = re.compile(r"([0-9a-f]{16})-rank([0-9]{6,})")
V1_BATCH = re.compile(r"([0-9]{12})-([0-9a-f]{64})\.tar")
V1_NODE_METADATA = ("exec_trace/source_files", "instrumentation")

_READ_ERRORS = (tarfile.TarError, EOFError, zlib.error, OSError)


def _read_chunks(f: IO[bytes], on_error: Callable[[Exception], IntegrityError],
                 sha: Any = None) -> Iterator[bytes]:
    while True:
        try:
            buf = f.read(CHUNK)
        except _READ_ERRORS as e:
            raise on_error(e) from None
        if not buf:
            return
        if sha is not None:
            sha.update(buf)
        yield buf


# ---- snapshot format ----------------------------------------------------------------------------

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
    except _READ_ERRORS as e:
        raise unreadable(e) from None
    with tar:
        members = iter(tar)
        while True:
            try:
                member = next(members)
            except StopIteration:
                break
            except _READ_ERRORS as e:
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
            except _READ_ERRORS as e:
                raise unreadable(e) from None
            assert f is not None
            n = tree.write(out, _read_chunks(f, unreadable), append=False)
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
        _guarded(sr, tree.root is not None, lambda rel=rel, sr=sr: _extract_snapshot(source, rel, tree, sr))  # type: ignore[misc]
        if progress:
            progress(rel, 1, 1)


# ---- reference v1 bundles -----------------------------------------------------------------------

def find_v1_owners(bundles: Path) -> list[Path]:
    return sorted(p for p in bundles.iterdir() if V1_OWNER.fullmatch(p.name))


def _v1_batches(owner: Path, report: VerifyReport) -> list[tuple[int, str, Path]]:
    stream = owner.name
    batches = []
    for child in sorted(owner.iterdir()):
        if child.name.startswith(".") and child.name.endswith(".part"):
            continue  # the reference's upload temporary: never published
        if not child.name.endswith(".tar"):
            report.warn(f"ignoring unexpected file {child} (not a v1 bundle)")
            continue
        m = V1_BATCH.fullmatch(child.name)
        if m is None:
            raise damaged(stream, f"malformed bundle name {child}")
        if child.is_symlink() or not child.is_file():
            raise damaged(stream, f"{child} is not a regular file (links are refused)")
        batches.append((int(m.group(1)), m.group(2), child))
    for expect, (seq, _d, path) in enumerate(batches, 1):
        if seq < expect:
            raise damaged(stream, f"two bundles with sequence {seq} ({path.name})")
        if seq > expect:
            raise damaged(stream, f"bundle {expect:012d} is missing (next present: {path.name})")
    return batches


def _v1_manifest(stream: str, tar: tarfile.TarFile, path: Path, seq: int) -> dict[str, Any]:
    for member in tar.getmembers():
        if not member.isfile():
            raise damaged(stream, f"bundle {path.name}: member {member.name!r} is not a regular file: refused")
    try:
        f = tar.extractfile("manifest.json")
        assert f is not None
        manifest = json.load(f)
    except (KeyError, ValueError) as e:
        raise damaged(stream, f"bundle {path.name}: no readable manifest.json ({e})") from None
    if not isinstance(manifest, dict) or not isinstance(manifest.get("entries"), list):
        raise damaged(stream, f"bundle {path.name}: manifest.json is not a v1 manifest")
    version = manifest.get("version")
    if isinstance(version, int) and version > V1_VERSION:
        raise IdentityError(f"bundle {path} has manifest version {version}, newer than the reference's v1 this "
                            "opguard reads", "upgrade opguard to read it")
    if version != V1_VERSION:
        raise damaged(stream, f"bundle {path.name}: manifest version {version!r}, expected 1")
    if manifest.get("sequence") != seq or isinstance(manifest.get("sequence"), bool):
        raise damaged(stream, f"bundle {path.name}: manifest sequence {manifest.get('sequence')!r}, expected {seq} "
                              "(a bundle from elsewhere)")
    return manifest


def _v1_entry(stream: str, path: Path, tar: tarfile.TarFile, entry: Any, tree: Tree) -> tuple[str, int]:
    bad = f"bundle {path.name}: entry {entry!r}"
    if not isinstance(entry, dict):
        raise damaged(stream, f"{bad} is not an object")
    rel = entry.get("restore_path", entry.get("path"))
    if not isinstance(entry.get("path"), str) or not isinstance(rel, str):
        raise damaged(stream, f"{bad} has no path")
    try:
        check_relpath(rel)
    except IntegrityError:
        raise damaged(stream, f"bundle {path.name}: unsafe path {rel!r} (absolute, '..' or empty components): "
                              "refused", "the bundle was not written by opguard; do not restore it") from None
    mode, offset, size, sha = entry.get("mode"), entry.get("offset"), entry.get("size"), entry.get("sha256")
    if (mode not in ("append", "replace") or not isinstance(offset, int) or isinstance(offset, bool) or offset < 0
            or not isinstance(size, int) or not isinstance(sha, str) or not isinstance(entry.get("member"), str)):
        raise damaged(stream, f"{bad} has a bad mode, offset, size, sha256 or member")
    try:
        member = tar.getmember(entry["member"])
    except KeyError:
        raise damaged(stream, f"bundle {path.name}: member {entry['member']!r} of {rel!r} is missing") from None
    if member.size != size:
        raise damaged(stream, f"bundle {path.name}: member {member.name!r} holds {member.size} bytes, the manifest "
                              f"says {size}")
    if mode == "append":
        have = tree.size(rel) or 0
        if have != offset:
            raise damaged(stream, f"bundle {path.name}: {rel!r} continues at offset {offset} but {have} bytes were "
                                  "restored (a missing or conflicting log prefix)")
    elif offset != 0:
        raise damaged(stream, f"bundle {path.name}: replacement of {rel!r} starts at {offset}, not 0")
    f = tar.extractfile(member)
    assert f is not None
    h = hashlib.sha256()

    def unreadable(e: Exception) -> IntegrityError:
        return damaged(stream, f"bundle {path.name}: member {member.name!r} is unreadable ({e})")

    n = tree.write(rel, _read_chunks(f, unreadable, h), append=mode == "append")
    if n != size or h.hexdigest() != sha:
        raise damaged(stream, f"bundle {path.name}: payload checksum mismatch for {rel!r}")
    return rel, n


def _replay_owner(owner: Path, tree: Tree, sr: StreamReport, report: VerifyReport, progress: Progress | None) -> None:
    stream = owner.name
    if owner.is_symlink() or not owner.is_dir():
        raise damaged(stream, f"{owner} is not a directory (links are refused)")
    batches = _v1_batches(owner, report)
    sr.last_sequence = len(batches)
    files: set[str] = set()
    for seq, digest, path in batches:
        if file_sha256(path) != digest:
            raise damaged(stream, f"bundle {path.name}: content does not match the digest in its name "
                                  "(altered or truncated)")
        try:
            with tarfile.open(path, "r:") as tar:
                manifest = _v1_manifest(stream, tar, path, seq)
                for entry in manifest["entries"]:
                    rel, n = _v1_entry(stream, path, tar, entry, tree)
                    files.add(rel)
                    sr.bytes += n
        except tarfile.TarError as e:
            raise damaged(stream, f"bundle {path.name}: not a readable tar ({e})") from None
        sr.batches += 1
        sr.files = len(files)
        if progress:
            progress(stream, sr.batches, len(batches))


def _copy_v1_node_metadata(owners: list[Path], root: Path) -> None:
    """As the reference: ``nodes/<node16>/{exec_trace/source_files,instrumentation}`` into each of that
    node's existing ``exec_trace/gpu_<rank:03d>/`` as ``source_files/`` and ``instrumentation/``."""
    for owner in owners:
        m = V1_OWNER.fullmatch(owner.name)
        assert m is not None
        gpu = root / "exec_trace" / f"gpu_{int(m.group(2)):03d}"
        if not gpu.is_dir():
            continue
        for relative in V1_NODE_METADATA:
            metadata = root / "nodes" / m.group(1) / relative
            if metadata.is_dir():
                copy_tree(metadata, gpu / metadata.name)


def run_v1(bundles: Path, tree: Tree, report: VerifyReport, progress: Progress | None) -> None:
    owners = []
    for child in sorted(bundles.iterdir()):
        if V1_OWNER.fullmatch(child.name):
            owners.append(child)
        elif child.is_dir() and not child.is_symlink():
            raise IntegrityError(f"unexpected directory {child} in a reference v1 target (not <node16>-rank<NNNNNN>)",
                                 "move it out of .opguard-bundles if it is not opguard data")
        else:
            report.warn(f"ignoring unexpected file {child} (not a v1 bundle directory)")
    for owner in owners:
        sr = report.add(owner.name)
        sr.node_id = V1_OWNER.fullmatch(owner.name).group(1)  # type: ignore[union-attr]
        _guarded(sr, tree.root is not None,
                 lambda owner=owner, sr=sr: _replay_owner(owner, tree, sr, report, progress))  # type: ignore[misc]
    if tree.root is not None:
        _copy_v1_node_metadata(owners, tree.root)
