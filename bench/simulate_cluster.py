#!/usr/bin/env python3
"""Simulate the uploads of an N-node × R-rank job with opguard's own scheduling code (issue 7).

Nothing here re-models what the project already decides. The simulation calls, on a virtual
clock:

* ``opguard.launcher.schedule.stagger_offset`` — when each node's periodic syncs start;
* ``opguard.staging.batchplan.select_batch`` — which pending data the next batch of a stream takes
  (one batch per stream per periodic sync; several for a final drain);
* ``opguard.staging.ratelimit.TokenBucket`` — the per-node cap, with an injected ``clock`` and
  ``sleep`` that advance the node's virtual time instead of waiting;

and it checks the result against the plan's formulas (``schedule.ClusterSizing``). What it does
model is only what cannot run here: the ranks' data (JSON lines at a steady rate plus whole
files at a fixed period), the wrapper's loop as ``launcher/supervise.py`` runs it (one sync at a
time; the next periodic sync one interval after the previous one started, at once if that has
passed; a requested drain after the running sync; periodic syncs resume after a warning drain,
or with ``--continuous-after-warning`` final passes repeat until SIGTERM), the drains
(``--signal`` warning at ``job - W``, SIGTERM at ``job``, when the ranks stop writing), and
the filesystem (an upload of ``b`` bytes takes exactly
what the bucket makes it wait; compression is a ratio, 1.0 = incompressible = worst case).

Nodes never coordinate (there is no cluster-wide scheduler), so each node is simulated on its
own clock and the cluster-wide series are built afterwards from every node's upload intervals.

The reference policy (PyPI opguard 0.1.0, ``opguard.local_sync.manager``), read from its
source: a thread in every rank process sleeps ``interval × U(1.0, 1.2)`` before every cycle,
including the first; each cycle builds at most one batch for its rank and publishes it under a
node-local ``.upload.lock`` (so one upload per node at a time, paced at the cap); the final
drain runs only in ``close()`` when the rank process exits (here: at SIGTERM, the best case),
and an upload in progress at that moment is abandoned and redone.

Run (figures in docs/sizing.md)::

    .venv/bin/python bench/simulate_cluster.py --nodes 1000 --ranks 8 --hours 1 \
        --reference-per-rank --png docs/sizing-1000x8.png --json /tmp/sim1000.json
    .venv/bin/python bench/simulate_cluster.py --table 64,256,1024 --ranks 8 --hours 1
"""

from __future__ import annotations

import argparse
import heapq
import json
import math
import multiprocessing
import os
import random
import resource
import sys
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ProcessPoolExecutor
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from opguard.launcher import schedule
from opguard.staging.batchplan import Item, select_batch
from opguard.staging.ratelimit import TokenBucket

MIB = 1 << 20
PERIODIC, DRAIN_WARNING, DRAIN_TERM = 0, 1, 2
PHASES = ("periodic", "drain-warning", "drain-term")
MIN_SYNC_SPACING = 1.0  # s between the starts of two back-to-back syncs (process start-up, scans)
SETTLE_INTERVALS = 5  # "steady" figures leave out the first five intervals


@dataclass(frozen=True)
class Workload:
    """One simulated job. Rates are per rank; sizes in bytes; times in seconds."""

    nodes: int = 1000
    ranks: int = 8
    jsonl_bytes_per_s: float = 0.25 * MIB
    record_bytes: int = 2048
    file_bytes: int = 4 * MIB
    file_period: float = 20.0
    node_meta_bytes: int = 1 * MIB  # written once at start-up by the node's metadata uploader
    compress_ratio: float = 1.0  # uploaded bytes = payload / ratio (1.0: incompressible, worst case)
    interval: float = 60.0
    batch_bytes: int = 256 * MIB
    cap_mib_s: float = 32.0
    job_seconds: float = 3600.0
    kill_wait: float = 30.0
    warning_s: float = 0.0  # --signal=B:USR1@W; 0: no warning, the drain starts at SIGTERM
    chunk_bytes: int = 0  # bytes per bucket.consume() call; 0: the whole batch in one call
    salt: str = ""  # opguard-run calls stagger_offset without a salt
    continuous_after_warning: bool = False  # after the warning drain, drain again and again until SIGTERM
    grid: bool = False  # next sync on the fixed grid offset + m·interval (skipping missed ones), not start + interval
    reference_node_lock: bool = True  # opguard 0.1.0 serializes a node's uploads; False: every rank on its own
    seed: int = 1

    def __post_init__(self) -> None:
        problems = [f"{name}={getattr(self, name)!r} must be > 0" for name in
                    ("nodes", "ranks", "record_bytes", "file_period", "interval", "batch_bytes", "cap_mib_s",
                     "job_seconds", "compress_ratio") if not getattr(self, name) > 0]
        problems += [f"{name}={getattr(self, name)!r} must be >= 0" for name in
                     ("jsonl_bytes_per_s", "file_bytes", "node_meta_bytes", "kill_wait", "warning_s", "chunk_bytes")
                     if getattr(self, name) < 0]
        if self.warning_s >= self.job_seconds:
            problems.append(f"warning_s={self.warning_s} must be shorter than job_seconds={self.job_seconds}")
        if problems:
            raise ValueError("bad workload: " + "; ".join(problems))

    @property
    def rank_bytes_per_s(self) -> float:
        return self.jsonl_bytes_per_s + self.file_bytes / self.file_period

    @property
    def node_upload_bytes_per_s(self) -> float:
        """Uploaded (compressed) bytes a node produces per second, all ranks together."""
        return self.ranks * self.rank_bytes_per_s / self.compress_ratio

    def sizing(self) -> schedule.ClusterSizing:
        """The plan's view of this job (what ``opguard-run --plan`` derives)."""
        return schedule.ClusterSizing(
            node_count=self.nodes, ranks_per_node=self.ranks, node_bytes_per_s=self.node_upload_bytes_per_s,
            interval=self.interval, batch_bytes=self.batch_bytes / self.compress_ratio, cap_mib_s=self.cap_mib_s,
            job_seconds=self.job_seconds, kill_wait=self.kill_wait)


# ---- the data one stream waits to publish ------------------------------------------------------

class RankData:
    """A rank's producer: JSON lines at a steady rate (complete records only) plus one whole file
    of ``file_bytes`` every ``file_period`` seconds from a per-rank phase; nothing after the job ends."""

    def __init__(self, w: Workload, phase: float) -> None:
        self.w = w
        self.phase = phase
        self.jsonl_published = 0
        self.files_published = 0

    def jsonl_visible(self, t: float) -> int:
        t = min(t, self.w.job_seconds)
        rec = self.w.record_bytes
        return int(self.w.jsonl_bytes_per_s * t // rec) * rec

    def files_visible(self, t: float) -> int:
        t = min(t, self.w.job_seconds)
        if self.w.file_bytes == 0 or t < self.phase:
            return 0
        return int((t - self.phase) // self.w.file_period) + 1

    def backlog(self, t: float) -> int:
        return (self.jsonl_visible(t) - self.jsonl_published
                + (self.files_visible(t) - self.files_published) * self.w.file_bytes)

    def items(self, t: float) -> list[Item]:
        """What a scan at ``t`` finds: the unpublished JSON-lines tail, then the unpublished files."""
        out: list[Item] = []
        n = self.jsonl_visible(t) - self.jsonl_published
        if n > 0:
            out.append(Item("trace.jsonl", "append", n, self.w.record_bytes))
        for k in range(self.files_published, self.files_visible(t)):
            out.append(Item(f"tensors/t{k:06d}.pt", "file", self.w.file_bytes))
        return out

    def take(self, t: float) -> int:
        """Select the next batch (the uploader's own ``select_batch``), mark it published, return its payload."""
        items = self.items(t)
        if not items:
            return 0
        plan = select_batch(items, self.w.batch_bytes)
        if plan.oversized:
            raise ValueError(f"a record of {self.w.record_bytes} bytes exceeds the batch limit {self.w.batch_bytes}")
        payload = 0
        for tk in plan.takes:
            if tk.item.kind == "append":
                n = tk.nbytes // self.w.record_bytes * self.w.record_bytes  # batches end at a record boundary
                self.jsonl_published += n
                payload += n
            else:
                self.files_published += 1
                payload += tk.nbytes
        return payload


class NodeMetaData(RankData):
    """The node's metadata stream: ``node_meta_bytes`` written once at start-up."""

    def __init__(self, w: Workload) -> None:
        super().__init__(w, 0.0)
        self.meta_published = False

    def backlog(self, t: float) -> int:
        return 0 if self.meta_published else self.w.node_meta_bytes

    def items(self, t: float) -> list[Item]:
        return [] if self.meta_published or not self.w.node_meta_bytes else [
            Item("node.json", "file", self.w.node_meta_bytes)]

    def take(self, t: float) -> int:
        items = self.items(t)
        if not items:
            return 0
        plan = select_batch(items, self.w.batch_bytes)
        self.meta_published = bool(plan.takes)
        return plan.payload_bytes


# ---- what the simulation records ---------------------------------------------------------------

@dataclass
class Record:
    """Everything one policy did, cluster-wide, as flat arrays (filled node by node)."""

    start: list[float] = field(default_factory=list)
    end: list[float] = field(default_factory=list)
    nbytes: list[float] = field(default_factory=list)
    phase: list[int] = field(default_factory=list)
    ops: list[float] = field(default_factory=list)  # time of every create / rename / link on the target
    sync_backlog: list[float] = field(default_factory=list)  # per node: the largest backlog a periodic sync met
    drain: dict[int, list[float]] = field(default_factory=lambda: {DRAIN_WARNING: [], DRAIN_TERM: []})
    drain_backlog: dict[int, list[float]] = field(default_factory=lambda: {DRAIN_WARNING: [], DRAIN_TERM: []})
    wasted_bytes: float = 0.0

    def upload(self, start: float, end: float, nbytes: float, phase: int) -> None:
        self.start.append(start)
        self.end.append(end)
        self.nbytes.append(nbytes)
        self.phase.append(phase)
        self.ops += (start, end)  # the hidden temporary is created, then renamed into place


class VirtualClock:
    """A node's time: the token bucket reads it and "sleeps" by advancing it."""

    def __init__(self) -> None:
        self.now = 0.0

    def clock(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.now += max(0.0, seconds)


def upload(vc: VirtualClock, bucket: TokenBucket, nbytes: float, chunk: int) -> None:
    """Push ``nbytes`` through the node's bucket the way the uploader's copy loop does."""
    left = math.ceil(nbytes)
    step = chunk or left
    while left > 0:
        n = min(step, left)
        bucket.consume(n)
        left -= n


# ---- our policy: one wrapper per node ------------------------------------------------------------

def simulate_node_ours(k: int, w: Workload, rec: Record) -> None:
    """Node ``k`` as ``opguard-run`` drives it (``launcher/supervise.py``): one sync at a time; the
    first periodic ``opguard sync --all`` at the node's stagger offset, each next one ``interval``
    after the previous one started (at once if that has passed); a drain requested while a
    periodic sync runs starts when it ends; after an early (warning) drain, periodic syncs resume;
    at SIGTERM the producers stop and the last final drain runs."""
    rng = random.Random(f"{w.seed}:{k}")
    streams: list[RankData] = [RankData(w, rng.uniform(0, w.file_period)) for _ in range(w.ranks)]
    streams.append(NodeMetaData(w))
    batches = [0] * len(streams)
    sealed: list[int | None] = [None] * len(streams)  # batch count at the stream's current seal
    vc = VirtualClock()
    rate = w.cap_mib_s * MIB
    ratio = w.compress_ratio
    drains = [(w.job_seconds - w.warning_s, DRAIN_WARNING)] if w.warning_s else []
    drains.append((w.job_seconds, DRAIN_TERM))
    next_sync = offset = schedule.stagger_offset(k, w.nodes, w.interval, w.salt)
    rec.ops += (0.0, 0.0)  # preflight: the node claim (docs/format.md §5.3), created then linked
    if k == 0:
        rec.ops += (0.0, 0.0)  # format.json, created once by whoever comes first
    worst = 0.0
    current: list[tuple[float, int]] = []  # (end, payload) of the latest periodic sync's uploads
    started = 0.0

    def drain_pass(kind: int) -> list[tuple[float, int]]:
        """One ``opguard sync --all --final``: each stream drains what its first scan sees, then is sealed."""
        done: list[tuple[float, int]] = []
        bucket = TokenBucket(rate, clock=vc.clock, sleep=vc.sleep)
        for i, s in enumerate(streams):
            mark = vc.now
            while True:
                t0 = vc.now
                payload = s.take(mark)
                if not payload:
                    break
                upload(vc, bucket, payload / ratio, w.chunk_bytes)
                rec.upload(t0, vc.now, payload / ratio, kind)
                done.append((vc.now, payload))
                batches[i] += 1
            if sealed[i] != batches[i]:
                rec.ops += (vc.now, vc.now)  # the seal: a temporary created, then linked into place
                sealed[i] = batches[i]
        return done

    for t_drain, kind in drains:
        while max(next_sync, vc.now) < t_drain:
            vc.now = started = max(next_sync, vc.now)
            worst = max(worst, sum(s.backlog(vc.now) for s in streams))
            bucket = TokenBucket(rate, clock=vc.clock, sleep=vc.sleep)  # one bucket per sync process
            current = []
            for i, s in enumerate(streams):
                payload = s.take(vc.now)  # the stream's scan happens when its turn comes
                if payload:
                    t0 = vc.now
                    upload(vc, bucket, payload / ratio, w.chunk_bytes)
                    rec.upload(t0, vc.now, payload / ratio, PERIODIC)
                    current.append((vc.now, payload))
                    batches[i] += 1
            next_sync = started + w.interval
            if w.grid and vc.now > next_sync:  # overran: wait for the node's own slot, keeping the stagger
                next_sync = offset + w.interval * math.ceil((vc.now - offset) / w.interval)
        # unpublished when the drain is requested, counting what the running sync published after that
        backlog = sum(s.backlog(t_drain) for s in streams) + sum(p for e, p in current if e > t_drain)
        vc.now = started = max(vc.now, t_drain)
        drain_pass(kind)
        rec.drain[kind].append(vc.now - t_drain)
        rec.drain_backlog[kind].append(backlog)
        if kind == DRAIN_WARNING and w.continuous_after_warning:
            # keep draining until SIGTERM: a new final pass as soon as the last one ends
            while True:
                started = max(vc.now, started + MIN_SYNC_SPACING)
                if started >= w.job_seconds:
                    break
                vc.now = started
                current = drain_pass(DRAIN_WARNING)
    rec.sync_backlog.append(worst)


# ---- the reference policy: a thread in every rank process ---------------------------------------

def simulate_node_reference(k: int, w: Workload, rec: Record) -> None:
    """Node ``k`` under opguard 0.1.0's policy (see the module docstring)."""
    rng = random.Random(f"{w.seed}:{k}")
    jitter = random.Random(f"{w.seed}:{k}:jitter")
    ranks = [RankData(w, rng.uniform(0, w.file_period)) for _ in range(w.ranks)]
    rate = w.cap_mib_s * MIB
    ratio = w.compress_ratio
    end = w.job_seconds
    heap = [(w.interval * jitter.uniform(1.0, 1.2), r) for r in range(w.ranks)]
    heapq.heapify(heap)
    free_at = 0.0  # when the node-local .upload.lock is next free
    worst = 0.0
    while heap:
        t, r = heapq.heappop(heap)
        if t >= end:
            continue
        if r == 0:  # the node's backlog, sampled at local rank 0's cycles
            worst = max(worst, sum(x.backlog(t) for x in ranks))
        s = ranks[r]
        saved = (s.jsonl_published, s.files_published)
        payload = s.take(t)  # the batch is built before the lock is taken
        done = t
        if payload:
            start = max(t, free_at) if w.reference_node_lock else t
            stop = min(end, start + payload / ratio / rate)
            if start >= end:  # still waiting for the lock when the process is told to stop
                s.jsonl_published, s.files_published = saved
            elif start + payload / ratio / rate > end:  # interrupted mid-copy: batch kept, redone at exit
                s.jsonl_published, s.files_published = saved
                rec.upload(start, stop, (stop - start) * rate, PERIODIC)
                rec.ops.pop()  # never renamed
                rec.wasted_bytes += (stop - start) * rate
            else:
                rec.upload(start, stop, payload / ratio, PERIODIC)
            free_at = done = stop
        heapq.heappush(heap, (done + w.interval * jitter.uniform(1.0, 1.2), r))
    # close() at exit: every rank drains what is visible, one upload at a time under the node lock
    backlog = sum(x.backlog(end) for x in ranks)
    now = last = max(end, free_at)
    for s in ranks:
        if not w.reference_node_lock:
            now = end  # every rank's process drains on its own
        while True:
            payload = s.take(end)
            if not payload:
                break
            rec.upload(now, now + payload / ratio / rate, payload / ratio, DRAIN_TERM)
            now += payload / ratio / rate
        last = max(last, now)
    rec.drain[DRAIN_TERM].append(last - end)
    rec.drain_backlog[DRAIN_TERM].append(backlog)
    rec.sync_backlog.append(worst)


NodeFn = Callable[[int, Workload, Record], None]


def _simulate_range(node_fn: NodeFn, w: Workload, lo: int, hi: int) -> Record:
    rec = Record()
    for k in range(lo, hi):
        node_fn(k, w, rec)
    return rec


def simulate(w: Workload, node_fn: NodeFn, jobs: int = 1) -> Record:
    """Every node in turn, or spread over ``jobs`` processes (nodes never interact, so the
    result is the same either way: the records are merged in node order)."""
    if jobs <= 1 or w.nodes < 4 * jobs:
        return _simulate_range(node_fn, w, 0, w.nodes)
    bounds = np.linspace(0, w.nodes, 4 * jobs + 1).astype(int)
    with ProcessPoolExecutor(jobs, mp_context=multiprocessing.get_context("fork")) as ex:
        parts = list(ex.map(_simulate_range, [node_fn] * (bounds.size - 1), [w] * (bounds.size - 1),
                            bounds[:-1].tolist(), bounds[1:].tolist()))
    rec = Record()
    for part in parts:
        for name in ("start", "end", "nbytes", "phase", "ops", "sync_backlog"):
            getattr(rec, name).extend(getattr(part, name))
        for kind in rec.drain:
            rec.drain[kind].extend(part.drain[kind])
            rec.drain_backlog[kind].extend(part.drain_backlog[kind])
        rec.wasted_bytes += part.wasted_bytes
    return rec


# ---- cluster-wide series -----------------------------------------------------------------------

def in_flight(start: np.ndarray, end: np.ndarray) -> tuple[int, np.ndarray, np.ndarray]:
    """(peak, counts, seconds spent at each count) of overlapping intervals; an end at the same
    instant as a start is processed first (back-to-back uploads are not concurrent); an upload
    the bucket's burst lets through in no time is never in flight."""
    keep = end > start
    start, end = start[keep], end[keep]
    if start.size == 0:
        return 0, np.zeros(1, dtype=np.int64), np.zeros(1)
    times = np.concatenate([end, start])
    delta = np.concatenate([-np.ones(end.size, dtype=np.int64), np.ones(start.size, dtype=np.int64)])
    order = np.lexsort((delta, times))
    times, delta = times[order], delta[order]
    level = np.cumsum(delta)
    dt = np.diff(times)
    weights = np.bincount(level[:-1], weights=dt, minlength=int(level.max()) + 1)
    return int(level.max()), np.arange(weights.size), weights


def count_at(start: np.ndarray, end: np.ndarray, grid: np.ndarray) -> np.ndarray:
    """Uploads in flight at each grid time."""
    keep = end > start
    s, e = np.sort(start[keep]), np.sort(end[keep])
    return np.searchsorted(s, grid, side="right") - np.searchsorted(e, grid, side="right")


def bytes_by(start: np.ndarray, end: np.ndarray, nbytes: np.ndarray, grid: np.ndarray) -> np.ndarray:
    """Bytes transferred up to each grid time, each upload at a constant rate over its interval."""
    dur = np.maximum(end - start, 1e-12)
    rate = nbytes / dur

    def ramp(points: np.ndarray) -> np.ndarray:  # Σ rate · max(0, t - point)
        order = np.argsort(points)
        p, r = points[order], rate[order]
        cr, crp = np.concatenate([[0.0], np.cumsum(r)]), np.concatenate([[0.0], np.cumsum(r * p)])
        i = np.searchsorted(p, grid, side="right")
        out: np.ndarray = grid * cr[i] - crp[i]
        return out

    out: np.ndarray = ramp(start) - ramp(end)
    return out


def percentiles(values: Sequence[float] | np.ndarray, qs: Sequence[float] = (50, 90, 99, 100)) -> dict[str, float]:
    a = np.asarray(values, dtype=float)
    if a.size == 0:
        return {f"p{q:g}": 0.0 for q in qs}
    return {("max" if q == 100 else f"p{q:g}"): float(np.percentile(a, q)) for q in qs}


def weighted_percentiles(counts: np.ndarray, weights: np.ndarray, qs: Sequence[float] = (50, 90, 99)) -> dict[str, int]:
    cum = np.cumsum(weights)
    total = cum[-1] if cum.size and cum[-1] > 0 else 1.0
    return {f"p{q:g}": int(counts[min(int(np.searchsorted(cum, total * q / 100)), counts.size - 1)]) for q in qs}


def summarize(w: Workload, rec: Record, step: float = 1.0) -> dict[str, Any]:
    start, end = np.asarray(rec.start), np.asarray(rec.end)
    nbytes, phase = np.asarray(rec.nbytes), np.asarray(rec.phase)
    per = phase == PERIODIC
    settle = SETTLE_INTERVALS * w.interval  # the first syncs carry uneven amounts; see docs/sizing.md
    stop = w.job_seconds - w.interval - w.warning_s
    steady = per & (start >= settle) & (end <= stop)
    peak, counts, weights = in_flight(start[per], end[per])
    s_peak, s_counts, s_weights = in_flight(start[steady], end[steady])
    horizon = float(end.max()) if end.size else w.job_seconds
    grid = np.arange(0.0, horizon + step, step)
    cum = bytes_by(start, end, nbytes, grid)
    rate = np.diff(cum) / step
    inner = (grid[1:] > settle) & (grid[1:] <= stop)
    ops = np.asarray(rec.ops)
    per_min = np.bincount((ops // 60).astype(np.int64)) if ops.size else np.zeros(1)
    steady_min = per_min[math.ceil(settle / 60):max(math.ceil(settle / 60) + 1, int(stop // 60))]
    drain_peak = {PHASES[kd]: in_flight(start[phase == kd], end[phase == kd])[0] for kd in (DRAIN_WARNING, DRAIN_TERM)}
    return {
        "uploads": int(start.size),
        "bytes_uploaded": float(nbytes.sum()),
        "in_flight_periodic": {
            "peak": peak, "peak_steady": s_peak,
            "mean_steady": float((s_counts * s_weights).sum() / max(s_weights.sum(), 1e-9)),
            **weighted_percentiles(counts, weights)},
        "in_flight_drain_peak": drain_peak,
        "aggregate_mib_s": {"peak": float(rate.max() / MIB) if rate.size else 0.0,
                            "mean_steady": float(rate[inner].mean() / MIB) if inner.any() else 0.0,
                            "peak_steady": float(rate[inner].max() / MIB) if inner.any() else 0.0},
        "metadata_ops_per_min": {"peak": int(per_min.max()),
                                 "mean_steady": float(steady_min.mean()) if steady_min.size else 0.0,
                                 "peak_steady": int(steady_min.max()) if steady_min.size else 0},
        "backlog_mib_per_node": {k: v / MIB for k, v in percentiles(rec.sync_backlog).items()},
        "drain_s": {PHASES[kd]: percentiles(v) for kd, v in rec.drain.items() if v},
        "drain_backlog_mib": {PHASES[kd]: {k: x / MIB for k, x in percentiles(v).items()}
                              for kd, v in rec.drain_backlog.items() if v},
        "drain_over_kill_wait": int(np.sum(np.asarray(rec.drain[DRAIN_TERM]) > w.kill_wait)),
        "drain_over_warning": int(np.sum(np.asarray(rec.drain[DRAIN_WARNING]) > w.warning_s)) if w.warning_s else None,
        "wasted_mib": rec.wasted_bytes / MIB,
        "_warning": w.warning_s, "_drain_term": rec.drain[DRAIN_TERM], "_drain_warning": rec.drain[DRAIN_WARNING],
        "series": {"t": grid[1:], "in_flight": count_at(start, end, grid[1:]), "mib_s": rate / MIB},
    }


def plan_numbers(w: Workload) -> dict[str, Any]:
    z = w.sizing()
    return {"upload_s": z.upload_s, "keeps_up": z.keeps_up, "ideal_peak_in_flight": z.ideal_peak_in_flight,
            "mean_in_flight": z.mean_in_flight, "aggregate_mib_s": z.aggregate_bytes_per_s / MIB,
            "drain_aggregate_mib_s": z.drain_aggregate_bytes_per_s / MIB,
            "metadata_ops_per_min": z.metadata_ops_per_minute, "worst_backlog_mib": z.worst_backlog_bytes / MIB,
            "worst_drain_s": z.worst_drain_s, "drain_fits_kill_wait": z.drain_fits_kill_wait,
            "worst_early_drain_s": z.worst_early_drain_s, "warning_s": z.warning_s}


@dataclass
class Result:
    workload: Workload
    plan: dict[str, Any]
    ours: dict[str, Any]
    ours_warned: dict[str, Any]
    reference: dict[str, Any]
    seconds: dict[str, float]
    reference_per_rank: dict[str, Any] | None = None

    def as_json(self) -> dict[str, Any]:
        def strip(d: dict[str, Any]) -> dict[str, Any]:
            return {k: v for k, v in d.items() if k != "series" and not k.startswith("_")}
        return {"workload": asdict(self.workload), "plan": self.plan, "ours": strip(self.ours),
                "ours_with_warning": strip(self.ours_warned), "reference": strip(self.reference),
                "reference_per_rank": strip(self.reference_per_rank) if self.reference_per_rank else None,
                "wall_seconds": self.seconds}


def _cpu() -> float:
    """CPU seconds of this process and its finished children (the worker processes)."""
    me, kids = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return me.ru_utime + me.ru_stime + kids.ru_utime + kids.ru_stime


def run(w: Workload, jobs: int = 1, per_rank: bool = False) -> Result:
    """Our policy without and with the ``--signal`` warning the plan recommends, and the reference
    (``per_rank``: also the reference without its node lock, every rank uploading on its own)."""
    plan = plan_numbers(w)
    warned = replace(w, warning_s=float(w.warning_s or plan["warning_s"]))
    bare = replace(w, warning_s=0.0)
    seconds: dict[str, float] = {}
    out: dict[str, dict[str, Any]] = {}
    runs: list[tuple[str, Workload, NodeFn]] = [
        ("ours", bare, simulate_node_ours), ("ours_warned", warned, simulate_node_ours),
        ("reference", bare, simulate_node_reference)]
    if per_rank:
        runs.append(("reference_per_rank", replace(bare, reference_node_lock=False), simulate_node_reference))
    for name, wl, fn in runs:
        t0, c0 = time.perf_counter(), _cpu()
        out[name] = summarize(wl, simulate(wl, fn, jobs))
        seconds[name] = time.perf_counter() - t0
        seconds[name + "_cpu"] = _cpu() - c0
    return Result(w, plan, out["ours"], out["ours_warned"], out["reference"], seconds, out.get("reference_per_rank"))


# ---- output ------------------------------------------------------------------------------------

def report(r: Result) -> str:
    w, p, o, ow, ref = r.workload, r.plan, r.ours, r.ours_warned, r.reference
    fo, fr = o["in_flight_periodic"], ref["in_flight_periodic"]
    lines = [
        f"{w.nodes} nodes x {w.ranks} ranks, {w.job_seconds / 3600:g} h, interval {w.interval:g} s, "
        f"batch {w.batch_bytes / MIB:g} MiB, cap {w.cap_mib_s:g} MiB/s, "
        f"{w.rank_bytes_per_s / MIB:.3g} MiB/s per rank (compress x{w.compress_ratio:g})",
        f"plan: t_upload {p['upload_s']:.2f} s, ideal peak {p['ideal_peak_in_flight']}, mean in flight "
        f"{p['mean_in_flight']:.1f}, aggregate {p['aggregate_mib_s']:.0f} MiB/s, "
        f"{p['metadata_ops_per_min']:.0f} ops/min, "
        f"worst drain {p['worst_drain_s']:.1f} s (KillWait {w.kill_wait:g} s), warning to request {p['warning_s']} s",
        f"in flight (periodic): ours peak {fo['peak']} ({fo['peak'] / max(p['ideal_peak_in_flight'], 1):.3f}x ideal), "
        f"steady peak {fo['peak_steady']}, p50/p99 {fo['p50']}/{fo['p99']}, steady mean {fo['mean_steady']:.1f} | "
        f"reference peak {fr['peak']} "
        f"({fr['peak'] / max(p['ideal_peak_in_flight'], 1):.2f}x ideal), steady peak {fr['peak_steady']}, "
        f"p50/p99 {fr['p50']}/{fr['p99']}",
        f"in flight (final drain): ours {o['in_flight_drain_peak']['drain-term']} | reference "
        f"{ref['in_flight_drain_peak']['drain-term']}",
        f"aggregate MiB/s: ours steady mean {o['aggregate_mib_s']['mean_steady']:.0f}, steady peak "
        f"{o['aggregate_mib_s']['peak_steady']:.0f}, overall peak {o['aggregate_mib_s']['peak']:.0f} | "
        f"reference steady peak {ref['aggregate_mib_s']['peak_steady']:.0f}, "
        f"overall peak {ref['aggregate_mib_s']['peak']:.0f}",
        f"creates+renames/min: ours steady mean {o['metadata_ops_per_min']['mean_steady']:.0f}, peak "
        f"{o['metadata_ops_per_min']['peak']} | reference steady mean "
        f"{ref['metadata_ops_per_min']['mean_steady']:.0f}, "
        f"peak {ref['metadata_ops_per_min']['peak']}",
        f"backlog per node at a periodic sync (MiB): ours p50 {o['backlog_mib_per_node']['p50']:.0f} max "
        f"{o['backlog_mib_per_node']['max']:.0f} | reference p50 {ref['backlog_mib_per_node']['p50']:.0f} max "
        f"{ref['backlog_mib_per_node']['max']:.0f}",
        f"drain at SIGTERM, no warning (s): ours p50 {o['drain_s']['drain-term']['p50']:.2f} max "
        f"{o['drain_s']['drain-term']['max']:.2f}, over KillWait {o['drain_over_kill_wait']}/{w.nodes} | reference "
        f"p50 {ref['drain_s']['drain-term']['p50']:.2f} max {ref['drain_s']['drain-term']['max']:.2f}, over KillWait "
        f"{ref['drain_over_kill_wait']}/{w.nodes}",
        f"with --signal=B:USR1@{ow['_warning']:g}: warning drain p50 {ow['drain_s']['drain-warning']['p50']:.2f} max "
        f"{ow['drain_s']['drain-warning']['max']:.2f} s (over warning {ow['drain_over_warning']}/{w.nodes}); "
        f"SIGTERM drain max {ow['drain_s']['drain-term']['max']:.2f} s (over KillWait {ow['drain_over_kill_wait']})",
        "simulation wall / CPU seconds: " + ", ".join(
            f"{k} {r.seconds[k]:.1f} / {r.seconds[k + '_cpu']:.1f}" for k in ("ours", "ours_warned", "reference")),
    ]
    if r.reference_per_rank:
        x = r.reference_per_rank
        lines.insert(-1, f"reference without its node lock (every rank uploads on its own): periodic peak "
                         f"{x['in_flight_periodic']['peak']}, steady peak {x['in_flight_periodic']['peak_steady']}, "
                         f"aggregate peak {x['aggregate_mib_s']['peak']:.0f} MiB/s, drain in flight "
                         f"{x['in_flight_drain_peak']['drain-term']}, "
                         f"drain max {x['drain_s']['drain-term']['max']:.2f} s")
    return "\n".join(lines)


def plot(r: Result, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    w = r.workload
    fig, axes = plt.subplots(3, 1, figsize=(11, 10))
    for name, s, colour in (("opguard (stagger by node index)", r.ours["series"], "tab:blue"),
                            ("reference (random ×1.0–1.2 per rank)", r.reference["series"], "tab:orange")):
        axes[0].plot(s["t"] / 60, s["in_flight"], lw=0.6, color=colour, label=name)
        axes[1].plot(s["t"] / 60, s["mib_s"] / 1024, lw=0.6, color=colour, label=name)
    axes[0].axhline(r.plan["ideal_peak_in_flight"], ls="--", color="k", lw=0.8,
                    label=f"ideal ⌈N·t_upload/interval⌉ = {r.plan['ideal_peak_in_flight']}")
    axes[0].set_ylabel("uploads in flight")
    axes[0].set_yscale("log")
    axes[1].set_ylabel("aggregate GiB/s on the target")
    axes[1].set_yscale("log")
    for ax in axes[:2]:
        ax.set_xlabel("job time (min)")
        ax.legend(loc="upper right", fontsize=8)
    bins = np.linspace(0, max(w.kill_wait, r.plan["warning_s"]) * 1.1, 45)
    axes[2].hist(r.ours["_drain_term"], bins=bins, alpha=0.6, label="opguard, drain at SIGTERM (no warning)")
    axes[2].hist(r.ours_warned["_drain_warning"], bins=bins, alpha=0.6,
                 label=f"opguard, drain at the warning (USR1@{r.ours_warned['_warning']:g})")
    axes[2].hist(r.reference["_drain_term"], bins=bins, alpha=0.6, label="reference, drain at exit")
    axes[2].axvline(w.kill_wait, color="r", ls="--", lw=1, label=f"KillWait {w.kill_wait:g} s")
    axes[2].set_xlabel("final drain time per node (s)")
    axes[2].set_ylabel("nodes")
    axes[2].legend(fontsize=8)
    fig.suptitle(f"{w.nodes} nodes × {w.ranks} ranks, {w.job_seconds / 3600:g} h, interval {w.interval:g} s, "
                 f"cap {w.cap_mib_s:g} MiB/s, {w.rank_bytes_per_s / MIB:.2f} MiB/s per rank")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def table(rows: list[Result]) -> str:
    """One markdown row per node count: the plan's number beside the simulation's."""
    head = ("| nodes | t_upload s | ideal peak | ours: peak (steady) | reference: peak (steady) "
            "| aggregate MiB/s: plan / sim | drain aggregate GiB/s: plan / sim "
            "| creates+renames/min: plan / sim (peak) | SIGTERM drain s: p50 / max (plan bound), nodes late "
            "| warning s | warning drain max s (plan bound) | then SIGTERM drain max s (nodes over KillWait) "
            "| reference drain max s (nodes over KillWait) |")
    out = [head, "|" + "---|" * (head.count("|") - 1)]
    for r in rows:
        p, o, ow, ref = r.plan, r.ours, r.ours_warned, r.reference
        fo, fr = o["in_flight_periodic"], ref["in_flight_periodic"]
        out.append(
            f"| {r.workload.nodes} | {p['upload_s']:.2f} | {p['ideal_peak_in_flight']} "
            f"| {fo['peak']} ({fo['peak_steady']}) | {fr['peak']} ({fr['peak_steady']}) "
            f"| {p['aggregate_mib_s']:.0f} / {o['aggregate_mib_s']['mean_steady']:.0f} "
            f"| {p['drain_aggregate_mib_s'] / 1024:.1f} / {o['aggregate_mib_s']['peak'] / 1024:.1f} "
            f"| {p['metadata_ops_per_min']:.0f} / {o['metadata_ops_per_min']['mean_steady']:.0f} "
            f"({o['metadata_ops_per_min']['peak']}) "
            f"| {o['drain_s']['drain-term']['p50']:.1f} / {o['drain_s']['drain-term']['max']:.1f} "
            f"({p['worst_drain_s']:.1f}), {o['drain_over_kill_wait']} | {p['warning_s']} "
            f"| {ow['drain_s']['drain-warning']['max']:.1f} ({p['worst_early_drain_s']:.1f}) "
            f"| {ow['drain_s']['drain-term']['max']:.1f} ({ow['drain_over_kill_wait']}) "
            f"| {ref['drain_s']['drain-term']['max']:.1f} ({ref['drain_over_kill_wait']}) |")
    return "\n".join(out)


def _workload(a: argparse.Namespace) -> Workload:
    return Workload(nodes=a.nodes, ranks=a.ranks, job_seconds=a.hours * 3600, interval=a.interval,
                    batch_bytes=a.batch_mib * MIB, cap_mib_s=a.mbps, jsonl_bytes_per_s=a.jsonl_mib_s * MIB,
                    file_bytes=int(a.file_mib * MIB), file_period=a.file_period, compress_ratio=a.compress,
                    kill_wait=a.kill_wait, warning_s=a.warning, chunk_bytes=int(a.chunk_mib * MIB), grid=a.grid,
                    continuous_after_warning=a.continuous_after_warning)


def main(argv: list[str] | None = None) -> int:
    d = Workload()
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--nodes", type=int, default=d.nodes)
    ap.add_argument("--ranks", type=int, default=d.ranks, help="ranks per node")
    ap.add_argument("--hours", type=float, default=d.job_seconds / 3600, help="job length (SIGTERM at the end)")
    ap.add_argument("--interval", type=float, default=d.interval, help="OPGUARD_LOCAL_DUMP_SYNC_INTERVAL (s)")
    ap.add_argument("--batch-mib", type=int, default=d.batch_bytes // MIB, help="OPGUARD_SYNC_BATCH_MB")
    ap.add_argument("--mbps", type=float, default=d.cap_mib_s, help="OPGUARD_SYNC_MBPS (per-node cap, MiB/s)")
    ap.add_argument("--jsonl-mib-s", type=float, default=d.jsonl_bytes_per_s / MIB, help="JSON lines per rank")
    ap.add_argument("--file-mib", type=float, default=d.file_bytes / MIB, help="whole file written by each rank ...")
    ap.add_argument("--file-period", type=float, default=d.file_period, help="... every this many seconds")
    ap.add_argument("--compress", type=float, default=d.compress_ratio, help="payload/uploaded ratio (1 = worst)")
    ap.add_argument("--kill-wait", type=float, default=d.kill_wait, help="Slurm KillWait (s)")
    ap.add_argument("--warning", type=float, default=0.0, help="--signal warning (s); default: the plan's")
    ap.add_argument("--chunk-mib", type=float, default=0.0, help="bytes per bucket.consume (0: whole batch)")
    ap.add_argument("--jobs", type=int, default=os.cpu_count() or 1, help="processes (nodes are independent)")
    ap.add_argument("--continuous-after-warning", action="store_true",
                    help="after the warning drain, keep draining until SIGTERM (instead of resuming periodic syncs)")
    ap.add_argument("--grid", action="store_true",
                    help="after an overrun, wait for the node's next slot (offset + m·interval), not at once")
    ap.add_argument("--reference-per-rank", action="store_true",
                    help="also simulate the reference without its node-local upload lock")
    ap.add_argument("--table", default="", help="comma-separated node counts: print a markdown table instead")
    ap.add_argument("--png", type=Path, help="write the plot here")
    ap.add_argument("--json", type=Path, help="write the figures here")
    a = ap.parse_args(argv)
    try:
        base = _workload(a)
    except ValueError as e:
        ap.error(f"{e} (fix the matching --option)")
    if a.table:
        rows = [run(replace(base, nodes=int(n)), a.jobs) for n in a.table.split(",")]
        print(table(rows))
        if a.json:
            a.json.write_text(json.dumps([r.as_json() for r in rows], indent=1, default=_jsonable))
        return 0
    t0 = time.perf_counter()
    r = run(base, a.jobs, a.reference_per_rank)
    print(report(r))
    print(f"total wall time {time.perf_counter() - t0:.1f} s")
    if a.json:
        a.json.write_text(json.dumps(r.as_json(), indent=1, default=_jsonable))
    if a.png:
        plot(r, a.png)
        print(f"plot: {a.png}")
    return 0


def _jsonable(x: object) -> object:
    if isinstance(x, np.ndarray):
        return x.tolist()
    if isinstance(x, np.generic):
        return x.item()
    raise TypeError(type(x))


if __name__ == "__main__":
    sys.exit(main())
