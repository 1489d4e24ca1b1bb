"""``opguard clean``: remove a node's local copies of streams that are sealed on the target (``docs/slurm.md``).

A stream's local copy (its producer directory and its uploader state) is removed only when
everything in it is safely published, re-checked now rather than trusted from the checkpoint:

* the local checkpoint says the head is sealed and no batch awaits publication (no ``pending.json``);
* the target holds batches 1..head, each file's SHA-256 equals the digest in its name, each
  manifest's ``prev_digest`` chains to the previous batch, the last digest equals the
  checkpoint's head, no batch follows it, and the current seal names it;
* every regular file in the producer directory is exactly what was published (same identity as
  its checkpoint record, no unpublished bytes after a JSON-lines file's last complete record),
  and nothing unpublishable (a symbolic link, a socket, ...) is there.

Anything else is kept and listed with the reason. Runs under each stream's lock.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from opguard.errors import ConfigError, LockTimeout, OpguardError
from opguard.staging.bundle import batch_name, file_sha256, read_manifest, seal_name
from opguard.staging.checkpoint import Checkpoint
from opguard.staging.config import StagingConfig
from opguard.staging.layout import STREAMS_DIRNAME, Layout
from opguard.staging.scan import walk
from opguard.staging.target import check_local_run, check_stream, list_batches, list_seals, staging_of


@dataclass
class CleanReport:
    dry_run: bool
    removed: list[tuple[str, int]] = field(default_factory=list)  # (stream, bytes)
    kept: list[tuple[str, str]] = field(default_factory=list)  # (stream, why)

    @property
    def freed(self) -> int:
        return sum(b for _s, b in self.removed)


def _tree_bytes(root: Path) -> int:
    total = 0
    for dirpath, _dirs, files in os.walk(root):
        for f in files:
            try:
                total += os.lstat(os.path.join(dirpath, f)).st_size
            except FileNotFoundError:
                pass
    return total


def _published_on_target(sdir: Path, cp: Checkpoint) -> str | None:
    """None when the target holds exactly the checkpoint's sealed history, intact; else why not."""
    head = cp.next_sequence - 1
    if cp.sealed_sequence is None or cp.sealed_sequence != head:
        return "not sealed (its final drain has not finished): run opguard sync --all --final first"
    batches = list_batches(sdir)
    if [s for s, _d in batches] != list(range(1, head + 1)):
        return (f"the target {sdir} holds batches {[s for s, _d in batches][:5]}..., not exactly 1..{head} as the "
                "local checkpoint says")
    prev: str | None = None
    for seq, digest in batches:
        path = sdir / batch_name(seq, digest)
        if file_sha256(path) != digest:
            return f"batch {path} does not match the digest in its name (damaged on the target)"
        if read_manifest(path).manifest.get("prev_digest") != prev:
            return f"batch {path} does not chain to batch {seq - 1} (hash chain broken)"
        prev = digest
    if prev != cp.head_digest:
        return f"the target's last batch {prev} is not the local checkpoint's head {cp.head_digest}"
    seals = list_seals(sdir)
    if not seals or seals[-1] != head:
        return f"the target's current seal is {seals[-1] if seals else 'missing'}, not batch {head}"
    from opguard.staging.fsutil import read_json

    seal_path = sdir / seal_name(head)
    seal = read_json(seal_path)
    named = seal.get("last_digest") if isinstance(seal, dict) else None
    if named != cp.head_digest:
        return f"the seal {seal_path} names {named}, not the head {cp.head_digest}"
    return None


def _unpublished(root: Path, cp: Checkpoint) -> str | None:
    """None when every file under ``root`` is exactly what was published; else the first that is not."""
    w = walk(root)
    for rel, kind in sorted(w.skipped.items()):
        return f"{root / rel} is a {kind}, which is never uploaded"
    for rel, s in sorted(w.files.items()):
        rec = cp.files.get(rel)
        if rec is None or rec.deleted:
            return f"{root / rel} was never published (written after the last sync)"
        if s.identity != rec.identity:
            return f"{root / rel} changed after it was published (an unpublished tail)"
        if rec.kind == "append" and rec.offset < s.size:
            return (f"{root / rel} has {s.size - rec.offset} byte(s) after its last complete record that were never "
                    "published (an incomplete last line)")
    return None


def _check(config: StagingConfig, layout: Layout, stream: str, root: Path) -> str | None:
    s = staging_of(config)
    try:
        cp, pending = check_stream(config, layout, stream)
    except OpguardError as e:
        return str(e)
    if cp is None:
        return "no local checkpoint: nothing of it was ever published"
    if pending is not None:
        return f"batch {pending.sequence} awaits publication (pending.json): run opguard sync --all --final"
    try:
        why = _published_on_target(s.bundles / STREAMS_DIRNAME / stream, cp)
    except (OpguardError, OSError, ValueError) as e:
        return f"the target's copy cannot be checked: {e}"
    return why if why is not None else _unpublished(root, cp)


def clean(config: StagingConfig, layout: Layout, streams: Sequence[str], node_id: str, *,
          dry_run: bool = False, inside_wrapper: bool = False) -> CleanReport:
    """Remove (or, ``dry_run``, only list) the local copies of ``streams`` that are safely published.

    Refused (ConfigError) while an ``opguard-run`` holds this local base's node duties: its program
    may still write files that look published; the lock is held for the whole clean, so no wrapper
    starts on the base meanwhile. ``inside_wrapper``: called by that wrapper after its supervision
    (``--clean-local``), which may hold the lock itself."""
    import filelock

    from opguard.staging.sync import stream_root

    check_local_run(config, layout, node_id)
    duty: filelock.BaseFileLock | None = None
    if not inside_wrapper and layout.node_duty_lock.parent.is_dir():
        duty = filelock.FileLock(os.fspath(layout.node_duty_lock), timeout=0)
        try:
            duty.acquire()
        except filelock.Timeout:
            raise ConfigError(
                f"an opguard-run is running on this local base (it holds {layout.node_duty_lock}): its program "
                "may still be writing files that look published, and cleaning now could delete them",
                "run opguard clean after the job, or let the wrapper do it: opguard-run --clean-local") from None
    try:
        return _clean(config, layout, streams, node_id, dry_run, stream_root)
    finally:
        if duty is not None:
            duty.release()


def _clean(config: StagingConfig, layout: Layout, streams: Sequence[str], node_id: str, dry_run: bool,
           stream_root: Callable[[Layout, str, str], tuple[Path, str, int | None]]) -> CleanReport:
    import filelock

    report = CleanReport(dry_run)
    for stream in streams:
        root = stream_root(layout, stream, node_id)[0]
        state = layout.stream_state_dir(stream)
        lock = filelock.FileLock(os.fspath(layout.stream_lock(stream)), timeout=config.lock_timeout)
        try:
            lock.acquire()
        except filelock.Timeout:
            report.kept.append((stream, str(LockTimeout(
                f"a sync held {layout.stream_lock(stream)} for more than {config.lock_timeout:g} s", ""))))
            continue
        try:
            why = _check(config, layout, stream, root)
            if why is not None:
                report.kept.append((stream, why))
                continue
            size = _tree_bytes(root) + _tree_bytes(state)
            if not dry_run:
                if root.exists():
                    shutil.rmtree(root)
                shutil.rmtree(state)
            report.removed.append((stream, size))
        except OSError as e:
            report.kept.append((stream, f"removing it failed: {e.strerror or e}"))
        finally:
            lock.release()
    return report

