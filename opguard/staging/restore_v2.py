"""Reader of format 2 (``docs/format.md`` §5, §7, §8): scan streams and seals, verify and replay batches.

Every directory and file of the target is opened relative to its parent's descriptor without
following a link (``.opguard-bundles``, ``streams``, each stream, each batch and seal); every name
taken from the target is checked by :mod:`opguard.staging.names` before it is used.
"""

from __future__ import annotations

import os
import re
import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from opguard.errors import IdentityError, IntegrityError, OpguardError
from opguard.staging import names
from opguard.staging.bundle import (
    BATCH_SUFFIX,
    FORMAT_NAME,
    FORMAT_VERSION,
    SEAL_SUFFIX,
    BatchInfo,
    iter_entries,
    open_batch,
    parse_batch_name,
    parse_seal_name,
)
from opguard.staging.fsutil import loads_json, open_beneath, open_dir_nofollow, open_regular
from opguard.staging.layout import (
    BUNDLES_DIRNAME,
    FORMAT_FILE,
    NODE_COPY_DIRNAME,
    NODES_DIRNAME,
    RANKS_DIRNAME,
    STREAMS_DIRNAME,
)
from opguard.staging.restore_report import (
    DAMAGED,
    FIX_DAMAGED,
    SEALED,
    UNSEALED,
    NothingPublished,
    RestoreProgress,
    RestoreReport,
    StreamVerifyReport,
    VerifyReport,
    check_require_sealed,
    damaged,
    guarded,
    warn_unsealed,
)
from opguard.staging.restore_tree import OutputTree

_DIGEST = re.compile(r"[0-9a-f]{64}")
# format.json and seals hold a handful of fields of bounded size (IDs of at most 128 characters,
# digests, numbers): 64 KiB is far above any real one and bounds what a reader loads
SMALL_JSON_MAX = 64 << 10
_FIX_TARGET = "recover it from a backup of the target"


def read_small_json(name: str, dir_fd: int, shown: Path) -> Any:
    """A small JSON document (``format.json``, a seal), opened without following a link, size-capped."""
    fd = open_regular(name, dir_fd)
    with os.fdopen(fd, "rb") as f:
        data = f.read(SMALL_JSON_MAX + 1)
    if len(data) > SMALL_JSON_MAX:
        raise ValueError(f"more than {SMALL_JSON_MAX} bytes")
    try:
        return loads_json(data)
    except RecursionError:
        raise ValueError("nested too deeply") from None


def read_format(bundles: Path, bfd: int) -> str:
    path = bundles / FORMAT_FILE
    try:
        data = read_small_json(FORMAT_FILE, bfd, path)
    except (OSError, ValueError) as e:
        raise IntegrityError(f"{path} is unreadable or not a regular file ({e})", _FIX_TARGET) from None
    if not isinstance(data, dict) or data.get("format") != FORMAT_NAME:
        raise IntegrityError(f"{path} is not an opguard-bundles identity file", "check that SOURCE is an opguard run")
    version = data.get("version")
    if not isinstance(version, int) or isinstance(version, bool) or version < 2:
        raise IntegrityError(f"{path} has an invalid version {names.show(version)}", _FIX_TARGET)
    if version > FORMAT_VERSION:
        raise IdentityError(f"{path} has format version {version}; this opguard reads up to {FORMAT_VERSION}",
                            "upgrade opguard to restore this run")
    try:
        return names.run_id(data.get("run_id"), f"{path} field run_id")
    except IntegrityError as e:
        raise IntegrityError(e.message, _FIX_TARGET) from None


# ---- format 2 -----------------------------------------------------------------------------------

@dataclass
class _Stream:
    name: str
    path: Path
    kind: str
    rank: int | None
    node_id: str | None
    report: StreamVerifyReport
    bfd: int  # the descriptor of .opguard-bundles/ (the stream directory is reopened below it)
    batches: list[tuple[int, str, Path]] = field(default_factory=list)
    origins: dict[str, tuple[int, str]] = field(default_factory=dict)  # path -> (sequence, node ID) of its last entry

    @property
    def prefix(self) -> str:
        if self.kind == "rank":
            return f"{RANKS_DIRNAME}/{self.name}"
        return f"{NODES_DIRNAME}/{self.node_id}"

    def open(self) -> int:
        """The stream directory, walked from .opguard-bundles/ without following links."""
        try:
            return open_beneath(self.bfd, f"streams/{self.name}")
        except OSError as e:
            raise damaged(self.name, f"{self.path} cannot be opened as a directory without following links "
                                     f"({e.strerror or e})") from None


def _list_streams(bundles: Path, bfd: int, report: VerifyReport) -> list[_Stream]:
    root = bundles / STREAMS_DIRNAME
    try:
        sfd = open_dir_nofollow(STREAMS_DIRNAME, bfd)
    except FileNotFoundError:
        return []
    except OSError as e:
        raise IntegrityError(f"{root} is not a directory ({e.strerror or e}; links are refused)", _FIX_TARGET) \
            from None
    try:
        listed = sorted(os.listdir(sfd))
        streams = []
        for name in listed:
            try:
                ident = names.stream(name, f"directory {root}/")
                os.close(open_dir_nofollow(name, sfd))
            except (IntegrityError, OSError):
                raise IntegrityError(f"{root / name} is not a stream directory (rank-<R:06d>/ or node-<node ID>/; "
                                     "links are refused)",
                                     "move it out of .opguard-bundles/streams if it is not opguard data") from None
            streams.append(_Stream(name, root / name, *ident, report=report.add(name), bfd=bfd))
    finally:
        os.close(sfd)
    return streams


def _scan_stream(st: _Stream, run_id: str, report: VerifyReport) -> None:
    """Names, contiguity and seals (cheap: no batch content is read). Sets the stream's status."""
    by_seq: dict[int, tuple[str, Path]] = {}
    seals: dict[int, Path] = {}
    dfd = st.open()
    try:
        for name in sorted(os.listdir(dfd)):
            child = st.path / name
            if name.startswith(".tmp-"):
                continue  # an upload in progress or abandoned: never part of the published history
            if name.endswith(BATCH_SUFFIX):
                parsed = parse_batch_name(name)
                if parsed is None:
                    raise damaged(st.name, f"malformed batch name {names.show(name)} in {st.path}")
                seq, digest = parsed
                if seq in by_seq:
                    raise damaged(st.name, f"two batches with sequence {seq}: {by_seq[seq][1].name} and {name}")
                by_seq[seq] = (digest, child)
            elif name.endswith(SEAL_SUFFIX):
                sealed = parse_seal_name(name)
                if sealed is None:
                    raise damaged(st.name, f"malformed seal name {names.show(name)} in {st.path}")
                seals[sealed] = child
            else:
                report.warn(f"ignoring unexpected file {child} (not a batch or a seal)")
                continue
            try:
                os.close(open_regular(name, dfd))
            except OSError as e:
                raise damaged(st.name, f"{child} is not a regular file ({e.strerror or e}; links are refused)") \
                    from None
        n = len(by_seq)
        for seq in range(1, n + 1):
            if seq not in by_seq:
                raise damaged(st.name, f"batch {seq:012d} is missing (batches 1..{max(by_seq)} expected, "
                                       f"{n} present); the hash chain is broken there")
        st.batches = [(seq, *by_seq[seq]) for seq in range(1, n + 1)]
        st.report.last_sequence = n
        current: int | None = None
        for s, path in sorted(seals.items()):
            seal = _read_seal(st, dfd, path, s, run_id)
            last, digest = seal["last_sequence"], seal["last_digest"]
            if last > n:
                raise damaged(st.name, f"seal {path.name} names batch {last:012d}, which is missing "
                                       f"(only {n} batches present): the newest batches of a sealed stream were lost")
            if last and digest != by_seq[last][0]:
                raise damaged(st.name, f"seal {path.name} names digest {digest} for batch {last:012d}, "
                                       f"but the published batch is {by_seq[last][1].name}")
            current = last
    finally:
        os.close(dfd)
    st.report.sealed_sequence = current
    if current is not None and current == n:
        st.report.status = SEALED
    else:
        st.report.status = UNSEALED


def _read_seal(st: _Stream, dfd: int, path: Path, seq: int, run_id: str) -> dict[str, Any]:
    try:
        seal = read_small_json(path.name, dfd, path)
    except (OSError, ValueError) as e:
        raise damaged(st.name, f"seal {path} is unreadable or not a regular file ({e})") from None
    if not isinstance(seal, dict):
        raise damaged(st.name, f"seal {path} is not a JSON object")
    version = seal.get("version")
    if isinstance(version, int) and not isinstance(version, bool) and version > FORMAT_VERSION:
        raise IdentityError(f"seal {path} has format version {version}; this opguard reads up to {FORMAT_VERSION}",
                            "upgrade opguard to restore this run")
    last, digest = seal.get("last_sequence"), seal.get("last_digest")
    problems = []
    if version != FORMAT_VERSION or isinstance(version, bool):
        problems.append(f"version {names.show(version)}")
    if seal.get("stream") != st.name:
        problems.append(f"stream {names.show(seal.get('stream'))}")
    if seal.get("run_id") != run_id:
        problems.append(f"run_id {names.show(seal.get('run_id'))} (the target holds {run_id!r})")
    if not isinstance(last, int) or isinstance(last, bool) or last != seq:
        problems.append(f"last_sequence {names.show(last)} (its name says {seq})")
    elif last == 0 and digest is not None:
        problems.append("a digest for an empty stream")
    elif last > 0 and (not isinstance(digest, str) or not _DIGEST.fullmatch(digest)):
        problems.append(f"last_digest {names.show(digest)}")
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
            raise damaged(st.name, f"batch {info.path.name}: manifest {key} is {names.show(m.get(key))}, "
                                   f"expected {want!r} ({what})")
    # the node ID names a directory of the restored tree (nodes/<id>/, copied into the rank's _node/)
    node = names.node_id(m.get("node_id"), "manifest field node_id")
    if st.kind == "node" and node != st.node_id:
        raise damaged(st.name, f"batch {info.path.name}: manifest node_id is {names.show(node)}, "
                               f"expected {st.node_id!r}")


def _check_batch_paths(st: _Stream, info: BatchInfo) -> None:
    """One scan of a real file system cannot hold a path as both a file and a directory
    (docs/format.md §8): refuse a batch that does. Linear in its entries (a set of paths, and
    every proper prefix of each path looked up once)."""
    paths = {e["path"] for e in info.manifest["entries"]}
    for p in paths:
        i = p.find("/")
        while i >= 0:
            if p[:i] in paths:
                raise damaged(st.name, f"batch {info.path.name}: {names.show(p[:i])} is both a file and the "
                                       f"directory of {names.show(p)} in one batch (one scan cannot see both)")
            i = p.find("/", i + 1)


def _apply_batch(st: _Stream, info: BatchInfo, tree: OutputTree, versions: dict[str, int], files: set[str],
                 digest: str, seq: int) -> int:
    """Verify every entry of one batch (and the file's ``digest``) and apply it (§7). Returns payload bytes."""
    _check_batch_paths(st, info)
    node = str(info.manifest["node_id"])  # checked by _check_manifest
    tree.reserve(sum(e["size"] for e in info.manifest["entries"]), f"batch {info.path}")
    total = 0
    for entry, chunks in iter_entries(info, digest):
        path = entry["path"]  # types and names checked by open_batch
        op = entry.get("op")
        version, offset = entry["version"], entry["offset"]
        if version < 1:
            raise damaged(st.name, f"batch {info.path.name}: entry {names.show(path)} has version {version}, not >= 1")
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
            raise damaged(st.name, f"batch {info.path.name}: unknown entry op {names.show(op)} for {path!r}")
        total += tree.write(rel, chunks, append=append)
        versions[path] = version
        files.add(path)
        st.origins[path] = (seq, node)
        mode, mtime = entry.get("mode"), entry.get("mtime_ns")
        tree.set_meta(rel, mode if _is_int(mode) else None, mtime if _is_int(mtime) else None)
    return total


def _is_int(value: object) -> bool:
    """An int a file's metadata can take (chmod bits, utime nanoseconds within int64)."""
    return isinstance(value, int) and not isinstance(value, bool) and -(1 << 63) <= value < (1 << 63)


def _replay_stream(st: _Stream, run_id: str, tree: OutputTree, progress: RestoreProgress | None,
                   stop: threading.Event | None = None) -> None:
    versions: dict[str, int] = {}
    files: set[str] = set()
    prev: str | None = None
    dfd = st.open()
    try:
        for seq, digest, path in st.batches:
            if stop is not None and stop.is_set():
                return  # another stream failed: the restore is abandoned
            try:
                info = open_batch(path, dfd)
                try:
                    _check_manifest(st, info, seq, prev, run_id)
                    # the file digest is checked in the same pass as decompression (one read of the batch),
                    # after its entries were applied to the partial tree, which is published only at the end
                    st.report.bytes += _apply_batch(st, info, tree, versions, files, digest, seq)
                finally:
                    info.close()
            except IdentityError:
                raise
            except OpguardError as e:
                if e.message.startswith(f"stream {st.name} ") or e.exit_code != IntegrityError.exit_code:
                    raise
                raise damaged(st.name, f"batch {path.name}: {e.message}", e.fix or FIX_DAMAGED) from None
            if st.kind == "rank":
                st.report.node_id = info.manifest["node_id"]
            prev = digest
            st.report.batches += 1
            st.report.files = len(files)
            if progress:
                progress(st.name, st.report.batches, len(st.batches))
    finally:
        os.close(dfd)


def _copy_node_metadata(streams: list[_Stream], tree: OutputTree) -> None:
    """``nodes/<id>/`` into ``ranks/rank-<R>/_node/`` for every rank whose last batch names that node
    (the node ID was checked against docs/format.md §2 when its batch was read)."""
    for st in streams:
        if st.kind == "rank" and st.report.node_id is not None:
            tree.copy_dir(f"{NODES_DIRNAME}/{st.report.node_id}", f"{RANKS_DIRNAME}/{st.name}/{NODE_COPY_DIRNAME}")


def run_v2(source: Path, tree: OutputTree, report: VerifyReport, progress: RestoreProgress | None,
           require_sealed: bool) -> None:
    bundles = source / BUNDLES_DIRNAME
    try:
        bfd = open_dir_nofollow(bundles)
    except OSError as e:
        raise IntegrityError(f"{bundles} cannot be opened as a directory without following links "
                             f"({e.strerror or e})", "restore from the real directory") from None
    try:
        _run_v2(source, bundles, bfd, tree, report, progress, require_sealed)
    finally:
        os.close(bfd)


def _run_v2(source: Path, bundles: Path, bfd: int, tree: OutputTree, report: VerifyReport,
            progress: RestoreProgress | None, require_sealed: bool) -> None:
    run_id = read_format(bundles, bfd)
    report.run_id = run_id
    streams = _list_streams(bundles, bfd, report)
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
        _copy_node_metadata(streams, tree)
        if isinstance(report, RestoreReport):
            report.origins = _origins(streams, tree)


def _origins(streams: list[_Stream], tree: OutputTree) -> dict[str, dict[str, Any]]:
    """Every restored file of a stream -> the batch and node its last entry came from, as the replay
    applied it (a path the latest-wins rule left out of the tree is not listed; nor the _node/ copies)."""
    out: dict[str, dict[str, Any]] = {}
    for st in streams:
        for path, (seq, node) in st.origins.items():
            rel = f"{st.prefix}/{path}"
            if tree.size(rel) is not None:
                out[rel] = {"stream": st.name, "sequence": seq, "node_id": node}
    return dict(sorted(out.items()))


def _replay_all(streams: list[_Stream], run_id: str, tree: OutputTree, progress: RestoreProgress | None,
                fail_fast: bool) -> None:
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

