"""How many bytes are waiting to be published: the input of the plan's and countdown's drain time.

Read-only: compares the files under a stream's root (``scan.walk``, the uploader's own walk) with
its durable checkpoint (``checkpoint.load_checkpoint``, ``docs/format.md`` §6) and adds a pending
batch. An estimate (an upper bound for rewritten files), cheap enough to run before a drain
decision: it reads no file contents, only ``stat()``; an unreadable checkpoint counts everything.
"""

from __future__ import annotations

import os
from pathlib import Path

from opguard.errors import IdentityError
from opguard.staging.checkpoint import CHECKPOINT_FILE, PENDING_FILE, FileRecord, load_checkpoint, load_pending
from opguard.staging.layout import RANKS_DIRNAME, Layout, node_stream, rank_stream
from opguard.staging.names import parse_rank_stream
from opguard.staging.scan import FileStat, walk


def _published(state: Path) -> dict[str, FileRecord]:
    try:
        cp = load_checkpoint(state / CHECKPOINT_FILE)
    except IdentityError:
        return {}  # the sync itself reports it; the estimate counts every file as unpublished
    return {} if cp is None else cp.files


def _pending_batch_bytes(state: Path) -> int:
    try:
        pending = load_pending(state / PENDING_FILE)
    except IdentityError:
        return 0
    return 0 if pending is None else pending.size


def unpublished_bytes(rec: FileRecord | None, s: FileStat) -> int:
    """What of one file its checkpoint record does not cover: everything after the published offset
    of the same append file, nothing of an unchanged file, all of a new or rewritten one."""
    if rec is None or rec.deleted or rec.ino != s.ino:
        return s.size
    if rec.kind == "append":
        return max(0, s.size - rec.offset)
    return s.size if (rec.size, rec.mtime_ns) != (s.size, s.mtime_ns) else 0


def stream_backlog(root: Path, state: Path) -> int:
    """Unpublished bytes of one stream (root: its rank_dir or node_dir; state: its state dir)."""
    published = _published(state)
    return _pending_batch_bytes(state) + sum(unpublished_bytes(published.get(rel), s)
                                             for rel, s in walk(root).files.items())


def rank_streams_present(layout: Layout) -> list[int]:
    """Global ranks that have a directory under the local base."""
    base = layout.config.local_base
    if base is None:
        return []
    try:
        names = os.listdir(base / RANKS_DIRNAME)
    except OSError:
        return []
    return sorted(r for name in names if (r := parse_rank_stream(name)) is not None)


def backlog_bytes(layout: Layout, ranks: list[int] | None, node_id: str | None) -> int:
    """Unpublished bytes of the given ranks (None: every rank present) and the node stream."""
    if not layout.config.enabled:
        return 0
    total = 0
    for r in rank_streams_present(layout) if ranks is None else ranks:
        total += stream_backlog(layout.rank_dir(r), layout.stream_state_dir(rank_stream(r)))
    if node_id is not None:
        total += stream_backlog(layout.node_dir(node_id), layout.stream_state_dir(node_stream(node_id)))
    return total
