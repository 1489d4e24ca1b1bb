"""The node-duty lock (``state/locks/node-duty.lock``): a second metadata uploader on one local base
is refused. The node claim on shared storage is staging's protocol (``opguard.staging.claim``,
``docs/format.md`` §5.3); its names are re-exported here for the launcher's modules."""

from __future__ import annotations

from typing import TYPE_CHECKING

from opguard.errors import ConfigError
from opguard.staging.claim import (  # re-exported: the launcher's modules import them from here
    NodeIdConflict,
    boot_id,
    claim_problem,
    machine_id,
    make_claim,
    record_conflict,
)
from opguard.staging.layout import Layout

if TYPE_CHECKING:
    import filelock

__all__ = ["NodeIdConflict", "boot_id", "claim_problem", "machine_id", "make_claim", "node_duty_problem",
           "record_conflict", "take_node_duty"]


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
