"""staging.syncrun: the sync as a module entry point (what the wrapper's sync children run) with a
typed report, and the node claim's conflict check made inside the sync (docs/launcher.md §3,
docs/format.md §5.3)."""

from __future__ import annotations

import json
import socket
import subprocess
import time
from pathlib import Path

from opguard.staging.claim import machine_id
from opguard.staging.syncrun import SyncOutcome, SyncRequest, module_command, parse
from tests.conftest import BIN


def _rank_file(env: dict[str, str]) -> None:
    d = Path(env["OPGUARD_LOCAL_DUMP_BASE"]) / "ranks" / "rank-000000"
    d.mkdir(parents=True, exist_ok=True)
    (d / "t.jsonl").write_text('{"i": 0}\n')


def _marker(env: dict[str, str], recorded_at: float) -> None:
    """A refused claimant's marker naming this machine's claim of node-a (docs/format.md §5.3)."""
    d = Path(env["OPGUARD_LOCAL_DUMP_TARGET"]) / ".opguard-bundles" / "nodes" / "node-a.conflicts"
    d.mkdir(parents=True)
    (d / "other-host-1-1.json").write_text(json.dumps({
        "version": 1, "node_id": "node-a", "hostname": "other-host", "job_id": None, "recorded_at": recorded_at,
        "claim": {"hostname": socket.gethostname(), "machine_id": machine_id()}}))


def _run(req: SyncRequest, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(module_command(req, str(BIN / "python")), env=env, capture_output=True, text=True,
                          timeout=120)


def test_request_round_trips_through_the_entry_points_arguments() -> None:
    req = SyncRequest(ranks=(3, 5), node=True, final=True, since=1764000000.25, report_json=Path("/r.json"))
    assert parse(req.argv()) == req
    assert parse(SyncRequest(all=True, quiet=True).argv()) == SyncRequest(all=True, quiet=True)


def test_module_entry_point_syncs_and_reports_typed(staging_env: dict[str, str], tmp_path: Path) -> None:
    _rank_file(staging_env)
    report = tmp_path / "r.json"
    r = _run(SyncRequest(ranks=(0,), final=True, since=time.time(), report_json=report), staging_env)
    assert r.returncode == 0, r.stderr
    out = SyncOutcome.read(report)
    assert out is not None and out.exit_code == 0 and out.batches == 1 and out.node_id_conflict is None
    assert [(s.stream, s.sealed, s.error) for s in out.streams] == [("rank-000000", True, None)]
    assert "opguard sync: final: 1 stream(s), 1 batch(es)" in r.stderr


def test_conflict_check_inside_the_sync_uploads_nothing(staging_env: dict[str, str], tmp_path: Path) -> None:
    _rank_file(staging_env)
    started = time.time()
    _marker(staging_env, started + 1)
    report = tmp_path / "r.json"
    r = _run(SyncRequest(all=True, final=True, since=started, report_json=report), staging_env)
    assert r.returncode == 2, r.stderr
    out = SyncOutcome.read(report)
    assert out is not None and out.node_id_conflict is not None and "also used by 1 other machine(s)" in \
        out.node_id_conflict and out.fix and out.batches == 0
    assert "also used by 1 other machine(s)" in r.stderr and "fix:" in r.stderr
    assert not (Path(staging_env["OPGUARD_LOCAL_DUMP_TARGET"]) / ".opguard-bundles" / "streams").exists()
    # a marker older than the wrapper's start (less the clock skew) is left from an earlier job
    r = _run(SyncRequest(all=True, final=True, since=started + 60, report_json=report), staging_env)
    assert r.returncode == 0, r.stderr
    assert SyncOutcome.read(report) is not None
