"""The test cluster itself: several nodes, node-local /local-ssd, a torchrun job across nodes."""

from __future__ import annotations

from pathlib import Path

from .conftest import APPS, BIN, Cluster

# gloo aborts so in two upstream races, no opguard involved: pytorch/gloo#162 (connect at start-up) and
# pytorch/pytorch#190489 (a worker thread at interpreter exit; see tests/capture/test_torchrun.py)
GLOO_ABORT = "terminate called without an active exception"


def test_sbatch_and_srun_reach_every_node(cluster: Cluster, workdir: Path) -> None:
    script = workdir / "hostname.sbatch"
    script.write_text("#!/bin/bash\nsrun hostname | sort\n")
    job = cluster.wait(cluster.sbatch(script, "-N", "3", "--ntasks-per-node=2", "-t", "2",
                                      "-o", str(workdir / "out-%j.txt")), timeout=60)
    assert job.state == "COMPLETED", job.fields
    lines = (workdir / f"out-{job.job_id}.txt").read_text().split()
    assert lines == ["node1", "node1", "node2", "node2", "node3", "node3"]


def test_local_ssd_is_node_local(cluster: Cluster, workdir: Path) -> None:
    cmd = 'echo "$(hostname) $(cat /local-ssd/WHOAMI)" > /local-ssd/mark-$SLURM_JOB_ID; ls /local-ssd'
    p = cluster.run(["srun", "-N", "3", "-t", "1", "--label", "bash", "-c", cmd])
    for k in (1, 2, 3):
        node = f"node{k}"
        marks = sorted(cluster.local_ssd(node).glob("mark-*"))
        assert len(marks) == 1, (node, marks)
        assert marks[0].read_text() == f"{node} {node}\n"
    # each node sees its own disk only: exactly one mark file listed per task
    assert p.stdout.count("mark-") == 3, p.stdout
    # and the root namespace does not see any node's /local-ssd content
    assert not Path("/local-ssd/WHOAMI").exists()


def test_torchrun_across_two_nodes(cluster: Cluster, workdir: Path) -> None:
    script = workdir / "ddp.sbatch"
    script.write_text(f"""#!/bin/bash
set -e
FIRST=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -1)
PORT=$((29500 + SLURM_JOB_ID % 1000))
# --max-restarts=1: a cluster smoke test, not a gloo test (under heavy load a gloo worker once
# aborted at connect, "terminate called without an active exception", and the other node waited
# for the time limit); a restart re-runs the whole group and the assertions below still hold
srun -n "$SLURM_NNODES" --ntasks-per-node=1 {BIN}/torchrun --nnodes="$SLURM_NNODES" --nproc-per-node=2 \\
  --max-restarts=1 --rdzv-backend=c10d --rdzv-endpoint="$FIRST:$PORT" --rdzv-id="$SLURM_JOB_ID" \\
  {APPS}/ddp_check.py {workdir}
""")
    for attempt in (1, 2):
        # waited past the job's 3-minute limit: when torchrun's restart hangs too (the peer waits in the
        # new rendezvous), the limit ends the job and the second attempt runs; a shorter wait raised
        # while the job still held both nodes, and the next test's job got other nodes (CI, session 18)
        job = cluster.wait(cluster.sbatch(script, "-N", "2", "--ntasks-per-node=1", "-t", "3",
                                          "-o", str(workdir / "out-%j.txt")), timeout=240)
        out = (workdir / f"out-{job.job_id}.txt").read_text()
        # one new job when gloo aborted at connect (pytorch/gloo#162) and torchrun's own restart of the
        # group across the two nodes failed too (seen once in CI here: the restarted peer refused)
        if job.state == "COMPLETED" or GLOO_ABORT not in out or attempt == 2:
            break
        for r in range(4):
            (workdir / f"rank{r}.txt").unlink(missing_ok=True)
    assert job.state == "COMPLETED", (job.fields, out[-3000:])
    rows = sorted((workdir / f"rank{r}.txt").read_text().split() for r in range(4))
    assert [r[:2] for r in rows] == [[str(r), "4"] for r in range(4)]
    assert {r[2] for r in rows} == {"node1", "node2"}
    assert all(r[3] == "6" for r in rows)  # 0+1+2+3
    assert all(sorted(r[4].split(",")) == ["node1", "node1", "node2", "node2"] for r in rows)
