"""The resolved plan: identity, directories, caps, stagger and the derived numbers.

Derived, not remembered: the per-node cap from an aggregate budget, the drain time of what is
pending now, whether one batch per interval keeps up — all from ``schedule.py``'s formulas.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from opguard.launcher import schedule
from opguard.launcher.backlog import backlog_bytes
from opguard.launcher.identity import Identity
from opguard.launcher.preflight import Preflight
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
        upload_s = schedule.upload_seconds(config.batch_bytes, caps.cap_mib_s)
        plan["derived"] = {
            "pending_bytes": pending,
            "drain_seconds_at_cap": round(schedule.drain_seconds(pending, caps.cap_mib_s), 3),
            "batch_upload_seconds_at_cap": round(upload_s, 3),
            "keeps_up": schedule.keeps_up(config.sync_interval, config.batch_bytes, caps.cap_mib_s),
            "periodic_capacity_mib_s": round(schedule.periodic_capacity_bytes_per_s(
                config.sync_interval, config.batch_bytes, caps.cap_mib_s) / MIB, 3),
            "suggested_warning_seconds": schedule.warning_seconds(pending, caps.cap_mib_s),
        }
        notes = plan["identity"]["notes"]
        if caps.note:
            notes.append(caps.note)
        if not plan["derived"]["keeps_up"]:
            notes.append(f"one batch ({config.batch_bytes / MIB:g} MiB) takes {upload_s:.1f} s at "
                         f"{caps.cap_mib_s:g} MiB/s, longer than the {config.sync_interval:g} s interval: "
                         "periodic syncs cannot publish a full batch per interval")
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
