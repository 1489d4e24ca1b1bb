"""Real torchrun (CPU torch, gloo) under opguard-run: one node, two simulated nodes, SIGTERM."""

from __future__ import annotations

import json
import signal
import socket
import subprocess
from pathlib import Path

import pytest

from tests.conftest import BIN
from tests.launcher.helpers import OPGUARD, OPGUARD_RUN, pid_alive, spawn, wait_for

TORCHRUN = str(BIN / "torchrun")
APP = str(Path(__file__).parent / "progs" / "ddp_app.py")

pytestmark = [pytest.mark.torch]


@pytest.fixture(autouse=True)
def _need_torch() -> None:
    if not Path(TORCHRUN).exists():
        pytest.skip("torchrun is not installed in this virtualenv (pip install torch, CPU build)")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def materialize(env: dict[str, str], dest: Path) -> Path:
    r = subprocess.run([OPGUARD, "materialize", "--require-sealed", env["OPGUARD_LOCAL_DUMP_TARGET"], str(dest)],
                       env=env, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    return dest


def torchrun(nnodes: int, node_rank: int, port: int, *app: str) -> list[str]:
    return [TORCHRUN, f"--nnodes={nnodes}", f"--node-rank={node_rank}", "--nproc-per-node=2",
            "--master-addr=127.0.0.1", f"--master-port={port}", APP, *app]


def test_one_wrapper_two_workers(staging_env: dict[str, str], tmp_path: Path) -> None:
    env = {**staging_env, "OMP_NUM_THREADS": "1"}
    r = subprocess.run([OPGUARD_RUN, *torchrun(1, 0, free_port(), "20")], env=env, capture_output=True,
                       text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    dest = materialize(env, tmp_path / "restored")
    local = Path(env["OPGUARD_LOCAL_DUMP_BASE"]) / "ranks"
    for rank in (0, 1):
        rd = dest / "ranks" / f"rank-{rank:06d}"
        assert (rd / "steps.jsonl").read_bytes() == (local / rd.name / "steps.jsonl").read_bytes()
        assert len((rd / "steps.jsonl").read_text().splitlines()) == 20
        ident = json.loads((rd / "identity.json").read_text())
        assert ident["rank"] == rank and ident["env"]["OPGUARD_NODE_ID"] == "node-a"
        assert json.loads((rd / "_node" / "node.json").read_text())["node_id"] == "node-a"
    # the source index names the program torchrun ran
    index = json.loads((dest / "nodes" / "node-a" / "source-index.json").read_text())
    assert any(f["path"] == "ddp_app.py" and f["program"] for f in index["files"])
    doc = json.loads((Path(env["OPGUARD_LOCAL_DUMP_BASE"]) / "state" / "launcher" / "node-node-a.json").read_text())
    assert doc["identity"]["mode"] == "torchrun" and doc["drain"]["status"] == "complete"
    assert sorted(doc["drain"]["sealed_streams"]) == ["node-node-a", "rank-000000", "rank-000001"]


def test_two_simulated_nodes_one_shared_target(staging_env: dict[str, str], tmp_path: Path) -> None:
    port = free_port()
    procs = []
    for k, node in enumerate(("node-a", "node-b")):
        base = tmp_path / f"local-{node}"
        base.mkdir()
        env = {**staging_env, "OPGUARD_NODE_ID": node, "OPGUARD_LOCAL_DUMP_BASE": str(base), "OMP_NUM_THREADS": "1"}
        procs.append(spawn(torchrun(2, k, port, "15"), env))
    outs = [p.communicate(timeout=300) for p in procs]
    for p, (_o, e) in zip(procs, outs, strict=True):
        assert p.returncode == 0, e
    dest = materialize(staging_env, tmp_path / "restored")
    for rank in range(4):
        node = "node-a" if rank < 2 else "node-b"
        rd = dest / "ranks" / f"rank-{rank:06d}"
        local = tmp_path / f"local-{node}" / "ranks" / rd.name / "steps.jsonl"
        assert (rd / "steps.jsonl").read_bytes() == local.read_bytes()
        ident = json.loads((rd / "identity.json").read_text())
        assert ident["world"] == 4 and ident["env"]["OPGUARD_NODE_INDEX"] == str(rank // 2)
        assert json.loads((rd / "_node" / "node.json").read_text())["node_id"] == node
    assert sorted(p.name for p in (dest / "nodes").iterdir()) == ["node-a", "node-b"]


def test_sigterm_to_torchrun_wrapper(staging_env: dict[str, str], tmp_path: Path) -> None:
    out = tmp_path / "out"
    out.mkdir()
    env = {**staging_env, "OMP_NUM_THREADS": "1", "OPGUARD_LOCAL_DUMP_SYNC_INTERVAL": "3600"}
    p = spawn(["--kill-grace", "30", *torchrun(1, 0, free_port(), "0", str(out))], env)
    wait_for(lambda: (out / "ready-0").exists() and (out / "ready-1").exists(), 180, "both workers to train")
    workers = [int((out / f"ready-{r}").read_text()) for r in (0, 1)]
    p.send_signal(signal.SIGTERM)
    _o, err = p.communicate(timeout=300)
    doc = json.loads((Path(env["OPGUARD_LOCAL_DUMP_BASE"]) / "state" / "launcher" / "node-node-a.json").read_text())
    # torchrun's own exit status on SIGTERM (observed: 1), passed through exactly; never 0
    assert p.returncode == doc["exit_code"] != 0, err
    rc = doc["child_returncode"]
    assert p.returncode == (128 - rc if rc < 0 else rc)
    assert "final drain requested (SIGTERM)" in err and doc["drain"]["status"] == "complete"
    assert not any(pid_alive(w) for w in workers)
    dest = materialize(env, tmp_path / "restored")
    local = Path(env["OPGUARD_LOCAL_DUMP_BASE"]) / "ranks"
    for rank in (0, 1):
        name = f"rank-{rank:06d}"
        restored = (dest / "ranks" / name / "steps.jsonl").read_bytes()
        assert restored == (local / name / "steps.jsonl").read_bytes() and restored


def test_wrapper_inside_torchrun_workers_uses_torchrun_family(staging_env: dict[str, str], tmp_path: Path) -> None:
    """torchrun --no-python opguard-run ...: each worker's wrapper resolves RANK/LOCAL_RANK/GROUP_RANK."""
    out = tmp_path / "plans"
    out.mkdir()
    env = {**staging_env, "OMP_NUM_THREADS": "1", "PMI_RANK": "0", "PMI_SIZE": "1"}  # a stale outer launch
    r = subprocess.run([TORCHRUN, "--nnodes=1", "--nproc-per-node=2", f"--master-port={free_port()}",
                        "--no-python", "sh", "-c", f'exec "$0" --plan --json "$@" > {out}/$RANK.json', OPGUARD_RUN,
                        "true"], env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    for rank in (0, 1):
        ident = json.loads((out / f"{rank}.json").read_text())["identity"]
        assert (ident["mode"], ident["rank"], ident["world_size"], ident["local_rank"], ident["node_index"]) == (
            "rank", rank, 2, rank, 0)
        assert ident["sources"]["rank"] == "RANK (torchrun)"
        assert "ignored:MPICH/Hydra/Intel MPI" in ident["sources"]  # other world size: an outer launch
