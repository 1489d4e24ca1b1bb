"""Two machines given one OPGUARD_NODE_ID (issue 4): the refused claimant records a conflict marker
beside the claim (docs/format.md §5.3); the first claimant's syncs find it before uploading, so it
stops its command and exits 2 too, and no batch reaches the target."""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import time
from pathlib import Path

import pytest

from tests.launcher.helpers import LIVE, OPGUARD_RUN, PY, pid_alive, spawn, wait_for

PROG = str(Path(__file__).parent / "progs" / "sigchild.py")


def _bundles(env: dict[str, str]) -> Path:
    return Path(env["OPGUARD_LOCAL_DUMP_TARGET"]) / ".opguard-bundles"


def _published(env: dict[str, str]) -> list[Path]:
    return sorted(_bundles(env).glob("streams/*/*.ogb"))


def _machine_id() -> str:
    p = Path("/etc/machine-id")
    return p.read_text().strip() if p.exists() else ""


def _plant_marker(env: dict[str, str], recorded_at: float, job_id: str | None = None) -> Path:
    """What a refused claimant on machine 'other-host' writes (claim.record_conflict's format)."""
    d = _bundles(env) / "nodes" / "node-a.conflicts"
    d.mkdir(parents=True, exist_ok=True)
    path = d / "other-host-1-1.json"
    path.write_text(json.dumps({"version": 1, "node_id": "node-a", "hostname": "other-host", "machine_id": "f" * 32,
                                "boot_id": "b", "pid": 1, "job_id": job_id, "recorded_at": recorded_at,
                                "claim": {"hostname": socket.gethostname(), "machine_id": _machine_id()}}))
    return path


def test_refused_claimant_records_a_marker(staging_env: dict[str, str], tmp_path: Path) -> None:
    nodes = _bundles(staging_env) / "nodes"
    nodes.mkdir(parents=True)
    (nodes / "node-a.json").write_text(json.dumps({
        "version": 2, "node_id": "node-a", "hostname": "elsewhere", "machine_id": "0" * 32, "boot_id": "b",
        "run_id": "experiment-001", "claimed_at": 1.0}))
    marker = tmp_path / "child-ran"
    r = subprocess.run([OPGUARD_RUN, PY, "-c", f"open({str(marker)!r}, 'w').write('x')"], env=staging_env,
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 2, r.stderr
    assert not marker.exists()
    assert "already claimed on the target by another machine" in r.stderr and "fix:" in r.stderr
    assert "nothing was written to shared storage but the conflict marker" in r.stderr
    markers = list((nodes / "node-a.conflicts").iterdir())
    assert len(markers) == 1 and str(markers[0]) in r.stderr
    doc = json.loads(markers[0].read_text())
    assert doc["hostname"] == socket.gethostname() and doc["claim"]["hostname"] == "elsewhere"
    assert sorted(p.name for p in _bundles(staging_env).rglob("*")) == sorted(
        ["nodes", "node-a.json", "node-a.conflicts", markers[0].name])  # nothing else on the target
    # --plan never writes one
    r = subprocess.run([OPGUARD_RUN, "--plan", PY, "-c", "pass"], env=staging_env, capture_output=True,
                       text=True, timeout=120)
    assert r.returncode == 2 and len(list((nodes / "node-a.conflicts").iterdir())) == 1


def test_first_claimant_stops_before_uploading(staging_env: dict[str, str], tmp_path: Path) -> None:
    out = tmp_path / "out"
    p = spawn([PY, PROG, str(out), "term-exit"], staging_env)
    claim = _bundles(staging_env) / "nodes" / "node-a.json"
    wait_for(claim.exists, 60, "the node claim")
    _plant_marker(staging_env, time.time())  # within the settle time: before any sync
    _o, err = p.communicate(timeout=120)
    assert p.returncode == 2, err  # not the child's 3: the job is misconfigured
    assert "node ID 'node-a' is also used by 1 other machine(s) of this job (other-host)" in err
    assert "terminating the command" in err and "fix:" in err
    assert (out / "signals.txt").read_text().split() == ["SIGTERM"]
    assert not pid_alive(int((out / "child.pid").read_text()))
    assert _published(staging_env) == []
    assert not (_bundles(staging_env) / "format.json").exists()  # no sync ever reached the target
    doc = json.loads((Path(staging_env["OPGUARD_LOCAL_DUMP_BASE"]) / "state" / "launcher" / "rank-000000.json")
                     .read_text())
    assert doc["exit_code"] == 2 and "also used by" in doc["error"] and doc["drain"]["status"] == "not run"


def test_every_sync_checks_for_markers(staging_env: dict[str, str], tmp_path: Path) -> None:
    """A marker that appears after syncs have published stops the next sync (and every later one)."""
    out = tmp_path / "out"
    p = spawn([PY, PROG, str(out), "term-exit"], staging_env)
    wait_for(lambda: bool(_published(staging_env)), 60, "a first periodic sync")
    _plant_marker(staging_env, time.time())
    _o, err = p.communicate(timeout=120)
    assert p.returncode == 2, err
    assert "also used by 1 other machine(s)" in err
    after = err.split("also used by", 1)[1]
    assert "published batch" not in after and "drain complete" not in after  # nothing uploaded after it
    assert "no final drain: node ID conflict" in after


@pytest.mark.parametrize("stale", ["old", "other-job"])
def test_stale_markers_are_ignored(staging_env: dict[str, str], tmp_path: Path, stale: str) -> None:
    """A marker from an earlier job that used this target does not stop a later run."""
    env = {**staging_env, "SLURM_JOB_ID": "42"} if stale == "other-job" else staging_env
    _plant_marker(env, time.time() - 3600 if stale == "old" else time.time() + 5,
                  job_id="41" if stale == "other-job" else None)
    r = subprocess.run([OPGUARD_RUN, "--no-countdown", PY, "-c", "pass"], env=env, capture_output=True,
                       text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert "drain complete" in r.stderr and "also used by" not in r.stderr


@pytest.mark.skipif(os.geteuid() != 0 or shutil.which("unshare") is None,
                    reason="a second machine identity needs a UTS namespace (root and unshare)")
def test_two_machines_started_together_both_exit_2(staging_env: dict[str, str], tmp_path: Path) -> None:
    """Two real wrappers, one in its own UTS namespace with another hostname, started together with one
    node ID, separate local bases, one target: whichever claims first, both exit 2, no batch published."""
    other_base = tmp_path / "local-b"
    other_base.mkdir()
    out_a, out_b = tmp_path / "out-a", tmp_path / "out-b"
    env_b = {**staging_env, "OPGUARD_LOCAL_DUMP_BASE": str(other_base)}
    a = spawn([PY, PROG, str(out_a), "term-exit"], staging_env)
    b = subprocess.Popen(["unshare", "--uts", "sh", "-c", 'hostname other-host && exec "$@"', "sh", OPGUARD_RUN,
                          PY, PROG, str(out_b), "term-exit"], env=env_b, stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, text=True)
    LIVE.append(b)
    _o, err_a = a.communicate(timeout=120)
    _o, err_b = b.communicate(timeout=120)
    assert a.returncode == 2 and b.returncode == 2, (err_a, err_b)
    errs = err_a + err_b
    assert "already claimed on the target by another machine" in errs, errs
    assert "also used by 1 other machine(s)" in errs, errs
    assert "recorded the node ID conflict" in errs
    assert _published(staging_env) == []
    names = {p.relative_to(_bundles(staging_env)).parts[0] for p in _bundles(staging_env).rglob("*")}
    assert names == {"nodes"}, names


def test_standalone_sync_of_the_same_job_refuses(staging_env: dict[str, str]) -> None:
    """The exit hook's `opguard sync --all --final` on the first claimant's node uploads nothing when a
    refused claimant of the same Slurm job left a marker; a marker of another job does not stop it."""
    rank = Path(staging_env["OPGUARD_LOCAL_DUMP_BASE"]) / "ranks" / "rank-000000"
    rank.mkdir(parents=True)
    (rank / "t.jsonl").write_text('{"i": 0}\n')
    claim = subprocess.run([OPGUARD_RUN, "--no-countdown", PY, "-c", "pass"], env=staging_env, capture_output=True,
                           text=True, timeout=120)  # makes this machine's claim (and publishes: no marker yet)
    assert claim.returncode == 0, claim.stderr
    (rank / "t.jsonl").write_text('{"i": 0}\n{"i": 1}\n')
    env = {**staging_env, "SLURM_JOB_ID": "42"}
    _plant_marker(env, time.time(), job_id="41")
    other = subprocess.run([str(Path(PY).parent / "opguard"), "sync", "--all", "--final"], env=env,
                           capture_output=True, text=True, timeout=120)
    assert other.returncode == 0, other.stderr  # another job's marker
    published = _published(staging_env)
    (rank / "t.jsonl").write_text('{"i": 0}\n{"i": 1}\n{"i": 2}\n')
    (_bundles(env) / "nodes" / "node-a.conflicts" / "other-host-1-2.json").write_text(json.dumps({
        "version": 1, "node_id": "node-a", "hostname": "other-host", "job_id": "42", "recorded_at": time.time(),
        "claim": {"hostname": socket.gethostname(), "machine_id": _machine_id()}}))
    r = subprocess.run([str(Path(PY).parent / "opguard"), "sync", "--all", "--final"], env=env,
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 2, r.stderr
    assert "also used by 1 other machine(s)" in r.stderr and "fix:" in r.stderr
    assert _published(staging_env) == published
