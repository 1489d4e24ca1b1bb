"""Shared fixtures; under CI=true a skipped test fails the session (nothing may skip in CI)."""

from __future__ import annotations

import os
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
BIN = Path(sys.executable).parent


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    if os.environ.get("CI", "").lower() not in ("1", "true", "yes"):
        return
    reporter = session.config.pluginmanager.get_plugin("terminalreporter")
    skipped = reporter.stats.get("skipped", []) if reporter else []
    if skipped:
        reporter.write_line(f"CI=true: {len(skipped)} test(s) were skipped; every test must run in CI", red=True)
        for rep in skipped:
            reporter.write_line(f"  skipped: {rep.nodeid} {rep.longrepr}")
        session.exitstatus = 1


@pytest.fixture
def staging_env(tmp_path: Path) -> Iterator[dict[str, str]]:
    """A complete staging environment in tmp_path: local base, shared target, fast settings."""
    target = tmp_path / "shared" / "experiment-001"
    local = tmp_path / "local-ssd" / "opguard"
    target.mkdir(parents=True)
    local.mkdir(parents=True)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("OPGUARD_", "SLURM_", "OMPI_", "PMI_"))}
    for k in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "GROUP_RANK"):
        env.pop(k, None)
    env.update({
        "OPGUARD_TRACE_OUTPUT_BASE": str(target),
        "OPGUARD_LOCAL_DUMP_ENABLED": "1",
        "OPGUARD_LOCAL_DUMP_TARGET": str(target),
        "OPGUARD_LOCAL_DUMP_BASE": str(local),
        "OPGUARD_LOCAL_DUMP_SYNC_INTERVAL": "2",
        "OPGUARD_SYNC_MBPS": "1000",
        "OPGUARD_NODE_ID": "node-a",
        "PATH": f"{BIN}:{os.environ.get('PATH', '')}",
    })
    yield env
