"""How jobs end under Slurm: scancel, the time limit with --signal=B:USR1@N, a wrapper SIGKILLed
mid-drain (the exit hook finishes it). Real jobs from the templates, real signals from Slurm."""

from __future__ import annotations

import json
import os
import signal
import time
from pathlib import Path
from typing import Any

import psutil
import pytest

from .conftest import APPS, Cluster, wait_for
from .e2e import Run, assert_all_sealed, assert_same_tree, records, seals

RANK_STREAMS_6 = {f"rank-{r:06d}" for r in range(6)}
NODE_STREAMS_3 = {f"node-node{k}" for k in (1, 2, 3)}


def cluster_pids(cluster: Cluster) -> list[psutil.Process]:
    """Every process living in one of the cluster nodes' network namespaces except the slurmd."""
    inodes = {int(x) for x in (cluster.base / "run" / "netns-inodes").read_text().split()}
    out = []
    for p in psutil.process_iter(["name", "cmdline"]):
        try:
            ino = os.stat(f"/proc/{p.pid}/ns/net").st_ino
        except OSError:
            continue
        if ino in inodes and p.info["name"] not in ("slurmd", "slurmctld"):
            out.append(p)
    return out


def job_processes(cluster: Cluster) -> list[str]:
    """Job processes (wrappers, syncs, launchers, the app) still alive on any node."""
    alive = []
    for p in cluster_pids(cluster):
        try:
            cmd = " ".join(p.cmdline())
        except psutil.Error:
            continue
        if any(s in cmd for s in ("opguard", "torchrun", str(APPS), "slurmstepd")):
            alive.append(f"{p.pid} {cmd[:120]}")
    return alive


def wait_records(run: Run, ranks: int, at_least: int, timeout: float) -> None:
    def enough() -> bool:
        local = run.local_rank_dirs()
        return len(local) == ranks and all(len(records(d / "trace.jsonl")) >= at_least for _, d in local.values())
    wait_for(enough, timeout, f"{ranks} ranks with >= {at_least} records each")


def launcher_reports(run: Run) -> list[dict[str, Any]]:
    out = []
    for k in range(1, run.cluster.nodes + 1):
        for p in sorted((run.local_on(f"node{k}") / "state" / "launcher").glob("*.json")):
            out.append(json.loads(p.read_text()))
    return out


@pytest.mark.parametrize("proctrack", ["linuxproc", "cgroup"])
def test_scancel_publishes_everything_written_before_the_signal(
        proctrack: str, request: pytest.FixtureRequest, workdir: Path) -> None:
    cluster: Cluster = request.getfixturevalue("cluster" if proctrack == "linuxproc" else "cgroup_cluster")
    run = Run(cluster, workdir, f"scancel-{proctrack}")
    env = run.env("--dist torch --steps 100000 --sleep 0.1 --pad 1000 --file-every 20", interval=3,
                  NPROC_PER_NODE="2")
    job_id = run.submit("torchrun", "-N", "3", "-t", "5", env=env)
    cluster.wait_state(job_id, {"RUNNING"}, 60)
    wait_records(run, 6, 30, timeout=120)
    # at least one periodic batch is out, so the cancel hits a run that has been syncing
    wait_for(lambda: any((run.target / ".opguard-bundles" / "streams").glob("rank-*/*.ogb")), 30, "a periodic batch")
    t_cancel = time.time()
    cluster.run(["scancel", str(job_id)])
    job = cluster.wait(job_id, timeout=60)
    assert job.state == "CANCELLED", job.fields

    # every process of the job is gone (workers too: torchrun's are in their own session)
    wait_for(lambda: not job_processes(cluster), 5, "the job's processes to exit")

    # drained within KillWait: every stream sealed, each seal written before Slurm's SIGKILL
    assert_all_sealed(run.target, RANK_STREAMS_6 | NODE_STREAMS_3)
    for stream, seal in seals(run.target).items():
        assert seal["sealed_at"] - t_cancel < cluster.killwait, (stream, seal["sealed_at"] - t_cancel)

    # everything written before the signal is published; what is published is exactly what was written
    restored = run.restore()
    for r, (_node, d) in run.local_rank_dirs().items():
        local_bytes = (d / "trace.jsonl").read_bytes()
        pub_bytes = (restored / "ranks" / f"rank-{r:06d}" / "trace.jsonl").read_bytes()
        assert local_bytes.startswith(pub_bytes), f"rank {r}: published trace is not a prefix of the local one"
        before = [x["step"] for x in records(d / "trace.jsonl") if x["t"] < t_cancel]
        pub = [json.loads(line)["step"] for line in pub_bytes.splitlines()]
        assert pub[:len(before)] == before, f"rank {r}: records written before scancel missing"
        for f in (d / "tensors").glob("*.bin"):
            if f.stat().st_mtime < t_cancel:
                assert (restored / "ranks" / f"rank-{r:06d}" / "tensors" / f.name).read_bytes() == f.read_bytes()
    (workdir / "measured.json").write_text(json.dumps({
        "proctrack": proctrack, "killwait": cluster.killwait,
        "seal_after_cancel_s": max(s["sealed_at"] for s in seals(run.target).values()) - t_cancel,
        "reports": [r.get("drain") for r in launcher_reports(run)]}, indent=1))


def test_time_limit_warning_drains_before_the_kill(cluster: Cluster, workdir: Path) -> None:
    run = Run(cluster, workdir, "timelimit")
    env = run.env("--steps 100000 --sleep 0.2 --pad 500 --file-every 25", interval=20)
    # -t 2 with the warning 50 s ahead: Slurm's 30 s check loop makes the signal land 50-80 s early
    job_id = run.submit("srun-per-rank", "-N", "3", "--ntasks-per-node=1", "-t", "2", "--signal=B:USR1@50",
                        env=env)
    job = cluster.wait(job_id, timeout=240)
    assert job.state == "TIMEOUT", job.fields
    reports = launcher_reports(run)
    assert len(reports) == 3, reports
    for rep in reports:
        sigs = {s["signal"]: s["at"] for s in rep["signals"]}
        assert "SIGUSR1" in sigs and "SIGTERM" in sigs, rep["signals"]
        assert sigs["SIGUSR1"] < sigs["SIGTERM"], rep["signals"]
        assert rep["drain"]["reason"].startswith("warning"), rep["drain"]
    t_warn = {int(rep["identity"]["rank"]): min(s["at"] for s in rep["signals"] if s["signal"] == "SIGUSR1")
              for rep in reports}
    t_term = min(s["at"] for rep in reports for s in rep["signals"] if s["signal"] == "SIGTERM")
    # the drain started at the warning sealed every rank stream before the time limit's SIGTERM
    sealed_in_window = {}
    for p in (run.target / ".opguard-bundles" / "streams").glob("rank-*/*.seal"):
        s = json.loads(p.read_text())
        r = int(p.parent.name.split("-")[1])
        if t_warn[r] <= s["sealed_at"] < t_term:
            sealed_in_window[r] = s
    assert sorted(sealed_in_window) == [0, 1, 2], "a warning drain did not seal its stream before SIGTERM"
    # ... and that drain holds every record written before the warning
    restored = run.restore()
    for r, (_node, d) in run.local_rank_dirs().items():
        before = [x["step"] for x in records(d / "trace.jsonl") if x["t"] < t_warn[r]]
        pub = [x["step"] for x in records(restored / "ranks" / f"rank-{r:06d}" / "trace.jsonl")]
        assert pub[:len(before)] == before
        assert len(before) > 10
    assert not job_processes(cluster)


def test_wrapper_sigkilled_mid_drain_exit_hook_finishes(cluster: Cluster, workdir: Path) -> None:
    run = Run(cluster, workdir, "sigkill-drain")
    # ~1.5 MB of incompressible files per rank, nothing synced periodically (long interval), then a
    # final drain at 0.5 MiB/s: each node's drain takes several seconds
    env = run.env("--steps 15 --sleep 0.05 --file-every 1 --file-bytes 100000", interval=600, mbps=0.5)
    job_id = run.submit("srun-per-rank", "-N", "3", "--ntasks-per-node=2", "-t", "4", env=env)
    streams = run.target / ".opguard-bundles" / "streams"
    victims = ("rank-000002", "rank-000003")   # node2's ranks (block distribution)

    def uploading() -> bool:
        return any(p.name.startswith(".tmp-") for v in victims for p in (streams / v).glob(".tmp-*"))
    wait_for(uploading, 90, "node2's final drain to be uploading", interval=0.05)
    killed = []
    for p in cluster_pids(cluster):
        try:
            cmd = p.cmdline()
        except psutil.Error:
            continue
        if any(c.endswith("opguard-run") for c in cmd[:2]) and p.environ().get("SLURMD_NODENAME") == "node2":
            tree = [p, *p.children(recursive=True)]
            for q in tree:
                try:
                    os.kill(q.pid, signal.SIGKILL)
                    killed.append(q.pid)
                except ProcessLookupError:
                    pass
    assert killed, "no opguard-run wrapper found on node2"
    not_sealed_at_kill = [v for v in victims if v not in seals(run.target)]
    assert not_sealed_at_kill, "node2 finished its drain before the kill: the test did not interrupt anything"

    job = cluster.wait(job_id, timeout=180)
    assert job.state == "FAILED", job.fields  # srun reported node2's killed tasks
    out = run.output(job_id)
    assert "opguard exit-hook: every node drained" in out, out[-3000:]
    assert "node=node2 rc=0 pending_batches=0" in out, out[-3000:]
    assert run.verify("--require-sealed").returncode == 0
    assert_all_sealed(run.target, RANK_STREAMS_6 | NODE_STREAMS_3)
    restored = run.restore()
    for r, (_node, d) in run.local_rank_dirs().items():
        assert assert_same_tree(d, restored / "ranks" / f"rank-{r:06d}") == 16  # nothing lost or duplicated
    # batch sequences are contiguous from 1 (no batch published twice under two numbers)
    for s in victims:
        seqs = sorted(int(p.name[:12]) for p in (streams / s).glob("*.ogb"))
        assert seqs == list(range(1, len(seqs) + 1)), (s, seqs)


def test_time_limit_without_a_warning_signal_the_countdown_drains(cluster: Cluster, workdir: Path) -> None:
    """A job submitted without --signal: the wrappers ask Slurm for the job's end time (squeue %e,
    never cached) and start the final drain when the time left falls to what the backlog needs
    (at least 30 s), so every rank stream is sealed before the time limit's SIGTERM."""
    run = Run(cluster, workdir, "countdown")
    script = workdir / "no-signal.sbatch"
    text = (Path(__file__).parents[2] / "slurm" / "srun-per-rank.sbatch").read_text()
    assert "#SBATCH --signal=" in text
    script.write_text("\n".join(x for x in text.splitlines() if not x.startswith("#SBATCH --signal=")) + "\n")
    env = run.env("--steps 100000 --sleep 0.2 --pad 500 --file-every 25", interval=20)
    job_id = cluster.sbatch(script, "-o", str(workdir / "job-%j.out"), "-N", "3", "--ntasks-per-node=1",
                            "-t", "1", env=env)
    job = cluster.wait(job_id, timeout=240)
    assert job.state == "TIMEOUT", job.fields
    reports = launcher_reports(run)
    assert len(reports) == 3, reports
    t_term = min(s["at"] for rep in reports for s in rep["signals"] if s["signal"] == "SIGTERM")
    for rep in reports:
        assert not any(s["signal"] == "SIGUSR1" for s in rep["signals"]), rep["signals"]  # no warning came
        assert rep["drain"]["reason"].startswith("job ends in"), rep["drain"]
    sealed = {int(p.parent.name.split("-")[1]) for p in (run.target / ".opguard-bundles" / "streams").glob(
        "rank-*/*.seal") if json.loads(p.read_text())["sealed_at"] < t_term}
    assert sealed == {0, 1, 2}, "the countdown's drain did not seal every rank stream before SIGTERM"
    restored = run.restore()
    for r in run.local_rank_dirs():
        pub = [x["step"] for x in records(restored / "ranks" / f"rank-{r:06d}" / "trace.jsonl")]
        assert len(pub) > 10 and pub == list(range(pub[0], pub[0] + len(pub))), pub[:20]
