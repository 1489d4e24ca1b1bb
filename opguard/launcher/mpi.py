"""In-process MPI identity for MPI programs (mpi4py, imported lazily inside the function only).

The wrapper never initialises MPI; a program that already uses MPI can call
:func:`mpi_identity` to get its local rank and node index from the communicator itself
(``Split_type(COMM_TYPE_SHARED)``: the ranks that share memory are one node) and to check that
every node uses a node ID no other node uses. Every rank takes part in every collective and
reaches the same verdict, so a refusal raises on all ranks alike (no rank is left waiting).
"""

from __future__ import annotations

import os
import socket
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from opguard.errors import ConfigError, IdentityError
from opguard.staging.config import validate_node_id


@dataclass(frozen=True)
class MpiIdentity:
    rank: int
    world_size: int
    local_rank: int
    local_world_size: int
    node_index: int
    node_count: int
    node_id: str
    notes: tuple[str, ...] = field(default=())


def local_node_id(env: Mapping[str, str] | None = None) -> str:
    """OPGUARD_NODE_ID (what opguard-run exported), else SLURMD_NODENAME, else the hostname."""
    env = os.environ if env is None else env
    for name in ("OPGUARD_NODE_ID", "SLURMD_NODENAME"):
        value = env.get(name, "").strip()
        if value:
            return value
    return socket.gethostname().split(".")[0]


def env_notes(rank: int, world: int, local_rank: int, node_index: int, env: Mapping[str, str]) -> list[str]:
    """Where opguard-run's exports disagree with what the communicator says."""
    notes = []
    for var, mine in (("OPGUARD_RANK", rank), ("OPGUARD_WORLD_SIZE", world), ("OPGUARD_LOCAL_RANK", local_rank),
                      ("OPGUARD_NODE_INDEX", node_index)):
        raw = env.get(var)
        if raw is not None and raw.strip().isdigit() and int(raw) != mine:
            notes.append(f"{var}={raw} (from opguard-run) differs from MPI's {mine}")
    return notes


def node_id_problem(ids: list[tuple[int, str]]) -> tuple[str, str] | None:
    """From every rank's (node index, node ID): (message, fix) or None. Pure, the same on every rank."""
    by_index: dict[int, set[str]] = {}
    nodes_of: dict[str, set[int]] = {}
    for idx, nid in ids:
        by_index.setdefault(idx, set()).add(nid)
        nodes_of.setdefault(nid, set()).add(idx)
    for i, names in sorted(by_index.items()):
        if len(names) > 1:
            return (f"the ranks of node {i} (one shared-memory group) use different node IDs {sorted(names)}",
                    "export one OPGUARD_NODE_ID per node (opguard-run does), not per rank")
    for n, ix in sorted(nodes_of.items()):
        if len(ix) > 1:
            return (f"node ID {n!r} is used by {len(ix)} different nodes (shared-memory groups {sorted(ix)}): "
                    "two nodes would upload as one", "give every node a unique OPGUARD_NODE_ID (e.g. $SLURMD_NODENAME)")
    return None


def mpi_identity(comm: Any = None, env: Mapping[str, str] | None = None, *, strict: bool = True) -> MpiIdentity:
    """Collective: rank, local rank/size, node index/count and node ID from the communicator.

    Raises :class:`IdentityError` (on every rank alike) when node IDs are not unique across nodes
    or differ within one node; with ``strict``, also when opguard-run's rank/local rank exports
    disagree with MPI on any rank (the wrapper and the program would sync different streams).
    The node index exported by a wrapper that assumed block placement is only noted.
    """
    from mpi4py import MPI  # lazily: importing this module never initialises MPI

    env = os.environ if env is None else env
    world = MPI.COMM_WORLD if comm is None else comm
    rank, size = world.Get_rank(), world.Get_size()
    node = world.Split_type(MPI.COMM_TYPE_SHARED, key=rank)
    try:
        local_rank, local_size = node.Get_rank(), node.Get_size()
        leaders = world.Split(0 if local_rank == 0 else MPI.UNDEFINED, key=rank)
        mine = None
        if local_rank == 0:
            mine = (leaders.Get_rank(), leaders.Get_size())
            leaders.Free()
        node_index, node_count = node.bcast(mine, root=0)
    finally:
        node.Free()
    nid = local_node_id(env)
    try:
        validate_node_id("node ID", nid)
        bad = None
    except ConfigError as e:
        bad = str(e)
    notes = env_notes(rank, size, local_rank, node_index, env)
    gathered = world.allgather((node_index, nid, bad, notes))
    first_bad = next((b for _i, _n, b, _no in gathered if b), None)
    if first_bad:
        raise IdentityError(f"a rank's node ID is invalid: {first_bad}", "set OPGUARD_NODE_ID per node")
    problem = node_id_problem([(i, n) for i, n, _b, _no in gathered])
    if problem is not None:
        raise IdentityError(*problem)
    rank_notes = [n for _i, _n, _b, no in gathered for n in no if not n.startswith("OPGUARD_NODE_INDEX")]
    if strict and rank_notes:
        raise IdentityError("; ".join(rank_notes[:4]),
                            "start opguard-run under the same launcher as the program (one wrapper per rank)")
    return MpiIdentity(rank, size, local_rank, local_size, node_index, node_count, nid, tuple(notes))
