"""Reader of format 2 (``docs/format.md`` §5, §7, §8): scan streams and seals, verify and replay batches."""

from __future__ import annotations

import os
import re
import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from opguard.errors import IdentityError, IntegrityError, OpguardError
from opguard.staging.bundle import FORMAT_VERSION, BatchInfo, iter_entries, parse_batch_name, read_manifest
from opguard.staging.fsutil import read_json
from opguard.staging.layout import BUNDLES_DIRNAME, NODE_COPY_DIRNAME, NODES_DIRNAME, RANKS_DIRNAME
from opguard.staging.restore_report import (
    DAMAGED,
    FIX_DAMAGED,
    SEALED,
    UNSEALED,
    NothingPublished,
    Progress,
    StreamReport,
    VerifyReport,
    check_require_sealed,
    damaged,
    guarded,
    warn_unsealed,
)
from opguard.staging.restore_tree import Tree, copy_tree

_RANK_STREAM = re.compile(r"rank-([0-9]{6,})")
_NODE_STREAM = re.compile(r"node-([A-Za-z0-9_-][A-Za-z0-9._-]{0,127})")
_SEAL_NAME = re.compile(r"([0-9]{12})\.seal")
_DIGEST = re.compile(r"[0-9a-f]{64}")


def read_format(bundles: Path) -> str:
    path = bundles / "format.json"
    if path.is_symlink() or not path.is_file():
        raise IntegrityError(f"{path} is not a regular file", "recover it from a backup of the target")
    try:
        data = read_json(path)
    except (OSError, ValueError) as e:
        raise IntegrityError(f"{path} is unreadable ({e})", "recover it from a backup of the target") from None
    if not isinstance(data, dict) or data.get("format") != "opguard-bundles":
        raise IntegrityError(f"{path} is not an opguard-bundles identity file", "check that SOURCE is an opguard run")
    version = data.get("version")
    if not isinstance(version, int) or version < 2:
        raise IntegrityError(f"{path} has an invalid version {version!r}", "recover it from a backup of the target")
    if version > FORMAT_VERSION:
        raise IdentityError(f"{path} has format version {version}; this opguard reads up to {FORMAT_VERSION}",
                            "upgrade opguard to restore this run")
    run_id = data.get("run_id")
    if not isinstance(run_id, str) or not run_id:
        raise IntegrityError(f"{path} has no run_id", "recover it from a backup of the target")
    return run_id


# ---- format 2 -----------------------------------------------------------------------------------

@dataclass
class _Stream:
    name: str
    path: Path
    kind: str
    rank: int | None
    node_id: str | None
    report: StreamReport
    batches: list[tuple[int, str, Path]] = field(default_factory=list)

    @property
    def prefix(self) -> str:
        if self.kind == "rank":
            return f"{RANKS_DIRNAME}/{self.name}"
        return f"{NODES_DIRNAME}/{self.node_id}"


def _stream_identity(name: str) -> tuple[str, int | None, str | None] | None:
    m = _RANK_STREAM.fullmatch(name)
    if m and f"rank-{int(m.group(1)):06d}" == name:
        return "rank", int(m.group(1)), None
    m = _NODE_STREAM.fullmatch(name)
    if m:
        return "node", None, m.group(1)
    return None


def _list_streams(bundles: Path, report: VerifyReport) -> list[_Stream]:
    root = bundles / "streams"
    if not root.exists():
        return []
    if root.is_symlink() or not root.is_dir():
        raise IntegrityError(f"{root} is not a directory", "recover it from a backup of the target")
    streams = []
    for child in sorted(root.iterdir()):
        ident = _stream_identity(child.name)
        if ident is None or child.is_symlink() or not child.is_dir():
            raise IntegrityError(f"{child} is not a stream directory (rank-<R:06d>/ or node-<node ID>/)",
                                 "move it out of .opguard-bundles/streams if it is not opguard data")
        streams.append(_Stream(child.name, child, *ident, report=report.add(child.name)))
    return streams


def _scan_stream(st: _Stream, run_id: str, report: VerifyReport) -> None:
    """Names, contiguity and seals (cheap: no batch content is read). Sets the stream's status."""
    by_seq: dict[int, tuple[str, Path]] = {}
    seals: dict[int, Path] = {}
    for child in sorted(st.path.iterdir()):
        name = child.name
        if name.startswith(".tmp-"):
            continue  # an upload in progress or abandoned: never part of the published history
        if child.is_symlink() or (name.endswith((".ogb", ".seal")) and not child.is_file()):
            raise damaged(st.name, f"{child} is not a regular file")
        if name.endswith(".ogb"):
            parsed = parse_batch_name(name)
            if parsed is None:
                raise damaged(st.name, f"malformed batch name {child}")
            seq, digest = parsed
            if seq in by_seq:
                raise damaged(st.name, f"two batches with sequence {seq}: {by_seq[seq][1].name} and {name}")
            by_seq[seq] = (digest, child)
        elif name.endswith(".seal"):
            m = _SEAL_NAME.fullmatch(name)
            if m is None:
                raise damaged(st.name, f"malformed seal name {child}")
            seals[int(m.group(1))] = child
        else:
            report.warn(f"ignoring unexpected file {child} (not a batch or a seal)")
    n = len(by_seq)
    for seq in range(1, n + 1):
        if seq not in by_seq:
            raise damaged(st.name, f"batch {seq:012d} is missing (batches 1..{max(by_seq)} expected, "
                                   f"{n} present); the hash chain is broken there")
    st.batches = [(seq, *by_seq[seq]) for seq in range(1, n + 1)]
    st.report.last_sequence = n
    current: int | None = None
    for s, path in sorted(seals.items()):
        seal = _read_seal(st, path, s, run_id)
        last, digest = seal["last_sequence"], seal["last_digest"]
        if last > n:
            raise damaged(st.name, f"seal {path.name} names batch {last:012d}, which is missing "
                                   f"(only {n} batches present): the newest batches of a sealed stream were lost")
        if last and digest != by_seq[last][0]:
            raise damaged(st.name, f"seal {path.name} names digest {digest} for batch {last:012d}, "
                                   f"but the published batch is {by_seq[last][1].name}")
        current = last
    st.report.sealed_sequence = current
    if current is not None and current == n:
        st.report.status = SEALED
    else:
        st.report.status = UNSEALED


def _read_seal(st: _Stream, path: Path, seq: int, run_id: str) -> dict[str, Any]:
    try:
        seal = read_json(path)
    except (OSError, ValueError) as e:
        raise damaged(st.name, f"seal {path} is unreadable ({e})") from None
    if not isinstance(seal, dict):
        raise damaged(st.name, f"seal {path} is not a JSON object")
    version = seal.get("version")
    if isinstance(version, int) and version > FORMAT_VERSION:
        raise IdentityError(f"seal {path} has format version {version}; this opguard reads up to {FORMAT_VERSION}",
                            "upgrade opguard to restore this run")
    last, digest = seal.get("last_sequence"), seal.get("last_digest")
    problems = []
    if version != FORMAT_VERSION:
        problems.append(f"version {version!r}")
    if seal.get("stream") != st.name:
        problems.append(f"stream {seal.get('stream')!r}")
    if seal.get("run_id") != run_id:
        problems.append(f"run_id {seal.get('run_id')!r} (the target holds {run_id!r})")
    if not isinstance(last, int) or isinstance(last, bool) or last != seq:
        problems.append(f"last_sequence {last!r} (its name says {seq})")
    elif last == 0 and digest is not None:
        problems.append("a digest for an empty stream")
    elif last > 0 and (not isinstance(digest, str) or not _DIGEST.fullmatch(digest)):
        problems.append(f"last_digest {digest!r}")
    if problems:
        raise damaged(st.name, f"seal {path} has a bad " + ", ".join(problems))
    return seal


def _check_manifest(st: _Stream, info: BatchInfo, seq: int, prev: str | None, run_id: str) -> None:
    m = info.manifest
    expect = {"run_id": run_id, "stream": st.name, "kind": st.kind, "rank": st.rank, "sequence": seq,
              "prev_digest": prev}
    for key, want in expect.items():
        if m.get(key) != want or isinstance(m.get(key), bool):
            what = "the hash chain is broken" if key == "prev_digest" else "it belongs elsewhere"
            raise damaged(st.name, f"batch {info.path.name}: manifest {key} is {m.get(key)!r}, expected {want!r} "
                                   f"({what})")
    if st.kind == "node" and m.get("node_id") != st.node_id:
        raise damaged(st.name, f"batch {info.path.name}: manifest node_id is {m.get('node_id')!r}, "
                               f"expected {st.node_id!r}")
    if st.kind == "rank" and not (isinstance(m.get("node_id"), str) and m["node_id"]):
        raise damaged(st.name, f"batch {info.path.name}: manifest has no node_id")


def _int(entry: dict[str, Any], key: str, minimum: int) -> int:
    value = entry.get(key)
    if not isinstance(value, int) or isinstance(value, bool) or value < minimum:
        raise ValueError(f"entry {entry.get('path')!r} has a bad {key} {value!r}")
    return value


def _apply_batch(st: _Stream, info: BatchInfo, tree: Tree, versions: dict[str, int], files: set[str],
                 digest: str) -> int:
    """Verify every entry of one batch (and the file's ``digest``) and apply it (§7). Returns payload bytes."""
    total = 0
    for entry, chunks in iter_entries(info, digest):
        path = entry.get("path")
        op = entry.get("op")
        try:
            version = _int(entry, "version", 1)
            offset = _int(entry, "offset", 0)
            _int(entry, "size", 0)
        except ValueError as e:
            raise damaged(st.name, f"batch {info.path.name}: {e}") from None
        assert isinstance(path, str)
        rel = f"{st.prefix}/{path}"
        if st.kind == "rank" and (path == NODE_COPY_DIRNAME or path.startswith(NODE_COPY_DIRNAME + "/")):
            raise damaged(st.name, f"batch {info.path.name}: path {path!r} is reserved for the restore's copy "
                                   "of node metadata", "rename that directory in the producer")
        current = versions.get(path, 0)
        if op == "append":
            if version > current:
                if offset != 0:
                    raise damaged(st.name, f"batch {info.path.name}: {path!r} version {version} starts at offset "
                                           f"{offset}, not 0: its beginning is missing")
                append = False
            elif version == current:
                have = tree.size(rel) or 0
                if offset != have:
                    raise damaged(st.name, f"batch {info.path.name}: {path!r} version {version} continues at offset "
                                           f"{offset} but {have} bytes were restored (a gap or an overlap)")
                append = True
            else:
                raise damaged(st.name, f"batch {info.path.name}: {path!r} version {version} after version {current}")
        elif op == "file":
            if version <= current or offset != 0:
                raise damaged(st.name, f"batch {info.path.name}: whole-file entry {path!r} version {version} "
                                       f"offset {offset} after version {current}")
            append = False
        else:
            raise damaged(st.name, f"batch {info.path.name}: unknown entry op {op!r} for {path!r}")
        total += tree.write(rel, chunks, append=append)
        versions[path] = version
        files.add(path)
        mode, mtime = entry.get("mode"), entry.get("mtime_ns")
        tree.set_meta(rel, mode if isinstance(mode, int) else None, mtime if isinstance(mtime, int) else None)
    return total


def _replay_stream(st: _Stream, run_id: str, tree: Tree, progress: Progress | None,
                   stop: threading.Event | None = None) -> None:
    versions: dict[str, int] = {}
    files: set[str] = set()
    prev: str | None = None
    for seq, digest, path in st.batches:
        if stop is not None and stop.is_set():
            return  # another stream failed: the restore is abandoned
        try:
            info = read_manifest(path)
            _check_manifest(st, info, seq, prev, run_id)
            # the file digest is checked in the same pass as decompression (one read of the batch),
            # after its entries were applied to the partial tree, which is published only at the end
            st.report.bytes += _apply_batch(st, info, tree, versions, files, digest)
        except IdentityError:
            raise
        except OpguardError as e:
            if e.message.startswith(f"stream {st.name} "):
                raise
            raise damaged(st.name, f"batch {path.name}: {e.message}", e.fix or FIX_DAMAGED) from None
        except (KeyError, TypeError, ValueError) as e:
            raise damaged(st.name, f"batch {path.name}: malformed manifest ({e!r})") from None
        if st.kind == "rank":
            st.report.node_id = info.manifest["node_id"]
        prev = digest
        st.report.batches += 1
        st.report.files = len(files)
        if progress:
            progress(st.name, st.report.batches, len(st.batches))


def _copy_node_metadata(streams: list[_Stream], root: Path) -> None:
    """``nodes/<id>/`` into ``ranks/rank-<R>/_node/`` for every rank whose last batch names that node."""
    for st in streams:
        if st.kind != "rank" or st.report.node_id is None:
            continue
        src = root / NODES_DIRNAME / st.report.node_id
        if src.is_dir():
            copy_tree(src, root / RANKS_DIRNAME / st.name / NODE_COPY_DIRNAME)


def run_v2(source: Path, tree: Tree, report: VerifyReport, progress: Progress | None, require_sealed: bool) -> None:
    bundles = source / BUNDLES_DIRNAME
    run_id = read_format(bundles)
    report.run_id = run_id
    streams = _list_streams(bundles, report)
    if not streams:
        raise NothingPublished(source, f"{bundles} holds format.json (run {run_id!r}) but no stream under "
                                       f"{bundles / 'streams'}")
    fail_fast = tree.root is not None
    for st in streams:
        guarded(st.report, fail_fast, lambda st=st: _scan_stream(st, run_id, report))  # type: ignore[misc]
    if all(st.report.status != DAMAGED and not st.batches and st.report.sealed_sequence is None for st in streams):
        raise NothingPublished(source, f"its {len(streams)} stream(s) under {bundles / 'streams'} hold no batch "
                                       "and no seal")
    if fail_fast:  # a restore refuses before doing any work; verify reports everything first
        warn_unsealed(report)
        check_require_sealed(report, require_sealed)
    _replay_all([st for st in streams if st.report.status != DAMAGED], run_id, tree, progress, fail_fast)
    if tree.root is not None:
        tree.apply_meta()
        _copy_node_metadata(streams, tree.root)


def _replay_all(streams: list[_Stream], run_id: str, tree: Tree, progress: Progress | None, fail_fast: bool) -> None:
    """Replay streams in parallel threads (one per usable CPU, at most 8): streams restore into
    disjoint subtrees, and decompression, hashing and file writes release the GIL. A restore
    (``fail_fast``) stops the other streams after the first failure and raises the failure of the
    first stream in order; verify replays every stream and marks each damaged one."""
    stop = threading.Event()

    def one(st: _Stream) -> BaseException | None:
        if stop.is_set():
            return None
        try:
            guarded(st.report, fail_fast, lambda: _replay_stream(st, run_id, tree, progress, stop))
        except BaseException as e:  # handed to the calling thread below
            if fail_fast:
                stop.set()
            return e
        return None

    workers = max(1, min(len(os.sched_getaffinity(0)), len(streams), 8))
    if workers == 1:
        errors = [one(st) for st in streams]
    else:
        with ThreadPoolExecutor(max_workers=workers, thread_name_prefix="opguard-restore") as pool:
            errors = list(pool.map(one, streams))
    for err in errors:
        if err is not None:
            raise err

