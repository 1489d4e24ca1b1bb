"""Who this wrapper is: the identity staging resolves, plus torchrun's per-node mode and the plan.

The launcher families, their precedence, the srun-task rule and the per-rank resolution live in
``opguard.staging.identity`` (one table; the writers and capture use the same function). This
module adds what only the wrapper needs: when it wraps ``torchrun`` it is one process per node,
and the node index and the ranks it owns come from torchrun's own arguments; and the
:class:`Identity` the plan prints and the wrapper exports.

Pure functions of (environment, argv, hostname): no I/O, no MPI initialisation.
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from opguard.errors import ConfigError
from opguard.staging.identity import SLURM, Environment, Problems, Reading, read_environment, resolve_process

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


def resolve(env: Mapping[str, str] | None = None, cmd: Sequence[str] = (), hostname: str | None = None,
            ) -> tuple[Identity, list[ConfigError]]:
    """Resolve the identity; returns it with every problem found (empty: consistent).

    Per rank, this is staging's :func:`~opguard.staging.identity.resolve_process` (the one resolver
    the writers use too); per node (torchrun), the same reading of the environment plus torchrun's
    arguments."""
    if is_torchrun(cmd):
        e = read_environment(env, hostname)
        ident = _resolve_torchrun(cmd, e)
        return ident, e.problems.items
    res = resolve_process(env, hostname)
    p = res.identity
    mode = "rank" if res.environment.winner is not None else "single"
    return Identity(mode, p.rank, p.world_size, p.local_rank, p.local_world_size, p.node_index, p.node_count,
                    p.node_id, res.sources, res.notes), res.problems


def _resolve_torchrun(cmd: Sequence[str], seen: Environment) -> Identity:
    winner, node_id, problems, sources, notes = seen.winner, seen.node_id, seen.problems, seen.sources, seen.notes
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
    node_index = _torchrun_node_index(t, seen, sources)
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


def _torchrun_node_index(t: TorchrunArgs, seen: Environment, sources: dict[str, str]) -> int | None:
    """Which node this torchrun agent is: --node-rank, Slurm's node ID or OPGUARD_NODE_INDEX (each
    checked against the others and against --nnodes); problems go to ``seen.problems``."""
    ov, slurm, problems = seen.overrides, seen.slurm, seen.problems
    node_count = t.nnodes_max
    node_index: int | None = None
    if t.node_rank is not None:
        node_index = t.node_rank
        sources["node_index"] = "torchrun --node-rank"
    if slurm is not None:
        node_index = _torchrun_under_slurm(t, slurm, node_index, problems, sources)
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
    return node_index


def _torchrun_under_slurm(t: TorchrunArgs, slurm: Reading, node_index: int | None, problems: Problems,
                          sources: dict[str, str]) -> int | None:
    """torchrun under srun: one agent per node, the node index from SLURM_NODEID unless --node-rank
    gave one (then they must agree), and --nnodes spanning the step's nodes."""
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
    return node_index
