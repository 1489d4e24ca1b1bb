"""Identity resolution: precedence and inconsistency cases for every launcher family."""

from __future__ import annotations

import pytest

from opguard.launcher.identity import is_torchrun, parse_torchrun, resolve

HOST = "node17"


def ident(env: dict[str, str], cmd: tuple[str, ...] = ("python", "app.py")):  # type: ignore[no-untyped-def]
    return resolve(env, cmd, HOST)


def messages(env: dict[str, str], cmd: tuple[str, ...] = ("python", "app.py")) -> str:
    _i, problems = ident(env, cmd)
    return "\n".join(str(p) for p in problems)


def test_no_launcher_is_rank_0_of_1() -> None:
    i, problems = ident({})
    assert problems == []
    assert (i.mode, i.rank, i.world_size, i.local_rank, i.node_index, i.node_count) == ("single", 0, 1, 0, 0, 1)
    assert i.node_id == HOST and i.sources["node_id"] == "hostname"
    assert i.exports()["OPGUARD_RANK"] == "0"


@pytest.mark.parametrize("env,rank,size,lrank,lsize,family", [
    ({"RANK": "3", "WORLD_SIZE": "4", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2", "GROUP_RANK": "1"},
     3, 4, 1, 2, "torchrun"),
    ({"OMPI_COMM_WORLD_RANK": "5", "OMPI_COMM_WORLD_SIZE": "8", "OMPI_COMM_WORLD_LOCAL_RANK": "1",
      "OMPI_COMM_WORLD_LOCAL_SIZE": "4"}, 5, 8, 1, 4, "Open MPI"),
    ({"MV2_COMM_WORLD_RANK": "2", "MV2_COMM_WORLD_SIZE": "4", "MV2_COMM_WORLD_LOCAL_RANK": "0",
      "MV2_COMM_WORLD_LOCAL_SIZE": "2"}, 2, 4, 0, 2, "MVAPICH2"),
    ({"PMI_RANK": "3", "PMI_SIZE": "4", "MPI_LOCALRANKID": "1", "MPI_LOCALNRANKS": "2"}, 3, 4, 1, 2, "Hydra"),
    ({"SLURM_PROCID": "6", "SLURM_NTASKS": "8", "SLURM_LOCALID": "2", "SLURM_NODEID": "1", "SLURM_NNODES": "2",
      "SLURM_STEP_ID": "0", "SLURM_STEP_TASKS_PER_NODE": "4(x2)", "SLURMD_NODENAME": "gpu002"}, 6, 8, 2, 4, "Slurm"),
])
def test_each_family(env: dict[str, str], rank: int, size: int, lrank: int, lsize: int, family: str) -> None:
    i, problems = ident(env)
    assert problems == []
    assert (i.rank, i.world_size, i.local_rank, i.local_world_size) == (rank, size, lrank, lsize)
    assert family in i.sources["rank"]


def test_slurm_node_name_and_index() -> None:
    env = {"SLURM_PROCID": "6", "SLURM_NTASKS": "8", "SLURM_LOCALID": "2", "SLURM_NODEID": "1",
           "SLURM_NNODES": "2", "SLURM_STEP_ID": "0", "SLURM_STEP_TASKS_PER_NODE": "4(x2)",
           "SLURMD_NODENAME": "gpu002"}
    i, _ = ident(env)
    assert (i.node_id, i.node_index, i.node_count) == ("gpu002", 1, 2)


def test_opguard_node_id_overrides_everything() -> None:
    i, _ = ident({"OPGUARD_NODE_ID": "n-a", "SLURMD_NODENAME": "gpu002", "SLURM_STEP_ID": "0",
                  "SLURM_PROCID": "0", "SLURM_NTASKS": "1", "SLURM_LOCALID": "0"})
    assert i.node_id == "n-a" and i.sources["node_id"] == "OPGUARD_NODE_ID"


def test_mpirun_in_batch_step_mpi_wins_over_stale_slurm_procid() -> None:
    """mpirun inside sbatch: every rank inherits the batch shell's SLURM_PROCID=0 (no step ID)."""
    env = {"SLURM_JOB_ID": "12", "SLURM_PROCID": "0", "SLURM_NTASKS": "4", "SLURM_LOCALID": "0",
           "SLURM_NODEID": "0", "SLURMD_NODENAME": "batchhost",
           "PMI_RANK": "3", "PMI_SIZE": "4", "MPI_LOCALRANKID": "1", "MPI_LOCALNRANKS": "2"}
    i, problems = ident(env)
    assert problems == []
    assert i.rank == 3 and i.local_rank == 1
    # the batch host's name propagated by mpirun does not name this rank's node
    assert i.node_id == HOST
    assert any("batch shell" in n for n in i.notes)


def test_srun_pmi2_same_launch_must_agree() -> None:
    base = {"SLURM_STEP_ID": "0", "SLURM_NTASKS": "4", "SLURM_LOCALID": "1", "SLURM_NODEID": "0",
            "PMI_SIZE": "4", "MPI_LOCALRANKID": "1", "MPI_LOCALNRANKS": "2"}
    i, problems = ident({**base, "SLURM_PROCID": "1", "PMI_RANK": "1"})
    assert problems == [] and i.rank == 1
    msg = messages({**base, "SLURM_PROCID": "1", "PMI_RANK": "2"})
    assert "PMI_RANK=2" in msg and "SLURM_PROCID=1" in msg and "disagree" in msg and "fix:" in msg


def test_outer_launch_with_other_size_is_ignored_not_an_error() -> None:
    """Hydra proxies started by srun (one task per node): Slurm's size differs: an outer launch."""
    env = {"SLURM_STEP_ID": "1", "SLURM_PROCID": "1", "SLURM_NTASKS": "2", "SLURM_LOCALID": "0",
           "SLURM_NODEID": "1", "PMI_RANK": "5", "PMI_SIZE": "8", "MPI_LOCALRANKID": "1", "MPI_LOCALNRANKS": "4"}
    i, problems = ident(env)
    assert problems == []
    assert i.rank == 5 and "ignored:Slurm" in i.sources


def test_openmpi_and_pmix_rank_agree_or_fail() -> None:
    base = {"OMPI_COMM_WORLD_RANK": "2", "OMPI_COMM_WORLD_SIZE": "4", "OMPI_COMM_WORLD_LOCAL_RANK": "0",
            "OMPI_COMM_WORLD_LOCAL_SIZE": "2"}
    assert ident({**base, "PMIX_RANK": "2"})[1] == []
    assert "PMIX_RANK=3" in messages({**base, "PMIX_RANK": "3"})


def test_pmix_alone_takes_size_from_agreeing_family() -> None:
    env = {"PMIX_RANK": "1", "SLURM_STEP_ID": "0", "SLURM_PROCID": "1", "SLURM_NTASKS": "2", "SLURM_LOCALID": "1",
           "SLURM_NODEID": "0", "SLURM_NNODES": "1", "SLURM_STEP_TASKS_PER_NODE": "2"}
    i, problems = ident(env)
    assert problems == []
    assert (i.rank, i.world_size, i.local_rank) == (1, 2, 1)


@pytest.mark.parametrize("env,needle", [
    ({"RANK": "4", "WORLD_SIZE": "4", "LOCAL_RANK": "0", "GROUP_RANK": "0"}, "rank >= world size"),
    ({"RANK": "1"}, "without a world size"),
    ({"PMI_RANK": "x", "PMI_SIZE": "4"}, "not an integer"),
    ({"PMI_RANK": "-1", "PMI_SIZE": "4"}, "negative"),
    ({"OMPI_COMM_WORLD_RANK": "1", "OMPI_COMM_WORLD_SIZE": "4", "OMPI_COMM_WORLD_LOCAL_RANK": "2",
      "OMPI_COMM_WORLD_LOCAL_SIZE": "2"}, "local rank >= local world size"),
    ({"RANK": "3", "WORLD_SIZE": "4", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2"}, "local rank without a node"),
    ({"PMIX_RANK": "1"}, "no variable gives the world size"),
    ({"OPGUARD_NODE_INDEX": "2", "OPGUARD_NODE_COUNT": "2"}, "not below OPGUARD_NODE_COUNT"),
    ({"OPGUARD_NODE_ID": "localhost"}, "loopback"),
    ({"OPGUARD_NODE_ID": ""}, "empty"),
    ({"OPGUARD_NODE_ID": "a/b"}, "not a valid node ID"),
])
def test_inconsistent(env: dict[str, str], needle: str) -> None:
    assert needle in messages(env)


def test_loopback_hostname_refused() -> None:
    _i, problems = resolve({}, ("python", "x.py"), "localhost")
    assert problems and "loopback" in str(problems[0]) and "OPGUARD_NODE_ID" in str(problems[0])


def test_block_placement_derives_node_index_for_hydra() -> None:
    i, _ = ident({"PMI_RANK": "3", "PMI_SIZE": "4", "MPI_LOCALRANKID": "1", "MPI_LOCALNRANKS": "2"})
    assert (i.node_index, i.node_count) == (1, 2)
    assert "derived" in i.sources["node_index"]


# ---- torchrun -------------------------------------------------------------------------------

def test_is_torchrun() -> None:
    assert is_torchrun(["/x/.venv/bin/torchrun", "a.py"])
    assert is_torchrun(["python3", "-m", "torch.distributed.run", "a.py"])
    assert not is_torchrun(["python", "a.py"])


def test_parse_torchrun_options() -> None:
    t = parse_torchrun(["torchrun", "--nnodes=1:4", "--node_rank", "2", "--nproc_per_node=8",
                        "--rdzv-backend=c10d", "--rdzv-endpoint", "h:29500", "train.py", "--lr", "1"])
    assert (t.nnodes_min, t.nnodes_max, t.node_rank, t.nproc_per_node, t.rdzv_backend) == (1, 4, 2, 8, "c10d")
    assert t.script == ["train.py", "--lr", "1"]
    t = parse_torchrun(["python", "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "auto", "x.py"])
    assert t.standalone and t.nproc_per_node is None and t.script == ["x.py"]


def test_torchrun_mode_identity() -> None:
    i, problems = ident({}, ("torchrun", "--nnodes=2", "--node-rank=1", "--nproc-per-node=2", "t.py"))
    assert problems == []
    assert (i.mode, i.rank, i.world_size, i.node_index, i.node_count, i.local_world_size) == (
        "torchrun", None, 4, 1, 2, 2)
    assert i.expected_ranks() == [2, 3]
    assert i.owned_ranks() is None  # syncs every rank under the local base
    ex = i.exports()
    assert "OPGUARD_RANK" not in ex and "OPGUARD_LOCAL_RANK" not in ex and ex["OPGUARD_NODE_INDEX"] == "1"


def test_torchrun_node_index_from_slurm_and_conflicts() -> None:
    slurm = {"SLURM_STEP_ID": "3", "SLURM_PROCID": "1", "SLURM_NTASKS": "2", "SLURM_LOCALID": "0",
             "SLURM_NODEID": "1", "SLURM_NNODES": "2", "SLURM_STEP_TASKS_PER_NODE": "1(x2)",
             "SLURMD_NODENAME": "gpu002"}
    i, problems = ident(slurm, ("torchrun", "--nnodes=2", "--nproc-per-node=2", "t.py"))
    assert problems == [] and i.node_index == 1 and i.node_id == "gpu002"
    msg = messages(slurm, ("torchrun", "--nnodes=2", "--node-rank=0", "--nproc-per-node=2", "t.py"))
    assert "--node-rank=0 disagrees with SLURM_NODEID=1" in msg
    msg = messages(slurm, ("torchrun", "--nnodes=3", "--nproc-per-node=2", "t.py"))
    assert "spans 2 nodes" in msg
    two_per_node = {**slurm, "SLURM_NTASKS": "4", "SLURM_STEP_TASKS_PER_NODE": "2(x2)", "SLURM_PROCID": "2"}
    msg = messages(two_per_node, ("torchrun", "--nnodes=2", "--nproc-per-node=2", "t.py"))
    assert "2 agents per node" in msg and "--ntasks-per-node=1" in msg


@pytest.mark.parametrize("cmd,needle", [
    (("torchrun", "--nnodes=2", "--nproc-per-node=2", "t.py"), "which node this is"),
    (("torchrun", "--nnodes=2", "--node-rank=2", "--nproc-per-node=2", "t.py"), "not below torchrun --nnodes=2"),
    (("torchrun", "--nnodes=x", "t.py"), "not an integer"),
    (("torchrun", "--nproc-per-node=2"), "no training program"),
])
def test_torchrun_inconsistent(cmd: tuple[str, ...], needle: str) -> None:
    assert needle in messages({}, cmd)


def test_torchrun_under_mpirun_refused() -> None:
    msg = messages({"PMI_RANK": "0", "PMI_SIZE": "2", "MPI_LOCALRANKID": "0", "MPI_LOCALNRANKS": "2"},
                   ("torchrun", "--nproc-per-node=2", "t.py"))
    assert "once per rank" in msg
