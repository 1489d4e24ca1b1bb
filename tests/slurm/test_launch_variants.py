"""The other templates: one wrapper per rank under srun (with the stagger measured across nodes),
an MPI program under srun --mpi=pmi2 and under mpirun inside an allocation."""

from __future__ import annotations

from pathlib import Path
from statistics import median

import pytest

from .conftest import BIN, Cluster
from .e2e import Run, assert_all_sealed, assert_same_tree, manifests


def _check_restore(run: Run, ranks: int, nodes: set[str]) -> None:
    local = run.local_rank_dirs()
    assert sorted(local) == list(range(ranks)), local
    assert {n for n, _ in local.values()} == nodes
    assert_all_sealed(run.target, {f"rank-{r:06d}" for r in range(ranks)} | {f"node-{n}" for n in nodes})
    restored = run.restore()
    for r, (node, d) in local.items():
        rd = restored / "ranks" / f"rank-{r:06d}"
        assert assert_same_tree(d, rd) >= 2
        assert any((rd / "_node").rglob("*")), f"rank {r}: no metadata of {node}"


def test_srun_per_rank_and_stagger(cluster: Cluster, workdir: Path) -> None:
    run = Run(cluster, workdir, "per-rank")
    interval = 6.0
    env = run.env("--steps 120 --sleep 0.2 --file-every 30", interval=interval)
    job = cluster.wait(run.submit("srun-per-rank", "-N", "3", "--ntasks-per-node=2", "-t", "3", env=env), 180)
    assert job.state == "COMPLETED", (job.fields, run.output(job.job_id)[-3000:])
    _check_restore(run, 6, {"node1", "node2", "node3"})

    # stagger: periodic (non-final) rank batches, by the node that built them
    by_node: dict[str, list[float]] = {}
    for m in manifests(run.target):
        if m["kind"] == "rank" and not m["final"]:
            by_node.setdefault(m["node_id"], []).append(m["created_at"])
    assert sorted(by_node) == ["node1", "node2", "node3"], by_node
    slot = interval / 3
    # phase of each periodic batch within the interval, per node: nodes sit at distinct phases
    phases = {n: median(t % interval for t in ts) for n, ts in by_node.items()}
    gaps = []
    order = sorted(phases, key=phases.__getitem__)
    for a, b in zip(order, order[1:] + order[:1], strict=True):
        gaps.append((phases[b] - phases[a]) % interval)
    # a perfect stagger gives gaps of one slot (2 s); lock-step would give ~0. The syncs run at nice 19,
    # so on a busy machine a node's batches are built up to ~1.4 s after its slot (smallest gaps seen:
    # 0.65 s and 0.70 s at load 1-7, the other gaps 1.0-4.3 s): the bound is a quarter of a slot
    assert min(gaps) > 0.25 * slot, (phases, gaps)
    # and no two nodes' periodic batches were created at the same moment
    nearest = [min(abs(t - u) for m, us in by_node.items() if m != n for u in us)
               for n, ts in by_node.items() for t in ts]
    assert median(nearest) > 0.3 * slot, nearest
    (workdir / "stagger.txt").write_text(f"phases={phases} gaps={gaps} median_nearest={median(nearest):.2f}\n")


@pytest.mark.parametrize("template", ["mpi-pmi2", "mpirun"])
def test_mpi_variants(cluster: Cluster, workdir: Path, template: str) -> None:
    run = Run(cluster, workdir, template)
    env = run.env("--dist mpi --steps 30 --sleep 0.2 --file-every 10", interval=3, MPIRUN=str(BIN / "mpiexec"))
    job = cluster.wait(run.submit(template, "-N", "2", "--ntasks-per-node=2", "-t", "3", env=env), 180)
    assert job.state == "COMPLETED", (job.fields, run.output(job.job_id)[-3000:])
    _check_restore(run, 4, {"node1", "node2"})
