"""Sync scheduling and the plan's derived numbers, shared by opguard-run and the simulator.

Pure functions of their arguments (no clock, no I/O), so ``bench/simulate_cluster.py`` drives
exactly the code the wrapper runs.
"""

from __future__ import annotations

import hashlib
import math
from dataclasses import dataclass

from opguard.staging.config import MIB

JITTER_FRACTION = 0.05  # of one node's slot (interval / node_count)


def jitter_unit(node_index: int, salt: str = "") -> float:
    """A deterministic number in [0, 1) for a node (stable across processes and runs)."""
    h = hashlib.sha256(f"{salt}:{node_index}".encode()).digest()
    return int.from_bytes(h[:8], "big") / 2.0**64


def stagger_offset(node_index: int, node_count: int, interval: float, salt: str = "") -> float:
    """Seconds after the wrapper starts at which node ``node_index`` of ``node_count`` first syncs.

    Node k of N starts at k/N of the interval, plus a small deterministic jitter (at most
    ``JITTER_FRACTION`` of one slot) so nodes that share an index pattern do not lock-step.
    """
    if node_count < 1 or not 0 <= node_index < node_count:
        raise ValueError(f"node index {node_index} outside 0..{node_count - 1}")
    slot = interval / node_count
    return node_index * slot + JITTER_FRACTION * slot * jitter_unit(node_index, salt)


def per_node_cap(aggregate_mib_s: float, node_count: int) -> float:
    """Per-node cap (MiB/s) from an aggregate budget: the budget divided by the node count."""
    return aggregate_mib_s / max(1, node_count)


def upload_seconds(nbytes: float, cap_mib_s: float) -> float:
    """Time one upload of ``nbytes`` takes at the cap."""
    return nbytes / (cap_mib_s * 2**20)


def drain_seconds(pending_bytes: float, cap_mib_s: float) -> float:
    """Time a final drain of ``pending_bytes`` takes at the node's cap."""
    return upload_seconds(pending_bytes, cap_mib_s)


def periodic_capacity_bytes_per_s(interval: float, batch_bytes: float, cap_mib_s: float, streams: int = 1) -> float:
    """The most a wrapper can publish per second through periodic syncs: one batch per stream per
    interval (``streams``: the ranks it syncs, plus the node stream if it has that duty), no more
    than the cap allows within the interval."""
    return min(streams * batch_bytes, cap_mib_s * 2**20 * interval) / interval


def keeps_up(interval: float, batch_bytes: float, cap_mib_s: float) -> bool:
    """True when a full batch can be uploaded within one interval at the cap."""
    return upload_seconds(batch_bytes, cap_mib_s) <= interval


def ideal_peak_in_flight(node_count: int, upload_s: float, interval: float) -> int:
    """⌈N · t_upload / interval⌉: uploads in flight at once with a perfect stagger."""
    return max(1, math.ceil(node_count * upload_s / interval)) if upload_s > 0 else 0


def warning_seconds(pending_bytes: float, cap_mib_s: float, margin: float = 1.5, floor: float = 30.0) -> int:
    """The ``--signal=B:USR1@N`` warning time to request for a drain of ``pending_bytes``."""
    return math.ceil(max(floor, margin * drain_seconds(pending_bytes, cap_mib_s)))


# ---- cluster sizing: the numbers `docs/sizing.md` derives and `bench/simulate_cluster.py` checks ----

OPS_PER_BATCH = 2  # one create (the hidden .tmp-* file) + one rename (publication)


def upload_seconds_per_interval(node_bytes_per_s: float, interval: float, cap_mib_s: float) -> float:
    """t_upload: how long a node's upload of one interval's worth of new data takes at the cap."""
    return upload_seconds(node_bytes_per_s * interval, cap_mib_s)


def mean_in_flight(node_count: int, upload_s: float, interval: float) -> float:
    """N · t_upload / interval, at most N: the time-averaged number of node uploads in flight."""
    return min(float(node_count), node_count * upload_s / interval)


def backlog_growth_bytes_per_s(node_bytes_per_s: float, interval: float, batch_bytes: float, cap_mib_s: float,
                               streams: int = 1) -> float:
    """How fast a node's unpublished data grows when periodic syncs cannot keep up (0 when they can).

    A periodic sync publishes at most one batch per stream, one upload at a time at the cap, so a
    node publishes at most ``min(streams · batch, cap · interval)`` per interval.
    """
    capacity = min(streams * batch_bytes, cap_mib_s * MIB * interval) / interval
    return max(0.0, node_bytes_per_s - capacity)


def worst_case_backlog_bytes(node_bytes_per_s: float, interval: float, batch_bytes: float, cap_mib_s: float,
                             streams: int = 1, elapsed_s: float = 0.0) -> float:
    """Unpublished data a node can hold when its final drain starts: one full interval of new data
    (the drain may start just before the next periodic sync); if the periodic syncs fall behind,
    also what accumulated over ``elapsed_s`` seconds and the batch still in flight (the node is
    then always uploading, and a batch counts as published only once renamed)."""
    growth = backlog_growth_bytes_per_s(node_bytes_per_s, interval, batch_bytes, cap_mib_s, streams)
    in_flight = batch_bytes if growth > 0 else 0.0
    return node_bytes_per_s * interval + growth * elapsed_s + in_flight


def metadata_ops_per_minute(node_count: int, streams_per_node: int, interval: float) -> float:
    """Creates + renames per minute on the target in steady state: every stream with new data
    publishes one batch per interval, each one create and one rename."""
    return OPS_PER_BATCH * node_count * streams_per_node * 60.0 / interval


@dataclass(frozen=True)
class ClusterSizing:
    """The derived numbers for N nodes × R ranks at a given data rate (``docs/sizing.md``)."""

    node_count: int
    ranks_per_node: int
    node_bytes_per_s: float  # new data per node (all its ranks plus node metadata)
    interval: float
    batch_bytes: float
    cap_mib_s: float
    job_seconds: float
    kill_wait: float

    @property
    def streams_per_node(self) -> int:
        return self.ranks_per_node + 1  # one stream per rank plus the node's metadata stream

    @property
    def upload_s(self) -> float:
        return upload_seconds_per_interval(self.node_bytes_per_s, self.interval, self.cap_mib_s)

    @property
    def keeps_up(self) -> bool:
        return backlog_growth_bytes_per_s(self.node_bytes_per_s, self.interval, self.batch_bytes,
                                          self.cap_mib_s, self.streams_per_node) == 0.0

    @property
    def ideal_peak_in_flight(self) -> int:
        return ideal_peak_in_flight(self.node_count, min(self.upload_s, self.interval), self.interval)

    @property
    def mean_in_flight(self) -> float:
        return mean_in_flight(self.node_count, min(self.upload_s, self.interval), self.interval)

    @property
    def aggregate_bytes_per_s(self) -> float:
        """Steady-state aggregate upload rate on the shared filesystem."""
        growth = backlog_growth_bytes_per_s(self.node_bytes_per_s, self.interval, self.batch_bytes,
                                            self.cap_mib_s, self.streams_per_node)
        return self.node_count * (self.node_bytes_per_s - growth)

    @property
    def drain_aggregate_bytes_per_s(self) -> float:
        """Aggregate rate while every node drains at once (all nodes get SIGTERM together)."""
        return self.node_count * self.cap_mib_s * MIB

    @property
    def metadata_ops_per_minute(self) -> float:
        return metadata_ops_per_minute(self.node_count, self.ranks_per_node, self.interval)

    @property
    def worst_backlog_bytes(self) -> float:
        return worst_case_backlog_bytes(self.node_bytes_per_s, self.interval, self.batch_bytes,
                                        self.cap_mib_s, self.streams_per_node, self.job_seconds)

    @property
    def worst_drain_s(self) -> float:
        return drain_seconds(self.worst_backlog_bytes, self.cap_mib_s)

    @property
    def worst_early_drain_s(self) -> float:
        """An early (warning) drain while the ranks keep writing: each stream drains what its first
        scan sees, so the drain also carries what is written meanwhile: backlog / (cap − rate)."""
        spare = self.cap_mib_s * MIB - self.node_bytes_per_s
        return self.worst_backlog_bytes / spare if spare > 0 else math.inf

    @property
    def drain_fits_kill_wait(self) -> bool:
        return self.worst_drain_s <= self.kill_wait

    @property
    def warning_s(self) -> int:
        """The ``--signal=B:USR1@N`` warning to request so the worst-case drain finishes in time
        (``warning_seconds``: 1.5 × the drain at the cap, at least 30 s; never less than the early
        drain's own bound)."""
        w = warning_seconds(self.worst_backlog_bytes, self.cap_mib_s)
        early = self.worst_early_drain_s
        return w if early <= w or math.isinf(early) else math.ceil(early)


def run_phase_shift(run_id: str, interval: float) -> float:
    """A per-run shift of the whole schedule within the interval (the same on every node of a run), so
    that different jobs on one filesystem do not all put their node 0 at the same wall-clock second."""
    return interval * jitter_unit(0, f"run:{run_id}")


def next_slot(after: float, phase: float, interval: float) -> float:
    """The first wall-clock time ≥ ``after`` that lies on this node's schedule (``phase`` modulo
    ``interval``). Anchoring syncs to the wall clock, not to each wrapper's own start, keeps the
    stagger between nodes whatever their start-up times and however long each sync ran."""
    return phase + math.ceil((after - phase) / interval) * interval
