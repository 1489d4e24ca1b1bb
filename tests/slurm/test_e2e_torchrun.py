"""slurm/torchrun.sbatch on 3 nodes x 2 ranks: periodic syncs, final drain, restore byte-for-byte."""

from __future__ import annotations

from pathlib import Path

from .conftest import Cluster
from .e2e import Run, assert_all_sealed, assert_same_tree, manifests, records


def test_torchrun_three_nodes_restores_byte_for_byte(cluster: Cluster, workdir: Path) -> None:
    run = Run(cluster, workdir, "e2e-torchrun")
    steps = 40
    env = run.env(f"--dist torch --steps {steps} --sleep 0.25 --file-every 10", interval=3, NPROC_PER_NODE="2")
    job = cluster.wait(run.submit("torchrun", "-N", "3", "-t", "5", env=env), timeout=240)
    out = run.output(job.job_id)
    assert job.state == "COMPLETED" and job.exit_code == "0:0", (job.fields, out[-4000:])

    local = run.local_rank_dirs()
    assert sorted(local) == list(range(6)), local
    assert sorted(node for node, _ in local.values()) == ["node1", "node1", "node2", "node2", "node3", "node3"]
    for r, (_node, d) in local.items():
        recs = records(d / "trace.jsonl")
        assert [x["step"] for x in recs] == list(range(steps)), f"rank {r} wrote {len(recs)} records"

    # periodic syncs ran during the job (not only the final drain): non-final batches exist
    ms = manifests(run.target)
    periodic = [m for m in ms if m["kind"] == "rank" and not m["final"]]
    assert periodic, "no periodic batch was published before the final drain"
    assert_all_sealed(run.target, {f"rank-{r:06d}" for r in range(6)} | {f"node-node{k}" for k in (1, 2, 3)})

    restored = run.restore()
    for r, (node, d) in local.items():
        rd = restored / "ranks" / f"rank-{r:06d}"
        assert assert_same_tree(d, rd) >= 1 + steps // 10
        # the metadata of the node that ran rank r is copied into the rank's directory
        node_copy = rd / "_node"
        assert node_copy.is_dir() and any(node_copy.iterdir()), f"no node metadata in {node_copy}"
        assert node in "".join(p.read_text(errors="replace") for p in node_copy.rglob("*") if p.is_file()), \
            f"rank {r} ran on {node} but its _node/ does not name it"
    assert run.verify("--require-sealed").returncode == 0
