"""The uploader: publish each stream's changes as batches (``docs/protocol.md``).

:func:`sync_streams` is the library entry point behind ``opguard sync``. For each stream it
takes the stream's local lock, checks identity against the target, publishes a pending batch
left by an earlier sync first, and otherwise builds at most one new batch (periodic) or drains
everything visible at its start and seals the stream (``final``).
"""

from __future__ import annotations

import errno
import math
import os
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import filelock

from opguard.errors import ConfigError, IdentityError, LockTimeout, OpguardError, PublishError
from opguard.staging import crashpoints, forkpool
from opguard.staging.batchplan import Item, select_batch
from opguard.staging.build import BatchSource, Torn, build_batch
from opguard.staging.bundle import BatchWriteError, read_manifest, seal_name
from opguard.staging.checkpoint import CHECKPOINT_FILE, PENDING_FILE, Checkpoint, Pending, save_checkpoint
from opguard.staging.config import StagingConfig
from opguard.staging.fsutil import create_exclusive, dump_json, fsync_dir, read_json_nofollow
from opguard.staging.layout import NODE_COPY_DIRNAME, RANKS_DIRNAME, WRITER_TMP_PREFIX, Layout, node_stream
from opguard.staging.names import parse_rank_stream
from opguard.staging.publish import Bucket, remove_stale_tmp, upload
from opguard.staging.ratelimit import TokenBucket, Unlimited
from opguard.staging.scan import Change, detect, walk
from opguard.staging.target import check_stream, ensure_target, open_stream_dir, staging_of, stream_dir
from opguard.staging.units import format_bytes

TORN_RETRIES = 3

SyncProgress = Callable[[str], None]


@dataclass
class StreamSyncReport:
    stream: str
    batches: int = 0
    payload_bytes: int = 0
    uploaded_bytes: int = 0
    seconds: float = 0.0
    backlog_bytes: int = 0
    sealed: bool = False
    error: str | None = None
    exit_code: int = 0
    warnings: list[str] = field(default_factory=list)

    def fail(self, err: OpguardError) -> None:
        """Record an error (once); the worst (highest) exit status wins."""
        if self.error is not None and str(err) in self.error:
            return
        self.error = str(err) if self.error is None else f"{self.error}\n{err}"
        self.exit_code = max(self.exit_code, err.exit_code)


@dataclass
class SyncReport:
    final: bool
    streams: list[StreamSyncReport] = field(default_factory=list)
    seconds: float = 0.0
    error: str | None = None  # a problem of the whole staging base / target (also set on every stream)
    error_code: int = 0

    @property
    def exit_code(self) -> int:
        return max([self.error_code, *(s.exit_code for s in self.streams)])

    @property
    def batches(self) -> int:
        return sum(s.batches for s in self.streams)

    @property
    def payload_bytes(self) -> int:
        return sum(s.payload_bytes for s in self.streams)

    @property
    def uploaded_bytes(self) -> int:
        return sum(s.uploaded_bytes for s in self.streams)

    @property
    def backlog_bytes(self) -> int:
        return sum(s.backlog_bytes for s in self.streams)

    def to_json(self) -> dict[str, Any]:
        return {"final": self.final, "seconds": self.seconds, "exit_code": self.exit_code, "error": self.error,
                "batches": self.batches, "payload_bytes": self.payload_bytes,
                "uploaded_bytes": self.uploaded_bytes, "backlog_bytes": self.backlog_bytes,
                "streams": [asdict(s) for s in self.streams]}


# ---- streams -------------------------------------------------------------------------------------

def stream_root(layout: Layout, stream: str, node_id: str) -> tuple[Path, str, int | None]:
    """(source directory, kind, rank) of a stream this node uploads."""
    rank = parse_rank_stream(stream)
    if rank is not None:
        return layout.rank_dir(rank), "rank", rank
    if stream == node_stream(node_id):
        return layout.node_dir(node_id), "node", None
    raise ConfigError(f"stream {stream!r} is neither rank-<R> nor this node's stream {node_stream(node_id)!r}",
                      "sync --rank R, --node (this node only) or --all")


def all_streams(config: StagingConfig, layout: Layout, node_id: str) -> list[str]:
    """Every rank stream under the local base (or with uploader state) plus this node's stream
    (when its directory or its state exists)."""
    s = staging_of(config)
    found: set[str] = set()
    for d in (s.local_base / RANKS_DIRNAME, layout.stream_state_dir("x").parent):
        try:
            found.update(n for n in os.listdir(d) if parse_rank_stream(n) is not None)
        except FileNotFoundError:
            pass
    out = sorted(found)
    ns = node_stream(node_id)
    if layout.node_dir(node_id).is_dir() or layout.stream_state_dir(ns).is_dir():
        out.append(ns)
    return out


MAX_STREAM_WORKERS = 4


# ---- building a batch ----------------------------------------------------------------------------

@dataclass
class _Ctx:
    config: StagingConfig
    layout: Layout
    stream: str
    node_id: str
    root: Path
    kind: str
    rank: int | None
    bucket: Bucket
    progress: SyncProgress
    report: StreamSyncReport
    uploading: Any  # the sync's own uploads take turns on this (then on the node upload lock)
    zstd_threads: int = 0
    skipped_changed: bool = False

    @property
    def state(self) -> Path:
        return self.layout.stream_state_dir(self.stream)

    @property
    def pending_dir(self) -> Path:
        return self.state / "pending"

    @property
    def target_dir(self) -> Path:
        return stream_dir(self.config, self.stream)


def _build(ctx: _Ctx, cp: Checkpoint, changes: list[Change], deleted: list[str], limit: int,
           final: bool, exclude: set[str]) -> tuple[Pending | None, int]:
    """Select and build the next batch (pending/<name> + pending.json). Returns (pending, backlog)."""
    use = [c for c in changes if c.path not in exclude]
    plan = select_batch([Item(c.path, c.kind, c.size, c.first_record) for c in use], limit)
    for it in plan.oversized:
        ctx.report.fail(ConfigError(
            f"{ctx.root / it.path}: a single JSON-lines record of {it.first_record} bytes exceeds "
            f"OPGUARD_SYNC_BATCH_MB={limit >> 20} ({limit} bytes); this file is not uploaded",
            f"raise OPGUARD_SYNC_BATCH_MB to at least {(it.first_record + (1 << 20) - 1) >> 20}, or write smaller "
            "records"))
    if not plan.takes and not deleted:
        return None, plan.backlog_bytes
    src = BatchSource(ctx.root, ctx.stream, ctx.kind, ctx.rank, ctx.node_id, ctx.state, ctx.zstd_threads)
    try:
        pending, taken = build_batch(src, cp, use, deleted, plan.takes, final)
    except BatchWriteError as e:
        raise _local_write_error(ctx, e, limit) from None
    return pending, max(0, sum(c.size for c in use) - taken)


def _local_write_error(ctx: _Ctx, e: BatchWriteError, limit: int) -> PublishError:
    """Building the local batch failed: name the pending directory, the staging base and the fix."""
    base = staging_of(ctx.config).local_base
    what = (f"building the next batch in {ctx.pending_dir} failed: "
            f"{e.error.strerror or e.error} (errno {e.error.errno}, {e.path}); nothing was published and "
            "nothing half-built was kept")
    if e.error.errno in (errno.ENOSPC, errno.EDQUOT):
        return PublishError(
            f"{what}: the staging disk OPGUARD_LOCAL_DUMP_BASE={base} is full",
            f"free space on {base} (or point OPGUARD_LOCAL_DUMP_BASE at a larger node-local disk): it must hold "
            f"the traces plus one pending batch (up to OPGUARD_SYNC_BATCH_MB={limit >> 20} MiB, or the largest "
            "single file when one exceeds it); the next sync retries")
    return PublishError(what, f"fix the file or directory named under OPGUARD_LOCAL_DUMP_BASE={base}; "
                              "the next sync retries")


def _clean_local(ctx: _Ctx, pending: Pending | None) -> None:
    """Remove half-built batches, batch files no pending.json names and stale JSON temporaries."""
    for n in os.listdir(ctx.state):
        if n.startswith(WRITER_TMP_PREFIX):
            (ctx.state / n).unlink(missing_ok=True)
    try:
        names = os.listdir(ctx.pending_dir)
    except FileNotFoundError:
        return
    for n in names:
        if pending is None or n != pending.name:
            (ctx.pending_dir / n).unlink(missing_ok=True)


def _publish(ctx: _Ctx, pending: Pending) -> Checkpoint:
    """Upload the pending batch, then advance the checkpoint and drop the local copy."""
    src = ctx.pending_dir / pending.name
    if not src.exists():
        raise IdentityError(f"{ctx.state}/pending.json names {src}, which is missing",
                            "restore the staging directory or choose a new run ID")
    try:
        lock = filelock.FileLock(os.fspath(ctx.layout.node_upload_lock), timeout=ctx.config.lock_timeout)
        with ctx.uploading, lock:  # this sync's streams queue without a timeout; other processes with one
            crashpoints.hit("upload-locked")
            sfd = open_stream_dir(ctx.config, ctx.stream)
            try:
                copied = upload(src, ctx.target_dir, pending.name, pending.size, ctx.bucket, dir_fd=sfd)
            finally:
                os.close(sfd)
    except filelock.Timeout:
        raise LockTimeout(
            f"the node upload lock {ctx.layout.node_upload_lock} was held by another sync for more than "
            f"OPGUARD_SYNC_LOCK_TIMEOUT={ctx.config.lock_timeout:g} s; batch {pending.name} stays pending",
            "raise OPGUARD_SYNC_LOCK_TIMEOUT or OPGUARD_SYNC_MBPS, or lower OPGUARD_SYNC_BATCH_MB") from None
    crashpoints.hit("uploaded")
    save_checkpoint(ctx.state / CHECKPOINT_FILE, pending.checkpoint)
    crashpoints.hit("checkpoint-saved")
    _finish_pending(ctx, pending)
    ctx.report.batches += 1
    if copied:
        ctx.report.uploaded_bytes += pending.size
    return pending.checkpoint


def _finish_pending(ctx: _Ctx, pending: Pending) -> None:
    (ctx.state / PENDING_FILE).unlink(missing_ok=True)
    crashpoints.hit("pending-removed")
    (ctx.pending_dir / pending.name).unlink(missing_ok=True)
    fsync_dir(ctx.state)


def _scan(ctx: _Ctx, cp: Checkpoint) -> tuple[list[Change], list[str]]:
    w = walk(ctx.root)
    if ctx.kind == "rank" and (ctx.root / NODE_COPY_DIRNAME).exists():
        reserved = sorted(p for p in w.files if p.split("/", 1)[0] == NODE_COPY_DIRNAME)
        for p in reserved:
            del w.files[p]
        if reserved:
            ctx.report.fail(ConfigError(
                f"{ctx.root / reserved[0]} (and {len(reserved) - 1} more) is under {NODE_COPY_DIRNAME}/, which a "
                "restore reserves for the node's metadata; it is not uploaded",
                f"write node metadata with write_node_file(), or rename the {NODE_COPY_DIRNAME} directory"))
    for rel, what in sorted(w.skipped.items()):
        if rel not in cp.skipped:
            msg = f"skipping {what} {ctx.root / rel}: only regular files are uploaded"
            ctx.report.warnings.append(msg)
            ctx.progress(f"warning: {msg}")
    if set(w.skipped) - set(cp.skipped):
        cp.skipped = sorted(set(cp.skipped) | set(w.skipped))
        ctx.skipped_changed = True
    return detect(ctx.root, cp.files, w)


@dataclass
class _Drain:
    """A final drain's bound: the data visible when it began (``None`` until the first scan)."""

    visible: dict[str, Change] | None = None
    switched: set[str] = field(default_factory=set)

    def clip(self, changes: list[Change]) -> list[Change]:
        if self.visible is None:
            self.visible = {c.path: c for c in changes}
            return changes
        out: list[Change] = []
        for c in changes:
            v = self.visible.get(c.path)
            if v is None:
                continue  # appeared after the drain began
            if v.version != c.version:
                if c.kind == "file" or c.path in self.switched:
                    continue  # published in this drain already; a later version waits for the next sync
                # a log rewritten since the drain began: its old data is gone; take the new version
                # as it is now (once), and no more of it later
                self.switched.add(c.path)
                self.visible[c.path] = v = c
            if c.kind == "append":
                end = min(c.end, v.end)
                if end <= c.start and not c.new_version:
                    continue
                c = Change(c.path, c.kind, c.version, c.start, end, min(c.first_record, end - c.start), c.stat,
                           c.new_version)
            out.append(c)
        return out


def _one_batch(ctx: _Ctx, cp: Checkpoint, final: bool, drain: _Drain) -> tuple[Pending | None, int]:
    """Scan, plan and build the next batch, retrying around files that change while read."""
    torn: dict[str, int] = {}
    exclude: set[str] = set()
    while True:
        changes, deleted = _scan(ctx, cp)
        if final:
            changes = drain.clip(changes)
        try:
            return _build(ctx, cp, changes, deleted, ctx.config.batch_bytes, final, exclude)
        except Torn as t:
            torn[t.path] = torn.get(t.path, 0) + 1
            if torn[t.path] >= TORN_RETRIES:
                exclude.add(t.path)
                ctx.report.fail(PublishError(
                    f"{ctx.root / t.path} changed while being read ({TORN_RETRIES} attempts); it was not uploaded "
                    "this time, to avoid publishing a torn copy",
                    "producers must publish whole files by atomic rename (opguard.staging.writers.write_file_atomic)"
                    " and JSON-lines files must only be appended to"))


def _seal(ctx: _Ctx, cp: Checkpoint) -> Checkpoint:
    last = cp.next_sequence - 1
    if cp.sealed_sequence == last:
        return cp
    doc = {"version": 2, "stream": ctx.stream, "run_id": cp.run_id, "last_sequence": last,
           "last_digest": cp.head_digest, "sealed_at": time.time(), "host": ctx.node_id}
    path = ctx.target_dir / seal_name(last)
    try:
        os.close(open_stream_dir(ctx.config, ctx.stream))  # no link followed (docs/format.md §11)
        crashpoints.hit("sealing")
        created = create_exclusive(path, dump_json(doc))
        crashpoints.hit("sealed")
        if not created:
            try:
                existing = read_json_nofollow(path)  # a link planted as the seal is not followed
            except (OSError, ValueError):
                existing = None
            if (not isinstance(existing, dict) or existing.get("last_digest") != cp.head_digest
                    or existing.get("stream") != ctx.stream):
                raise IdentityError(f"seal {path} names another batch than this stream's head {cp.head_digest}",
                                    "two uploaders wrote one stream; use a new output directory")
    except OSError as e:
        raise PublishError(f"writing the seal {path} failed: {e.strerror or e}",
                           "run the final sync again; the batches themselves are published") from None
    new = cp.copy()
    new.sealed_sequence = last
    save_checkpoint(ctx.state / CHECKPOINT_FILE, new)
    return new


def _sync_stream(ctx: _Ctx, final: bool) -> None:
    s = staging_of(ctx.config)
    cp, pending = check_stream(ctx.config, ctx.layout, ctx.stream)
    if cp is None:
        if not ctx.root.is_dir():
            raise ConfigError(f"nothing to sync for stream {ctx.stream}: {ctx.root} does not exist",
                              "check --rank/OPGUARD_RANK and OPGUARD_LOCAL_DUMP_BASE (is this the right node?)")
        cp = Checkpoint(s.run_id, ctx.stream, os.fspath(s.target))
        ctx.state.mkdir(parents=True, exist_ok=True)
        save_checkpoint(ctx.state / CHECKPOINT_FILE, cp)
        crashpoints.hit("initial-checkpoint")
    sfd = open_stream_dir(ctx.config, ctx.stream)  # created without following a planted link
    try:
        remove_stale_tmp(ctx.target_dir, dir_fd=sfd)
    finally:
        os.close(sfd)
    if pending is not None and pending.sequence < cp.next_sequence:
        _finish_pending(ctx, pending)  # crashed after the checkpoint advanced: already done
        pending = None
    _clean_local(ctx, pending)
    crashpoints.hit("cleaned")
    if pending is not None:
        payload = _payload_of(ctx, pending)
        cp = _publish(ctx, pending)
        ctx.report.payload_bytes += payload
        if not final:
            changes, _ = _scan(ctx, cp)
            ctx.report.backlog_bytes = sum(c.size for c in changes)
            return
    drain = _Drain()
    while True:
        pending, backlog = _one_batch(ctx, cp, final, drain)
        ctx.report.backlog_bytes = backlog
        if pending is None:
            break
        payload = _payload_of(ctx, pending)
        cp = _publish(ctx, pending)
        ctx.report.payload_bytes += payload
        if final:
            ctx.progress(f"{ctx.stream}: published batch {pending.sequence} ({format_bytes(payload)} payload, "
                         f"{format_bytes(pending.size)} compressed), {format_bytes(backlog)} left")
        else:
            break
    if ctx.skipped_changed and not (ctx.state / PENDING_FILE).exists():
        save_checkpoint(ctx.state / CHECKPOINT_FILE, cp)  # remember what was reported, so once only
    if final and ctx.report.exit_code == 0:
        cp = _seal(ctx, cp)
        ctx.report.sealed = True


def _payload_of(ctx: _Ctx, pending: Pending) -> int:
    """The payload bytes of a local batch (known when this sync built it; else from its manifest)."""
    if pending.payload is not None:
        return pending.payload
    path = ctx.pending_dir / pending.name
    try:
        return int(read_manifest(path).manifest.get("payload_size", 0))
    except (OSError, OpguardError):
        return 0


def usable_cpus() -> int:
    """The CPUs this process may run on (its affinity mask: a Slurm step's allocation), at least 1."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def stream_workers(streams: int) -> int:
    """How many streams one sync builds at once: one per CPU this process may run on, at most
    MAX_STREAM_WORKERS (each builder holds a compression context and its read buffers: peak RSS of
    one sync of 8 x 5,000 files of 16 KiB was 53 MiB at 2 workers, 76 MiB at 4, 73 MiB at 1 with a zstd
    worker thread), never more than there are streams. Uploads stay one at a time per node (the upload lock)."""
    return max(1, min(streams, usable_cpus(), MAX_STREAM_WORKERS))


MAX_ZSTD_WORKERS = 4


LOADAVG = "/proc/loadavg"
RUNNABLE_SAMPLES = 5  # reads of the runnable-thread count, 1 ms apart: their median


def busy_cpus(loadavg: str = LOADAVG) -> float:
    """How many CPUs other processes keep busy: the smaller of the 1-minute load average and the
    threads runnable right now besides this one (the median of RUNNABLE_SAMPLES reads of
    ``/proc/loadavg``'s fourth field, ``running/total``). The load average alone lags by a minute:
    right after a busy minute (the previous sync of a periodic drain, the job's own start) it still
    reports CPUs busy that are idle now, and a one-stream sync then compressed inline at ~1.6x of
    ``tar | zstd`` where two workers gave ~1.2x (docs/benchmarks.md staging run 10). Under sustained
    load both figures are high. 0 if neither can be read (not Linux)."""
    try:
        load = os.getloadavg()[0]
    except (AttributeError, OSError):
        load = 0.0
    counts: list[int] = []
    for i in range(RUNNABLE_SAMPLES):
        try:
            with open(loadavg, "rb") as f:
                counts.append(int(f.read().split()[3].split(b"/")[0]))
        except (OSError, ValueError, IndexError):
            return load
        if i + 1 < RUNNABLE_SAMPLES:
            time.sleep(0.001)
    others = max(0, sorted(counts)[len(counts) // 2] - 1)  # the reading thread is running
    return min(load, float(others))


def zstd_workers(builders: int) -> int:
    """zstd worker threads per batch when ``builders`` streams build at once (``docs/protocol.md``).

    Workers only pay where they find idle CPUs: they cost CPU of their own (handing jobs over,
    copying the input into job buffers; a one-stream sync of 196 MiB: 2.27 s CPU with 2 workers vs
    2.01 s inline, docs/benchmarks.md staging run 9), and on busy CPUs the ratio to ``tar | zstd``
    follows CPU seconds. So 0 (each builder compresses inline) when the builders have no CPU beyond
    one each, or when the CPUs left idle (usable CPUs minus ``busy_cpus()``) are not more than the
    builders. Otherwise the idle CPUs, shared out, and at most MAX_ZSTD_WORKERS in
    all: ``min(ceil(idle) // builders, cpus // builders, MAX_ZSTD_WORKERS // builders)``. Each worker
    buffers a few jobs of ``bundle.ZSTD_JOB_SIZE``: peak RSS of a one-stream sync is under the 128 MiB
    goal at MAX_ZSTD_WORKERS (staging run 9).
    """
    builders = max(1, builders)
    cpus = usable_cpus()
    idle = cpus - busy_cpus()
    if builders >= cpus or idle <= builders:
        return 0
    return max(1, min(math.ceil(idle) // builders, cpus // builders, MAX_ZSTD_WORKERS // builders))


def _sync_one(config: StagingConfig, layout: Layout, sr: StreamSyncReport, final: bool, node_id: str, tb: Bucket,
              say: SyncProgress, zstd_threads: int, uploading: Any) -> StreamSyncReport:
    stream = sr.stream
    ts = time.monotonic()
    try:
        root, kind, rank = stream_root(layout, stream, node_id)
        ctx = _Ctx(config, layout, stream, node_id, root, kind, rank, tb, say, sr, uploading, zstd_threads)
        layout.locks_dir.mkdir(parents=True, exist_ok=True)
        lock = filelock.FileLock(os.fspath(layout.stream_lock(stream)), timeout=config.lock_timeout)
        try:
            lock.acquire()
        except filelock.Timeout:
            raise LockTimeout(
                f"another sync of stream {stream} held {layout.stream_lock(stream)} for more than "
                f"OPGUARD_SYNC_LOCK_TIMEOUT={config.lock_timeout:g} s; nothing was uploaded by this sync",
                "let the running sync finish (or raise OPGUARD_SYNC_LOCK_TIMEOUT); a lock timeout never "
                "starts a second upload") from None
        try:
            crashpoints.hit("locked")
            _sync_stream(ctx, final)
        finally:
            lock.release()
    except OpguardError as err:
        sr.fail(err)
    except OSError as e:
        where = e.filename or f"under OPGUARD_LOCAL_DUMP_BASE or {staging_of(config).bundles}"
        sr.fail(PublishError(f"stream {stream}: {e.strerror or e} (errno {e.errno}, {where})",
                             "fix the file or directory named; nothing partial was published and the next "
                             "sync retries"))
    sr.seconds = time.monotonic() - ts
    return sr


def _worker_lost(sr: StreamSyncReport, why: str) -> StreamSyncReport:
    sr.fail(PublishError(
        f"stream {sr.stream}: {why}; what it had not published stays in the staging "
        "directory (pending or unread), nothing partial is visible on the target",
        "run the sync again (it resumes); if the kernel log shows the OOM killer, lower "
        "OPGUARD_SYNC_BATCH_MB or leave the node more memory"))
    return sr


def sync_streams(config: StagingConfig, layout: Layout, streams: Sequence[str], *, final: bool = False,
                 node_id: str, progress: SyncProgress | None = None, bucket: Bucket | None = None,
                 workers: int | None = None, processes: bool | None = None) -> SyncReport:
    """Sync each stream (periodic: at most one batch each; ``final``: drain and seal).

    Streams are independent (their own lock, checkpoint, pending batch and target directory): up
    to ``workers`` (default :func:`stream_workers`) are scanned and built at once, in forked worker
    processes (:mod:`opguard.staging.forkpool`; ``processes``: None = ``OPGUARD_SYNC_WORKERS``, whose
    ``auto`` forks where that is safe, False = threads, True = processes or ``ValueError``); their
    uploads take turns. Errors are
    recorded per stream (``StreamSyncReport.error``/``exit_code``) and never stop the other streams;
    identity errors that concern the whole staging base apply to every stream.
    """
    t0 = time.monotonic()
    processes = _processes_wanted(config, processes)
    say: SyncProgress = progress or (lambda _msg: None)
    report = SyncReport(final=final)
    err = _prepare_target(config, layout, node_id)
    if err is not None:  # a problem of the whole target: every stream fails with it
        report.error, report.error_code = str(err), err.exit_code
        for stream in streams:
            sr = StreamSyncReport(stream)
            sr.fail(err)
            report.streams.append(sr)
        report.seconds = time.monotonic() - t0
        return report
    tb: Bucket = bucket if bucket is not None else TokenBucket(config.rate_bytes_per_s)
    report.streams = [StreamSyncReport(stream) for stream in streams]
    n = stream_workers(len(streams)) if workers is None else max(1, min(workers, len(streams)))
    # the node stream is the node's metadata (small): it compresses inline and leaves the CPUs to the
    # rank streams (the per-rank wrapper's `--rank R --node` is one big stream, not two)
    ranks = sum(1 for st in streams if parse_rank_stream(st) is not None)
    zthreads = zstd_workers(min(n, ranks)) if ranks else 0
    own = tb if isinstance(tb, TokenBucket | Unlimited) else None  # one the workers can share
    mutex = _fork_mutex(n, processes, own)
    uploading: Any = mutex if mutex is not None else threading.Lock()

    def one(sr: StreamSyncReport) -> StreamSyncReport:
        return _sync_one(config, layout, sr, final, node_id, tb, say,
                         zthreads if parse_rank_stream(sr.stream) is not None else 0, uploading)

    try:
        if n == 1:
            for sr in report.streams:
                one(sr)
        elif mutex is not None:  # forked workers
            def before_fork() -> None:
                crashpoints.share()
                if own is not None:
                    own.share()  # one bucket for the node, whichever worker uploads

            report.streams = forkpool.run(report.streams, n, one, _worker_lost, before_fork)
        else:
            with ThreadPoolExecutor(max_workers=n, thread_name_prefix="opguard-sync") as pool:
                list(pool.map(one, report.streams))
    finally:
        if mutex is not None:
            mutex.close()
    report.seconds = time.monotonic() - t0
    return report


def _processes_wanted(config: StagingConfig, processes: bool | None) -> bool | None:
    """``sync_streams``' ``processes`` with ``OPGUARD_SYNC_WORKERS`` applied (None: auto)."""
    if processes is None and config.sync_workers != "auto":
        processes = config.sync_workers == "processes"
        if processes and not forkpool.available():
            raise ConfigError("OPGUARD_SYNC_WORKERS=processes, but forking stream workers is not safe here (it "
                              "needs Linux and a caller running a single thread)",
                              "unset OPGUARD_SYNC_WORKERS (auto) or set it to threads")
    return processes


def _prepare_target(config: StagingConfig, layout: Layout, node_id: str) -> OpguardError | None:
    """Record or check the run identity on the target (``ensure_target``); the error, if any."""
    try:
        try:
            ensure_target(config, layout, node_id)
        except OSError as e:  # e.g. a full target while format.json is created: no traceback, exit 4
            raise PublishError(f"recording the run identity on the target failed: {e.strerror or e} "
                               f"(errno {e.errno}, {e.filename or staging_of(config).bundles})",
                               "free space or quota on the shared target (or fix its permissions) and sync "
                               "again; nothing was published") from None
    except OpguardError as err:
        return err
    return None


def _fork_mutex(n: int, processes: bool | None, own: TokenBucket | Unlimited | None) -> forkpool.ProcessMutex | None:
    """The upload mutex of forked stream workers, or None where the streams run in threads (or
    one at a time): forked only with several workers, ``processes`` not False, forking safe here
    and a bucket the workers can share."""
    mutex: forkpool.ProcessMutex | None = None
    if n > 1 and processes is not False and forkpool.available() and own is not None:
        try:
            mutex = forkpool.ProcessMutex()
        except OSError as e:  # no temporary file for the mutex: threads need none
            if processes:
                tmpdir = os.environ.get("TMPDIR", "unset")
                raise ConfigError(f"forked stream workers need a temporary file for their upload mutex, and "
                                  f"creating one failed: {e.strerror or e} (TMPDIR={tmpdir})",
                                  "point TMPDIR at a writable directory, or set OPGUARD_SYNC_WORKERS=threads") from None
    if processes and mutex is None and n > 1:
        raise ValueError("processes=True needs Linux, a single-threaded caller and opguard's own bucket")
    return mutex
