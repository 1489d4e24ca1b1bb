"""Who this process is: the one table of launcher families and the one resolver of rank, world
size, local rank, node index and node ID (``docs/launcher.md`` §1).

Every launcher family describes a process with its own environment variables. This module reads
them all, picks one by the documented precedence, and checks the others against it: a family that
describes the *same* launch (same world size) must agree; one that describes an outer launch (the
batch step of an allocation, per-node proxies) is recorded and ignored. Slurm's variables describe
a process only when it is an srun task.

Everything that needs a rank uses this module: the writers (``layout.current_rank`` /
``current_node_id``), the capture session, ``opguard sync`` and the launcher, whose
``opguard.launcher.identity.resolve`` adds torchrun's per-node mode and the plan on top of
:func:`resolve_process`. Pure functions of (environment, hostname): no I/O, no MPI initialisation.
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from dataclasses import dataclass, field

from opguard.errors import ConfigError
from opguard.staging.config import is_loopback_id, validate_node_id

# ---------------------------------------------------------------------------------------------
# the table


@dataclass(frozen=True)
class Family:
    """How one launcher family names rank, size, local rank/size and node index/count."""

    name: str
    rank: str
    size: str | None
    local_rank: str | None = None
    local_size: str | None = None
    node_index: str | None = None
    node_count: str | None = None


TORCHRUN = Family("torchrun", "RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK", None)
OPGUARD = Family("opguard-run (outer wrapper)", "OPGUARD_RANK", "OPGUARD_WORLD_SIZE", "OPGUARD_LOCAL_RANK",
                 "OPGUARD_LOCAL_WORLD_SIZE", None, None)
OPENMPI = Family("Open MPI", "OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_LOCAL_RANK",
                 "OMPI_COMM_WORLD_LOCAL_SIZE")
MVAPICH2 = Family("MVAPICH2", "MV2_COMM_WORLD_RANK", "MV2_COMM_WORLD_SIZE", "MV2_COMM_WORLD_LOCAL_RANK",
                  "MV2_COMM_WORLD_LOCAL_SIZE")
PMIX = Family("PMIx", "PMIX_RANK", None)
HYDRA = Family("MPICH/Hydra/Intel MPI", "PMI_RANK", "PMI_SIZE", "MPI_LOCALRANKID", "MPI_LOCALNRANKS")
SLURM = Family("Slurm", "SLURM_PROCID", "SLURM_NTASKS", "SLURM_LOCALID", None, "SLURM_NODEID", "SLURM_NNODES")

# Precedence, highest first (docs/launcher.md §1). A torchrun worker's own RANK comes first (the
# wrapper's OPGUARD_RANK describes the wrapper, not its workers), then what an outer opguard-run
# exported, then the launchers' native variables; Slurm last and only for srun tasks.
FAMILIES: tuple[Family, ...] = (TORCHRUN, OPGUARD, OPENMPI, MVAPICH2, PMIX, HYDRA, SLURM)
# Launchers that start processes on other machines with this environment (SLURMD_NODENAME included).
MPI_FAMILIES: tuple[Family, ...] = (OPENMPI, MVAPICH2, PMIX, HYDRA)


@dataclass(frozen=True)
class Reading:
    """What one family says about this process (``None``: that family does not say)."""

    family: Family
    rank: int
    size: int | None
    local_rank: int | None
    local_size: int | None
    node_index: int | None
    node_count: int | None


class Problems:
    """Collects every problem instead of stopping at the first. ``invalid``: the subset that are
    malformed launcher variables (not an integer, negative), which no process can run with."""

    def __init__(self) -> None:
        self.items: list[ConfigError] = []
        self.invalid: list[ConfigError] = []

    def add(self, message: str, fix: str) -> None:
        self.items.append(ConfigError(message, fix))

    def __bool__(self) -> bool:
        return bool(self.items)


def _get_int(env: Mapping[str, str], name: str | None, problems: Problems, launcher: bool = True) -> int | None:
    """``launcher``: a launcher family's variable (a malformed one is also ``problems.invalid``)."""
    if name is None:
        return None
    raw = env.get(name)
    if raw is None or raw.strip() == "":
        return None
    try:
        value = int(raw.strip())
    except ValueError:
        problems.add(f"{name}={raw!r} is not an integer", f"unset {name} or fix the launcher that sets it")
        problems.invalid.extend(problems.items[-1:] if launcher else [])
        return None
    if value < 0:
        problems.add(f"{name}={raw!r} is negative", f"unset {name} or fix the launcher that sets it")
        problems.invalid.extend(problems.items[-1:] if launcher else [])
        return None
    return value


def slurm_is_step_task(env: Mapping[str, str]) -> bool:
    """True when Slurm's task variables describe *this* process (an srun task).

    The batch shell of an allocation has SLURM_PROCID=0 too, and ``mpirun`` inside it passes
    that to every rank; only srun tasks carry a step ID.
    """
    step = env.get("SLURM_STEP_ID", env.get("SLURM_STEPID", "")).strip()
    return step.isdigit()


def _slurm_tasks_per_node(env: Mapping[str, str]) -> int | None:
    """This node's task count from SLURM_STEP_TASKS_PER_NODE / SLURM_TASKS_PER_NODE ("2(x3),1")."""
    raw = env.get("SLURM_STEP_TASKS_PER_NODE") or env.get("SLURM_TASKS_PER_NODE")
    node = env.get("SLURM_NODEID", "").strip()
    if not raw or not node.isdigit():
        return None
    counts: list[int] = []
    for part in raw.split(","):
        m = re.fullmatch(r"(\d+)(?:\(x(\d+)\))?", part.strip())
        if not m:
            return None
        counts.extend([int(m.group(1))] * int(m.group(2) or 1))
    idx = int(node)
    return counts[idx] if idx < len(counts) else None


def read_family(env: Mapping[str, str], fam: Family, problems: Problems) -> Reading | None:
    """What ``fam`` says about this process, or None when its rank variable is absent."""
    if fam is SLURM and not slurm_is_step_task(env):
        return None
    rank = _get_int(env, fam.rank, problems)
    if rank is None:
        return None
    size = _get_int(env, fam.size, problems)
    if fam is SLURM:
        size = _get_int(env, "SLURM_STEP_NUM_TASKS", problems) or size
    local_rank = _get_int(env, fam.local_rank, problems)
    local_size = _get_int(env, fam.local_size, problems)
    if fam is SLURM:
        local_size = _slurm_tasks_per_node(env)
    node_index = _get_int(env, fam.node_index, problems)
    node_count = _get_int(env, fam.node_count, problems)
    if fam is SLURM:
        node_count = _get_int(env, "SLURM_STEP_NUM_NODES", problems) or node_count
    r = Reading(fam, rank, size, local_rank, local_size, node_index, node_count)
    _check_reading(r, problems)
    return r


def _check_reading(r: Reading, problems: Problems) -> None:
    f = r.family
    if f.size and r.size is None:
        problems.add(f"{f.rank}={r.rank} is set but {f.size} is not: a rank without a world size",
                     f"set {f.size} too, or unset {f.rank}")
    if r.size is not None and r.size < 1:
        problems.add(f"{f.size}={r.size}: a world size must be >= 1", f"fix {f.size}")
    if r.size is not None and r.rank >= r.size:
        problems.add(f"{f.rank}={r.rank} is not below {f.size}={r.size}: rank >= world size",
                     f"fix the launcher variables ({f.rank} must be 0..{max(0, r.size - 1)})")
    if r.local_rank is not None and r.local_size is not None and r.local_rank >= r.local_size:
        problems.add(f"{f.local_rank}={r.local_rank} is not below {f.local_size}={r.local_size}: "
                     "local rank >= local world size", f"fix {f.local_rank} / {f.local_size}")
    if r.local_size is not None and r.size is not None and r.local_size > r.size:
        problems.add(f"{f.local_size}={r.local_size} exceeds {f.size}={r.size}", f"fix {f.local_size}")
    if r.node_index is not None and r.node_count is not None and r.node_index >= r.node_count:
        problems.add(f"{f.node_index}={r.node_index} is not below {f.node_count}={r.node_count}",
                     f"fix {f.node_index} / {f.node_count}")
    if f is TORCHRUN and r.local_rank is not None and r.node_index is None and (
            r.size is None or r.local_size is None or r.size > r.local_size):
        problems.add(f"LOCAL_RANK={r.local_rank} is set but GROUP_RANK is not: a local rank without a node "
                     "in a multi-node job", "set GROUP_RANK (torchrun sets it for its workers) or unset LOCAL_RANK")


def _agree(winner: Reading, other: Reading, problems: Problems, sources: dict[str, str], notes: list[str]) -> None:
    """Compare a lower-precedence family with the winner (docs/launcher.md, "disagreements")."""
    w, o = winner.family, other.family
    if winner.size is None:  # PMIx gives no size: a family that agrees on the rank describes the same launch
        same_launch = other.rank == winner.rank
    else:
        same_launch = (other.size is not None and other.size == winner.size) or (
            other.size is None and o is PMIX and w in (OPENMPI, OPGUARD))
    if not same_launch:
        notes.append(f"{o.name} variables ({o.rank}={other.rank}, world size {other.size}) describe an outer "
                     f"launch (world size differs from {w.name}'s {winner.size}); ignored")
        sources[f"ignored:{o.name}"] = f"{o.rank}={other.rank}"
        return
    pairs = ((w.rank, winner.rank, o.rank, other.rank),
             (w.local_rank, winner.local_rank, o.local_rank, other.local_rank),
             (w.local_size, winner.local_size, o.local_size, other.local_size),
             (w.node_index, winner.node_index, o.node_index, other.node_index))
    for wn, wv, on, ov in pairs:
        if wv is not None and ov is not None and wv != ov:
            problems.add(f"{wn}={wv} ({w.name}) and {on}={ov} ({o.name}) describe the same launch of "
                         f"{winner.size} processes but disagree",
                         f"launch with one launcher, or unset the stale {o.name} variables (e.g. {on})")


@dataclass
class Overrides:
    """The ``OPGUARD_NODE_*`` variables, validated."""

    node_id: str | None
    node_index: int | None
    node_count: int | None


def _overrides(env: Mapping[str, str], problems: Problems) -> Overrides:
    node_id = env.get("OPGUARD_NODE_ID")
    if node_id is not None:
        node_id = node_id.strip()
        try:
            validate_node_id("OPGUARD_NODE_ID", node_id)
        except ConfigError as e:
            problems.items.append(e)
            node_id = None
    idx = _get_int(env, "OPGUARD_NODE_INDEX", problems, launcher=False)
    cnt = _get_int(env, "OPGUARD_NODE_COUNT", problems, launcher=False)
    if cnt is not None and cnt < 1:
        problems.add(f"OPGUARD_NODE_COUNT={cnt} must be >= 1", "set OPGUARD_NODE_COUNT to the number of nodes")
        cnt = None
    if idx is not None and cnt is not None and idx >= cnt:
        problems.add(f"OPGUARD_NODE_INDEX={idx} is not below OPGUARD_NODE_COUNT={cnt}",
                     "node indices run from 0 to OPGUARD_NODE_COUNT-1")
    return Overrides(node_id, idx, cnt)


@dataclass
class Environment:
    """Every family read from one environment, the winner by precedence, and the node ID.

    ``slurm``: Slurm's reading when it describes this process (an srun task that won or agreed
    with the winner), else None. ``node_id_error``: why the node ID is not usable (also in
    ``problems``)."""

    overrides: Overrides
    readings: list[Reading]
    winner: Reading | None
    slurm: Reading | None
    node_id: str
    node_id_error: ConfigError | None
    problems: Problems
    sources: dict[str, str] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)


def _node_id(env: Mapping[str, str], ov: Overrides, name_trusted: bool, hostname: str,
             problems: Problems, sources: dict[str, str]) -> tuple[str, ConfigError | None]:
    if ov.node_id:
        sources["node_id"] = "OPGUARD_NODE_ID"
        return ov.node_id, None
    name = env.get("SLURMD_NODENAME", "").strip()
    if name and name_trusted:
        sources["node_id"] = "SLURMD_NODENAME"
        candidate, var = name, "SLURMD_NODENAME"
    else:
        sources["node_id"] = "hostname"
        candidate, var = hostname.split(".")[0] if not is_loopback_id(hostname) else hostname, "hostname"
    try:
        return validate_node_id(f"{var} (set OPGUARD_NODE_ID to override)", candidate), None
    except ConfigError as e:
        problems.items.append(e)
        return candidate or "?", e


def read_environment(env: Mapping[str, str] | None = None, hostname: str | None = None) -> Environment:
    """Read every family, pick the winner, check the others against it, and resolve the node ID."""
    env = os.environ if env is None else env
    hostname = os.uname().nodename if hostname is None else hostname
    problems = Problems()
    sources: dict[str, str] = {}
    notes: list[str] = []
    ov = _overrides(env, problems)
    readings = [r for r in (read_family(env, f, problems) for f in FAMILIES) if r is not None]
    slurm = next((r for r in readings if r.family is SLURM), None)
    if not slurm_is_step_task(env) and env.get("SLURM_PROCID"):
        notes.append("SLURM_PROCID without a step ID belongs to the batch shell of the allocation; ignored")
    winner = readings[0] if readings else None
    for other in readings[1:]:
        assert winner is not None
        _agree(winner, other, problems, sources, notes)
    # Slurm describes this process when it won or agreed (same launch) with the winner. Its node
    # name is also this machine's when no MPI launcher started the process (the batch shell, what it
    # runs directly, torchrun's workers); an MPI launcher passes the batch host's on to other nodes.
    slurm_trusted = slurm is not None and (winner is slurm or f"ignored:{SLURM.name}" not in sources)
    name_trusted = slurm_trusted or not any(r.family in MPI_FAMILIES for r in readings)
    node_id, node_id_error = _node_id(env, ov, name_trusted, hostname, problems, sources)
    return Environment(ov, readings, winner, slurm if slurm_trusted else None, node_id, node_id_error, problems,
                       sources, notes)


# ---------------------------------------------------------------------------------------------
# one process


@dataclass(frozen=True)
class ProcessIdentity:
    """Who one process is (one rank of a launch, or a lone process: rank 0 of 1)."""

    rank: int
    world_size: int | None
    local_rank: int
    local_world_size: int | None
    node_index: int | None
    node_count: int | None
    node_id: str


@dataclass
class Resolution:
    """:func:`resolve_process`'s answer: the identity, with the source of every number, notes and
    every problem (empty: consistent). ``environment``: what it was derived from."""

    identity: ProcessIdentity
    environment: Environment

    @property
    def problems(self) -> list[ConfigError]:
        return self.environment.problems.items

    @property
    def sources(self) -> dict[str, str]:
        return self.environment.sources

    @property
    def notes(self) -> list[str]:
        return self.environment.notes


def resolve_process(env: Mapping[str, str] | None = None, hostname: str | None = None) -> Resolution:
    """This process as one rank of its launch (``docs/launcher.md`` §1), with every problem."""
    e = read_environment(env, hostname)
    winner, ov, sources = e.winner, e.overrides, e.sources
    if winner is None:
        sources["rank"] = "none (a lone process is rank 0 of 1)"
        return Resolution(ProcessIdentity(0, 1, 0, 1, ov.node_index if ov.node_index is not None else 0,
                                          ov.node_count if ov.node_count is not None else 1, e.node_id), e)
    f = winner.family
    sources["rank"] = f"{f.rank} ({f.name})"
    size = _world_size(e, winner)
    local_rank, local_size = _local_rank(e, winner)
    node_index, node_count = _node_index(e, winner, size, local_rank, local_size)
    return Resolution(ProcessIdentity(winner.rank, size, local_rank, local_size, node_index, node_count,
                                      e.node_id), e)


def _world_size(e: Environment, winner: Reading) -> int | None:
    """The winner's world size, or (PMIx gives none) that of a family that agrees on the rank."""
    f, sources = winner.family, e.sources
    size = winner.size
    if size is None:  # PMIx gives no size: take it from a family that agrees on the rank
        for r in e.readings[1:]:
            if r.size is not None and r.rank == winner.rank:
                size = r.size
                sources["world_size"] = f"{r.family.size} ({r.family.name})"
                break
        else:
            e.problems.add(f"{f.rank}={winner.rank} is set but no variable gives the world size",
                           "launch through a launcher that also exports the world size (srun, mpiexec, torchrun)")
    else:
        sources["world_size"] = f"{f.size} ({f.name})"
    return size


def _local_rank(e: Environment, winner: Reading) -> tuple[int, int | None]:
    """The winner's local rank and local world size, else Slurm's; a problem (and 0) without one."""
    f, slurm, sources = winner.family, e.slurm, e.sources
    local_rank, local_size = winner.local_rank, winner.local_size
    if local_rank is not None:
        sources["local_rank"] = f"{f.local_rank} ({f.name})"
    elif slurm is not None and slurm.local_rank is not None:
        local_rank, local_size = slurm.local_rank, slurm.local_size
        sources["local_rank"] = "SLURM_LOCALID (Slurm)"
    else:
        e.problems.add(f"{f.name} gives rank {winner.rank} but no local rank: the node's metadata uploader "
                       "(local rank 0) cannot be chosen",
                       "launch with a launcher that exports a local rank (srun, mpiexec, torchrun)")
        local_rank = 0
    return local_rank, local_size


def _node_index(e: Environment, winner: Reading, size: int | None, local_rank: int,
                local_size: int | None) -> tuple[int | None, int | None]:
    """Node index and count: the winner's, else Slurm's; OPGUARD_NODE_INDEX/COUNT checked against
    them and taken; else derived from block placement where the numbers allow it."""
    f, ov, slurm, problems, sources, notes = winner.family, e.overrides, e.slurm, e.problems, e.sources, e.notes
    node_index, node_count = winner.node_index, winner.node_count
    if node_index is not None:
        sources["node_index"] = f"{f.node_index} ({f.name})"
    elif slurm is not None and slurm.node_index is not None:
        node_index, node_count = slurm.node_index, slurm.node_count
        sources["node_index"] = "SLURM_NODEID (Slurm)"
    if ov.node_index is not None:
        if node_index is not None and node_index != ov.node_index:
            problems.add(f"OPGUARD_NODE_INDEX={ov.node_index} disagrees with {sources['node_index']}={node_index}",
                         "unset OPGUARD_NODE_INDEX (the launcher already says which node this is)")
        node_index = ov.node_index
        sources["node_index"] = "OPGUARD_NODE_INDEX"
    if ov.node_count is not None:
        if node_count is not None and node_count != ov.node_count:
            problems.add(f"OPGUARD_NODE_COUNT={ov.node_count} disagrees with the launcher's node count "
                         f"{node_count}", "unset OPGUARD_NODE_COUNT")
        node_count = ov.node_count
    if node_index is None and size is not None and local_size and local_rank is not None \
            and size % local_size == 0 and winner.rank % local_size == local_rank:
        node_index, node_count = winner.rank // local_size, size // local_size
        sources["node_index"] = f"derived: rank // local world size (block placement of {f.name} ranks)"
        notes.append("node index derived assuming block placement; set OPGUARD_NODE_INDEX/OPGUARD_NODE_COUNT or "
                     "use opguard.launcher.mpi.mpi_identity() in the program for the exact value")
    if node_index is None:
        notes.append("node index unknown: the sync stagger uses a jitter from the node ID only")
    return node_index, node_count


def process_identity(env: Mapping[str, str] | None = None, hostname: str | None = None) -> ProcessIdentity:
    """For the writers, capture and ``opguard sync`` inside a program: the same resolution as the
    launcher's, raising only what no process can run with: a malformed launcher variable (not an
    integer, negative). Disagreements between families are the launcher's
    preflight to refuse (exit 2 before the program starts); here the winner by precedence stands."""
    res = resolve_process(env, hostname)
    bad = res.environment.problems.invalid
    if bad:
        raise bad[0]
    return res.identity
