"""Which data the next batch takes: a pure function, shared with ``bench/simulate_cluster.py``.

A periodic sync publishes at most one batch per stream holding at most ``limit`` bytes of
payload. Items are taken in order; the first item that does not fit ends the batch (so a large
item is never starved by a stream of small ones). A whole file larger than the limit is taken
alone. A JSON-lines record larger than the limit can never be published: it is reported in
``oversized`` and its file is left out (the other items still go).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class Item:
    """Data waiting in one path: ``size`` bytes; for JSON lines, ``first_record`` is the length
    of its first complete record (a batch may end at any record boundary)."""

    path: str
    kind: str  # "append" | "file"
    size: int
    first_record: int = 0


@dataclass(frozen=True)
class Take:
    item: Item
    nbytes: int  # whole files: item.size; JSON lines: an upper bound, trimmed down to a record boundary


@dataclass(frozen=True)
class BatchPlan:
    takes: tuple[Take, ...]
    oversized: tuple[Item, ...]
    payload_bytes: int  # upper bound of the batch's payload
    backlog_bytes: int  # bytes left waiting after this batch (oversized items included)


def select_batch(items: Sequence[Item], limit: int) -> BatchPlan:
    """The next batch from ``items`` (in order) under the soft payload ``limit`` (bytes)."""
    if limit < 1:
        raise ValueError(f"batch limit must be >= 1 byte, got {limit}")
    takes: list[Take] = []
    oversized: list[Item] = []
    used = 0
    total = sum(i.size for i in items)
    stopped = False
    for it in items:
        if it.kind == "append" and it.first_record > limit:
            oversized.append(it)
            continue
        if stopped:
            continue
        room = limit - used
        if it.kind == "file":
            if it.size <= room or not takes:
                takes.append(Take(it, it.size))
                used += it.size
            else:
                stopped = True
            continue
        if it.first_record > room and it.size > 0:
            stopped = True
            continue
        n = min(it.size, room)
        takes.append(Take(it, n))
        used += n
        if n < it.size:
            stopped = True
    return BatchPlan(tuple(takes), tuple(oversized), used, total - used)
