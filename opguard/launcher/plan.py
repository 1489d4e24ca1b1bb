"""The resolved plan: identity, directories, caps, stagger and the derived numbers.

Derived, not remembered: the per-node cap from an aggregate budget, the drain time of what is
pending now, whether one batch per interval keeps up — all from ``schedule.py``'s formulas.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from opguard.launcher import schedule
from opguard.launcher.identity import Identity
from opguard.launcher.preflight import Preflight
from opguard.staging.backlog import backlog_bytes
from opguard.staging.config import MIB, StagingConfig
from opguard.staging.layout import Layout


@dataclass(frozen=True)
class Caps:
    cap_mib_s: float  # the per-node cap the syncs use
    configured_mib_s: float
    aggregate_mib_s: float | None
    aggregate_share_mib_s: float | None
    note: str | None


def effective_cap(config: StagingConfig, node_count: int | None) -> Caps:
    """OPGUARD_SYNC_MBPS, lowered to the aggregate budget's share (aggregate ÷ node count) if one is given."""
    if config.aggregate_mbps is None:
        return Caps(config.mbps, config.mbps, None, None, None)
    if node_count is None:
        return Caps(config.mbps, config.mbps, config.aggregate_mbps, None,
                    "OPGUARD_SYNC_AGGREGATE_MBPS is set but the node count is unknown: cap not derived")
    share = schedule.per_node_cap(config.aggregate_mbps, node_count)
    note = None
    if share < config.mbps:
        note = (f"OPGUARD_SYNC_MBPS={config.mbps:g} exceeds the aggregate share {share:.3g} "
                f"(= {config.aggregate_mbps:g} / {node_count} nodes): the share is used")
    return Caps(min(share, config.mbps), config.mbps, config.aggregate_mbps, share, note)


def stagger(identity: Identity, interval: float) -> float:
    """Seconds after start of this wrapper's first sync: its node's offset (``schedule.stagger_offset``),
    plus, with one wrapper per rank, local rank k of L at k/L of the node's slot (the node's wrappers
    share one upload lock: spread over the slot they do not queue on it)."""
    nodes = identity.node_count if identity.node_index is not None and identity.node_count else None
    if nodes is not None:
        assert identity.node_index is not None
        offset = schedule.stagger_offset(identity.node_index, nodes, interval)
    else:  # node index unknown: a deterministic jitter within the first slot from the node ID
        offset = schedule.JITTER_FRACTION * interval * schedule.jitter_unit(0, identity.node_id)
    local = identity.local_world_size
    if identity.mode == "rank" and local and local > 1 and 0 < identity.local_rank < local:
        offset += identity.local_rank * (interval / (nodes or 1)) / local
    return offset


SLURM_DEFAULT_KILL_WAIT_S = 30.0  # only for the plan's "fits the default KillWait" line


def wrapper_streams(identity: Identity) -> int:
    """Streams one wrapper syncs: its owned ranks (every local rank under torchrun) plus the node stream."""
    ranks = identity.owned_ranks()
    n = len(ranks) if ranks is not None else (identity.local_world_size or 1)
    return n + (1 if identity.node_duty else 0)


def sizing(identity: Identity, config: StagingConfig, cap_mib_s: float, node_mib_s: float) -> schedule.ClusterSizing:
    """The node's numbers at an expected data rate (``docs/sizing.md``): backlog at the warning, drain time,
    warning to request. The job's length is unknown here: a backlog that grows (periodic syncs that do
    not keep up) is counted for one interval only, and the plan says so."""
    return schedule.ClusterSizing(
        node_count=identity.node_count or 1, ranks_per_node=identity.local_world_size or 1,
        node_bytes_per_s=node_mib_s * MIB, interval=config.sync_interval, batch_bytes=config.batch_bytes,
        cap_mib_s=cap_mib_s, job_seconds=0.0, kill_wait=SLURM_DEFAULT_KILL_WAIT_S)


def _warning(pf: Preflight, config: StagingConfig, cap: float, pending: int, notes: list[str]) -> dict[str, Any]:
    """The ``--signal=B:USR1@N`` suggestion: from the expected data rate when one is given, else the
    pending data now (usually nothing, so the 30 s floor), said so in a note."""
    from_pending = schedule.warning_seconds(pending, cap)
    rate = pf.expected_mib_s
    if rate is None:
        what = ("the 30 s floor" if from_pending <= 30 else
                f"derived from the {pending / MIB:.1f} MiB pending now only")
        notes.append(f"suggested_warning_seconds={from_pending} is {what} because no expected data rate was "
                     "given: set OPGUARD_EXPECTED_MBPS to the MiB/s one node writes (all its ranks) to derive it")
        return {"expected_mib_s": None, "suggested_warning_seconds": from_pending,
                "suggested_warning_basis": "floor, no expected rate" if from_pending <= 30 else "pending now"}
    sz = sizing(pf.identity, config, cap, rate)
    warning = max(sz.warning_s, from_pending)
    if not sz.keeps_up:
        growth = schedule.backlog_growth_bytes_per_s(rate * MIB, config.sync_interval, config.batch_bytes, cap,
                                                     sz.streams_per_node)
        notes.append(
            f"at OPGUARD_EXPECTED_MBPS={rate:g} periodic syncs fall behind by "
            f"{growth / MIB:.3g} MiB/s (at most one batch per "
            "stream per interval, one upload at a time at the cap): the backlog grows with the job's length and "
            "the suggested warning covers one interval of it only; raise OPGUARD_SYNC_BATCH_MB or "
            "OPGUARD_SYNC_MBPS, or shorten OPGUARD_LOCAL_DUMP_SYNC_INTERVAL")
    if rate >= cap:
        notes.append(f"OPGUARD_EXPECTED_MBPS={rate:g} is not below the cap {cap:g} MiB/s: a drain while the "
                     "program still writes never catches up; raise OPGUARD_SYNC_MBPS")
    if not sz.drain_fits_kill_wait:
        notes.append(f"a drain at SIGTERM of the worst backlog ({sz.worst_backlog_bytes / MIB:.1f} MiB) takes "
                     f"{sz.worst_drain_s:.1f} s at the cap, more than Slurm's default KillWait of "
                     f"{SLURM_DEFAULT_KILL_WAIT_S:g} s: request the warning signal (#SBATCH --signal=B:USR1@{warning})")
    return {"expected_mib_s": rate, "expected_keeps_up": sz.keeps_up,
            "expected_backlog_at_warning_mib": round(sz.worst_backlog_bytes / MIB, 3),
            "expected_drain_seconds_at_cap": round(sz.worst_drain_s, 3),
            "suggested_warning_seconds": warning,
            "suggested_warning_basis": f"expected rate {rate:g} MiB/s per node (ClusterSizing.warning_s)"}


def build_plan(pf: Preflight, cmd: list[str]) -> dict[str, Any]:
    ident = pf.identity
    plan: dict[str, Any] = {"command": cmd, "identity": ident.as_dict(), "exports": ident.exports(),
                            "staging_enabled": bool(pf.config and pf.config.enabled)}
    config = pf.config
    if config is not None and config.enabled:
        layout = Layout(config)
        caps = effective_cap(config, ident.node_count)
        ranks = ident.owned_ranks()
        pending = backlog_bytes(layout, ranks, ident.node_id if ident.node_duty else None) \
            if config.local_base is not None and config.local_base.is_dir() else 0
        plan["directories"] = {
            "local_base": str(config.local_base), "target": str(config.target),
            "bundles": str(layout.bundles_dir), "state": str(layout.state_dir),
            "rank_dirs": [str(layout.rank_dir(r)) for r in ranks] if ranks is not None
            else f"every {layout.rank_dir(0).parent}/rank-* (torchrun: ranks assigned at rendezvous)",
            "node_dir": str(layout.node_dir(ident.node_id)) if ident.node_duty else None,
            "local_fstype": pf.local_fstype,
            "local_free_mib": round(pf.free_bytes / MIB, 1) if pf.free_bytes is not None else None,
        }
        plan["run_id"] = config.run_id
        plan["sync"] = {
            "interval_s": config.sync_interval, "batch_mib": config.batch_bytes / MIB,
            "cap_mib_s": caps.cap_mib_s, "configured_cap_mib_s": caps.configured_mib_s,
            "aggregate_mib_s": caps.aggregate_mib_s, "aggregate_share_mib_s": caps.aggregate_share_mib_s,
            "stagger_offset_s": round(stagger(ident, config.sync_interval), 3),
            "node_duty": ident.node_duty,
            "streams": "rank " + ", ".join(str(r) for r in ranks) if ranks is not None else "--all",
        }
        streams = wrapper_streams(ident)
        upload_s = schedule.upload_seconds(config.batch_bytes, caps.cap_mib_s)
        notes = plan["identity"]["notes"]
        plan["derived"] = {
            "pending_bytes": pending,
            "drain_seconds_at_cap": round(schedule.drain_seconds(pending, caps.cap_mib_s), 3),
            "batch_upload_seconds_at_cap": round(upload_s, 3),
            "stream_count": streams,
            # a periodic sync publishes at most one batch per stream, one upload at a time at the cap
            "keeps_up": schedule.keeps_up(config.sync_interval, streams * config.batch_bytes, caps.cap_mib_s),
            "periodic_capacity_mib_s": round(schedule.periodic_capacity_bytes_per_s(
                config.sync_interval, config.batch_bytes, caps.cap_mib_s, streams=streams) / MIB, 3),
            **_warning(pf, config, caps.cap_mib_s, pending, notes),
        }
        if caps.note:
            notes.append(caps.note)
        if not plan["derived"]["keeps_up"]:
            notes.append(f"one full batch per stream ({streams} × {config.batch_bytes / MIB:g} MiB) takes "
                         f"{streams * upload_s:.1f} s at {caps.cap_mib_s:g} MiB/s, longer than the "
                         f"{config.sync_interval:g} s interval: periodic syncs cannot publish a full batch "
                         "per stream per interval")
    plan["problems"] = [{"message": p.message, "fix": p.fix} for p in pf.problems]
    plan["ok"] = pf.ok
    return plan


def render(plan: dict[str, Any]) -> str:
    """Human-readable plan (stderr)."""
    ident = plan["identity"]
    lines = [f"opguard-run plan: {' '.join(plan['command'])}",
             f"  mode: {ident['mode']}   node {ident['node_id']} (index {ident['node_index']} of "
             f"{ident['node_count']})"]
    who = (f"rank {ident['rank']} of {ident['world_size']}" if ident["rank"] is not None
           else f"world size {ident['world_size']}, ranks {ident['expected_ranks'] or 'assigned at rendezvous'}")
    lines.append(f"  identity: {who}, local rank {ident['local_rank']} of {ident['local_world_size']}")
    for k, v in sorted(ident["sources"].items()):
        lines.append(f"    {k}: {v}")
    lines.append("  exports: " + " ".join(f"{k}={v}" for k, v in sorted(plan["exports"].items())))
    if not plan["staging_enabled"]:
        lines.append("  staging: disabled (no syncs; the wrapper forwards signals and keeps exit codes)")
    else:
        lines.append(f"  run ID: {plan.get('run_id')}")
        for k, v in plan["directories"].items():
            lines.append(f"  {k}: {v}")
        for k, v in plan["sync"].items():
            lines.append(f"  {k}: {v}")
        for k, v in plan["derived"].items():
            lines.append(f"  {k}: {v}")
    for note in ident["notes"]:
        lines.append(f"  note: {note}")
    if plan["problems"]:
        lines.append(f"  {len(plan['problems'])} problem(s):")
        for p in plan["problems"]:
            lines.append(f"  - {p['message']}")
            if p["fix"]:
                lines.append(f"      fix: {p['fix']}")
    else:
        lines.append("  ok: no problems found")
    return "\n".join(lines)
