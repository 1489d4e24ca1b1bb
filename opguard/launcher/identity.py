"""Who this process is: rank, world size, local rank, node index and node ID.

Every launcher family describes a process with its own environment variables. This module
reads them all, picks one by a documented precedence (``docs/launcher.md``), and checks the
others against it: a family that describes the *same* launch (same world size) must agree;
one that describes an outer launch (the batch step of an allocation, per-node proxies) is
recorded and ignored. When the wrapper wraps ``torchrun`` it is one process per node, and the
node index and the ranks it owns come from torchrun's own arguments.

Pure functions of (environment, argv, hostname): no I/O, no MPI initialisation.
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from opguard.errors import ConfigError
from opguard.staging.config import is_loopback_id, validate_node_id

# ---------------------------------------------------------------------------------------------
# families


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

# Precedence, highest first (docs/launcher.md). The outer-wrapper family sits right below
# torchrun, as in opguard.staging.layout.RANK_VARIABLES, so the writers agree with the wrapper.
FAMILIES: tuple[Family, ...] = (TORCHRUN, OPGUARD, OPENMPI, MVAPICH2, PMIX, HYDRA, SLURM)
MPI_FAMILIES = (OPENMPI, MVAPICH2, PMIX, HYDRA)


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


# ---------------------------------------------------------------------------------------------
# torchrun arguments


@dataclass(frozen=True)
class TorchrunArgs:
    """The arguments of a wrapped ``torchrun`` that decide which ranks this node owns."""

    nnodes_min: int
    nnodes_max: int
    node_rank: int | None
    nproc_per_node: int | None  # None: "auto"/"gpu"/"cpu", resolved by torchrun itself
    nproc_spec: str
    standalone: bool
    rdzv_backend: str | None
    script: list[str]  # the training program and its arguments (after torchrun's options)


_TORCHRUN_VALUE_OPTS = {
    "--nnodes", "--nproc-per-node", "--nproc_per_node", "--node-rank", "--node_rank", "--rdzv-backend",
    "--rdzv_backend", "--rdzv-endpoint", "--rdzv_endpoint", "--rdzv-id", "--rdzv_id", "--rdzv-conf",
    "--rdzv_conf", "--max-restarts", "--max_restarts", "--monitor-interval", "--monitor_interval",
    "--start-method", "--start_method", "--role", "--master-addr", "--master_addr", "--master-port",
    "--master_port", "--local-addr", "--local_addr", "--log-dir", "--log_dir", "-r", "--redirects",
    "-t", "--tee", "--local-ranks-filter", "--local_ranks_filter", "--logs-specs", "--logs_specs",
    "--signals-to-handle", "--signals_to_handle", "--event-log-handler", "--event_log_handler",
    "--numa-binding", "--numa_binding", "--virtual-local-rank", "--virtual_local_rank",
    "--duplicate-stdout-filters", "--duplicate_stdout_filters", "--duplicate-stderr-filters",
    "--duplicate_stderr_filters",
}
_TORCHRUN_FLAGS = {"--standalone", "--no-python", "--no_python", "-m", "--module", "--run-path", "--run_path"}


def is_torchrun(cmd: Sequence[str]) -> bool:
    """``torchrun ...`` or ``python -m torch.distributed.run ...`` (also ``launch``)."""
    if not cmd:
        return False
    if os.path.basename(cmd[0]) == "torchrun":
        return True
    return (re.fullmatch(r"python[0-9.]*", os.path.basename(cmd[0])) is not None and len(cmd) >= 3
            and cmd[1] == "-m" and cmd[2] in ("torch.distributed.run", "torch.distributed.launch"))


def _int_arg(name: str, raw: str) -> int:
    try:
        value = int(raw)
    except ValueError:
        raise ConfigError(f"torchrun {name}={raw!r} is not an integer", f"pass {name} as a whole number") from None
    if value < 0:
        raise ConfigError(f"torchrun {name}={raw!r} is negative", f"pass a {name} >= 0")
    return value


def parse_torchrun(cmd: Sequence[str]) -> TorchrunArgs:
    """Parse the options of a ``torchrun`` command line (only what decides node and ranks)."""
    args = list(cmd[3:] if cmd[0] != "torchrun" and os.path.basename(cmd[0]) != "torchrun" else cmd[1:])
    values: dict[str, str] = {}
    standalone = False
    i = 0
    while i < len(args):
        a = args[i]
        if not a.startswith("-") or a == "--":
            break
        key, eq, val = a.partition("=")
        if key in _TORCHRUN_FLAGS:
            standalone = standalone or key == "--standalone"
            i += 1
            continue
        if not eq:
            if key not in _TORCHRUN_VALUE_OPTS or i + 1 >= len(args):
                i += 1  # an option we do not know: torchrun will judge it
                continue
            val = args[i + 1]
            i += 2
        else:
            i += 1
        values[key.replace("_", "-")] = val
    script = args[i + 1:] if i < len(args) and args[i] == "--" else args[i:]
    nnodes = values.get("--nnodes", "1")
    lo, _, hi = nnodes.partition(":")
    nmin = _int_arg("--nnodes", lo)
    nmax = _int_arg("--nnodes", hi) if hi else nmin
    if nmin < 1 or nmax < nmin:
        raise ConfigError(f"torchrun --nnodes={nnodes!r} is not a valid N or MIN:MAX", "pass --nnodes=N or MIN:MAX")
    node_rank = _int_arg("--node-rank", values["--node-rank"]) if "--node-rank" in values else None
    spec = values.get("--nproc-per-node", "1")
    nproc = None if spec in ("auto", "gpu", "cpu", "xpu") else _int_arg("--nproc-per-node", spec)
    if nproc == 0:
        raise ConfigError("torchrun --nproc-per-node=0 starts no workers", "pass --nproc-per-node >= 1")
    return TorchrunArgs(nmin, nmax, node_rank, nproc, spec, standalone, values.get("--rdzv-backend"), script)


# ---------------------------------------------------------------------------------------------
# resolution


@dataclass
class Identity:
    """The resolved identity of this wrapper (and what it exports to its child)."""

    mode: str  # "torchrun" (one wrapper per node), "rank" (one wrapper per rank), "single"
    rank: int | None  # None in torchrun mode: workers get their ranks from torchrun
    world_size: int | None
    local_rank: int
    local_world_size: int | None
    node_index: int | None
    node_count: int | None
    node_id: str
    sources: dict[str, str] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)
    torchrun: TorchrunArgs | None = None

    @property
    def node_duty(self) -> bool:
        """Whether this wrapper runs the node's duties (metadata, node stream): local rank 0."""
        return self.local_rank == 0

    def owned_ranks(self) -> list[int] | None:
        """Global ranks whose streams this wrapper syncs; None: every rank under the local base."""
        if self.mode == "torchrun":
            return None
        assert self.rank is not None
        return [self.rank]

    def expected_ranks(self) -> list[int] | None:
        """torchrun with a static rendezvous: the ranks this node's workers will get."""
        t = self.torchrun
        if t is None or self.node_index is None or t.nproc_per_node is None or t.nnodes_min != t.nnodes_max:
            return None
        if t.rdzv_backend not in (None, "static") and not t.standalone and t.nnodes_max > 1:
            return None
        n = t.nproc_per_node
        return list(range(self.node_index * n, (self.node_index + 1) * n))

    def exports(self) -> dict[str, str]:
        """Environment variables for the child (``docs/launcher.md``)."""
        out = {"OPGUARD_NODE_ID": self.node_id, "OPGUARD_LOCAL_RANK": str(self.local_rank)}
        if self.rank is not None:
            out["OPGUARD_RANK"] = str(self.rank)
        for key, val in (("OPGUARD_WORLD_SIZE", self.world_size), ("OPGUARD_LOCAL_WORLD_SIZE", self.local_world_size),
                         ("OPGUARD_NODE_INDEX", self.node_index), ("OPGUARD_NODE_COUNT", self.node_count)):
            if val is not None:
                out[key] = str(val)
        if self.mode == "torchrun":
            del out["OPGUARD_LOCAL_RANK"]  # each worker has its own LOCAL_RANK
        return out

    def as_dict(self) -> dict[str, object]:
        return {
            "mode": self.mode, "rank": self.rank, "world_size": self.world_size, "local_rank": self.local_rank,
            "local_world_size": self.local_world_size, "node_index": self.node_index,
            "node_count": self.node_count, "node_id": self.node_id, "sources": dict(self.sources),
            "notes": list(self.notes), "expected_ranks": self.expected_ranks(),
        }


class Problems:
    """Collects every problem instead of stopping at the first."""

    def __init__(self) -> None:
        self.items: list[ConfigError] = []

    def add(self, message: str, fix: str) -> None:
        self.items.append(ConfigError(message, fix))

    def extend(self, errs: Sequence[ConfigError]) -> None:
        self.items.extend(errs)

    def __bool__(self) -> bool:
        return bool(self.items)


def _get_int(env: Mapping[str, str], name: str | None, problems: Problems) -> int | None:
    if name is None:
        return None
    raw = env.get(name)
    if raw is None or raw.strip() == "":
        return None
    try:
        value = int(raw.strip())
    except ValueError:
        problems.add(f"{name}={raw!r} is not an integer", f"unset {name} or fix the launcher that sets it")
        return None
    if value < 0:
        problems.add(f"{name}={raw!r} is negative", f"unset {name} or fix the launcher that sets it")
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
class _Overrides:
    node_id: str | None
    node_index: int | None
    node_count: int | None


def _overrides(env: Mapping[str, str], problems: Problems) -> _Overrides:
    node_id = env.get("OPGUARD_NODE_ID")
    if node_id is not None:
        node_id = node_id.strip()
        try:
            validate_node_id("OPGUARD_NODE_ID", node_id)
        except ConfigError as e:
            problems.items.append(e)
            node_id = None
    idx = _get_int(env, "OPGUARD_NODE_INDEX", problems)
    cnt = _get_int(env, "OPGUARD_NODE_COUNT", problems)
    if cnt is not None and cnt < 1:
        problems.add(f"OPGUARD_NODE_COUNT={cnt} must be >= 1", "set OPGUARD_NODE_COUNT to the number of nodes")
        cnt = None
    if idx is not None and cnt is not None and idx >= cnt:
        problems.add(f"OPGUARD_NODE_INDEX={idx} is not below OPGUARD_NODE_COUNT={cnt}",
                     "node indices run from 0 to OPGUARD_NODE_COUNT-1")
    return _Overrides(node_id, idx, cnt)


def _node_id(env: Mapping[str, str], ov: _Overrides, slurm_trusted: bool, hostname: str,
             problems: Problems, sources: dict[str, str]) -> str:
    if ov.node_id:
        sources["node_id"] = "OPGUARD_NODE_ID"
        return ov.node_id
    name = env.get("SLURMD_NODENAME", "").strip()
    if name and slurm_trusted:
        sources["node_id"] = "SLURMD_NODENAME"
        candidate, var = name, "SLURMD_NODENAME"
    else:
        sources["node_id"] = "hostname"
        candidate, var = hostname.split(".")[0] if not is_loopback_id(hostname) else hostname, "hostname"
    try:
        return validate_node_id(f"{var} (set OPGUARD_NODE_ID to override)", candidate)
    except ConfigError as e:
        problems.items.append(e)
        return candidate or "?"


def resolve(env: Mapping[str, str] | None = None, cmd: Sequence[str] = (), hostname: str | None = None,
            ) -> tuple[Identity, list[ConfigError]]:
    """Resolve the identity; returns it with every problem found (empty: consistent)."""
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
    # Slurm describes this process when it won or agreed (same launch) with the winner.
    slurm_trusted = slurm is not None and (winner is slurm or f"ignored:{SLURM.name}" not in sources)
    node_id = _node_id(env, ov, slurm_trusted, hostname, problems, sources)

    if is_torchrun(cmd):
        ident = _resolve_torchrun(cmd, env, ov, winner, slurm if slurm_trusted else None, node_id, problems,
                                  sources, notes)
    else:
        ident = _resolve_rank(winner, readings, ov, slurm if slurm_trusted else None, node_id, problems,
                              sources, notes)
    return ident, problems.items


def _resolve_rank(winner: Reading | None, readings: list[Reading], ov: _Overrides, slurm: Reading | None,
                  node_id: str, problems: Problems, sources: dict[str, str], notes: list[str]) -> Identity:
    if winner is None:
        sources["rank"] = "none (a lone process is rank 0 of 1)"
        return Identity("single", 0, 1, 0, 1, ov.node_index if ov.node_index is not None else 0,
                        ov.node_count if ov.node_count is not None else 1, node_id, sources, notes)
    f = winner.family
    sources["rank"] = f"{f.rank} ({f.name})"
    size = winner.size
    if size is None:  # PMIx gives no size: take it from a family that agrees on the rank
        for r in readings[1:]:
            if r.size is not None and r.rank == winner.rank:
                size = r.size
                sources["world_size"] = f"{r.family.size} ({r.family.name})"
                break
        else:
            problems.add(f"{f.rank}={winner.rank} is set but no variable gives the world size",
                         "launch through a launcher that also exports the world size (srun, mpiexec, torchrun)")
    else:
        sources["world_size"] = f"{f.size} ({f.name})"
    local_rank, local_size = winner.local_rank, winner.local_size
    if local_rank is not None:
        sources["local_rank"] = f"{f.local_rank} ({f.name})"
    elif slurm is not None and slurm.local_rank is not None:
        local_rank, local_size = slurm.local_rank, slurm.local_size
        sources["local_rank"] = "SLURM_LOCALID (Slurm)"
    else:
        problems.add(f"{f.name} gives rank {winner.rank} but no local rank: the node's metadata uploader "
                     "(local rank 0) cannot be chosen",
                     "launch with a launcher that exports a local rank (srun, mpiexec, torchrun)")
        local_rank = 0
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
    return Identity("rank", winner.rank, size, local_rank, local_size, node_index, node_count, node_id,
                    sources, notes)


def _resolve_torchrun(cmd: Sequence[str], env: Mapping[str, str], ov: _Overrides, winner: Reading | None,
                      slurm: Reading | None, node_id: str, problems: Problems, sources: dict[str, str],
                      notes: list[str]) -> Identity:
    try:
        t = parse_torchrun(cmd)
    except ConfigError as e:
        problems.items.append(e)
        t = TorchrunArgs(1, 1, None, 1, "1", False, None, [])
    if winner is not None and winner.family is not SLURM:
        problems.add(f"opguard-run wraps torchrun but {winner.family.rank}={winner.rank} ({winner.family.name}) "
                     "says this process is one rank of a parallel launch: torchrun would start its workers "
                     "once per rank", "start one opguard-run torchrun per node (e.g. srun -n $SLURM_NNODES "
                     "--ntasks-per-node=1 opguard-run torchrun ...), not under mpirun")
    node_count = t.nnodes_max
    sources["node_count"] = "torchrun --nnodes" + (" (MAX of MIN:MAX)" if t.nnodes_min != t.nnodes_max else "")
    node_index: int | None = None
    if t.node_rank is not None:
        node_index = t.node_rank
        sources["node_index"] = "torchrun --node-rank"
    if slurm is not None:
        if slurm.local_size is not None and slurm.local_size > 1:
            problems.add(f"Slurm runs {slurm.local_size} tasks of this step on this node, so torchrun would start "
                         f"{slurm.local_size} agents per node (srun ignores --ntasks-per-node=1 it cannot honour)",
                         "run srun -n \"$SLURM_NNODES\" --ntasks-per-node=1 opguard-run torchrun ...")
        if slurm.node_index is not None:
            if node_index is not None and node_index != slurm.node_index:
                problems.add(f"torchrun --node-rank={node_index} disagrees with SLURM_NODEID={slurm.node_index}",
                             "drop --node-rank under srun, or pass --node-rank=$SLURM_NODEID")
            elif node_index is None:
                node_index = slurm.node_index
                sources["node_index"] = "SLURM_NODEID (Slurm)"
        if slurm.node_count is not None and not t.nnodes_min <= slurm.node_count <= t.nnodes_max:
            spec = f"{t.nnodes_min}:{t.nnodes_max}" if t.nnodes_max != t.nnodes_min else str(t.nnodes_min)
            problems.add(f"torchrun --nnodes={spec} but this srun step spans {slurm.node_count} nodes",
                         "pass --nnodes=$SLURM_NNODES")
    if ov.node_index is not None:
        if node_index is not None and node_index != ov.node_index:
            problems.add(f"OPGUARD_NODE_INDEX={ov.node_index} disagrees with {sources['node_index']}={node_index}",
                         "unset OPGUARD_NODE_INDEX")
        node_index = ov.node_index
        sources["node_index"] = "OPGUARD_NODE_INDEX"
    if ov.node_count is not None and not t.nnodes_min <= ov.node_count <= t.nnodes_max:
        problems.add(f"OPGUARD_NODE_COUNT={ov.node_count} is outside torchrun --nnodes={t.nnodes_min}:{t.nnodes_max}",
                     "unset OPGUARD_NODE_COUNT or fix --nnodes")
    if node_index is None:
        if t.nnodes_max == 1 or t.standalone:
            node_index = 0
            sources["node_index"] = "single node (--nnodes=1/--standalone)"
        else:
            problems.add(f"torchrun --nnodes={t.nnodes_max} but nothing says which node this is",
                         "pass --node-rank=K, run under srun (SLURM_NODEID), or set OPGUARD_NODE_INDEX=K")
    if node_index is not None and node_index >= node_count:
        problems.add(f"node index {node_index} ({sources.get('node_index')}) is not below "
                     f"torchrun --nnodes={node_count}",
                     "fix --node-rank / --nnodes")
    world = t.nproc_per_node * node_count if t.nproc_per_node is not None and t.nnodes_min == t.nnodes_max else None
    if t.nproc_per_node is None:
        notes.append(f"--nproc-per-node={t.nproc_spec}: torchrun decides the worker count")
    if t.rdzv_backend == "c10d" or t.nnodes_min != t.nnodes_max:
        notes.append("ranks are assigned at rendezvous: the wrapper syncs every rank directory under its local base")
    if not t.script:
        problems.add("opguard-run torchrun: no training program after torchrun's options",
                     "opguard-run torchrun --nproc-per-node=N train.py ...")
    return Identity("torchrun", None, world, 0, t.nproc_per_node, node_index, node_count, node_id, sources,
                    notes, torchrun=t)
