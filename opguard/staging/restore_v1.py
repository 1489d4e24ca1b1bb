"""Reader of the reference implementation's v1 bundles (``docs/format.md`` §9, ``docs/legacy.md`` §1), read only.

``.opguard-bundles/<node16>-rank<NNNNNN>/<seq12>-<sha256>.tar`` (uncompressed tar holding
``manifest.json`` and ``data/<i>`` members), restored to exactly the tree the reference's own
materialize produces, node-metadata copies into ``exec_trace/gpu_<rank:03d>/`` included. The
format has no seals: its streams are always reported unsealed.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import tarfile
from pathlib import Path
from typing import Any

from opguard.errors import IdentityError, IntegrityError
from opguard.staging import names
from opguard.staging.bundle import CHUNK
from opguard.staging.fsutil import open_beneath, open_regular
from opguard.staging.restore_report import RestoreProgress, StreamVerifyReport, VerifyReport, damaged, guarded
from opguard.staging.restore_snapshot import CappedTarInfo
from opguard.staging.restore_tree import READ_ERRORS, OutputTree, read_chunks

V1_VERSION = 1
V1_OWNER = re.compile(r"([0-9a-f]{16})-rank([0-9]{6,})")
V1_BATCH = re.compile(r"([0-9]{12})-([0-9a-f]{64})\.tar")
V1_NODE_METADATA = ("exec_trace/source_files", "instrumentation")


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
    except (KeyError, ValueError, RecursionError) as e:
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


def _v1_entry(stream: str, path: Path, tar: tarfile.TarFile, entry: Any, tree: OutputTree, i: int) -> tuple[str, int]:
    bad = f"bundle {path.name}: entries[{i}] {names.show(entry)}"
    if not isinstance(entry, dict):
        raise damaged(stream, f"{bad} is not an object")
    field = "restore_path" if "restore_path" in entry else "path"
    try:
        names.relpath(entry.get("path"), "field path")
        rel = names.relpath(entry.get(field), f"field {field}")
    except IntegrityError as e:
        raise damaged(stream, f"bundle {path.name}: unsafe path: {e.message}: refused",
                      "the bundle was not written by opguard; do not restore it") from None
    mode, offset, size, sha = entry.get("mode"), entry.get("offset"), entry.get("size"), entry.get("sha256")
    if (mode not in ("append", "replace") or not isinstance(offset, int) or isinstance(offset, bool) or offset < 0
            or not isinstance(size, int) or isinstance(size, bool) or size < 0 or not isinstance(sha, str)
            or not isinstance(entry.get("member"), str)):
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
    if not member.isfile():
        raise damaged(stream, f"bundle {path.name}: member {names.show(member.name)} is not a regular file: refused")
    tree.reserve(size, f"bundle {path}, entry {names.show(rel)},")
    f = tar.extractfile(member)
    assert f is not None
    h = hashlib.sha256()

    def unreadable(e: Exception) -> IntegrityError:
        return damaged(stream, f"bundle {path.name}: member {member.name!r} is unreadable ({e})")

    n = tree.write(rel, read_chunks(f, unreadable, h), append=mode == "append")
    if n != size or h.hexdigest() != sha:
        raise damaged(stream, f"bundle {path.name}: payload checksum mismatch for {rel!r}")
    return rel, n


def _replay_owner(owner: Path, bfd: int, tree: OutputTree, sr: StreamVerifyReport, report: VerifyReport,
                  progress: RestoreProgress | None) -> None:
    stream = owner.name
    try:
        dfd = open_beneath(bfd, owner.name)
    except OSError as e:
        raise damaged(stream, f"{owner} cannot be opened as a directory without following links "
                              f"({e.strerror or e})") from None
    try:
        _replay_owner_fd(owner, dfd, tree, sr, report, progress)
    finally:
        os.close(dfd)


def _replay_owner_fd(owner: Path, dfd: int, tree: OutputTree, sr: StreamVerifyReport, report: VerifyReport,
                     progress: RestoreProgress | None) -> None:
    stream = owner.name
    batches = _v1_batches(owner, report)
    sr.last_sequence = len(batches)
    files: set[str] = set()
    for seq, digest, path in batches:
        try:
            fd = open_regular(path.name, dfd)
        except OSError as e:
            raise damaged(stream, f"{path} is not a regular file ({e.strerror or e}; links are refused)") from None
        with os.fdopen(fd, "rb") as f:
            sha = hashlib.sha256()
            while buf := f.read(CHUNK):
                sha.update(buf)
            if sha.hexdigest() != digest:
                raise damaged(stream, f"bundle {path.name}: content does not match the digest in its name "
                                      "(altered or truncated)")
            f.seek(0)
            try:
                with tarfile.open(fileobj=f, mode="r:", tarinfo=CappedTarInfo) as tar:
                    manifest = _v1_manifest(stream, tar, path, seq)
                    for i, entry in enumerate(manifest["entries"]):
                        rel, n = _v1_entry(stream, path, tar, entry, tree, i)
                        files.add(rel)
                        sr.bytes += n
            except READ_ERRORS as e:
                raise damaged(stream, f"bundle {path.name}: not a readable tar ({type(e).__name__}: {e})") from None
        sr.batches += 1
        sr.files = len(files)
        if progress:
            progress(stream, sr.batches, len(batches))


def _copy_v1_node_metadata(owners: list[Path], tree: OutputTree) -> None:
    """As the reference: ``nodes/<node16>/{exec_trace/source_files,instrumentation}`` into each of that
    node's existing ``exec_trace/gpu_<rank:03d>/`` as ``source_files/`` and ``instrumentation/``."""
    for owner in owners:
        m = V1_OWNER.fullmatch(owner.name)
        assert m is not None
        gpu = f"exec_trace/gpu_{int(m.group(2)):03d}"
        if not tree.is_dir(gpu):
            continue
        for relative in V1_NODE_METADATA:
            metadata = f"nodes/{m.group(1)}/{relative}"
            if tree.is_dir(metadata):
                tree.copy_dir(metadata, f"{gpu}/{relative.rpartition('/')[2]}")


def run_v1(bundles: Path, tree: OutputTree, report: VerifyReport, progress: RestoreProgress | None) -> None:
    source_fd = os.open(bundles.parent, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)  # SOURCE: the caller's
    try:
        _run_v1(bundles, source_fd, tree, report, progress)
    finally:
        os.close(source_fd)


def _run_v1(bundles: Path, source_fd: int, tree: OutputTree, report: VerifyReport,
            progress: RestoreProgress | None) -> None:
    try:
        bfd = open_beneath(source_fd, bundles.name)
    except OSError as e:
        raise IntegrityError(f"{bundles} cannot be opened as a directory without following links "
                             f"({e.strerror or e})", "restore from the real directory") from None
    try:
        owners = []
        for name in sorted(os.listdir(bfd)):
            child = bundles / name
            if V1_OWNER.fullmatch(name):
                owners.append(child)
            elif child.is_dir() and not child.is_symlink():
                raise IntegrityError(f"unexpected directory {child} in a reference v1 target "
                                     "(not <node16>-rank<NNNNNN>)",
                                     "move it out of .opguard-bundles if it is not opguard data")
            else:
                report.warn(f"ignoring unexpected file {child} (not a v1 bundle directory)")
        for owner in owners:
            sr = report.add(owner.name)
            sr.node_id = V1_OWNER.fullmatch(owner.name).group(1)  # type: ignore[union-attr]
            guarded(sr, tree.root is not None,
                    lambda owner=owner, sr=sr: _replay_owner(owner, bfd, tree, sr, report, progress))  # type: ignore[misc]
    finally:
        os.close(bfd)
    if tree.root is not None:
        _copy_v1_node_metadata(owners, tree)
