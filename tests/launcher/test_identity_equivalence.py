"""One resolver: every environment of the launcher's identity tests, through both paths.

The launcher's ``identity.resolve`` (what opguard-run exports, plans and refuses) and the writers'
path (``staging.layout.current_rank`` / ``current_node_id``, staging's ``process_identity``, which
capture uses too) must give equal rank, local rank, world size and node ID for every environment
(``docs/launcher.md`` §1). The environments are read from ``test_identity.py`` itself (every dict
literal of strings, with the ``{**base, ...}`` forms evaluated), so a case added there is checked
here too.
"""

from __future__ import annotations

import ast
import os
from pathlib import Path

import pytest

from opguard.errors import ConfigError
from opguard.launcher.identity import resolve
from opguard.staging.config import StagingConfig
from opguard.staging.identity import process_identity, resolve_process
from opguard.staging.layout import current_node_id, current_rank

SOURCE = Path(__file__).with_name("test_identity.py")
HOST = "node17"


def _environments() -> list[dict[str, str]]:
    """Every ``dict[str, str]`` literal in test_identity.py, evaluated with the dict variables
    assigned before it in the same function (``base``, ``slurm``, ...)."""
    tree = ast.parse(SOURCE.read_text())
    found: list[dict[str, str]] = []

    def evaluate(node: ast.expr, names: dict[str, object]) -> None:
        try:
            value = eval(compile(ast.Expression(node), str(SOURCE), "eval"), {}, dict(names))
        except Exception:  # a literal this harness cannot evaluate (none today)
            return
        if isinstance(value, dict) and all(isinstance(k, str) and isinstance(v, str) for k, v in value.items()) \
                and value not in found:
            found.append(value)

    for scope in [tree, *(n for n in ast.walk(tree) if isinstance(n, ast.FunctionDef))]:
        names: dict[str, object] = {}
        body: list[ast.AST] = [*scope.decorator_list, *scope.body] if isinstance(scope, ast.FunctionDef) else [
            n for n in scope.body if not isinstance(n, ast.FunctionDef)]
        for stmt in body:
            for node in ast.walk(stmt):
                if isinstance(node, ast.Dict):
                    evaluate(node, names)
            if isinstance(stmt, ast.Assign) and len(stmt.targets) == 1 and isinstance(stmt.targets[0], ast.Name):
                try:
                    names[stmt.targets[0].id] = eval(compile(ast.Expression(stmt.value), str(SOURCE), "eval"),
                                                     {}, dict(names))
                except Exception:  # not a plain value (a call): not an environment
                    continue
    return found


ENVIRONMENTS = _environments()


def test_the_harness_sees_the_launcher_tests() -> None:
    """Guard against a harness that silently checks nothing: the launcher tests have ~40 environments,
    every family among them."""
    assert len(ENVIRONMENTS) >= 30
    keys = {k for e in ENVIRONMENTS for k in e}
    assert {"RANK", "OMPI_COMM_WORLD_RANK", "MV2_COMM_WORLD_RANK", "PMIX_RANK", "PMI_RANK", "SLURM_PROCID",
            "OPGUARD_NODE_ID", "SLURMD_NODENAME"} <= keys


@pytest.mark.parametrize("env", ENVIRONMENTS, ids=lambda e: ",".join(f"{k}={v}" for k, v in sorted(e.items()))[:90])
def test_launcher_and_writers_resolve_alike(env: dict[str, str]) -> None:
    ident, problems = resolve(env, ("python", "app.py"), HOST)
    res = resolve_process(env, HOST)
    p = res.identity
    assert (p.rank, p.local_rank, p.world_size, p.local_world_size, p.node_index, p.node_count, p.node_id) == (
        ident.rank, ident.local_rank, ident.world_size, ident.local_world_size, ident.node_index, ident.node_count,
        ident.node_id)
    assert [str(e) for e in res.problems] == [str(e) for e in problems]

    # the writers' own entry points, on this machine's hostname
    here, here_problems = resolve(env, ("python", "app.py"), os.uname().nodename)
    invalid = [str(e) for e in here_problems if "is not an integer" in str(e) or "is negative" in str(e)]
    launcher_invalid = [e for e in invalid if not e.startswith(("OPGUARD_NODE_INDEX", "OPGUARD_NODE_COUNT"))]
    if launcher_invalid:  # a malformed launcher variable: refused by the writers as by the wrapper
        with pytest.raises(ConfigError) as err:
            current_rank(env)
        assert str(err.value) == launcher_invalid[0]
        return
    assert current_rank(env) == here.rank == process_identity(env).rank
    config = StagingConfig.from_env({k: v for k, v in env.items() if k != "OPGUARD_NODE_ID"})
    node_problems = [str(e) for e in here_problems if "node ID" in str(e) or "loopback" in str(e)]
    if "OPGUARD_NODE_ID" in env or node_problems:
        return  # the writers take OPGUARD_NODE_ID from their validated config (StagingConfig's own tests)
    assert current_node_id(config, env) == here.node_id


def test_batch_shell_and_mpirun_rank_name_their_nodes_as_the_launcher_does() -> None:
    """The disagreement this fixed: the writers trusted SLURMD_NODENAME always, so a rank that mpirun
    started on another node from an sbatch script staged its node stream under the batch host's name,
    while the wrapper (and the launcher's rule) used the rank's own hostname."""
    batch = {"SLURM_JOB_ID": "12", "SLURM_PROCID": "0", "SLURM_NTASKS": "4", "SLURMD_NODENAME": "batchhost"}
    config = StagingConfig.from_env({})
    mpi_rank = {**batch, "PMI_RANK": "3", "PMI_SIZE": "4", "MPI_LOCALRANKID": "1", "MPI_LOCALNRANKS": "2"}
    host = os.uname().nodename.split(".")[0]
    assert current_node_id(config, mpi_rank) == resolve(mpi_rank, ("python", "a.py"))[0].node_id == host
    # the batch shell itself (and what it runs directly) is on the node SLURMD_NODENAME names
    assert current_node_id(config, batch) == resolve(batch, ("python", "a.py"))[0].node_id == "batchhost"
