"""Real mpiexec (MPICH from PyPI, Hydra) with one opguard-run per rank, and the mpi4py helper."""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path

import pytest

from tests.conftest import BIN
from tests.launcher.helpers import OPGUARD, OPGUARD_RUN, PY

MPIEXEC = BIN / "mpiexec"
APP = str(Path(__file__).parent / "progs" / "mpi_app.py")

pytestmark = [pytest.mark.mpi]


@pytest.fixture(autouse=True)
def _need_mpi() -> None:
    if not MPIEXEC.exists():
        pytest.skip("mpiexec (the mpich wheel) is not installed in this virtualenv: pip install '.[mpi]'")
    try:
        import mpi4py  # noqa: F401
    except ImportError:
        pytest.skip("mpi4py is not installed: pip install '.[mpi]'")


def mpiexec(args: list[str], env: dict[str, str], timeout: float = 180) -> subprocess.CompletedProcess[str]:
    return subprocess.run([str(MPIEXEC), *args], env=env, capture_output=True, text=True, timeout=timeout)


def helper_code(out: Path) -> str:
    """Each rank writes its helper result to OUT/<rank>.json (ranks' stdout lines can be glued)."""
    return ("import json; from opguard.launcher.mpi import mpi_identity; i = mpi_identity(); "
            f"open('{out}/%d.json' % i.rank, 'w').write(json.dumps(i.__dict__, default=list))")


def results(out: Path) -> list[dict[str, object]]:
    return [json.loads((out / f"{r}.json").read_text()) for r in range(len(list(out.iterdir())))]


def helper(env: dict[str, str], out: Path, *hydra: str) -> subprocess.CompletedProcess[str]:
    out.mkdir()
    return mpiexec([*hydra, PY, "-c", helper_code(out)], env)


def test_helper_one_node(staging_env: dict[str, str], tmp_path: Path) -> None:
    env = {k: v for k, v in staging_env.items() if k != "OPGUARD_NODE_ID"}
    r = helper(env, tmp_path / "out", "-n", "4")
    assert r.returncode == 0, r.stderr
    ids = results(tmp_path / "out")
    assert [(d["rank"], d["local_rank"], d["local_world_size"], d["node_index"], d["node_count"]) for d in ids] == [
        (0, 0, 4, 0, 1), (1, 1, 4, 0, 1), (2, 2, 4, 0, 1), (3, 3, 4, 0, 1)]


def test_helper_two_fake_hosts(staging_env: dict[str, str], tmp_path: Path) -> None:
    env = {k: v for k, v in staging_env.items() if k != "OPGUARD_NODE_ID"}
    out = tmp_path / "out"
    out.mkdir()
    code = helper_code(out)
    r = mpiexec(["-launcher", "fork", "-hosts", "nodeA,nodeB", "-ppn", "2",
                 "-n", "2", "-env", "OPGUARD_NODE_ID", "node-a", PY, "-c", code, ":",
                 "-n", "2", "-env", "OPGUARD_NODE_ID", "node-b", PY, "-c", code], env)
    assert r.returncode == 0, r.stderr
    ids = results(out)
    assert [(d["rank"], d["local_rank"], d["node_index"], d["node_count"], d["node_id"]) for d in ids] == [
        (0, 0, 0, 2, "node-a"), (1, 1, 0, 2, "node-a"), (2, 0, 1, 2, "node-b"), (3, 1, 1, 2, "node-b")]


def test_helper_refuses_one_node_id_on_two_nodes(staging_env: dict[str, str], tmp_path: Path) -> None:
    """Two shared-memory groups, both with this machine's hostname as node ID: refused on every rank."""
    env = {k: v for k, v in staging_env.items() if k != "OPGUARD_NODE_ID"}
    r = helper(env, tmp_path / "out", "-launcher", "fork", "-hosts", "nodeA,nodeB", "-ppn", "2", "-n", "4")
    assert r.returncode != 0
    assert r.stderr.count("is used by 2 different nodes") == 4, r.stderr


def test_wrapper_per_rank_two_fake_nodes(staging_env: dict[str, str], tmp_path: Path) -> None:
    env = {k: v for k, v in staging_env.items() if k not in ("OPGUARD_NODE_ID", "OPGUARD_LOCAL_DUMP_BASE")}
    bases = {n: tmp_path / f"local-{n}" for n in ("node-a", "node-b")}
    args: list[str] = ["-launcher", "fork", "-hosts", "nodeA,nodeB", "-ppn", "2"]
    for i, (node, base) in enumerate(bases.items()):
        base.mkdir()
        args += [*([":"] if i else []), "-n", "2", "-env", "OPGUARD_NODE_ID", node,
                 "-env", "OPGUARD_LOCAL_DUMP_BASE", str(base), OPGUARD_RUN, PY, APP]
    r = mpiexec(args, env)
    assert r.returncode == 0, r.stderr
    assert r.stderr.count("drain complete") == 4
    dest = tmp_path / "restored"
    m = subprocess.run([OPGUARD, "materialize", "--require-sealed", env["OPGUARD_LOCAL_DUMP_TARGET"], str(dest)],
                       env=env, capture_output=True, text=True, timeout=120)
    assert m.returncode == 0, m.stderr
    for rank in range(4):
        node = "node-a" if rank < 2 else "node-b"
        rd = dest / "ranks" / f"rank-{rank:06d}"
        ident = json.loads((rd / "identity.json").read_text())
        assert (ident["rank"], ident["local_rank"], ident["node_index"], ident["node_id"]) == (
            rank, rank % 2, rank // 2, node)
        assert ident["env"]["OPGUARD_RANK"] == str(rank) and ident["env"]["OPGUARD_LOCAL_RANK"] == str(rank % 2)
        assert ident["env"]["OPGUARD_NODE_INDEX"] == str(rank // 2)  # derived (block placement) and confirmed
        assert len((rd / "trace.jsonl").read_text().splitlines()) == 20
        assert (rd / "trace.jsonl").read_bytes() == (bases[node] / "ranks" / rd.name / "trace.jsonl").read_bytes()
        assert json.loads((rd / "_node" / "node.json").read_text())["node_id"] == node
    # node duties ran once per node (local rank 0): one node stream each
    bundles = Path(env["OPGUARD_LOCAL_DUMP_TARGET"]) / ".opguard-bundles"
    streams = sorted(p.name for p in (bundles / "streams").iterdir())
    assert streams == ["node-node-a", "node-node-b", *[f"rank-{r:06d}" for r in range(4)]]


def test_wrapper_precedence_under_mpiexec_with_stale_batch_slurm_vars(staging_env: dict[str, str],
                                                                      tmp_path: Path) -> None:
    """mpirun inside sbatch: the batch shell's SLURM_PROCID=0 reaches every rank; MPI wins."""
    env = {**staging_env, "SLURM_JOB_ID": "42", "SLURM_PROCID": "0", "SLURM_NTASKS": "4", "SLURM_LOCALID": "0",
           "SLURMD_NODENAME": "batchhost"}
    out = tmp_path / "plans"
    out.mkdir()
    r = mpiexec(["-n", "4", "sh", "-c", f'exec "$0" --plan --json "$@" > {out}/$PMI_RANK.json', OPGUARD_RUN,
                 PY, APP], env)
    assert r.returncode == 0, r.stderr
    plans = [json.loads((out / f"{i}.json").read_text()) for i in range(4)]
    assert [p["identity"]["rank"] for p in plans] == [0, 1, 2, 3]
    assert all("PMI_RANK" in p["identity"]["sources"]["rank"] for p in plans)
    assert [p["identity"]["local_rank"] for p in plans] == [0, 1, 2, 3]


def test_wrapper_refuses_inconsistent_srun_pmi_vars(staging_env: dict[str, str], tmp_path: Path) -> None:
    """A step task (SLURM_STEP_ID set) of the same size whose SLURM_PROCID disagrees with PMI_RANK."""
    env = {**staging_env, "SLURM_STEP_ID": "0", "SLURM_PROCID": "0", "SLURM_NTASKS": "2", "SLURM_LOCALID": "0"}
    marker = tmp_path / "ran"
    r = mpiexec(["-n", "2", OPGUARD_RUN, PY, "-c", f"open('{marker}-' + __import__('os').environ['PMI_RANK'], 'w')"],
                env)
    assert r.returncode != 0
    assert "PMI_RANK=1 (MPICH/Hydra/Intel MPI) and SLURM_PROCID=0 (Slurm)" in r.stderr
    assert Path(f"{marker}-0").exists() and not Path(f"{marker}-1").exists()


def test_mpiexec_found() -> None:
    assert shutil.which(str(MPIEXEC))
