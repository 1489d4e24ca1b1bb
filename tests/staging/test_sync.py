"""The uploader end to end through the real ``opguard sync`` CLI: change detection, batching, sealing."""

from __future__ import annotations

import builtins
import json
import os
from pathlib import Path
from typing import Any

import pytest

from opguard.staging.config import StagingConfig
from opguard.staging.layout import Layout
from opguard.staging.sync import sync_streams
from opguard.staging.writers import JsonlWriter, write_file_atomic
from tests.helpers.sync import batches, checkpoint, manifests, opguard, rank_dir, replay, stream_dir, sync


def test_round_trip_over_many_syncs(staging_env: dict[str, str]) -> None:
    env = staging_env
    d = rank_dir(env)
    log = d / "trace.jsonl"
    log.write_bytes(b'{"a":1}\n{"b":2}\n{"partial"')
    write_file_atomic(d / "tensors" / "t0.pt", b"\x00" * 1000)
    sync(env)
    assert replay(env) == {"trace.jsonl": b'{"a":1}\n{"b":2}\n', "tensors/t0.pt": b"\x00" * 1000}
    # the partial record waited; completing it publishes exactly the rest
    with open(log, "ab") as f:
        f.write(b':3}\n{"c":4}\n')
    write_file_atomic(d / "tensors" / "t0.pt", b"\x01" * 10)  # replaced: a new version
    sync(env)
    got = replay(env)
    assert got["trace.jsonl"] == log.read_bytes()
    assert got["tensors/t0.pt"] == b"\x01" * 10
    # rotation by truncation starts a new version from offset 0
    log.write_bytes(b'{"new":1}\n')
    sync(env)
    assert replay(env)["trace.jsonl"] == b'{"new":1}\n'
    m = manifests(env)[-1]
    assert [(e["op"], e["offset"], e["version"]) for e in m["entries"]] == [("append", 0, 2)]
    # rotation by rename: the old name's new inode is a new version, the renamed file a new path
    os.rename(log, d / "trace.1.jsonl")
    log.write_bytes(b'{"after":1}\n')
    sync(env)
    assert replay(env)["trace.jsonl"] == b'{"after":1}\n'
    assert replay(env)["trace.1.jsonl"] == b'{"new":1}\n'
    # in-place rewrite of the same inode with a changed tail: new version
    log.write_bytes(b'{"AFTER":2}\n{"x":1}\n')
    sync(env)
    assert replay(env)["trace.jsonl"] == log.read_bytes()
    seqs = [m["sequence"] for m in manifests(env)]
    assert seqs == list(range(1, len(seqs) + 1))


def test_unchanged_files_make_no_batch_and_are_not_read(staging_env: dict[str, str],
                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    env = staging_env
    d = rank_dir(env)
    for i in range(20):
        write_file_atomic(d / f"f{i}.bin", os.urandom(100))
    (d / "log.jsonl").write_bytes(b"1\n2\npartial")
    sync(env)
    n = len(batches(env))
    opened: list[str] = []
    real_os_open, real_open = os.open, builtins.open

    def spy_os_open(path: Any, *a: Any, **k: Any) -> int:
        opened.append(os.fspath(path))
        return real_os_open(path, *a, **k)

    def spy_open(path: Any, *a: Any, **k: Any) -> Any:
        if isinstance(path, (str, os.PathLike)):
            opened.append(os.fspath(path))
        return real_open(path, *a, **k)

    config = StagingConfig.from_env(env)
    layout = Layout(config)
    monkeypatch.setattr(os, "open", spy_os_open)
    monkeypatch.setattr(builtins, "open", spy_open)
    report = sync_streams(config, layout, ["rank-000000"], node_id="node-a")
    monkeypatch.undo()
    assert report.exit_code == 0 and report.batches == 0
    assert [p for p in opened if p.startswith(str(d))] == []
    assert len(batches(env)) == n


def test_deleted_files_are_listed_and_history_kept(staging_env: dict[str, str]) -> None:
    env = staging_env
    d = rank_dir(env)
    write_file_atomic(d / "old.txt", b"old")
    write_file_atomic(d / "keep.txt", b"keep")
    sync(env)
    (d / "old.txt").unlink()
    sync(env)
    m = manifests(env)[-1]
    assert m["deleted"] == ["old.txt"] and m["entries"] == []
    assert replay(env)["old.txt"] == b"old"
    # a path that comes back gets a higher version than before
    write_file_atomic(d / "old.txt", b"back")
    sync(env)
    assert manifests(env)[-1]["entries"][0]["version"] == 2
    assert replay(env)["old.txt"] == b"back"


def test_periodic_sync_publishes_one_bounded_batch_final_drains_and_seals(staging_env: dict[str, str]) -> None:
    env = {**staging_env, "OPGUARD_SYNC_BATCH_MB": "1"}
    d = rank_dir(env)
    for i in range(5):
        write_file_atomic(d / f"t{i}.bin", os.urandom(600 * 1024))
    with JsonlWriter(d / "log.jsonl") as w:
        for i in range(3000):
            w.write({"i": i, "pad": "x" * 200})
    sync(env)
    ms = manifests(env)
    assert len(ms) == 1 and ms[0]["payload_size"] <= 1 << 20
    r = sync(env, "--final")
    ms = manifests(env)
    assert len(ms) >= 4 and all(m["payload_size"] <= 1 << 20 for m in ms)
    assert "published batch" in r.stderr
    got = replay(env)
    assert got == {p.relative_to(d).as_posix(): p.read_bytes() for p in d.rglob("*") if p.is_file()}
    seal = json.loads((stream_dir(env) / f"{len(ms):012d}.seal").read_text())
    assert seal["last_sequence"] == len(ms) and seal["last_digest"] == checkpoint(env)["head_digest"]
    assert ms[-1]["final"] is True


def test_single_whole_file_may_exceed_the_limit_alone(staging_env: dict[str, str]) -> None:
    env = {**staging_env, "OPGUARD_SYNC_BATCH_MB": "1"}
    d = rank_dir(env)
    write_file_atomic(d / "a.bin", os.urandom(100))
    write_file_atomic(d / "big.bin", os.urandom(3 << 20))
    sync(env)
    assert [e["path"] for e in manifests(env)[0]["entries"]] == ["a.bin"]
    sync(env)
    assert [e["path"] for e in manifests(env)[1]["entries"]] == ["big.bin"]


def test_record_larger_than_the_limit_is_an_error_naming_file_and_size(staging_env: dict[str, str]) -> None:
    env = {**staging_env, "OPGUARD_SYNC_BATCH_MB": "1"}
    d = rank_dir(env)
    (d / "huge.jsonl").write_bytes(b"x" * (2 << 20) + b"\n")
    write_file_atomic(d / "ok.bin", b"fine")
    r = opguard(env, "sync")
    assert r.returncode == 2
    assert "huge.jsonl" in r.stderr and str((2 << 20) + 1) in r.stderr and "OPGUARD_SYNC_BATCH_MB" in r.stderr
    assert replay(env) == {"ok.bin": b"fine"}  # the rest still went


def test_node_stream_and_all(staging_env: dict[str, str]) -> None:
    env = staging_env
    node = Path(env["OPGUARD_LOCAL_DUMP_BASE"]) / "node"
    write_file_atomic(node / "topology.json", b"{}")
    write_file_atomic(rank_dir(env, 1) / "x.bin", b"r1")
    write_file_atomic(rank_dir(env, 2) / "x.bin", b"r2")
    sync(env, "--all", "--final")
    assert replay(env, "node-node-a") == {"topology.json": b"{}"}
    assert replay(env, "rank-000001") == {"x.bin": b"r1"}
    assert replay(env, "rank-000002") == {"x.bin": b"r2"}
    m = manifests(env, "rank-000001")[0]
    assert (m["kind"], m["rank"], m["node_id"]) == ("rank", 1, "node-a")
    assert manifests(env, "node-node-a")[0]["kind"] == "node"


def test_unknown_rank_is_an_error_not_a_no_op(staging_env: dict[str, str]) -> None:
    r = opguard(staging_env, "sync", "--rank", "7")
    assert r.returncode == 2
    assert "rank-000007" in r.stderr and "fix:" in r.stderr


def test_links_and_temporaries_are_skipped_and_reported_once(staging_env: dict[str, str]) -> None:
    env = staging_env
    d = rank_dir(env)
    write_file_atomic(d / "real.bin", b"r")
    (d / ".opguard-tmp-real.bin.abc").write_bytes(b"half-written")
    os.symlink("real.bin", d / "link.bin")
    os.mkfifo(d / "pipe")
    r = sync(env)
    assert "symbolic link" in r.stderr and "link.bin" in r.stderr and "FIFO" in r.stderr
    assert replay(env) == {"real.bin": b"r"}
    r = sync(env)
    assert "link.bin" not in r.stderr  # reported once


def test_report_json(staging_env: dict[str, str], tmp_path: Path) -> None:
    env = staging_env
    write_file_atomic(rank_dir(env) / "x.bin", b"x" * 1000)
    out = tmp_path / "report.json"
    r = sync(env, "--report-json", str(out))
    rep = json.loads(out.read_text())
    assert rep["exit_code"] == 0 and rep["batches"] == 1 and rep["payload_bytes"] == 1000
    s = rep["streams"][0]
    assert s["stream"] == "rank-000000" and s["uploaded_bytes"] == batches(env)[0].stat().st_size
    assert s["backlog_bytes"] == 0 and s["error"] is None
    assert "1 batch(es)" in r.stderr and "backlog" in r.stderr
    r = opguard(env, "sync", "--rank", "9", "--report-json", str(out))
    rep = json.loads(out.read_text())
    assert r.returncode == 2 and rep["exit_code"] == 2 and "rank-000009" in rep["streams"][0]["error"]


def test_periodic_backlog_is_reported(staging_env: dict[str, str]) -> None:
    env = {**staging_env, "OPGUARD_SYNC_BATCH_MB": "1"}
    d = rank_dir(env)
    for i in range(3):
        write_file_atomic(d / f"t{i}.bin", os.urandom(700 * 1024))
    config = StagingConfig.from_env(env)
    rep = sync_streams(config, Layout(config), ["rank-000000"], node_id="node-a")
    assert rep.batches == 1 and rep.payload_bytes == 700 * 1024 and rep.backlog_bytes == 2 * 700 * 1024


def test_all_with_a_missing_staging_base_fails_loudly(staging_env: dict[str, str]) -> None:
    env = staging_env
    Path(env["OPGUARD_LOCAL_DUMP_BASE"]).rmdir()
    r = opguard(env, "sync", "--all")
    assert r.returncode == 2 and "OPGUARD_LOCAL_DUMP_BASE" in r.stderr and "fix:" in r.stderr


def test_file_names_that_are_not_utf8_round_trip(staging_env: dict[str, str], tmp_path: Path) -> None:
    """A name with bytes that are not UTF-8 (Python sees surrogate escapes) is published, kept in the
    checkpoint and restored byte-exact under the same name (state and manifests fall back from
    orjson to json for such documents)."""
    d = rank_dir(staging_env)
    odd = os.fsdecode(b"trace-\xff\xfe.jsonl")
    (d / odd).write_bytes(b'{"a":1}\n')
    (d / "plain.json").write_bytes(b"{}")
    sync(staging_env)
    assert odd in checkpoint(staging_env)["files"]
    (d / odd).write_bytes(b'{"a":1}\n{"b":2}\n')
    sync(staging_env, "--final")
    assert replay(staging_env)[odd] == b'{"a":1}\n{"b":2}\n'
    dest = tmp_path / "restored"
    r = opguard(staging_env, "materialize", staging_env["OPGUARD_LOCAL_DUMP_TARGET"], str(dest))
    assert r.returncode == 0, r.stderr
    assert (dest / "ranks" / "rank-000000" / odd).read_bytes() == b'{"a":1}\n{"b":2}\n'
