"""The node claim on shared storage (``docs/format.md`` §5.3): staging's protocol.

A claim ``TARGET/.opguard-bundles/nodes/<node ID>.json`` is created once, with create-if-absent
semantics, before anything is uploaded; a claim by another machine (different hostname or
machine ID) means two machines use one node ID and is refused. The refused claimant records a
conflict marker ``nodes/<node ID>.conflicts/<host>-<pid>-<ns>.json`` so that the first claimant,
whose syncs look for one before uploading (:func:`sync_conflict`, inside every ``opguard sync``),
stops too. The launcher makes the claim and records refusals; staging reads them.
"""

from __future__ import annotations

import json
import os
import re
import time
from pathlib import Path

from opguard.errors import ConfigError
from opguard.staging.config import StagingConfig
from opguard.staging.fsutil import create_exclusive, dump_json, fsync_dir
from opguard.staging.layout import BUNDLES_DIRNAME, CLAIMS_DIRNAME


def _read_first_line(path: str) -> str:
    try:
        with open(path) as f:
            return f.readline().strip()
    except OSError:
        return ""


def machine_id() -> str:
    return _read_first_line("/etc/machine-id") or _read_first_line("/var/lib/dbus/machine-id")


def boot_id() -> str:
    return _read_first_line("/proc/sys/kernel/random/boot_id")


# A conflict marker counts for a wrapper only if recorded after the wrapper started, less this much
# clock difference between nodes (NTP keeps cluster clocks within milliseconds); an older marker is
# left from an earlier job that used this target, and one with another SLURM_JOB_ID is ignored too.
CLOCK_SKEW_S = 10.0


class NodeIdConflict(ConfigError):
    """The node ID is claimed on the target by another machine (exit 2, like every ConfigError)."""

    def __init__(self, message: str, fix: str, claim: dict[str, object]) -> None:
        super().__init__(message, fix)
        self.claim = claim


def claim_path(target: Path, node_id: str) -> Path:
    return target / BUNDLES_DIRNAME / CLAIMS_DIRNAME / f"{node_id}.json"


def conflicts_dir(target: Path, node_id: str) -> Path:
    return target / BUNDLES_DIRNAME / CLAIMS_DIRNAME / f"{node_id}.conflicts"


def claim_record(node_id: str, run_id: str) -> dict[str, object]:
    return {"version": 2, "node_id": node_id, "hostname": os.uname().nodename, "machine_id": machine_id(),
            "boot_id": boot_id(), "run_id": run_id, "claimed_at": time.time()}


def _conflict(path: Path, existing: object, node_id: str) -> ConfigError | None:
    if not isinstance(existing, dict):
        return ConfigError(f"node claim {path} is not a JSON object", "use a new output directory")
    mine = (os.uname().nodename, machine_id())
    theirs = (existing.get("hostname"), existing.get("machine_id"))
    if theirs != mine:
        return NodeIdConflict(
            f"node ID {node_id!r} is already claimed on the target by another machine "
            f"(hostname {theirs[0]!r}, machine-id {theirs[1]!r}; this is {mine[0]!r}, {mine[1]!r}): "
            f"two machines would upload as one node ({path})",
            "give every node a unique OPGUARD_NODE_ID (or unset it to use the scheduler's node name)",
            existing)
    return None


def claim_problem(config: StagingConfig, node_id: str) -> ConfigError | None:
    """Read-only: the problem with an existing claim of ``node_id``, if any."""
    assert config.target is not None
    path = claim_path(config.target, node_id)
    try:
        existing = json.loads(path.read_bytes())
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as e:
        return ConfigError(f"node claim {path} is unreadable: {e}", "use a new output directory")
    return _conflict(path, existing, node_id)


def make_claim(config: StagingConfig, node_id: str) -> bool:
    """Create the claim if absent (True when this call created it); ConfigError on a conflict."""
    assert config.target is not None and config.run_id is not None
    path = claim_path(config.target, node_id)
    if not path.parent.is_dir():
        path.parent.mkdir(parents=True, exist_ok=True)
        fsync_dir(path.parent.parent)
    if create_exclusive(path, dump_json(claim_record(node_id, config.run_id))):
        return True
    err = _conflict(path, json.loads(path.read_bytes()), node_id)
    if err is not None:
        raise err
    return False


def _job_id() -> str | None:
    return os.environ.get("SLURM_JOB_ID") or None


def record_conflict(target: Path, err: NodeIdConflict, node_id: str) -> Path | None:
    """The refused claimant's marker (create-if-absent, never overwritten), naming the claim it
    collided with; None if it could not be written (the refusal stands; the caller says so)."""
    host = re.sub(r"[^A-Za-z0-9._-]", "-", os.uname().nodename).lstrip(".")[:64] or "host"
    d = conflicts_dir(target, node_id)
    path = d / f"{host}-{os.getpid()}-{time.time_ns()}.json"
    doc = {"version": 1, "node_id": node_id, "hostname": os.uname().nodename, "machine_id": machine_id(),
           "boot_id": boot_id(), "pid": os.getpid(), "job_id": _job_id(), "recorded_at": time.time(),
           "claim": {k: err.claim.get(k) for k in ("hostname", "machine_id", "boot_id", "claimed_at")}}
    try:
        d.mkdir(parents=True, exist_ok=True)
        return path if create_exclusive(path, dump_json(doc)) else None
    except OSError:
        return None


def find_conflicts(target: Path, node_id: str, since: float) -> list[dict[str, object]]:
    """Conflict markers that concern this wrapper's claim: they name a claim by this machine, were
    recorded after ``since`` (the wrapper's start, wall clock) less ``CLOCK_SKEW_S``, and carry
    this job's SLURM_JOB_ID when both know one. One stat when there is none (the usual case)."""
    d = conflicts_dir(target, node_id)
    try:
        names = sorted(os.listdir(d))
    except FileNotFoundError:
        return []
    mine = (os.uname().nodename, machine_id())
    job = _job_id()
    found = []
    for name in names:
        if not name.endswith(".json") or name.startswith("."):
            continue
        try:
            doc = json.loads((d / name).read_bytes())
        except (OSError, ValueError):
            continue  # being created by its writer (create-if-absent: it appears whole) or unreadable
        if not isinstance(doc, dict):
            continue
        claim = doc.get("claim")
        if not isinstance(claim, dict) or (claim.get("hostname"), claim.get("machine_id")) != mine:
            continue
        if float(doc.get("recorded_at", 0.0)) < since - CLOCK_SKEW_S:
            continue
        if job is not None and doc.get("job_id") not in (None, job):
            continue
        found.append(doc)
    return found


def job_conflict(target: Path, node_id: str) -> ConfigError | None:
    """For ``opguard sync`` run on its own (the exit hook, by hand): markers recorded in this Slurm job
    (same SLURM_JOB_ID) that name a claim of this machine; without a job ID a stand-alone sync cannot
    tell a marker of this run from an old one, and uploads (the wrapper's own syncs check by time)."""
    job = _job_id()
    if job is None:
        return None
    found = [m for m in find_conflicts(target, node_id, 0.0) if m.get("job_id") == job]
    return conflict_message(node_id, found, conflicts_dir(target, node_id)) if found else None


def conflict_message(node_id: str, markers: list[dict[str, object]], path: Path) -> ConfigError:
    hosts = sorted({str(m.get("hostname")) for m in markers})
    return ConfigError(
        f"node ID {node_id!r} is also used by {len(hosts)} other machine(s) of this job ({', '.join(hosts)}), "
        f"which were refused ({path}): this node claimed it first, but two machines would upload as one node, "
        "so it uploads nothing (opguard-run also stops its command)",
        "give every node a unique OPGUARD_NODE_ID (or unset it to use the scheduler's node name)")


def sync_conflict(target: Path, node_id: str, since: float | None) -> ConfigError | None:
    """The check every sync makes before it uploads: markers that concern this node's claim.
    ``since``: the wrapper's start (wall clock) when a wrapper runs the sync (markers recorded after
    it, less ``CLOCK_SKEW_S``); None for a stand-alone ``opguard sync`` (:func:`job_conflict`)."""
    if since is None:
        return job_conflict(target, node_id)
    found = find_conflicts(target, node_id, since)
    return conflict_message(node_id, found, conflicts_dir(target, node_id)) if found else None
