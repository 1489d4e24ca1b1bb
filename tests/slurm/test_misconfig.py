"""Misconfiguration is caught before the job runs: the job fails fast with the message naming the
problem, the program never starts, and the shared target is untouched."""

from __future__ import annotations

from pathlib import Path

import pytest

from .conftest import Cluster
from .e2e import Run


def _target_snapshot(target: Path) -> list[str]:
    return sorted(str(p.relative_to(target)) for p in target.rglob("*")) if target.exists() else []


@pytest.mark.parametrize("case", ["local-base-in-target", "local-base-on-shared", "same-node-id"])
def test_misconfiguration_fails_fast_and_leaves_the_target_untouched(
        cluster: Cluster, workdir: Path, case: str) -> None:
    run = Run(cluster, workdir, f"misconfig-{case}")
    extra: dict[str, str] = {}
    if case == "local-base-in-target":
        # the "local" base points into the shared target (a common copy-paste slip)
        extra["LOCAL_BASE"] = str(run.target / "local")
        expect = ["OPGUARD_LOCAL_DUMP_BASE", "OPGUARD_LOCAL_DUMP_TARGET"]
    elif case == "local-base-on-shared":
        # the "local" base is a directory of the shared filesystem, beside the target. The shared
        # filesystem of a real cluster is Lustre/GPFS/NFS, which cannot exist here: the one fake is
        # the mount table opguard-run reads, the real one plus a Lustre mount of the shared dir.
        shared_local = workdir / "not-local"
        shared_local.mkdir()
        mountinfo = workdir / "mountinfo"
        mountinfo.write_text(Path("/proc/self/mountinfo").read_text()
                             + f"999 1 0:999 / {cluster.shared} rw,relatime - lustre 10.213.0.1@tcp:/scratch rw\n")
        extra["LOCAL_BASE"] = str(shared_local)
        extra["OPGUARD_RUN_ARGS"] = f"--mountinfo {mountinfo}"
        expect = ["OPGUARD_LOCAL_DUMP_BASE", "lustre"]
    else:
        # one OPGUARD_NODE_ID exported for the whole job: every node claims the same identity
        extra["OPGUARD_NODE_ID"] = "trainer"
        expect = ["trainer"]
    marker = workdir / "app-started"
    env = run.env(f"--steps 5 --sleep 0.1 --started {marker}", interval=3, extra=extra)
    job = cluster.wait(run.submit("srun-per-rank", "-N", "3", "--ntasks-per-node=1", "-t", "2", env=env), 120)
    out = run.output(job.job_id)
    assert job.state == "FAILED", (job.fields, out[-3000:])
    assert "opguard-run" in out and all(e in out for e in expect), out[-3000:]
    assert "exit 2" in out or "Exited with exit code 2" in out, out[-3000:]
    if case != "same-node-id":
        # refused everywhere before anything ran: no program, nothing on the target
        assert not marker.exists(), "the program started although the configuration was refused"
        assert not (run.target / ".opguard-bundles").exists(), _target_snapshot(run.target)
    else:
        # The node that claims 'trainer' first is stopped too: the refused nodes record conflict
        # markers beside the claim, and its syncs (none before a settle time) find one before they
        # upload anything. Every node exits 2; no batch reaches the target.
        refused = out.count("already claimed on the target by another machine")
        assert refused == 2, out[-3000:]
        assert out.count("recorded the node ID conflict") == 2, out[-3000:]
        # the first claimant's wrapper; the exit hook's `opguard sync` on its node refuses alike
        assert out.count("opguard-run: error: node ID 'trainer' is also used by 2 other machine(s)") == 1, out[-3000:]
        started = marker.read_text().splitlines() if marker.exists() else []
        assert len(started) <= 1, "a refused node started its program"
        bundles = run.target / ".opguard-bundles"
        assert sorted(p.name for p in bundles.iterdir()) == ["nodes"], _target_snapshot(run.target)
        nodes = bundles / "nodes"  # the claim and the two refused nodes' markers, nothing else
        assert sorted(p.name for p in nodes.iterdir()) == ["trainer.conflicts", "trainer.json"], \
            _target_snapshot(run.target)
        assert len(list((nodes / "trainer.conflicts").glob("*.json"))) == 2, _target_snapshot(run.target)
