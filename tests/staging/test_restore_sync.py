"""Round trip through the real uploader: ``opguard sync`` subprocesses publish, ``opguard verify`` and
``opguard materialize`` restore byte-exact latest content of every path ever published."""

from __future__ import annotations

import json
import os
from pathlib import Path

from tests.helpers.restore import files_of, leftovers
from tests.helpers.sync import opguard, sync


def _local(env: dict[str, str]) -> Path:
    return Path(env["OPGUARD_LOCAL_DUMP_BASE"])


def _write(path: Path, data: bytes, mode: str = "ab") -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, mode) as f:
        f.write(data)


def test_sync_then_restore_round_trip(staging_env: dict[str, str], tmp_path: Path) -> None:
    env = {**staging_env, "OPGUARD_SYNC_BATCH_MB": "1"}
    local, target = _local(env), Path(env["OPGUARD_LOCAL_DUMP_TARGET"])
    r0, r1, node = local / "ranks/rank-000000", local / "ranks/rank-000001", local / "node"
    expected: dict[str, bytes] = {}

    _write(r0 / "trace.jsonl", b'{"a":1}\n{"partial"')
    _write(r0 / "tensors/t0.pt", os.urandom(3 << 20), "wb")  # a whole file above the 1 MiB soft limit
    _write(r1 / "trace.jsonl", b"".join(b'{"i":%d}\n' % i for i in range(40000)))  # several batches
    _write(node / "instrumentation/config.json", b'{"v":1}', "wb")
    sync(env, "--all")
    _write(r0 / "trace.jsonl", b':2}\n{"b":3}\n')
    _write(r0 / "old.txt", b"will be deleted", "wb")
    _write(node / "source_files/model.py", b"def f(): pass\n", "wb")
    sync(env, "--all")
    expected["ranks/rank-000000/old.txt"] = b"will be deleted"
    (r0 / "old.txt").unlink()
    (r0 / "trace.jsonl").write_bytes(b'{"rotated":1}\n')  # truncation: a new version
    _write(r0 / "tensors/t0.pt", b"small now", "wb")
    sync(env, "--all")

    # the job "dies" here: published but unsealed
    dest = tmp_path / "restored-unsealed"
    r = opguard(env, "materialize", str(target), str(dest))
    assert r.returncode == 0, r.stderr
    assert "UNSEALED" in r.stderr

    sync(env, "--all", "--final")
    v = opguard(env, "verify", "--require-sealed", "--json", str(target))
    assert v.returncode == 0, v.stderr
    report = json.loads(v.stdout)
    assert report["format"] == "opguard-bundles-v2" and report["damaged"] == 0 and report["unsealed"] == 0
    assert {s["stream"] for s in report["streams"]} == {"rank-000000", "rank-000001", "node-node-a"}

    dest = tmp_path / "restored"
    r = opguard(env, "materialize", "--require-sealed", str(target), str(dest))
    assert r.returncode == 0, r.stderr
    assert "WARNING" not in r.stderr
    for src, prefix in ((r0, "ranks/rank-000000"), (r1, "ranks/rank-000001"), (node, "nodes/node-a")):
        for p in src.rglob("*"):
            if p.is_file():
                expected[f"{prefix}/{p.relative_to(src).as_posix()}"] = p.read_bytes()
    for rank in ("rank-000000", "rank-000001"):
        for p in node.rglob("*"):
            if p.is_file():
                expected[f"ranks/{rank}/_node/{p.relative_to(node).as_posix()}"] = p.read_bytes()
    assert files_of(dest) == expected
    assert leftovers(tmp_path) == []
