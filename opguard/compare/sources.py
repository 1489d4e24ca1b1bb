"""Resolve a compare input (A or B) into trace streams (``docs/compare.md`` §1).

Accepted, detected in this order:

* a shared target holding ``.opguard-bundles/`` (format 2 or reference v1 bundles), or legacy
  ``sync.tar.gz`` snapshots (the directory, or one archive in it): restored and verified with
  :func:`opguard.staging.restore.materialize` into a temporary directory, removed afterwards;
* a trace directory or a restored directory: ``ranks/rank-<R:06d>/capture/trace.jsonl``
  (opguard capture, ``docs/capture.md``);
* reference-implementation traces: ``exec_trace/gpu_<R:03d>/ops/<fn>/<fn>_line<N>.jsonl``
  (the directory holding ``exec_trace/``, ``exec_trace/`` itself, or one ``gpu_<R>`` directory).

A *stream* is one rank's sequence of operations in execution order; streams of two runs
correspond when rank and stream name are equal.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import io
import json
import os
import re
import shutil
import sys
import tempfile
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from orjson import loads as orjson_loads

from opguard.compare.records import (
    CAPTURE_VERSION,
    CAPTURE_VERSIONS,
    Record,
    SiteCache,
    SourceCopies,
    bad_line,
    capture_index_fields,
    from_capture,
    from_reference,
    iter_jsonl,
    jsonl_where,
    loads,
)
from opguard.errors import ConfigError, IdentityError, IntegrityError, OpguardError
from opguard.staging import names
from opguard.staging.fsutil import open_regular, read_json_nofollow
from opguard.staging.layout import (
    BUNDLES_DIRNAME,
    CAPTURE_DIRNAME,
    CAPTURE_META_FILE,
    CAPTURE_SOURCES_FILE,
    CAPTURE_TRACE_FILE,
    NODE_COPY_DIRNAME,
    SOURCE_COPY_MAX_BYTES,
    capture_dump_slot,
    parse_capture_dirname,
)
from opguard.staging.names import parse_rank_stream, printable
from opguard.staging.writers import parse_segment

REF_STREAM = "ops"
_GPU_DIR = re.compile(r"gpu_([0-9]{3,})")

KIND_CAPTURE = "opguard-capture"
CAPTURE_STREAM = "capture"
KIND_REFERENCE = "reference-exec-trace"


@dataclass
class Stream:
    """One rank's operations of one run. ``records()`` reads them again on every call."""

    kind: str
    rank: int
    name: str
    files: list[Path]
    sources: SourceCopies
    rank_dir: Path = Path()
    dumps: dict[int, dict[str, str]] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)
    meta_notes: list[str] = field(default_factory=list)     # from meta.json (schema v2 ``notes``)
    # functions this run's capture collapsed (meta.json ``collapsed_wrappers``, docs/capture.md §3.10)
    collapsed: frozenset[str] = frozenset()
    # positional parameter names of the recorded functions (meta.json ``arg_names``, docs/capture.md §3.4)
    arg_names: dict[str, tuple[str | None, ...]] = field(default_factory=dict)
    # (opguard version, argument forms revision) of the capture (meta.json ``opguard``, ``arg_forms``; §2.1)
    forms: tuple[str | None, int] = (None, 1)
    # what capture's own selection left out (meta.json ``options``: steps, functions, modules,
    # contexts), e.g. "steps 1-2"; "" when it recorded every call (docs/compare.md §4)
    selection: str = ""
    # functions whose nested function-level records pass 1 leaves out (set by the engine for a stream pair)
    aside: frozenset[str] = frozenset()
    sites: SiteCache = field(init=False)

    def __post_init__(self) -> None:
        self.sites = SiteCache(self.sources)

    @property
    def key(self) -> tuple[int, str]:
        return (self.rank, self.name)

    def where(self, fi: int, n: int, offset: int, start: tuple[int, int] = (0, 0)) -> str:
        """How record (file index, line number, byte offset) is named in messages, read from ``start``."""
        return jsonl_where(self.files[fi], n, offset, start[1] if fi == start[0] else 0)

    def capture_ops(self, start: tuple[int, int] = (0, 0)) -> Iterator[tuple[int, int, int, dict[str, Any]]]:
        """(file index, line number, byte offset, record) of the ``op`` records of a capture stream,
        from ``start`` = (file index, byte offset) (name one with :meth:`where`). Read from the
        beginning, dump, cap and end records and gaps in ``seq`` are collected (``dumps``, ``notes``)."""
        from_start = start == (0, 0)
        expect_seq: int | None = None
        if from_start:
            self.notes[:] = self.meta_notes
        ended = False
        rank = self.rank
        for fi in range(start[0], len(self.files)):
            path = self.files[fi]
            first = start[1] if fi == start[0] else 0
            with open(path, "rb") as f:     # iter_jsonl inlined: one generator less per operation
                f.seek(first)
                offset = first
                for n, line in enumerate(f, 1):
                    here = offset
                    offset += len(line)
                    if line[-1:] != b"\n":
                        break
                    try:
                        obj = orjson_loads(line)
                    except ValueError:
                        try:
                            obj = loads(line)       # what orjson refuses (NaN literals, ...), or the error
                        except ValueError as e:
                            if not line.strip():
                                continue
                            raise bad_line(path, n, here, first, e) from None
                    if obj.__class__ is not dict:
                        raise bad_line(path, n, here, first, None)
                    if obj.get("v") not in CAPTURE_VERSIONS:
                        raise IdentityError(f"{jsonl_where(path, n, here, first)}: capture record version "
                                            f"{obj.get('v')!r}; this opguard reads versions 1 to {CAPTURE_VERSION}",
                                            "upgrade opguard to compare this run")
                    kind = obj.get("kind")
                    if kind == "op":
                        if obj.get("rank") != rank:
                            raise ConfigError(f"{jsonl_where(path, n, here, first)}: record of rank "
                                              f"{obj.get('rank')!r} in the directory of rank {rank}",
                                              "a rank directory must hold only its own records")
                        if from_start:
                            seq = obj.get("seq")
                            if seq.__class__ is int:
                                if expect_seq is not None and seq > expect_seq:
                                    self.notes.append(f"records seq {expect_seq}..{seq - 1} are missing "
                                                      "(a crash lost them)")
                                expect_seq = seq + 1
                        yield fi, n, here, obj
                    elif not from_start:
                        continue
                    elif kind == "dump":
                        self._dump(obj, fi, n, here)
                    elif kind == "cap":
                        self.notes.append(f"capture reached its size cap at step {obj.get('step')} "
                                          f"(seq {obj.get('seq')}): later operations were not recorded")
                    elif kind == "end":
                        ended = True
        if from_start and not ended:
            self.notes.append("no end record: the capture did not end cleanly (the trace may be incomplete)")

    def _dump(self, obj: dict[str, Any], fi: int, n: int, offset: int) -> None:
        """A ``dump`` record (docs/capture.md §7): its file, a relative path inside the rank
        directory (capture writes nothing else), attached to its op's slot."""
        seq, slot, path = obj.get("seq"), obj.get("slot"), obj.get("path")
        if seq.__class__ is not int or not isinstance(slot, str) or not isinstance(path, str):
            raise ConfigError(f"{self.where(fi, n, offset)}: not an opguard capture dump record (seq, slot and "
                              "path must be an integer and two strings)",
                              "pass a trace directory written by opguard capture (docs/capture.md §7)")
        try:
            rel = names.relpath(path, "dump record field path")
        except IntegrityError as e:
            raise ConfigError(f"{self.where(fi, n, offset)}: {e.message}",
                              "a dump record names a file inside its rank directory (docs/capture.md §7)") from None
        self.dumps.setdefault(seq, {})[slot] = str(self.rank_dir / rel)

    def capture_op_lines(self, start: tuple[int, int], files: Sequence[int], offsets: Sequence[int],
                         first: int) -> Iterator[tuple[int, int, int, bytes]]:
        """(file index, line number, byte offset, line) of the ``op`` records from operation
        ``first``, which begins at ``start`` (pass 2): the lines at the positions pass 1 found
        (``files``/``offsets``: each operation's file index and byte offset; pass 1 checked every
        line, so nothing is parsed here: :meth:`parse_op` parses a line when it is needed)."""
        k, nops = first, len(offsets)
        for fi in range(start[0], len(self.files)):
            off = start[1] if fi == start[0] else 0
            with open(self.files[fi], "rb") as f:
                f.seek(off)
                for n, line in enumerate(f, 1):
                    if k >= nops:
                        return
                    if offsets[k] == off and files[k] == fi:
                        yield fi, n, off, line
                        k += 1
                    off += len(line)

    def parse_op(self, fi: int, n: int, offset: int, line: bytes, start: tuple[int, int]) -> dict[str, Any]:
        """An ``op`` line of :meth:`capture_op_lines` parsed (as :meth:`capture_ops` parses it)."""
        try:
            obj = orjson_loads(line)
        except ValueError:
            try:
                obj = loads(line)
            except ValueError as e:
                raise bad_line(self.files[fi], n, offset, start[1] if fi == start[0] else 0, e) from None
        if obj.__class__ is not dict:
            raise bad_line(self.files[fi], n, offset, start[1] if fi == start[0] else 0, None)
        return obj

    def index_fields(self) -> Iterator[tuple[str, str, str | None, bool, bool, int, int]]:
        """Per operation: (key, line key, anchor text, collective, has a source-line digest, file index,
        byte offset); reading it also collects the stream's dumps and notes."""
        if self.kind == KIND_REFERENCE:
            for rec in self.reference_records():
                yield (rec.key(), rec.line_key(), rec.anchor_text(), rec.collective, rec.line_digest is not None,
                       0, 0)
            return
        for fi, n, offset, obj in self.capture_ops():
            try:
                site, text = capture_index_fields(obj, self.sites)
            except (KeyError, TypeError, ValueError, AttributeError) as e:
                raise ConfigError(f"{self.where(fi, n, offset)}: not an opguard capture op record "
                                  f"({type(e).__name__}: {e})",
                                  "pass a trace directory written by opguard capture (docs/capture.md)") from None
            yield site.key, site.line_key, text, site.collective, site.line_digest is not None, fi, offset

    def capture_record(self, obj: dict[str, Any], index: int, where: str) -> Record:
        """A capture op record as a :class:`Record`, with its tensor dumps."""
        rec = from_capture(obj, index, self.sites, where, self.arg_names)
        dumps = self.dumps
        if dumps and rec.seq in dumps:
            slots = dumps[rec.seq]
            for slot in rec.inputs:  # names that never collide (capture §7): out=<input> is in.out
                slot.dump = slots.get(capture_dump_slot(slot.name, False))
            for slot in rec.outputs:  # an output named like an input it wrote: out.<slot>
                slot.dump = slots.get(capture_dump_slot(slot.name, True))
        return rec

    def records(self, first: int = 0, start: tuple[int, int] = (0, 0)) -> Iterator[Record]:
        """Operations in execution order; ``first``/``start``: resume at operation ``first``, which
        begins at ``start`` = (file index, byte offset) (capture streams; from index_fields)."""
        if self.kind == KIND_REFERENCE:
            for rec in self.reference_records():
                if rec.index >= first:
                    yield rec
            return
        for index, (fi, n, offset, obj) in enumerate(self.capture_ops(start), first):
            yield self.capture_record(obj, index, self.where(fi, n, offset, start))

    def reference_records(self) -> Iterator[Record]:
        recs: list[Record] = []
        for path in self.files:
            for n, _off, obj in iter_jsonl(path):
                where = jsonl_where(path, n, _off, 0)
                rec = from_reference(obj, self.sources, where)
                if rec.rank != self.rank:
                    raise ConfigError(f"{where}: record of gpu_rank {rec.rank} under gpu_{self.rank:03d}",
                                      "a gpu_<rank> directory must hold only its own rank's records")
                recs.append(rec)
        recs.sort(key=lambda r: (r.seq if r.seq is not None else -1))
        for i, rec in enumerate(recs):
            rec.index = i
            yield rec


@dataclass
class Run:
    """One side of a comparison."""

    label: str                 # "A" or "B"
    given: str                 # the path as the user gave it
    kind: str
    root: Path
    streams: dict[tuple[int, str], Stream] = field(default_factory=dict)
    restored_from: str | None = None
    skipped: list[str] = field(default_factory=list)

    def digest(self) -> str:
        """SHA-256 over every trace file of the run (relative path and content), in a fixed order."""
        h = hashlib.sha256()
        for key in sorted(self.streams):
            for path in self.streams[key].files:
                rel = os.path.relpath(path, self.root)
                h.update(rel.encode() + b"\0")
                with open(path, "rb") as f:
                    while chunk := f.read(1 << 20):
                        h.update(chunk)
                h.update(b"\0")
        return h.hexdigest()


# ---- discovery ---------------------------------------------------------------------------------

def _segments(files: list[Path]) -> dict[str, list[Path]]:
    """JSON-lines files grouped by the name of their segment 0 (``writers.parse_segment``), in segment order."""
    groups: dict[str, list[tuple[int, Path]]] = {}
    for p in files:
        parsed = parse_segment(p.name)
        if parsed is None:
            continue
        base, n = parsed
        groups.setdefault(str(p.parent / base), []).append((n, p))
    return {k: [p for _, p in sorted(v)] for k, v in groups.items()}


# what compare reads whole besides traces: a capture's meta.json and sources.json (a few fields per
# file, a few thousand files), a listed source file (the node metadata copies stop at 4 MiB a file:
# staging/layout.py SOURCE_COPY_MAX_BYTES)
TABLE_MAX_BYTES = 64 << 20


def read_regular(path: Path | str, limit: int, follow: bool = False) -> bytes | None:
    """The bytes of ``path`` when it is a regular file of at most ``limit`` bytes, else None: a
    device (``/dev/zero``) or a FIFO listed or planted in a run directory is never read (no hang,
    no unbounded read); a symbolic link is not followed unless ``follow`` (a program's own source
    file may be one). Other OSErrors propagate."""
    try:
        fd = open_regular(path, follow=follow)
    except OSError as e:
        if e.errno in (errno.ELOOP, errno.EINVAL):  # a link, or not a regular file
            return None
        raise
    with os.fdopen(fd, "rb") as f:
        if os.fstat(f.fileno()).st_size > limit:
            return None
        data = f.read(limit + 1)
    return data if len(data) <= limit else None


def _capture_streams(run: Run, ranks_dir: Path) -> None:
    for rank_dir in sorted(ranks_dir.iterdir()):
        rank_or_none = parse_rank_stream(rank_dir.name)
        if rank_or_none is None or not (rank_dir / CAPTURE_DIRNAME / CAPTURE_TRACE_FILE).exists():
            if rank_or_none is not None and rank_dir.is_dir():
                run.skipped.append(rank_dir.name)
            continue
        # torchrun's restarted attempts (docs/capture.md §2): each its own stream, named by its directory
        attempts = sorted((n, p.name) for p in rank_dir.iterdir()
                          if (n := parse_capture_dirname(p.name)) is not None and (p / CAPTURE_TRACE_FILE).exists())
        for _, name in attempts:
            _capture_stream(run, rank_dir, rank_or_none, name)


def _capture_stream(run: Run, rank_dir: Path, rank: int, dirname: str) -> None:
    """The stream of one capture directory of ``rank_dir`` (``capture``, ``capture.restart-<k>``)."""
    cap = rank_dir / dirname
    trace = cap / CAPTURE_TRACE_FILE
    if trace.is_symlink() or not trace.is_file():  # a link, FIFO or device: never read
        raise ConfigError(f"{trace} is not a regular file (a link, FIFO or device)",
                          "pass a trace directory written by opguard capture, or restore it with "
                          "opguard materialize (which writes regular files only)")
    meta_notes: list[str] = []
    forms: list[tuple[str | None, int]] = []
    selection: list[str] = []
    collapsed, arg_names = _check_meta(cap / CAPTURE_META_FILE, rank, meta_notes, forms, selection)
    segs = _segments([p for p in cap.iterdir() if p.is_file() and not p.is_symlink()]).get(str(trace), [])
    stream = CAPTURE_STREAM if dirname == CAPTURE_DIRNAME else dirname
    run.streams[(rank, stream)] = Stream(KIND_CAPTURE, rank, stream, segs, _capture_sources(rank_dir, dirname),
                                         rank_dir, meta_notes=meta_notes, collapsed=collapsed,
                                         arg_names=arg_names, forms=forms[0] if forms else (None, 1),
                                         selection="; ".join(selection))


def _check_meta(path: Path, rank: int, notes: list[str], forms: list[tuple[str | None, int]] | None = None,
                selection: list[str] | None = None) -> tuple[frozenset[str], dict[str, tuple[str | None, ...]]]:
    """Check a capture's meta.json; its notes into ``notes``, its (opguard version, argument forms)
    into ``forms``, what its options left out into ``selection``; returns the functions it
    collapsed and the positional parameter names of the recorded functions (``arg_names``,
    docs/capture.md §3.4)."""
    try:
        meta = read_json_nofollow(path, TABLE_MAX_BYTES)
    except FileNotFoundError:
        return frozenset(), {}
    except (OSError, ValueError, RecursionError) as e:
        raise ConfigError(f"{path} is unreadable ({e})", "restore the rank directory again") from None
    version = meta.get("version") if isinstance(meta, dict) else None
    if not isinstance(version, int) or isinstance(version, bool) or version < 1:
        raise ConfigError(f"{path}: no capture schema version (version {version!r})",
                          "pass a trace directory written by opguard capture (docs/capture.md §2.1)")
    if version > CAPTURE_VERSION:
        raise IdentityError(f"{path}: capture schema version {version!r}; this opguard reads versions 1 to "
                            f"{CAPTURE_VERSION}", "upgrade opguard to compare this run")
    if forms is not None:
        made_by, arg_forms = meta.get("opguard"), meta.get("arg_forms", 1)
        forms.append((printable(made_by, 40) if isinstance(made_by, str) else None,
                      arg_forms if isinstance(arg_forms, int) and not isinstance(arg_forms, bool) else 1))
    options = meta.get("options")
    if selection is not None and isinstance(options, dict):  # capture-time selection (docs/capture.md §1.1)
        steps = options.get("steps")
        if isinstance(steps, str) and steps != "all":
            selection.append(f"steps {printable(steps, 80)}")
        for key in ("functions", "modules", "contexts"):
            chosen = options.get(key)
            if isinstance(chosen, list) and chosen:
                selection.append(f"{key} {', '.join(printable(str(c), 80) for c in chosen[:4])}"
                                 + (", ..." if len(chosen) > 4 else ""))
    listed = meta.get("notes")
    for note in listed if isinstance(listed, list) else ():  # schema v2: capture's notes (docs/capture.md §2.1)
        notes.append(f"capture: {printable(note, 1000)}")
    if meta.get("rank") != rank:
        raise ConfigError(f"{path}: rank {meta.get('rank')!r} in the directory of rank {rank}",
                          "a rank directory must hold only its own rank's capture")
    names = meta.get("arg_names")
    arg_names = {fn[:512]: tuple(n[:256] if isinstance(n, str) else None for n in listed[:_MAX_POSITIONAL])
                 for fn, listed in (names.items() if isinstance(names, dict) else ())
                 if isinstance(fn, str) and isinstance(listed, list)}
    found = meta.get("collapsed_wrappers")
    if not isinstance(found, list):
        return frozenset(), arg_names
    return frozenset(w["fn"][:512] for w in found[:_MAX_COLLAPSED]
                     if isinstance(w, dict) and isinstance(w.get("fn"), str)), arg_names


# capture collapses at most this many functions (capture/wrappers.py _MAX_WATCHED); a longer list is not its own
_MAX_COLLAPSED = 4096
_MAX_POSITIONAL = 256  # positional parameter names kept per function (meta.json arg_names)


def _capture_sources(rank_dir: Path, dirname: str = CAPTURE_DIRNAME) -> SourceCopies:
    """Copies of the files in capture/sources.json (docs/capture.md §9) found in the rank's ``_node/``
    (restored node metadata), matched by name and SHA-256, or else the listed file itself while its
    SHA-256 is still the recorded one (docs/compare.md §2)."""
    index = SourceCopies()
    try:
        data = read_json_nofollow(rank_dir / dirname / CAPTURE_SOURCES_FILE, TABLE_MAX_BYTES)
    except (OSError, ValueError, RecursionError):
        return index
    wanted: dict[str, tuple[str, str]] = {}
    files = data.get("files") if isinstance(data, dict) else None
    for f in files if isinstance(files, list) else []:
        if isinstance(f, dict) and isinstance(f.get("path"), str) and isinstance(f.get("sha256"), str):
            wanted[os.path.basename(f["path"])] = (f["path"], f["sha256"])
    node = rank_dir / NODE_COPY_DIRNAME
    if node.is_dir():
        for cand in node.rglob("*"):
            hit = wanted.get(cand.name)
            if hit and not cand.is_symlink() and cand.is_file():
                with contextlib.suppress(OSError):
                    data_c = read_regular(cand, SOURCE_COPY_MAX_BYTES)
                    if data_c is not None and hashlib.sha256(data_c).hexdigest() == hit[1]:
                        index.add(hit[0], cand)
    for path, sha in wanted.values():
        if path not in index.files:
            # the listed file itself (docs/compare.md §2): only a regular file of a source's size
            with contextlib.suppress(OSError):
                data_p = read_regular(path, SOURCE_COPY_MAX_BYTES, follow=True)
                if data_p is not None and hashlib.sha256(data_p).hexdigest() == sha:
                    index.add(path, Path(path))
    return index


def _reference_sources(exec_trace: Path, gpu_dir: Path) -> SourceCopies:
    index = SourceCopies(rewritten=True)
    for base in (gpu_dir, exec_trace):
        fi = base / "source_files" / "file_index.json"
        try:
            data = json.loads(fi.read_text())
        except (OSError, ValueError):
            continue
        if isinstance(data, dict):
            for original, info in data.items():
                rel = info[0] if isinstance(info, list) and info else info
                if isinstance(rel, str):
                    index.add(original, base / rel)
    return index


def _reference_streams(run: Run, exec_trace: Path, gpu_dirs: list[Path]) -> None:
    for gpu in gpu_dirs:
        m = _GPU_DIR.fullmatch(gpu.name)
        if not m:
            continue
        files = sorted(p for p in (gpu / "ops").rglob("*.jsonl") if p.is_file() and "full" not in p.parts)
        if files:
            rank = int(m[1])
            run.streams[(rank, REF_STREAM)] = Stream(KIND_REFERENCE, rank, REF_STREAM, files,
                                                    _reference_sources(exec_trace, gpu))


def _scan(run: Run, root: Path) -> None:
    if (root / "ranks").is_dir():
        run.kind = KIND_CAPTURE
        _capture_streams(run, root / "ranks")
        return
    exec_trace = root / "exec_trace" if (root / "exec_trace").is_dir() else root
    gpus = sorted(p for p in exec_trace.glob("gpu_*") if p.is_dir())
    if gpus:
        run.kind = KIND_REFERENCE
        _reference_streams(run, exec_trace, gpus)
        return
    if _GPU_DIR.fullmatch(root.name) and (root / "ops").is_dir():
        run.kind = KIND_REFERENCE
        _reference_streams(run, root.parent, [root])
        return
    lone_rank = parse_rank_stream(root.name)
    if lone_rank is not None:
        run.kind = KIND_CAPTURE
        _capture_streams(run, root.parent)
        run.streams = {k: v for k, v in run.streams.items() if k[0] == lone_rank}


def _holds_capture(path: Path) -> bool:
    """A trace directory (``ranks/<R>/capture/trace.jsonl``) or one rank directory of one."""
    if (path / CAPTURE_DIRNAME / CAPTURE_TRACE_FILE).exists():
        return True
    ranks = path / "ranks"
    try:
        return any((r / CAPTURE_DIRNAME / CAPTURE_TRACE_FILE).exists() for r in ranks.iterdir())
    except OSError:
        return False


@contextlib.contextmanager
def open_run(given: str, label: str) -> Iterator[Run]:
    """Resolve ``given`` into a :class:`Run`; a staged target is restored into a temporary dir first."""
    from opguard.staging.restore import holds_published_data, materialize

    path = Path(given)
    if not path.exists():
        raise ConfigError(f"compare input {label}: {given} does not exist",
                          "pass a trace directory, a restored directory, a shared target or reference traces")
    if path.is_file():
        if path.name.endswith(".tar.gz"):
            path = path.parent
        else:
            raise ConfigError(f"compare input {label}: {given} is a file",
                              "pass the directory that holds the traces (or the sync.tar.gz's directory)")
    run = Run(label, given, "", path.resolve())
    tmp: str | None = None
    try:
        if holds_published_data(path) and not (path / BUNDLES_DIRNAME).is_dir() and _holds_capture(path):
            # legacy archives beside capture traces: every file a rank writes is published and
            # restored, so one rank's output could stand in for the run's traces
            raise ConfigError(f"compare input {label}: {given} holds both capture traces (ranks/*/capture/) and "
                              "legacy sync.tar.gz archives: which run is it",
                              "pass the directory of the traces alone, or of the archives alone")
        if holds_published_data(path):
            tmp = tempfile.mkdtemp(prefix=f"opguard-compare-{label}-")
            # a lone rank directory (e.g. gpu_003 holding sync.tar.gz) keeps its name: it carries the rank
            dest = Path(tmp) / (path.name if _GPU_DIR.fullmatch(path.name) or parse_rank_stream(path.name) is not None
                                else "restored")
            captured = io.StringIO()
            try:
                with contextlib.redirect_stderr(captured):     # restore's warnings, to say which input
                    materialize(path, dest)
            except OpguardError as e:
                # the documented base class (subclasses such as NothingPublished take other arguments)
                cls: type[OpguardError] = next(
                    (c for c in (IntegrityError, IdentityError, ConfigError) if isinstance(e, c)), OpguardError)
                raise cls(f"compare input {label} ({given}) cannot be restored: {e.message}", e.fix) from None
            finally:
                for line in captured.getvalue().splitlines():
                    prefix = "opguard: WARNING: "
                    text = line[len(prefix):] if line.startswith(prefix) else line
                    print(f"opguard: WARNING: compare input {label} ({given}): {text}", file=sys.stderr, flush=True)
            run.restored_from = str(path.resolve())
            run.root = dest
        _scan(run, run.root)
        if not run.streams:
            extra = f" (rank directories without capture/trace.jsonl: {', '.join(run.skipped[:5])})" \
                if run.skipped else ""
            raise ConfigError(
                f"compare input {label}: no trace files in {given}{extra}",
                "pass a directory holding ranks/rank-<R>/ capture files, exec_trace/gpu_<R>/ops/ reference "
                "traces, or a shared target with .opguard-bundles/ or sync.tar.gz")
        yield run
    finally:
        if tmp is not None:
            shutil.rmtree(tmp, ignore_errors=True)
