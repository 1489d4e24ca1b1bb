"""How many bytes are waiting to be published: the input of the plan's and countdown's drain time.

Read-only: compares the files under a stream's root with its durable checkpoint
(``docs/format.md`` §6) and adds a pending batch. An estimate (an upper bound for rewritten
files), cheap enough to run before a drain decision.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from opguard.staging.layout import RANKS_DIRNAME, WRITER_TMP_PREFIX, Layout


def _checkpoint_files(state: Path) -> dict[str, dict[str, object]]:
    try:
        data = json.loads((state / "checkpoint.json").read_bytes())
    except (OSError, ValueError):
        return {}
    files = data.get("files", {}) if isinstance(data, dict) else {}
    return files if isinstance(files, dict) else {}


def _pending_batch_bytes(state: Path) -> int:
    try:
        data = json.loads((state / "pending.json").read_bytes())
        return int(data.get("size", 0))
    except (OSError, ValueError, AttributeError, TypeError):
        return 0


def stream_backlog(root: Path, state: Path) -> int:
    """Unpublished bytes of one stream (root: its rank_dir or node_dir; state: its state dir)."""
    published = _checkpoint_files(state)
    total = _pending_batch_bytes(state)
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = [d for d in dirnames if not d.startswith(WRITER_TMP_PREFIX)]
        for name in filenames:
            if name.startswith(WRITER_TMP_PREFIX):
                continue
            path = os.path.join(dirpath, name)
            try:
                st = os.lstat(path)
            except OSError:
                continue
            if not os.path.isfile(path) or os.path.islink(path):
                continue
            rec = published.get(os.path.relpath(path, root))
            if not isinstance(rec, dict) or rec.get("ino") != st.st_ino:
                total += st.st_size
            elif rec.get("kind") == "append":
                off = rec.get("offset", 0)
                total += max(0, st.st_size - (off if isinstance(off, int) else 0))
            elif rec.get("size") != st.st_size or rec.get("mtime_ns") != st.st_mtime_ns:
                total += st.st_size
    return total


def rank_streams_present(layout: Layout) -> list[int]:
    """Global ranks that have a directory under the local base."""
    base = layout.config.local_base
    if base is None:
        return []
    ranks = []
    try:
        names = os.listdir(base / RANKS_DIRNAME)
    except OSError:
        return []
    for name in names:
        if name.startswith("rank-") and name[5:].isdigit():
            ranks.append(int(name[5:]))
    return sorted(ranks)


def backlog_bytes(layout: Layout, ranks: list[int] | None, node_id: str | None) -> int:
    """Unpublished bytes of the given ranks (None: every rank present) and the node stream."""
    from opguard.staging.layout import node_stream, rank_stream

    if not layout.config.enabled:
        return 0
    total = 0
    for r in rank_streams_present(layout) if ranks is None else ranks:
        total += stream_backlog(layout.rank_dir(r), layout.stream_state_dir(rank_stream(r)))
    if node_id is not None:
        total += stream_backlog(layout.node_dir(node_id), layout.stream_state_dir(node_stream(node_id)))
    return total
