"""A staging base shared by two nodes is refused: one node must never publish another's files."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

from tests.conftest import BIN


def _sync(env: dict[str, str], node: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([str(BIN / "opguard"), "sync", "--all", "--final"], env={**env, "OPGUARD_NODE_ID": node},
                          capture_output=True, text=True, timeout=120)


def test_second_node_on_the_same_local_base_is_refused(staging_env: dict[str, str]) -> None:
    base = Path(staging_env["OPGUARD_LOCAL_DUMP_BASE"])
    (base / "node").mkdir(parents=True)
    (base / "node" / "node.json").write_text('{"node": "a"}\n')
    first = _sync(staging_env, "node-a")
    assert first.returncode == 0, first.stderr
    run = json.loads((base / "state" / "run.json").read_text())
    assert run["node_id"] == "node-a" and run["hostname"]
    streams = Path(staging_env["OPGUARD_LOCAL_DUMP_TARGET"]) / ".opguard-bundles" / "streams"
    before = sorted(p.name for p in streams.iterdir())
    second = _sync(staging_env, "node-b")
    assert second.returncode == 6, second.stderr
    assert "was set up by node 'node-a'" in second.stderr and "OPGUARD_LOCAL_DUMP_BASE" in second.stderr
    assert sorted(p.name for p in streams.iterdir()) == before == ["node-node-a"]
