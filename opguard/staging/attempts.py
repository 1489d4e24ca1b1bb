"""Attempts of a run: who launched into it, when, and why a sealed run was reopened (``docs/format.md`` §4.1).

A run whose streams are sealed is finished. Launching into it again is legitimate only when it is
asked for (``opguard-run --resume`` / ``OPGUARD_RESUME=1``) or when Slurm requeued the job that made
the last attempt (``SLURM_RESTART_COUNT`` > 0 and the same ``SLURM_JOB_ID``); otherwise the launcher
refuses before the command starts. Every attempt is recorded in the node metadata
(``node/attempts.json``), which the node stream publishes like any other node file.
"""

from __future__ import annotations

import json
import os
import socket
import time
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from opguard.errors import ConfigError, OpguardError
from opguard.staging.bundle import batch_name, parse_batch_name, seal_name
from opguard.staging.checkpoint import CHECKPOINT_FILE, load_checkpoint
from opguard.staging.config import StagingConfig, env_bool
from opguard.staging.fsutil import atomic_replace_bytes
from opguard.staging.layout import BUNDLES_DIRNAME, NODE_STREAM_PREFIX, STREAMS_DIRNAME, Layout
from opguard.staging.names import parse_stream, printable

ATTEMPTS_FILE = "attempts.json"
ATTEMPTS_VERSION = 1
# A reader's bound on a published attempts.json (the target is writable by others, docs/format.md §11):
# one attempt record is under 512 bytes and MAX_ATTEMPTS bounds their number.
MAX_ATTEMPTS = 1024
ATTEMPTS_MAX_BYTES = 512 * MAX_ATTEMPTS
RESUME_VAR = "OPGUARD_RESUME"
# why an attempt was allowed to start (the "how" field)
FIRST, UNSEALED, RESUME_FLAG, RESUME_ENV, REQUEUE = ("first", "unsealed", "resume-flag", "resume-env",
                                                     "slurm-requeue")


@dataclass(frozen=True)
class SealedStream:
    stream: str
    sequence: int
    sealed_at: float | None
    host: str | None


def _utc(t: float | None) -> str:
    if t is None:
        return "an unknown time"
    try:
        return time.strftime("%Y-%m-%d %H:%M:%SZ", time.gmtime(t))
    except (OverflowError, ValueError, OSError):  # NaN, 1e300, -1e18: a forged or damaged record
        return f"an invalid time ({t!r})"


def resume_requested(env: Mapping[str, str]) -> bool:
    return env_bool(env, RESUME_VAR, False, f"set {RESUME_VAR} to 1 (continue a sealed run) or 0")


def sealed_streams(config: StagingConfig, layout: Layout) -> list[SealedStream]:
    """Local streams whose checkpoint says their head is sealed (their final drain finished), with
    the seal record's time and host from the target when it can be read. Reads only."""
    sd = layout.stream_state_dir("x").parent
    try:
        names = sorted(os.listdir(sd))
    except FileNotFoundError:
        return []
    out: list[SealedStream] = []
    for name in names:
        try:
            cp = load_checkpoint(sd / name / CHECKPOINT_FILE)
        except OpguardError:
            continue  # the uploader's own checks report a damaged checkpoint
        if cp is None or cp.sealed_sequence is None or cp.sealed_sequence != cp.next_sequence - 1:
            continue
        sealed_at: float | None = None
        host: str | None = None
        assert config.target is not None
        seal = config.target / BUNDLES_DIRNAME / STREAMS_DIRNAME / name / seal_name(cp.sealed_sequence)
        try:
            doc = json.loads(seal.read_bytes())
            sealed_at = float(doc["sealed_at"]) if isinstance(doc.get("sealed_at"), int | float) else None
            host = str(doc["host"]) if doc.get("host") is not None else None
        except (OSError, ValueError, KeyError, TypeError):
            pass
        out.append(SealedStream(name, cp.sealed_sequence, sealed_at, host))
    return out


# ---- the attempts file ---------------------------------------------------------------------------

def attempts_path(layout: Layout, node_id: str) -> Path:
    return layout.node_dir(node_id) / ATTEMPTS_FILE


def load_attempts(path: Path) -> list[dict[str, Any]]:
    """The recorded attempts (``[]`` when there is no file; an unreadable file is an error)."""
    try:
        doc = json.loads(path.read_bytes())
    except FileNotFoundError:
        return []
    except (OSError, ValueError) as e:
        raise ConfigError(f"{path} is unreadable ({e})",
                          "restore it from the published node metadata, or use a new output directory") from None
    attempts = doc.get("attempts") if isinstance(doc, dict) else None
    if not isinstance(attempts, list) or not all(isinstance(a, dict) for a in attempts):
        raise ConfigError(f"{path} is not an attempts file (no \"attempts\" list)",
                          "restore it from the published node metadata, or use a new output directory")
    return attempts


def _save(path: Path, node_id: str, attempts: list[dict[str, Any]]) -> None:
    doc = {"version": ATTEMPTS_VERSION, "node_id": node_id, "attempts": attempts}
    path.parent.mkdir(parents=True, exist_ok=True)
    atomic_replace_bytes(path, json.dumps(doc, indent=1, sort_keys=True).encode() + b"\n")


def _job_id(env: Mapping[str, str]) -> str | None:
    return env.get("SLURM_JOB_ID", "").strip() or None


def _restart_count(env: Mapping[str, str]) -> int:
    try:
        return int(env.get("SLURM_RESTART_COUNT", "0").strip() or 0)
    except ValueError:
        return 0


def decide(config: StagingConfig, layout: Layout, node_id: str, env: Mapping[str, str],
           resume_flag: bool) -> tuple[str, ConfigError | None]:
    """Whether this launch may start: (how, None), or (how, the refusal) for a sealed run that
    nobody asked to continue. Reads only."""
    try:
        resume_env = resume_requested(env)
    except ConfigError as e:
        return FIRST, e
    sealed = sealed_streams(config, layout)
    try:
        previous = load_attempts(attempts_path(layout, node_id))
    except ConfigError as e:
        return FIRST, e
    if not sealed:
        return (UNSEALED if previous or _has_state(layout) else FIRST), None
    if resume_flag:
        return RESUME_FLAG, None
    if resume_env:
        return RESUME_ENV, None
    last = previous[-1] if previous else {}
    job = _job_id(env)
    if _restart_count(env) > 0 and job is not None and last.get("job_id") == job:
        return REQUEUE, None
    newest = max(sealed, key=lambda s: s.sealed_at or 0.0)
    by = f"job {last['job_id']}" if last.get("job_id") else ("a launch outside Slurm" if last else "an unknown job")
    attempt = f" (attempt {last.get('attempt')})" if last else ""
    requeue = ""
    if _restart_count(env) > 0 and job is not None:
        requeue = (f"; this is a Slurm requeue (SLURM_RESTART_COUNT={env.get('SLURM_RESTART_COUNT')}) but of job "
                   f"{job}, not of the job that made the last attempt")
    return FIRST, ConfigError(
        f"run {config.run_id!r} (target {config.target}, local base {config.local_base}) is sealed: its final drain "
        f"sealed {len(sealed)} stream(s) (e.g. {newest.stream} at batch {newest.sequence}) at {_utc(newest.sealed_at)} "
        f"by {by}{attempt} on {newest.host or 'an unknown host'}; launching into it again would append a second "
        f"attempt to a finished run{requeue}",
        "start a new run in a new directory (a new OPGUARD_LOCAL_DUMP_TARGET / OPGUARD_TRACE_OUTPUT_BASE and a "
        "fresh OPGUARD_LOCAL_DUMP_BASE), or continue this run as a new attempt with opguard-run --resume (or "
        f"{RESUME_VAR}=1)")


def _has_state(layout: Layout) -> bool:
    try:
        return any(os.scandir(layout.stream_state_dir("x").parent))
    except FileNotFoundError:
        return False


def _next_sequences(layout: Layout) -> dict[str, int]:
    """Stream -> the sequence its next batch gets, for every stream with local state now: the first
    batch of the attempt that starts (a stream absent here had no batch before it)."""
    sd = layout.stream_state_dir("x").parent
    out: dict[str, int] = {}
    try:
        names = sorted(os.listdir(sd))
    except FileNotFoundError:
        return out
    for name in names:
        try:
            cp = load_checkpoint(sd / name / CHECKPOINT_FILE)
        except OpguardError:
            continue
        if cp is not None:
            out[name] = cp.next_sequence
    return out


def begin_attempt(layout: Layout, node_id: str, how: str, env: Mapping[str, str]) -> int:
    """Record a new attempt (before the command starts); returns its number."""
    path = attempts_path(layout, node_id)
    attempts = load_attempts(path)
    number = int(attempts[-1].get("attempt", len(attempts))) + 1 if attempts else 1
    attempts.append({"attempt": number, "job_id": _job_id(env), "restart_count": _restart_count(env),
                     "how": how, "hostname": socket.gethostname(), "pid": os.getpid(),
                     "started_at": time.time(), "ended_at": None, "exit_status": None,
                     "first_sequence": _next_sequences(layout)})
    _save(path, node_id, attempts)
    return number


def end_attempt(layout: Layout, node_id: str, number: int, exit_status: int) -> None:
    path = attempts_path(layout, node_id)
    attempts = load_attempts(path)
    for a in attempts:
        if a.get("attempt") == number:
            a["ended_at"] = time.time()
            a["exit_status"] = exit_status
    _save(path, node_id, attempts)


def describe(attempt: Mapping[str, Any]) -> str:
    """One line: ``attempt 2: job 1234 on node1, 2026-12-01 21:00:00Z - 21:05:00Z, exit 0 (resumed: --resume)``."""
    how = {FIRST: "first launch", UNSEALED: "continued an unsealed run", RESUME_FLAG: "resumed: --resume",
           RESUME_ENV: f"resumed: {RESUME_VAR}=1", REQUEUE: "Slurm requeue"}.get(str(attempt.get("how")),
                                                                                 printable(attempt.get("how")))
    job = f"job {printable(attempt['job_id'])}" if attempt.get("job_id") else "no Slurm job"
    start = attempt.get("started_at")
    end = attempt.get("ended_at")
    status = attempt.get("exit_status")
    span = f"{_utc(start if isinstance(start, int | float) else None)} - " + (
        _utc(end) if isinstance(end, int | float) else "(no end recorded)")
    return (f"attempt {printable(attempt.get('attempt'))}: {job} on {printable(attempt.get('hostname'))}, {span}, "
            f"exit {printable(status) if status is not None else '?'} ({how})")


# ---- reading them back from a run's shared output ------------------------------------------------

def published_attempts(source: Path) -> dict[str, list[dict[str, Any]]]:
    """Node ID -> attempts, from the last published ``attempts.json`` of every node stream under
    SOURCE (``.opguard-bundles/streams/node-*``). Batches are read through the verifying reader;
    a stream that cannot be read yields nothing here (``verify`` reports it). Read like every
    reader of the target (docs/format.md §11.2): below SOURCE (the caller's) through directory
    descriptors, no link followed, so a stream directory swapped for a link after ``verify``
    checked it cannot make this read another target."""
    from opguard.staging.fsutil import open_beneath, open_dir_nofollow

    try:
        src_fd = os.open(source, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    except OSError:
        return {}
    out: dict[str, list[dict[str, Any]]] = {}
    try:
        try:
            streams_fd = open_beneath(src_fd, f"{BUNDLES_DIRNAME}/{STREAMS_DIRNAME}")
        except OSError:
            return {}
        try:
            # valid stream names only: a node ID of [A-Za-z0-9._-] (a name holding a newline is no stream)
            names = sorted(n for n in os.listdir(streams_fd) if n.startswith(NODE_STREAM_PREFIX)
                           and parse_stream(n) is not None)
            for name in names:
                try:
                    sfd = open_dir_nofollow(name, dir_fd=streams_fd)
                except OSError:
                    continue
                try:
                    found = _last_published(sfd)
                finally:
                    os.close(sfd)
                if found is not None:
                    out[name.removeprefix(NODE_STREAM_PREFIX)] = found
        finally:
            os.close(streams_fd)
    finally:
        os.close(src_fd)
    return out


def _last_published(sfd: int) -> list[dict[str, Any]] | None:
    """The attempts of the last batch of the stream open at ``sfd`` holding ``attempts.json``."""
    from opguard.staging.bundle import iter_entries, open_batch

    batches = sorted(p for n in os.listdir(sfd) if (p := parse_batch_name(n)) is not None)
    for seq, digest in reversed(batches):
        try:
            info = open_batch(Path(batch_name(seq, digest)), dir_fd=sfd)
            if not any(e.get("path") == ATTEMPTS_FILE and e.get("op") == "file"
                       for e in info.manifest.get("entries", [])):
                continue
            data = bytearray()
            for entry, chunks in iter_entries(info):
                wanted = entry.get("path") == ATTEMPTS_FILE and entry.get("op") == "file"
                for chunk in chunks:  # every entry's chunks are consumed; only this one is kept
                    if wanted:
                        data += chunk
                        if len(data) > ATTEMPTS_MAX_BYTES:
                            raise ValueError(f"{ATTEMPTS_FILE} is larger than {ATTEMPTS_MAX_BYTES} bytes")
            doc = json.loads(bytes(data))
        except (OpguardError, OSError, ValueError):
            return None
        if isinstance(doc, dict) and isinstance(doc.get("attempts"), list):
            return [a for a in doc["attempts"] if isinstance(a, dict)]
        return None
    return None


def finish_attempt(config: StagingConfig, layout: Layout, node_id: str, number: int, exit_status: int) -> bool:
    """Record the attempt's end and exit status. When the final drain sealed the node stream, the
    record is published at once by one more final sync of the node stream (one small batch and a
    new seal); otherwise the next sync of the node stream publishes it. True when published."""
    from opguard.staging.layout import node_stream
    from opguard.staging.sync import sync_streams

    stream = node_stream(node_id)
    try:
        cp = load_checkpoint(layout.stream_state_dir(stream) / CHECKPOINT_FILE)
    except OpguardError:
        cp = None
    sealed = cp is not None and cp.sealed_sequence is not None and cp.sealed_sequence == cp.next_sequence - 1
    end_attempt(layout, node_id, number, exit_status)
    if not sealed:
        return False
    report = sync_streams(config, layout, [stream], final=True, node_id=node_id)
    return report.error is None and all(sr.error is None for sr in report.streams)


PROVENANCE_FILE = ".opguard-attempts.json"  # written by materialize at the top of the restored tree


def attempt_of(attempts: list[dict[str, Any]], stream: str, sequence: int) -> int | None:
    """The attempt (of one node's list) that published batch ``sequence`` of ``stream``: the last
    whose ``first_sequence`` for the stream (1 when absent) is <= ``sequence``; None for a list
    without ``first_sequence`` (recorded before it existed) or no attempt at all."""
    found: int | None = None
    for a in attempts:
        firsts = a.get("first_sequence") if isinstance(a, dict) else None
        if not isinstance(firsts, dict):
            return None
        first = firsts.get(stream, 1)
        if isinstance(first, int) and first <= sequence:
            n = a.get("attempt")  # a number written by the launcher; anything else: unknown
            found = n if isinstance(n, int) and not isinstance(n, bool) and n > 0 else None
    return found


def restored_attempts(root: Path) -> dict[str, list[dict[str, Any]]]:
    """Node ID -> attempts, from the ``nodes/<id>/attempts.json`` a restore just verified and wrote
    into ``root`` (its private partial tree): the same last published version that
    :func:`published_attempts` reads from the target, without reading the target a second time.
    Read without following links and bounded by ATTEMPTS_MAX_BYTES; an unreadable file yields
    nothing for its node."""
    from opguard.staging.layout import NODES_DIRNAME

    out: dict[str, list[dict[str, Any]]] = {}
    try:
        nodes = sorted(os.listdir(root / NODES_DIRNAME))
    except (FileNotFoundError, NotADirectoryError):
        return out
    for node in nodes:
        try:
            fd = os.open(root / NODES_DIRNAME / node / ATTEMPTS_FILE, os.O_RDONLY | os.O_NOFOLLOW)
        except OSError:
            continue
        try:
            data = os.read(fd, ATTEMPTS_MAX_BYTES + 1)
        finally:
            os.close(fd)
        try:
            doc = json.loads(data) if len(data) <= ATTEMPTS_MAX_BYTES else None
        except ValueError:
            doc = None
        if isinstance(doc, dict) and isinstance(doc.get("attempts"), list):
            out[node] = [a for a in doc["attempts"] if isinstance(a, dict)]
    return out


def provenance(root: Path, origins: Mapping[str, Mapping[str, Any]]) -> dict[str, Any] | None:
    """The ``.opguard-attempts.json`` document of a restored tree (``docs/format.md`` §8): for every
    restored path of ``origins`` (path -> the stream, batch sequence and node ID its last entry came
    from, as the restore applied it), the attempt of that node that published the batch; the
    attempts as restored under ``root``. None when the run recorded no attempts."""
    published = restored_attempts(root)
    if not published:
        return None
    files = {rel: {"attempt": attempt_of(published.get(str(o["node_id"]), []), str(o["stream"]), int(o["sequence"])),
                   "node_id": o["node_id"], "stream": o["stream"], "sequence": o["sequence"]}
             for rel, o in sorted(origins.items())}
    return {"version": 1, "attempts": published, "files": files}


def write_provenance(root: Path, origins: Mapping[str, Mapping[str, Any]]) -> Path | None:
    """``root/.opguard-attempts.json`` (temp file, fsync, rename, fsync) when the run recorded
    attempts (a run made by ``opguard-run``); None otherwise. ``materialize`` calls it on the
    partial tree, before the rename that publishes DEST."""
    doc = provenance(root, origins)
    if doc is None:
        return None
    path = root / PROVENANCE_FILE
    atomic_replace_bytes(path, json.dumps(doc, indent=1, sort_keys=True).encode() + b"\n")
    return path
