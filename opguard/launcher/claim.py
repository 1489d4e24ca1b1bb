"""The node claim on shared storage (``docs/format.md`` §5.3) and the node-duty lock.

A claim ``TARGET/.opguard-bundles/nodes/<node ID>.json`` is created once, with create-if-absent
semantics, before anything is uploaded; a claim by another machine (different hostname or
machine ID) means two machines use one node ID and is refused. The node-duty lock
(``state/locks/node-duty.lock``) makes a second metadata uploader on one local base visible.
"""

from __future__ import annotations

import json
import socket
import time
from pathlib import Path
from typing import TYPE_CHECKING

from opguard.errors import ConfigError
from opguard.staging.config import StagingConfig
from opguard.staging.fsutil import create_exclusive, dump_json, fsync_dir
from opguard.staging.layout import BUNDLES_DIRNAME, Layout

if TYPE_CHECKING:
    import filelock


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


def claim_path(target: Path, node_id: str) -> Path:
    return target / BUNDLES_DIRNAME / "nodes" / f"{node_id}.json"


def claim_record(node_id: str, run_id: str) -> dict[str, object]:
    return {"version": 2, "node_id": node_id, "hostname": socket.gethostname(), "machine_id": machine_id(),
            "boot_id": boot_id(), "run_id": run_id, "claimed_at": time.time()}


def _conflict(path: Path, existing: object, node_id: str) -> ConfigError | None:
    if not isinstance(existing, dict):
        return ConfigError(f"node claim {path} is not a JSON object", "use a new output directory")
    mine = (socket.gethostname(), machine_id())
    theirs = (existing.get("hostname"), existing.get("machine_id"))
    if theirs != mine:
        return ConfigError(
            f"node ID {node_id!r} is already claimed on the target by another machine "
            f"(hostname {theirs[0]!r}, machine-id {theirs[1]!r}; this is {mine[0]!r}, {mine[1]!r}): "
            f"two machines would upload as one node ({path})",
            "give every node a unique OPGUARD_NODE_ID (or unset it to use the scheduler's node name)")
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


def _duty_conflict(layout: Layout) -> ConfigError:
    return ConfigError(
        f"another opguard-run already holds the node duties of this local base ({layout.node_duty_lock}): "
        "two processes claim local rank 0 on one node",
        "give each node its own OPGUARD_LOCAL_DUMP_BASE and check the launcher's local ranks "
        "(one opguard-run torchrun per node, or one opguard-run per rank)")


def take_node_duty(layout: Layout) -> filelock.BaseFileLock:
    """Hold the node-duty lock for the run; ConfigError if another wrapper holds it."""
    import filelock  # lazily: only staging runs need it

    layout.locks_dir.mkdir(parents=True, exist_ok=True)
    lock = filelock.FileLock(str(layout.node_duty_lock), timeout=0)
    try:
        lock.acquire()
    except filelock.Timeout:
        raise _duty_conflict(layout) from None
    return lock


def node_duty_problem(layout: Layout) -> ConfigError | None:
    """Read-only probe (plan and preflight): is the node-duty lock held by a live wrapper now?"""
    import filelock

    if not layout.node_duty_lock.exists():
        return None
    lock = filelock.FileLock(str(layout.node_duty_lock), timeout=0)
    try:
        lock.acquire()
    except filelock.Timeout:
        return _duty_conflict(layout)
    except OSError:
        return None
    lock.release()
    return None
