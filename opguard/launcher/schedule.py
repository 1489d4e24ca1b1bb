"""Sync scheduling and the plan's derived numbers, shared by opguard-run and the simulator.

Pure functions of their arguments (no clock, no I/O), so ``bench/simulate_cluster.py`` drives
exactly the code the wrapper runs.
"""

from __future__ import annotations

import hashlib
import math

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


def periodic_capacity_bytes_per_s(interval: float, batch_bytes: float, cap_mib_s: float) -> float:
    """The most a node can publish per second through periodic syncs (one batch per interval,
    each no longer than the cap allows within the interval)."""
    return min(batch_bytes, cap_mib_s * 2**20 * interval) / interval


def keeps_up(interval: float, batch_bytes: float, cap_mib_s: float) -> bool:
    """True when a full batch can be uploaded within one interval at the cap."""
    return upload_seconds(batch_bytes, cap_mib_s) <= interval


def ideal_peak_in_flight(node_count: int, upload_s: float, interval: float) -> int:
    """⌈N · t_upload / interval⌉: uploads in flight at once with a perfect stagger."""
    return max(1, math.ceil(node_count * upload_s / interval)) if upload_s > 0 else 0


def warning_seconds(pending_bytes: float, cap_mib_s: float, margin: float = 1.5, floor: float = 30.0) -> int:
    """The ``--signal=B:USR1@N`` warning time to request for a drain of ``pending_bytes``."""
    return int(math.ceil(max(floor, margin * drain_seconds(pending_bytes, cap_mib_s))))
