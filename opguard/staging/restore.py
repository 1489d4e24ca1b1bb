"""Verify and restore a shared target (``docs/format.md`` §5, §7, §8; legacy formats §9).

``verify(source)`` reads everything and writes nothing; ``materialize(source, dest)`` builds the
logical tree in ``DEST.opguard-partial-<random>`` beside DEST, verifying every batch as it is
applied, fsyncs it and publishes it with one no-replace rename. On any failure the partial tree
is removed: DEST never appears half-written.

Stream status: **sealed** (the current seal names the last batch), **unsealed** (no seal, or
batches follow it: the job may have died before its final drain; reported loudly, an error with
``require_sealed``), **damaged** (a missing, altered, truncated or foreign batch, a broken hash
chain or a seal naming a missing batch: always an error, exit 5). A newer format is refused
(exit 6). Reference v1 bundles and legacy ``sync.tar.gz`` snapshots carry no seals: their
streams are always reported unsealed.

``progress``, when given, is called as ``progress(stream, batches_done, batches_total)`` after
each batch (or archive) of a stream.
"""

from __future__ import annotations

import ctypes
import errno
import json
import os
import re
import secrets
import shutil
import sys
import threading
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from opguard.errors import ConfigError, IdentityError, IntegrityError, OpguardError
from opguard.staging.bundle import (
    FORMAT_VERSION,
    BatchInfo,
    check_relpath,
    iter_entries,
    parse_batch_name,
    read_manifest,
)
from opguard.staging.fsutil import fsync_dir, read_json, syncfs
from opguard.staging.layout import BUNDLES_DIRNAME, NODE_COPY_DIRNAME, NODES_DIRNAME, RANKS_DIRNAME

Progress = Callable[[str, int, int], None]

SEALED = "sealed"
UNSEALED = "unsealed"
DAMAGED = "damaged"

FORMAT_V2 = "opguard-bundles-v2"
FORMAT_V1 = "reference-v1-bundles"
FORMAT_SNAPSHOT = "legacy-snapshot"

_RANK_STREAM = re.compile(r"rank-([0-9]{6,})")
_NODE_STREAM = re.compile(r"node-([A-Za-z0-9_-][A-Za-z0-9._-]{0,127})")
_SEAL_NAME = re.compile(r"([0-9]{12})\.seal")
_DIGEST = re.compile(r"[0-9a-f]{64}")
_FIX_DAMAGED = ("recover the named file from a backup of the shared target; published data cannot be "
                "restored past a damaged batch of its stream")


# ---- reports ------------------------------------------------------------------------------------

@dataclass
class StreamReport:
    """One stream: a v2 stream, a v1 owner directory or one legacy ``sync.tar.gz``."""

    stream: str
    status: str = UNSEALED
    batches: int = 0
    files: int = 0
    bytes: int = 0
    last_sequence: int = 0
    sealed_sequence: int | None = None
    node_id: str | None = None
    error: str | None = None


@dataclass
class VerifyReport:
    source: str
    format: str = ""
    run_id: str | None = None
    streams: list[StreamReport] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)

    @property
    def batches(self) -> int:
        return sum(s.batches for s in self.streams)

    @property
    def files(self) -> int:
        return sum(s.files for s in self.streams)

    @property
    def bytes(self) -> int:
        return sum(s.bytes for s in self.streams)

    def with_status(self, status: str) -> list[StreamReport]:
        return [s for s in self.streams if s.status == status]

    @property
    def ok(self) -> bool:
        """True when nothing published is damaged (unsealed streams are not damage)."""
        return not self.with_status(DAMAGED)

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d.update(ok=self.ok, batches=self.batches, files=self.files, bytes=self.bytes,
                 sealed=len(self.with_status(SEALED)), unsealed=len(self.with_status(UNSEALED)),
                 damaged=len(self.with_status(DAMAGED)))
        return d

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=1, sort_keys=True)

    def warn(self, message: str) -> None:
        """Record a warning and print it to stderr at once (a library caller sees it too)."""
        self.warnings.append(message)
        print(f"opguard: WARNING: {message}", file=sys.stderr, flush=True)

    def add(self, stream: str) -> StreamReport:
        sr = StreamReport(stream)
        self.streams.append(sr)
        return sr


@dataclass
class RestoreReport(VerifyReport):
    dest: str = ""


class DamagedSource(IntegrityError):
    """Integrity failure (exit 5) that carries the report of everything that was checked."""

    def __init__(self, message: str, fix: str, report: VerifyReport) -> None:
        super().__init__(message, fix)
        self.report = report


class NothingPublished(IntegrityError):
    """SOURCE is a run's target but holds no published stream yet (exit 5: the data is missing)."""

    def __init__(self, source: Path, what: str) -> None:
        super().__init__(
            f"nothing has been published to {source} yet: {what}; there is nothing to restore",
            "wait for the run's first sync (every OPGUARD_LOCAL_DUMP_SYNC_INTERVAL seconds), or run "
            "`opguard sync --all --final` on each node whose staging directory (OPGUARD_LOCAL_DUMP_BASE) still "
            "exists; if the job has ended and its staging directories are gone, none of its data can be restored")


def damaged(stream: str, what: str, fix: str = _FIX_DAMAGED) -> IntegrityError:
    return IntegrityError(f"stream {stream} is damaged: {what}", fix)


# ---- the tree being restored (or, with root None, only simulated) --------------------------------

class Tree:
    """Regular files and directories under ``root``; with ``root`` None only simulated (same checks).

    Every path is checked with :func:`check_relpath`; only directories and regular files are ever
    created, so no path can leave the root. A path that was a file and later a directory (or the
    reverse: the producer deleted one and created the other) follows the **latest wins** rule of
    ``docs/format.md`` §8: the older file, or the older directory with every file under it, is
    left out of the result and reported through ``warn``.
    """

    def __init__(self, root: Path | None, warn: Callable[[str], None] | None = None) -> None:
        self.root = root
        self.warn = warn or (lambda _msg: None)
        self.sizes: dict[str, int] = {}
        self.dirs: set[str] = set()  # every directory holding a restored file or made by mkdir
        self.meta: dict[str, tuple[int | None, int | None]] = {}
        self._lock = threading.Lock()  # streams are restored by parallel threads (disjoint subtrees)

    def size(self, rel: str) -> int | None:
        return self.sizes.get(rel)

    def _make_parents(self, rel: str) -> None:
        """Register (and create) the directories above ``rel``, replacing older files in the way."""
        parent = rel.rpartition("/")[0]
        if not parent or parent in self.dirs:
            return  # invariant: every ancestor of a registered directory is a registered directory
        parts = parent.split("/")
        with self._lock:
            for k in range(1, len(parts) + 1):
                d = "/".join(parts[:k])
                if d in self.sizes:
                    self._drop_file(d, f"{rel!r}")
                self.dirs.add(d)
        if self.root is not None:
            (self.root / parent).mkdir(parents=True, exist_ok=True)

    def _drop_file(self, old: str, new: str) -> None:
        """``new``: what the later directory holds, for the report."""
        del self.sizes[old]
        self.meta.pop(old, None)
        if self.root is not None:
            (self.root / old).unlink()
        self.warn(f"{old!r} was a file and later a directory holding {new} at the source: the restore keeps "
                  f"the later directory and leaves out the older file {old!r} (docs/format.md §8: the latest "
                  "wins; the older file stays in the published batches)")

    def _drop_dir(self, old: str, new: str) -> None:
        below = [p for p in self.sizes if p.startswith(old + "/")]
        for p in below:
            del self.sizes[p]
            self.meta.pop(p, None)
        self.dirs = {d for d in self.dirs if d != old and not d.startswith(old + "/")}
        if self.root is not None:
            shutil.rmtree(self.root / old)
        shown = ", ".join(repr(p) for p in sorted(below)[:5]) + (" ..." if len(below) > 5 else "")
        self.warn(f"{old!r} was a directory and later {new} at the source: the restore keeps the later "
                  f"{new} and leaves out the older directory with its {len(below)} file(s) ({shown or 'none'}) "
                  "(docs/format.md §8: the latest wins; the older files stay in the published batches)")

    def write(self, rel: str, chunks: Iterable[bytes], *, append: bool) -> int:
        """Replace (``append`` False) or extend ``rel`` with ``chunks``; returns bytes written."""
        check_relpath(rel)
        self._make_parents(rel)
        if rel in self.dirs:
            with self._lock:
                self._drop_dir(rel, "a file")
        n = 0
        if self.root is None:
            for buf in chunks:
                n += len(buf)
        else:
            with open(self.root / rel, "ab" if append else "wb") as f:
                for buf in chunks:
                    f.write(buf)
                    n += len(buf)
        self.sizes[rel] = (self.sizes.get(rel, 0) if append else 0) + n
        return n

    def mkdir(self, rel: str) -> None:
        check_relpath(rel)
        self._make_parents(rel)
        with self._lock:
            if rel in self.sizes:
                self._drop_file(rel, "files")
            self.dirs.add(rel)
        if self.root is not None:
            (self.root / rel).mkdir(exist_ok=True)

    def set_meta(self, rel: str, mode: int | None, mtime_ns: int | None) -> None:
        self.meta[rel] = (mode, mtime_ns)

    def apply_meta(self) -> None:
        """Apply recorded modes (always owner read/write) and mtimes; call once all content is in."""
        if self.root is not None:
            for rel, (mode, mtime_ns) in self.meta.items():
                path = self.root / rel
                if mode is not None:
                    os.chmod(path, (mode & 0o777) | 0o600)
                if mtime_ns is not None:
                    os.utime(path, ns=(mtime_ns, mtime_ns))
        self.meta.clear()

    def fsync_all(self) -> None:
        """Make every restored file and directory durable (before the publishing rename): one
        ``syncfs`` of DEST's filesystem where it reports errors, else an fsync of each."""
        if self.root is None or syncfs(self.root):
            return
        for dirpath, _dirs, files in os.walk(self.root, topdown=False):
            for name in files:
                fd = os.open(os.path.join(dirpath, name), os.O_RDONLY)
                try:
                    os.fsync(fd)
                finally:
                    os.close(fd)
            fsync_dir(Path(dirpath))


def copy_tree(src: Path, dst: Path) -> None:
    """Copy a restored directory (only directories and regular files) into ``dst``, merging."""
    for dirpath, _dirs, files in os.walk(src):
        rel = os.path.relpath(dirpath, src)
        out = dst / rel if rel != "." else dst
        out.mkdir(parents=True, exist_ok=True)
        for name in files:
            shutil.copy2(os.path.join(dirpath, name), out / name)


# ---- source detection ---------------------------------------------------------------------------

def detect(source: Path) -> str:
    """Which format SOURCE holds (FORMAT_V2, FORMAT_V1 or FORMAT_SNAPSHOT); errors if none/mixed."""
    from opguard.staging.legacy import find_snapshots, find_v1_owners

    if not source.is_dir():
        raise ConfigError(f"restore source {source} is not a directory",
                          "pass the run's shared output directory (the one holding .opguard-bundles/)")
    bundles = source / BUNDLES_DIRNAME
    snapshots = find_snapshots(source)
    if bundles.is_symlink():
        raise IntegrityError(f"{bundles} is a symbolic link", "restore from the real directory")
    if bundles.is_dir():
        if snapshots:
            raise IdentityError(
                f"{source} holds both {BUNDLES_DIRNAME}/ and legacy snapshot archives "
                f"(e.g. {snapshots[0]}): the formats are never mixed in one run",
                "copy the sync.tar.gz files to another directory and restore each format separately")
        names = os.listdir(bundles)
        temporaries = sorted(n for n in names if n.startswith(".tmp-"))
        if len(temporaries) == len(names):
            held = (f"only {len(temporaries)} temporary file(s) of a first sync that is running or was killed "
                    f"(e.g. {bundles / temporaries[0]})" if temporaries else "nothing")
            raise NothingPublished(source, f"{bundles} holds {held}, no format.json and no batch")
        if (bundles / "format.json").exists() or (bundles / "format.json").is_symlink():
            return FORMAT_V2
        if find_v1_owners(bundles):
            return FORMAT_V1
        if (bundles / "streams").exists():
            raise IntegrityError(f"{bundles / 'format.json'} is missing but {bundles / 'streams'} exists",
                                 "the target identity file was lost; recover it from a backup of the target")
        raise IntegrityError(f"{bundles} holds neither format.json (format 2) nor reference v1 bundle "
                             "directories (<node16>-rank<NNNNNN>)", "check that SOURCE is the run's output directory")
    if snapshots:
        return FORMAT_SNAPSHOT
    raise ConfigError(f"no opguard data in {source}: no {BUNDLES_DIRNAME}/ and no sync.tar.gz",
                      "pass the run's shared output directory (OPGUARD_LOCAL_DUMP_TARGET of the run)")


def _read_format(bundles: Path) -> str:
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
            raise damaged(st.name, f"batch {path.name}: {e.message}", e.fix or _FIX_DAMAGED) from None
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


def _run_v2(source: Path, tree: Tree, report: VerifyReport, progress: Progress | None, require_sealed: bool) -> None:
    bundles = source / BUNDLES_DIRNAME
    run_id = _read_format(bundles)
    report.run_id = run_id
    streams = _list_streams(bundles, report)
    if not streams:
        raise NothingPublished(source, f"{bundles} holds format.json (run {run_id!r}) but no stream under "
                                       f"{bundles / 'streams'}")
    fail_fast = tree.root is not None
    for st in streams:
        _guarded(st.report, fail_fast, lambda st=st: _scan_stream(st, run_id, report))  # type: ignore[misc]
    if all(st.report.status != DAMAGED and not st.batches and st.report.sealed_sequence is None for st in streams):
        raise NothingPublished(source, f"its {len(streams)} stream(s) under {bundles / 'streams'} hold no batch "
                                       "and no seal")
    if fail_fast:  # a restore refuses before doing any work; verify reports everything first
        _warn_unsealed(report)
        _require_sealed(report, require_sealed)
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
            _guarded(st.report, fail_fast, lambda: _replay_stream(st, run_id, tree, progress, stop))
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


# ---- shared driver ------------------------------------------------------------------------------

def _guarded(sr: StreamReport, fail_fast: bool, fn: Callable[[], None]) -> None:
    """Run ``fn``; an integrity failure marks the stream damaged (and stops a restore at once)."""
    try:
        fn()
    except IdentityError:
        raise
    except IntegrityError as e:
        sr.status = DAMAGED
        sr.error = e.message
        if fail_fast:
            raise


def _unsealed_why(sr: StreamReport) -> str:
    if sr.sealed_sequence is None:
        return "no seal"
    return f"batches after its seal at {sr.sealed_sequence}"


def _warn_unsealed(report: VerifyReport) -> None:
    """Warn loudly about every unsealed stream (once per stream; once per legacy format)."""
    unsealed = report.with_status(UNSEALED)
    if not unsealed:
        return
    if report.format == FORMAT_V2:
        for sr in unsealed:
            report.warn(f"stream {sr.stream} is UNSEALED ({sr.last_sequence} batches, {_unsealed_why(sr)}): "
                        "the job may have died before its final drain; its newest data could be missing")
    else:
        names = ", ".join(sr.stream for sr in unsealed[:5]) + (" ..." if len(unsealed) > 5 else "")
        report.warn(f"{len(unsealed)} stream(s) in {report.format} format are UNSEALED ({names}): this format has "
                    "no seals, so a lost newest batch or a job that died before its final sync cannot be detected; "
                    "the restored data may be incomplete")


def _require_sealed(report: VerifyReport, require_sealed: bool) -> None:
    unsealed = report.with_status(UNSEALED)
    if require_sealed and unsealed:
        names = ", ".join(sr.stream for sr in unsealed)
        raise DamagedSource(f"--require-sealed: {len(unsealed)} unsealed stream(s): {names}",
                            "if the node's staging directory still exists, run `opguard sync --final` there; "
                            "otherwise drop --require-sealed to restore what was published", report)


def _run(source: Path, tree: Tree, report: VerifyReport, require_sealed: bool, progress: Progress | None) -> None:
    from opguard.staging.legacy import run_snapshots, run_v1

    report.format = detect(source)
    if report.format == FORMAT_V2:
        _run_v2(source, tree, report, progress, require_sealed)
    elif report.format == FORMAT_V1:
        run_v1(source / BUNDLES_DIRNAME, tree, report, progress)
    else:
        run_snapshots(source, tree, report, progress)
    if report.format != FORMAT_V2 or tree.root is None:
        _warn_unsealed(report)
    bad = report.with_status(DAMAGED)
    if bad:
        detail = "; ".join(f"{sr.error}" for sr in bad)
        raise DamagedSource(f"{len(bad)} damaged stream(s): {detail}", _FIX_DAMAGED, report)
    _require_sealed(report, require_sealed)
    tree.apply_meta()
    tree.fsync_all()


def verify(source: Path, *, require_sealed: bool = False, progress: Progress | None = None) -> VerifyReport:
    """Check everything published under SOURCE without writing anything.

    Returns the report when nothing is damaged (unsealed streams are reported and warned about).
    Raises :class:`DamagedSource` (exit 5, with ``.report``) naming every damaged stream, or, with
    ``require_sealed``, every unsealed one; :class:`IdentityError` (exit 6) for a newer format.
    """
    source = Path(os.path.abspath(source))
    report = VerifyReport(str(source))
    _run(source, Tree(None, report.warn), report, require_sealed, progress)
    return report


def materialize(source: Path, dest: Path, *, require_sealed: bool = False,
                progress: Progress | None = None) -> RestoreReport:
    """Restore SOURCE into DEST (which must not exist), verified, published by one rename."""
    source = Path(os.path.abspath(source))
    dest = Path(os.path.abspath(dest))
    if os.path.lexists(dest):
        raise ConfigError(f"restore destination {dest} already exists",
                          "choose a destination that does not exist (the restore creates it)")
    parent = dest.parent
    if not parent.is_dir():
        raise ConfigError(f"the parent of the restore destination, {parent}, is not a directory",
                          f"create it first: mkdir -p {parent}")
    real_src, real_parent = source.resolve(), parent.resolve()
    if real_parent == real_src or real_src in real_parent.parents:
        raise ConfigError(f"restore destination {dest} is inside the source {source}",
                          "choose a destination outside the source directory")
    report = RestoreReport(str(source), dest=str(dest))
    partial = parent / f"{dest.name}.opguard-partial-{secrets.token_hex(6)}"
    partial.mkdir()
    try:
        _run(source, Tree(partial, report.warn), report, require_sealed, progress)
        fsync_dir(partial)
        rename_noreplace(partial, dest)
        fsync_dir(parent)
    except BaseException:
        shutil.rmtree(partial, ignore_errors=True)
        raise
    return report


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
