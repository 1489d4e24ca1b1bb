"""slurm/exit-hook.sh as a plain step after srun: bounded in time, reports what is unpublished,
and a second run finishes the drain (resumable, nothing lost or duplicated)."""

from __future__ import annotations

import subprocess
from pathlib import Path

from .conftest import APPS, BIN, SLURM_DIR, Cluster
from .e2e import Run, assert_all_sealed, assert_same_tree


def test_exit_hook_is_bounded_and_resumable(cluster: Cluster, workdir: Path) -> None:
    run = Run(cluster, workdir, "exit-hook")
    script = workdir / "hook.sbatch"
    # ranks write ~2 MB of incompressible files each through the writers API, with no wrapper:
    # nothing is published until the hook runs
    script.write_text(f"""#!/bin/bash
export PATH={BIN}:$PATH OPGUARD_LOCAL_DUMP_ENABLED=1 OPGUARD_LOCAL_DUMP_TARGET={run.target}
export OPGUARD_TRACE_OUTPUT_BASE={run.target} OPGUARD_LOCAL_DUMP_BASE={run.local_base}
mkdir -p {run.target}
srun -n "$SLURM_NNODES" --ntasks-per-node=1 mkdir -p {run.local_base}
srun python {APPS}/trace_app.py --steps 20 --sleep 0 --file-every 1 --file-bytes 100000
echo "== hook 1"
OPGUARD_SYNC_MBPS=0.2 OPGUARD_EXIT_HOOK_TIMEOUT=3 {SLURM_DIR}/exit-hook.sh; echo "hook1 rc=$?"
echo "== hook 2"
OPGUARD_SYNC_MBPS=100 {SLURM_DIR}/exit-hook.sh; echo "hook2 rc=$?"
""")
    job = cluster.wait(cluster.sbatch(script, "-N", "2", "--ntasks-per-node=1", "-t", "3",
                                      "-o", str(workdir / "job-%j.out")), timeout=150)
    out = (workdir / f"job-{job.job_id}.out").read_text()
    assert job.state == "COMPLETED", (job.fields, out[-3000:])
    first, second = out.split("== hook 2")
    assert "hook1 rc=1" in first and "did not finish within 3 s" in first, first[-2000:]
    assert "hook2 rc=0" in second and "every node drained: nothing left unpublished" in second, second[-2000:]
    assert second.count("pending_batches=0") == 2, second[-2000:]
    assert_all_sealed(run.target, {"rank-000000", "rank-000001"})
    restored = run.restore()
    for r, (_node, d) in run.local_rank_dirs().items():
        assert assert_same_tree(d, restored / "ranks" / f"rank-{r:06d}") == 21


def test_exit_hook_outside_slurm_names_the_fix(tmp_path: Path) -> None:
    p = subprocess.run([str(SLURM_DIR / "exit-hook.sh")], capture_output=True, text=True, timeout=30,
                       env={"PATH": "/usr/bin:/bin"})
    assert p.returncode == 1
    assert "SLURM_JOB_ID is not set" in p.stderr and "fix:" in p.stderr
