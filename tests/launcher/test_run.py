"""Node duties, progress output, the exit hook after a SIGKILL, node metadata and the countdown."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from datetime import datetime
from pathlib import Path

import pytest

from opguard.launcher.countdown import lead_seconds, parse_end_time
from opguard.launcher.identity import resolve
from opguard.launcher.nodeinfo import filtered_env, program_paths, source_index
from tests.launcher.helpers import OPGUARD, OPGUARD_RUN, PY, pid_alive, spawn, tree_snapshot, wait_for

PROG = str(Path(__file__).parent / "progs" / "sigchild.py")


def test_second_node_duty_claimant_is_refused(staging_env: dict[str, str], tmp_path: Path) -> None:
    out = tmp_path / "out"
    first = spawn([PY, PROG, str(out), "wait", "0"], staging_env)
    try:
        wait_for(lambda: (out / "ready").exists(), 60, "the first wrapper's child")
        # a second local rank 0 on the same local base (e.g. two "nodes" sharing one base)
        marker = tmp_path / "second-ran"
        target = Path(staging_env["OPGUARD_LOCAL_DUMP_TARGET"])
        env = {**staging_env, "OPGUARD_LOCAL_DUMP_SYNC_INTERVAL": "3600"}
        for args in (["--plan"], []):
            before = tree_snapshot(target / ".opguard-bundles" / "nodes")
            r = subprocess.run([OPGUARD_RUN, *args, PY, "-c", f"open({str(marker)!r}, 'w')"], env=env,
                               capture_output=True, text=True, timeout=60)
            assert r.returncode == 2, r.stderr
            assert "already holds the node duties" in r.stderr and "fix:" in r.stderr
            assert not marker.exists()
            assert tree_snapshot(target / ".opguard-bundles" / "nodes") == before
    finally:
        (out / "release").write_text("1")
        first.communicate(timeout=120)
    assert first.returncode == 0


def test_quiet_and_verbose_progress(staging_env: dict[str, str], tmp_path: Path) -> None:
    env = {**staging_env, "OPGUARD_LOCAL_DUMP_SYNC_INTERVAL": "0.3"}
    # writes until a periodic sync has published a batch (the event the test is about), at most 60 s
    code = ("import os, pathlib, time; from opguard.staging.writers import open_jsonl; w = open_jsonl('t.jsonl')\n"
            "b = pathlib.Path(os.environ['OPGUARD_LOCAL_DUMP_TARGET'], '.opguard-bundles', 'streams')\n"
            "n = len(list(b.glob('*/*.ogb')))\n"  # the quiet run's batches are there for the verbose run
            "for i in range(600):\n"
            "    w.write({'i': i}); time.sleep(0.1)\n"
            "    if i >= 5 and len(list(b.glob('*/*.ogb'))) > n: break\n")
    q = subprocess.run([OPGUARD_RUN, "--quiet", PY, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert q.returncode == 0, q.stderr
    lines = q.stderr.strip().splitlines()
    assert all(line.startswith("opguard-run: ") for line in lines)
    assert not any(" sync #" in line for line in lines)  # periodic syncs are silent with --quiet
    assert any("final drain ok" in line for line in lines) and "drain complete" in lines[-1]
    v = subprocess.run([OPGUARD_RUN, "--verbose", "--resume", PY, "-c", code], env=env, capture_output=True,
                       text=True, timeout=120)  # a second attempt of the quiet run's sealed run
    assert v.returncode == 0, v.stderr
    assert "opguard-run plan:" in v.stderr and "starting sync --rank 0 --node" in v.stderr
    sync_lines = [line for line in v.stderr.splitlines() if " sync #" in line]
    assert sync_lines and all("batch(es)" in x and "/s)" in x and "backlog" in x for x in sync_lines)
    assert v.stdout == ""


def test_exit_hook_finishes_a_drain_cut_by_sigkill(staging_env: dict[str, str], tmp_path: Path) -> None:
    out = tmp_path / "out"
    env = {**staging_env, "OPGUARD_LOCAL_DUMP_SYNC_INTERVAL": "3600"}
    p = spawn([PY, PROG, str(out), "wait", "0"], env)
    wait_for(lambda: (out / "ready").exists(), 60, "the child to start")
    child = int((out / "child.pid").read_text())
    p.send_signal(signal.SIGKILL)  # what Slurm does after KillWait
    p.communicate(timeout=60)
    wait_for(lambda: not pid_alive(child), 30, "the child to die with its wrapper (PR_SET_PDEATHSIG)")
    r = subprocess.run([OPGUARD, "sync", "--all", "--final"], env={**env, "OPGUARD_NODE_ID": "node-a"},
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    dest = tmp_path / "restored"
    m = subprocess.run([OPGUARD, "materialize", "--require-sealed", env["OPGUARD_LOCAL_DUMP_TARGET"], str(dest)],
                       env=env, capture_output=True, text=True, timeout=120)
    assert m.returncode == 0, m.stderr
    local = Path(env["OPGUARD_LOCAL_DUMP_BASE"]) / "ranks" / "rank-000000" / "trace.jsonl"
    assert (dest / "ranks" / "rank-000000" / "trace.jsonl").read_bytes() == local.read_bytes()


def test_periodic_syncs_are_staggered_and_low_priority(staging_env: dict[str, str], tmp_path: Path) -> None:
    """Node 1 of 2 starts at half the interval; its syncs run at nice 19 as children of the wrapper."""
    out = tmp_path / "out"
    env = {**staging_env, "OPGUARD_LOCAL_DUMP_SYNC_INTERVAL": "4", "OPGUARD_NODE_INDEX": "1",
           "OPGUARD_NODE_COUNT": "2"}
    p = spawn([PY, PROG, str(out), "wait", "0"], env)
    import psutil

    wrapper = psutil.Process(p.pid)
    seen: dict[str, object] = {}

    def sync_child() -> bool:
        for c in wrapper.children():
            try:
                if "opguard.staging.syncrun" in c.cmdline():  # the sync child: python -m opguard.staging.syncrun
                    seen.update(nice=c.nice(), t=time.time())
                    return True
            except psutil.Error:
                continue
        return False

    wait_for(sync_child, 60, "the first periodic sync", interval=0.01)
    (out / "release").write_text("1")
    p.communicate(timeout=120)
    assert seen["nice"] == 19
    # node 1 of 2 syncs at phase 1/2 of the 4 s interval on the wall clock (plus the run's shift)
    from opguard.launcher.schedule import run_phase_shift, stagger_offset

    phase = (stagger_offset(1, 2, 4.0) + run_phase_shift("experiment-001", 4.0)) % 4.0
    assert isinstance(seen["t"], float)
    lag = (seen["t"] - phase) % 4.0  # how late the sync process was seen after its slot
    assert lag < 1.0, (seen["t"] % 4.0, phase)


def test_node_metadata_filters_secrets_and_indexes_the_program(tmp_path: Path) -> None:
    env = {"SLURM_JOB_ID": "5", "OPGUARD_NODE_ID": "n1", "AWS_SECRET_ACCESS_KEY": "x", "SLURM_AUTH_TOKEN": "t",
           "HOME": "/root", "NCCL_DEBUG": "INFO"}
    assert filtered_env(env) == {"NCCL_DEBUG": "INFO", "OPGUARD_NODE_ID": "n1", "SLURM_JOB_ID": "5"}
    (tmp_path / "pkg").mkdir()
    (tmp_path / "train.py").write_text("print(1)\n")
    (tmp_path / "pkg" / "model.py").write_text("x = 1\n")
    (tmp_path / "data.bin").write_bytes(b"\0" * 10)
    cmd = ["torchrun", "--nproc-per-node=2", str(tmp_path / "train.py"), "--lr", "1"]
    assert program_paths(cmd) == [(tmp_path / "train.py").resolve()]
    root, files = source_index(cmd)
    assert root == tmp_path.resolve()
    assert sorted(f["path"] for f in files) == ["pkg/model.py", "train.py"]
    assert program_paths(["python", "-u", str(tmp_path / "train.py")]) == [(tmp_path / "train.py").resolve()]
    (tmp_path / "local-ssd" / "node").mkdir(parents=True)
    (tmp_path / "local-ssd" / "node" / "node.json").write_text("{}")
    _root, files = source_index(cmd, exclude=[tmp_path / "local-ssd"])
    assert sorted(f["path"] for f in files) == ["pkg/model.py", "train.py"]  # the staging base is never indexed
    assert program_paths(["python", "-m", "x"]) == []


# ---- the scheduler countdown ------------------------------------------------------------------

def test_parse_end_time() -> None:
    t = parse_end_time("2026-11-29T21:30:00\n")
    assert t == datetime(2026, 11, 29, 21, 30).timestamp()
    assert parse_end_time("EndTime=2026-11-29T21:30:00") == t
    for raw in ("N/A", "Unknown", "", "garbage"):
        assert parse_end_time(raw) is None


def test_lead_time_is_derived_from_backlog_and_cap() -> None:
    assert lead_seconds(0, 32) == 30  # floor
    assert lead_seconds(32 * 2**20 * 100, 32) == 150  # 100 s of drain at the cap, x1.5 margin


def test_countdown_unknown_job_does_nothing(staging_env: dict[str, str]) -> None:
    """SLURM_JOB_ID of a job the scheduler does not know (no controller here): no drain, no error."""
    env = {**staging_env, "SLURM_JOB_ID": "999999", "OPGUARD_LOCAL_DUMP_SYNC_INTERVAL": "3600"}
    r = subprocess.run([OPGUARD_RUN, PY, "-c", "pass"], env=env, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert "job ends in" not in r.stderr


@pytest.mark.parametrize("mode", ["rank", "torchrun"])
def test_exports(mode: str) -> None:
    cmd = ("torchrun", "--nproc-per-node=2", "t.py") if mode == "torchrun" else ("python", "a.py")
    env = {"OPGUARD_NODE_ID": "n1", **({} if mode == "torchrun" else {
        "OMPI_COMM_WORLD_RANK": "3", "OMPI_COMM_WORLD_SIZE": "4", "OMPI_COMM_WORLD_LOCAL_RANK": "1",
        "OMPI_COMM_WORLD_LOCAL_SIZE": "2"})}
    ident, problems = resolve(env, cmd, "h")
    assert problems == []
    ex = ident.exports()
    assert ex["OPGUARD_NODE_ID"] == "n1"
    if mode == "rank":
        assert (ex["OPGUARD_RANK"], ex["OPGUARD_LOCAL_RANK"], ex["OPGUARD_NODE_INDEX"]) == ("3", "1", "1")
    else:
        assert "OPGUARD_RANK" not in ex and ex["OPGUARD_WORLD_SIZE"] == "2"


def test_wrapper_never_imports_torch_or_mpi(staging_env: dict[str, str]) -> None:
    code = ("import sys; from opguard.cli_run import run_command; import opguard.launcher.supervise, "
            "opguard.launcher.mpi, opguard.launcher.nodeinfo; "
            "assert not {'torch', 'mpi4py'} & set(sys.modules), sorted(sys.modules)")
    r = subprocess.run([PY, "-c", code], env=staging_env, capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    assert os.path.exists(OPGUARD_RUN)


def test_drain_timeout_stops_the_drain_not_the_exit_code(staging_env: dict[str, str]) -> None:
    """A drain that cannot finish in --drain-timeout is stopped (resumable), reported, exit code kept."""
    env = {**staging_env, "OPGUARD_SYNC_MBPS": "0.05", "OPGUARD_LOCAL_DUMP_SYNC_INTERVAL": "3600"}
    code = ("import os; from opguard.staging.writers import write_rank_file; "
            "write_rank_file('big.bin', os.urandom(4 << 20)); raise SystemExit(9)")
    t0 = time.monotonic()
    r = subprocess.run([OPGUARD_RUN, "--drain-timeout", "2", PY, "-c", code], env=env, capture_output=True,
                       text=True, timeout=120)
    assert r.returncode == 9, r.stderr
    assert time.monotonic() - t0 < 60  # 4 MiB at 0.05 MiB/s would take 80 s
    assert "exceeded --drain-timeout=2 s" in r.stderr and "opguard sync --all --final" in r.stderr
    doc = json.loads((Path(env["OPGUARD_LOCAL_DUMP_BASE"]) / "state" / "launcher" / "rank-000000.json").read_text())
    assert doc["drain"]["status"] == "timed out" and doc["exit_code"] == 9


def test_stagger_spreads_local_ranks_over_the_node_slot() -> None:
    from opguard.launcher.plan import stagger
    from opguard.launcher.schedule import stagger_offset

    env = {"OMPI_COMM_WORLD_RANK": "7", "OMPI_COMM_WORLD_SIZE": "8", "OMPI_COMM_WORLD_LOCAL_RANK": "3",
           "OMPI_COMM_WORLD_LOCAL_SIZE": "4", "OPGUARD_NODE_ID": "n1"}
    ident, problems = resolve(env, ("python", "a.py"), "h")
    assert problems == [] and (ident.node_index, ident.node_count) == (1, 2)
    # node 1 of 2 starts at half of the 60 s interval; local rank 3 of 4 at 3/4 of the node's 30 s slot
    assert stagger(ident, 60) == pytest.approx(stagger_offset(1, 2, 60) + 22.5)
    lead, _ = resolve({**env, "OMPI_COMM_WORLD_RANK": "4", "OMPI_COMM_WORLD_LOCAL_RANK": "0"}, ("python", "a.py"), "h")
    assert stagger(lead, 60) == pytest.approx(stagger_offset(1, 2, 60))
