"""Run identity on the shared target, checked before the first upload (``docs/format.md`` §5).

:func:`check_target` only reads (the launcher's preflight calls it); :func:`ensure_target` checks
and then records the identity (``format.json`` on the target, ``state/run.json`` locally). On a
refusal nothing is written anywhere.
"""

from __future__ import annotations

import errno
import json
import os
import socket
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from opguard.errors import ConfigError, IdentityError, LockTimeout
from opguard.staging.bundle import FORMAT_NAME, FORMAT_VERSION, parse_batch_name, parse_seal_name
from opguard.staging.checkpoint import CHECKPOINT_FILE, PENDING_FILE, Checkpoint, Pending, load_checkpoint, load_pending
from opguard.staging.config import StagingConfig
from opguard.staging.dirs import TARGET_MODE, creatable_problem, ensure_dir
from opguard.staging.fsutil import create_exclusive, dump_json, makedirs_nofollow, read_json
from opguard.staging.layout import (
    BUNDLES_DIRNAME,
    CLAIMS_DIRNAME,
    FORMAT_FILE,
    SNAPSHOT_NAME,
    STREAMS_DIRNAME,
    TARGET_TMP_PREFIX,
    Layout,
)
from opguard.staging.writers import check_staging_usable

RUN_TMP_PREFIX = ".tmp-run.json."  # create_exclusive's temporaries of state/run.json
_V2_TOP = {FORMAT_FILE, CLAIMS_DIRNAME, STREAMS_DIRNAME}
NEW_RUN_FIX = "use a new output directory (OPGUARD_TRACE_OUTPUT_BASE / OPGUARD_LOCAL_DUMP_TARGET) or another run ID"


@dataclass(frozen=True)
class Staging:
    local_base: Path
    target: Path
    run_id: str
    bundles: Path


def staging_of(config: StagingConfig) -> Staging:
    local_base, target, run_id = config.require_staging()
    return Staging(local_base, target, run_id, target / BUNDLES_DIRNAME)


def stream_dir(config: StagingConfig, stream: str) -> Path:
    return staging_of(config).bundles / STREAMS_DIRNAME / stream


def open_stream_dir(config: StagingConfig, stream: str) -> int:
    """Create (as needed) and open ``.opguard-bundles/streams/<stream>`` below the target without
    following a symbolic link: a link planted there by another user of the shared target would send
    the run's batches wherever it points. Refused with exit 6, before anything is written."""
    s = staging_of(config)
    try:
        return makedirs_nofollow(s.target, f"{BUNDLES_DIRNAME}/{STREAMS_DIRNAME}/{stream}")
    except OSError as e:
        if e.errno not in (errno.ELOOP, errno.ENOTDIR, errno.EMLINK):
            raise
        where = e.filename or stream_dir(config, stream)
        raise IdentityError(
            f"{where} on the target is a symbolic link or not a directory: the stream {stream} will not be "
            "published through it (its batches would go wherever the link points)",
            f"remove it (and find out who created it: the target is writable by others), or {NEW_RUN_FIX}") \
            from None


# ---- reading the target ------------------------------------------------------------------------

def read_format(bundles: Path) -> dict[str, Any] | None:
    path = bundles / FORMAT_FILE
    try:
        d = read_json(path)
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as e:
        raise IdentityError(f"{path} is unreadable ({e})", NEW_RUN_FIX) from None
    if not isinstance(d, dict) or d.get("format") != FORMAT_NAME:
        raise IdentityError(f"{path} is not an opguard target identity file", NEW_RUN_FIX)
    return d


def _check_format(path: Path, fmt: dict[str, Any], run_id: str) -> None:
    version = fmt.get("version")
    if not isinstance(version, int) or version > FORMAT_VERSION:
        raise IdentityError(
            f"{path} declares format version {version!r}; this opguard writes version {FORMAT_VERSION}",
            "upgrade opguard, or use a new output directory for this run")
    if fmt.get("run_id") != run_id:
        raise IdentityError(
            f"the target {path.parent.parent} holds run {fmt.get('run_id')!r}, not this run {run_id!r}",
            "set OPGUARD_RUN_ID to the run that owns it to continue that run, or " + NEW_RUN_FIX)


def find_legacy(target: Path) -> list[Path]:
    """Legacy data under ``target``: ``sync.tar.gz`` snapshots and reference v1 bundle dirs."""
    found: list[Path] = []
    for dirpath, dirnames, filenames in os.walk(target):
        if dirpath == os.fspath(target) and BUNDLES_DIRNAME in dirnames:
            dirnames.remove(BUNDLES_DIRNAME)
        if SNAPSHOT_NAME in filenames:
            found.append(Path(dirpath) / SNAPSHOT_NAME)
            if len(found) >= 3:
                return found
    bundles = target / BUNDLES_DIRNAME
    try:
        names = sorted(os.listdir(bundles))
    except FileNotFoundError:
        names = []
    found += [bundles / n for n in names if n not in _V2_TOP and not n.startswith(TARGET_TMP_PREFIX)][:3]
    return found


def _refuse_legacy(target: Path) -> None:
    legacy = find_legacy(target)
    if legacy:
        raise IdentityError(
            f"the target {target} holds data of an older opguard format (e.g. {legacy[0]}); "
            "opguard will not mix batches into it",
            "use a new output directory when migrating from the old snapshot format")


def list_batches(sdir: Path) -> list[tuple[int, str]]:
    """(sequence, digest) of every batch of a stream on the target, sorted."""
    try:
        names = os.listdir(sdir)
    except FileNotFoundError:
        return []
    out = [p for n in names if (p := parse_batch_name(n)) is not None]
    return sorted(out)


def list_seals(sdir: Path) -> list[int]:
    try:
        names = os.listdir(sdir)
    except FileNotFoundError:
        return []
    return sorted(seq for n in names if (seq := parse_seal_name(n)) is not None)


# ---- local run identity ------------------------------------------------------------------------

def _read_run_file(layout: Layout) -> dict[str, Any] | None:
    try:
        d = read_json(layout.run_file)
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as e:
        raise IdentityError(f"{layout.run_file} is unreadable ({e})",
                            "restore the staging directory, or use a new OPGUARD_LOCAL_DUMP_BASE") from None
    if not isinstance(d, dict):
        raise IdentityError(f"{layout.run_file} is not a JSON object", "use a new OPGUARD_LOCAL_DUMP_BASE")
    return d


def _check_run_file(d: dict[str, Any], layout: Layout, s: Staging, node_id: str | None) -> None:
    if int(d.get("version", 0)) > FORMAT_VERSION:
        raise IdentityError(f"{layout.run_file} has version {d.get('version')}, newer than {FORMAT_VERSION}",
                            "use the opguard version that wrote it")
    if d.get("run_id") != s.run_id or d.get("target") != os.fspath(s.target):
        raise IdentityError(
            f"the staging directory {s.local_base} belongs to run {d.get('run_id')!r} with target "
            f"{d.get('target')!r}, not run {s.run_id!r} with target {s.target}",
            "let that run finish its final sync and remove its staging directory, or set OPGUARD_LOCAL_DUMP_BASE "
            "to a fresh node-local directory for this run")
    recorded = d.get("node_id")
    if node_id is not None and recorded is not None and recorded != node_id:
        raise IdentityError(
            f"the staging directory {s.local_base} was set up by node {recorded!r} (host "
            f"{d.get('hostname')!r}), but this is node {node_id!r} (host {socket.gethostname()!r}): "
            "OPGUARD_LOCAL_DUMP_BASE is shared between nodes, so one node would publish another's files "
            "under its own identity",
            "point OPGUARD_LOCAL_DUMP_BASE at node-local disk (e.g. /local-ssd/opguard), not at a directory "
            "several nodes see")


def check_local_run(config: StagingConfig, layout: Layout, node_id: str | None = None) -> bool:
    """Refuse a staging base that belongs to another run or another node; True if ``run.json`` exists."""
    s = staging_of(config)
    d = _read_run_file(layout)
    if d is None:
        return False
    _check_run_file(d, layout, s, node_id)
    return True


# ---- one stream ---------------------------------------------------------------------------------

def check_stream(config: StagingConfig, layout: Layout, stream: str) -> tuple[Checkpoint | None, Pending | None]:
    """Local checkpoint and pending intent of ``stream``, checked against the target; read-only."""
    s = staging_of(config)
    sd = layout.stream_state_dir(stream)
    cp = load_checkpoint(sd / CHECKPOINT_FILE)
    pending = load_pending(sd / PENDING_FILE)
    tdir = s.bundles / STREAMS_DIRNAME / stream
    batches = list_batches(tdir)
    seqs = [b[0] for b in batches]
    if len(set(seqs)) != len(seqs):
        raise IdentityError(f"the target stream {tdir} holds two different batches with one sequence number",
                            "two uploaders wrote one stream (duplicate node ID or run ID?); " + NEW_RUN_FIX)
    if cp is None:
        if pending is not None:
            raise IdentityError(f"{sd}/pending.json exists but {sd}/checkpoint.json is missing",
                                "restore the staging directory or choose a new run ID")
        if batches or list_seals(tdir):
            raise IdentityError(
                f"stream {stream} already has {len(batches)} batch(es) on the target {tdir} but no local "
                f"checkpoint in {sd}: continuing would fork its history",
                "restore the staging directory or choose a new run ID")
        return None, None
    if cp.run_id != s.run_id or cp.target != os.fspath(s.target) or cp.stream != stream:
        raise IdentityError(
            f"checkpoint {sd}/checkpoint.json is for run {cp.run_id!r}, target {cp.target!r}, stream {cp.stream!r}",
            "restore the matching staging directory, or use a fresh OPGUARD_LOCAL_DUMP_BASE for this run")
    if pending is not None and not (
            pending.sequence == cp.next_sequence
            or (pending.sequence == cp.next_sequence - 1 and pending.digest == cp.head_digest)):
        raise IdentityError(
            f"{sd}/pending.json holds batch {pending.sequence} ({pending.digest}) but the checkpoint's next batch "
            f"is {cp.next_sequence}: the local state is inconsistent (edited or mixed from two copies)",
            "restore the staging directory from one consistent copy, or choose a new run ID")
    expected = (cp.next_sequence - 1, cp.head_digest)
    head = batches[-1] if batches else (0, None)
    ok = head == expected
    if not ok and pending is not None and pending.sequence == cp.next_sequence:
        ok = head == (pending.sequence, pending.digest)  # our own pending batch, published before a crash
    if not ok:
        raise IdentityError(
            f"stream {stream}: the target {tdir} ends at batch {head[0]} ({head[1]}) but the local checkpoint "
            f"expects batch {expected[0]} ({expected[1]}): the target was changed by someone else or the "
            "checkpoint is stale",
            "restore the staging directory that matches this target, or choose a new run ID and output directory")
    return cp, pending


# ---- whole-target checks ------------------------------------------------------------------------

def check_target(config: StagingConfig, layout: Layout, streams: Sequence[str],
                 node_id: str | None = None) -> None:
    """Every identity check, reading only: target format and run, legacy data, the local run
    file and each stream's checkpoint against the target. Raises IdentityError / ConfigError."""
    s = staging_of(config)
    missing = creatable_problem(s.target, "OPGUARD_LOCAL_DUMP_TARGET")
    if missing is not None:
        raise missing
    if s.target.is_dir():  # else a new target: created by the first writer (nothing to check there)
        fmt = read_format(s.bundles)
        if fmt is not None:
            _check_format(s.bundles / FORMAT_FILE, fmt, s.run_id)
        _refuse_legacy(s.target)
    check_local_run(config, layout, node_id)
    for stream in streams:
        check_stream(config, layout, stream)


def ensure_target(config: StagingConfig, layout: Layout, node_id: str) -> None:
    """Check the target's identity and record it (``format.json``, ``state/run.json``).

    Per-stream checks happen under each stream's lock (:func:`check_stream`). The legacy scan
    walks the target only when this node first joins the run or the target is new.
    """
    s = staging_of(config)
    if not s.local_base.is_dir():  # the writers and opguard-run create it: a sync has nothing to upload
        raise ConfigError(
            f"OPGUARD_LOCAL_DUMP_BASE={s.local_base} does not exist or is not a directory: nothing was staged "
            "here (the uploader does not create it; the writers and opguard-run do)",
            "run the sync on the node that staged the data, with the job's OPGUARD_LOCAL_DUMP_BASE")
    check_staging_usable(config, layout, create_state=False)
    missing = creatable_problem(s.target, "OPGUARD_LOCAL_DUMP_TARGET")
    if missing is not None:
        raise missing
    has_run = check_local_run(config, layout, node_id)
    fmt = read_format(s.bundles)
    if fmt is not None:
        _check_format(s.bundles / FORMAT_FILE, fmt, s.run_id)
    if fmt is None or not has_run:
        _refuse_legacy(s.target)
    # every check passed: record the identity
    check_staging_usable(config, layout, create_state=True)
    ensure_dir(s.target, "OPGUARD_LOCAL_DUMP_TARGET", TARGET_MODE)
    if fmt is None:
        s.bundles.mkdir(parents=True, exist_ok=True)  # streams/ only after format.json: a crash between
        # the two must not leave a target that readers take for one whose format.json was lost
        doc = {"format": FORMAT_NAME, "version": FORMAT_VERSION, "run_id": s.run_id,
               "created_at": time.time(), "created_by": node_id}
        if not create_exclusive(s.bundles / FORMAT_FILE, dump_json(doc)):
            fmt = read_format(s.bundles)  # another node won the race
            assert fmt is not None
            _check_format(s.bundles / FORMAT_FILE, fmt, s.run_id)
    if not has_run or _run_tmp_orphans(layout):
        _record_local_run(config, layout, s, node_id)


def _run_tmp_orphans(layout: Layout) -> list[str]:
    """Temporaries of ``run.json`` (``state/.tmp-run.json.*``) present now."""
    try:
        names = os.listdir(layout.run_file.parent)
    except FileNotFoundError:
        return []
    return [n for n in names if n.startswith(RUN_TMP_PREFIX)]


def _record_local_run(config: StagingConfig, layout: Layout, s: Staging, node_id: str) -> None:
    """Create ``run.json`` if absent, under the node-local run lock, first removing its orphaned
    temporaries: every creator holds the lock, so a temporary seen under it belongs to a process
    that died between writing it and linking it (``docs/protocol.md``, step 3)."""
    import filelock  # here, not at the top: opguard-run's preflight imports this module (start-up)

    layout.locks_dir.mkdir(parents=True, exist_ok=True)
    lock = filelock.FileLock(os.fspath(layout.run_lock), timeout=config.lock_timeout)
    try:
        lock.acquire()
    except filelock.Timeout:
        raise LockTimeout(
            f"another sync held {layout.run_lock} for more than OPGUARD_SYNC_LOCK_TIMEOUT={config.lock_timeout:g} s "
            "while recording this node's run file; nothing was uploaded by this sync",
            "let the running sync finish (or raise OPGUARD_SYNC_LOCK_TIMEOUT)") from None
    try:
        for n in _run_tmp_orphans(layout):
            (layout.run_file.parent / n).unlink(missing_ok=True)
        if layout.run_file.exists():
            check_local_run(config, layout, node_id)
            return
        doc = {"version": FORMAT_VERSION, "run_id": s.run_id, "target": os.fspath(s.target),
               "node_id": node_id, "hostname": socket.gethostname(), "created_at": time.time()}
        if not create_exclusive(layout.run_file, json.dumps(doc, sort_keys=True).encode() + b"\n"):
            check_local_run(config, layout, node_id)
    finally:
        lock.release()
