"""Producers' writers: whole records only, atomic files, and no fallback when staging is broken."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from opguard.errors import ConfigError
from opguard.staging.writers import (
    JsonlWriter,
    open_jsonl,
    parse_segment,
    segment_path,
    write_file_atomic,
    write_node_file,
    write_rank_file,
)


def test_jsonl_records_are_whole_lines_appended(tmp_path: Path) -> None:
    p = tmp_path / "a" / "trace.jsonl"
    with JsonlWriter(p, fsync=True) as w:
        w.write({"x": 1, "s": "line\nbreak"})
        w.write_line(b'{"raw":true}\n')
        w.flush()
    with JsonlWriter(p) as w:  # reopening appends
        w.write([1, 2])
    lines = p.read_bytes().split(b"\n")
    assert lines[-1] == b"" and len(lines) == 4
    assert json.loads(lines[0]) == {"x": 1, "s": "line\nbreak"}
    assert json.loads(lines[2]) == [1, 2]


@pytest.mark.parametrize("bad", [b"no newline", b"two\nrecords\n", b"double\n\n", b""])
def test_write_line_refuses_anything_but_one_record(tmp_path: Path, bad: bytes) -> None:
    with JsonlWriter(tmp_path / "t.jsonl") as w, pytest.raises(ValueError):
        w.write_line(bad)
    assert (tmp_path / "t.jsonl").read_bytes() == b""


def test_jsonl_writer_refuses_other_names(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="JSON-lines"):
        JsonlWriter(tmp_path / "t.json")


def test_rotation_uses_segment_files_and_resumes(tmp_path: Path) -> None:
    p = tmp_path / "events.ndjson"
    w = JsonlWriter(p, rotate_bytes=30)
    for i in range(6):
        w.write({"i": i, "pad": "xxxxxxxx"})
    w.close()
    segs = sorted(tmp_path.iterdir())
    assert [s.name for s in segs] == ["events.000001.ndjson", "events.000002.ndjson", "events.000003.ndjson",
                                      "events.000004.ndjson", "events.000005.ndjson", "events.ndjson"]
    assert all(s.read_bytes().count(b"\n") == 1 for s in segs)
    w = JsonlWriter(p)
    assert w.current_path == segment_path(p, 5)
    assert w.rotate() == tmp_path / "events.000006.ndjson"
    w.close()
    assert (tmp_path / "events.000006.ndjson").exists()


def test_write_file_atomic_leaves_no_temporary(tmp_path: Path) -> None:
    p = write_file_atomic(tmp_path / "d" / "t.pt", b"one")
    write_file_atomic(p, b"two")
    assert p.read_bytes() == b"two"
    assert [x.name for x in p.parent.iterdir()] == ["t.pt"]


def test_write_file_atomic_failure_leaves_old_content_and_no_temporary(tmp_path: Path) -> None:
    p = write_file_atomic(tmp_path / "t.pt", b"old")
    (tmp_path / "sub").mkdir()
    with pytest.raises(OSError):
        write_file_atomic(tmp_path / "sub", b"x")  # the final name is a directory: rename fails
    assert p.read_bytes() == b"old"
    assert sorted(x.name for x in tmp_path.iterdir()) == ["sub", "t.pt"]


@pytest.mark.parametrize("rel", ["../x.jsonl", "/abs.jsonl", "a//b.jsonl", "a/./b.jsonl", "",
                                 ".opguard-tmp-x.jsonl", "_node/x.jsonl"])
def test_relative_paths_are_validated(staging_env: dict[str, str], rel: str) -> None:
    with pytest.raises(ConfigError) as ei:
        open_jsonl(rel, rank=0, env=staging_env)
    assert ei.value.fix
    assert not (Path(staging_env["OPGUARD_LOCAL_DUMP_BASE"]) / "ranks").exists()


def test_helpers_write_under_the_rank_and_node_dirs(staging_env: dict[str, str]) -> None:
    env = {**staging_env, "RANK": "5"}
    base = Path(env["OPGUARD_LOCAL_DUMP_BASE"])
    with open_jsonl("logs/trace.jsonl", env=env) as w:
        w.write({"a": 1})
    assert (base / "ranks/rank-000005/logs/trace.jsonl").read_bytes() == b'{"a":1}\n'
    assert write_rank_file("t/x.pt", b"T", rank=2, env=env) == base / "ranks/rank-000002/t/x.pt"
    assert write_node_file("topo.json", b"{}", env=env) == base / "node/topo.json"
    assert (base / "state").is_dir()
    target = Path(env["OPGUARD_LOCAL_DUMP_TARGET"])
    assert list(target.iterdir()) == []  # nothing on shared storage


def test_staging_disabled_writes_the_output_base(staging_env: dict[str, str]) -> None:
    env = {**staging_env, "OPGUARD_LOCAL_DUMP_ENABLED": "0"}
    out = Path(env["OPGUARD_TRACE_OUTPUT_BASE"])
    write_rank_file("x.bin", b"x", rank=3, env=env)
    assert (out / "ranks/rank-000003/x.bin").read_bytes() == b"x"
    write_node_file("n.json", b"{}", env=env)
    assert (out / "nodes/node-a/n.json").read_bytes() == b"{}"


def _broken(env: dict[str, str], how: str) -> dict[str, str]:
    base = Path(env["OPGUARD_LOCAL_DUMP_BASE"])
    if how == "missing":  # its parent too: a missing base whose parent exists is created (docs/format.md §1.1)
        base.rmdir()
        base.parent.rmdir()
    elif how == "not-a-directory":
        base.rmdir()
        base.write_bytes(b"")
    elif how == "no-state-dir":
        (base / "state").write_bytes(b"a file where the state dir belongs")
    return env


@pytest.mark.parametrize("how", ["missing", "not-a-directory", "no-state-dir"])
def test_broken_staging_never_falls_back_to_shared_storage(staging_env: dict[str, str], how: str) -> None:
    env = _broken(staging_env, how)
    target = Path(env["OPGUARD_LOCAL_DUMP_TARGET"])
    for call in (lambda: open_jsonl("t.jsonl", rank=0, env=env), lambda: write_rank_file("x", b"x", 0, env),
                 lambda: write_node_file("x", b"x", env)):
        with pytest.raises(ConfigError) as ei:
            call()
        assert "OPGUARD_LOCAL_DUMP_BASE" in str(ei.value) or "state" in ei.value.message
        assert ei.value.fix
    assert list(target.iterdir()) == []


def test_writers_create_a_missing_local_base_under_an_existing_parent(staging_env: dict[str, str]) -> None:
    base = Path(staging_env["OPGUARD_LOCAL_DUMP_BASE"])
    base.rmdir()
    write_rank_file("x.bin", b"x", rank=0, env=staging_env)
    assert (base / "ranks" / "rank-000000" / "x.bin").read_bytes() == b"x"
    assert base.stat().st_mode & 0o077 == 0  # 0700: node-local staging is private to the job's user


def test_a_record_cut_short_by_an_error_is_rolled_back(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import errno
    import os

    w = JsonlWriter(tmp_path / "t.jsonl")
    w.write({"ok": 1})
    real_write = os.write
    calls = {"n": 0}

    def short_then_enospc(fd: int, data: bytes | memoryview) -> int:
        calls["n"] += 1
        if calls["n"] == 1:
            return real_write(fd, bytes(data)[:5])
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(os, "write", short_then_enospc)
    with pytest.raises(OSError):
        w.write({"big": "x" * 100})
    monkeypatch.undo()
    w.write({"ok": 2})
    w.close()
    assert (tmp_path / "t.jsonl").read_bytes() == b'{"ok":1}\n{"ok":2}\n'


@pytest.mark.parametrize("rotate", [None, 1, 30, 64, 1000])
def test_write_lines_lands_as_write_line_does_with_one_write_per_segment(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, rotate: int | None) -> None:
    import os

    recs = [json.dumps({"i": i, "pad": "x" * (i % 7)}, separators=(",", ":")).encode() + b"\n" for i in range(23)]
    one = tmp_path / "one"
    w = JsonlWriter(one / "e.jsonl", rotate_bytes=rotate)
    w.write_line(recs[0])
    for r in recs[1:]:
        w.write_line(r)
    w.close()
    real_write = os.write
    writes = []

    def counted(fd: int, data: bytes | memoryview) -> int:
        writes.append(len(data))
        return real_write(fd, data)

    many = tmp_path / "many"
    w = JsonlWriter(many / "e.jsonl", rotate_bytes=rotate)
    w.write_line(recs[0])
    monkeypatch.setattr(os, "write", counted)
    w.write_lines(recs[1:12])
    w.write_lines([])
    w.write_lines(recs[12:])
    monkeypatch.undo()
    w.close()
    a = {f.name: f.read_bytes() for f in one.iterdir()}
    b = {f.name: f.read_bytes() for f in many.iterdir()}
    assert a == b  # same segments, same bytes
    assert len(writes) <= len(a) + 1  # at most one write() per segment each call lands in
    assert sum(writes) == sum(len(r) for r in recs[1:])
    if rotate is None or rotate == 1000:
        assert len(writes) == 2  # one write() per call


@pytest.mark.parametrize("bad", [[b"ok\n", b"no newline"], [b"two\nrecords\n"], [b"ok\n", b"double\n\n"], [b""]])
def test_write_lines_refuses_anything_but_records(tmp_path: Path, bad: list[bytes]) -> None:
    with JsonlWriter(tmp_path / "t.jsonl") as w, pytest.raises(ValueError):
        w.write_lines(bad)
    assert (tmp_path / "t.jsonl").read_bytes() == b""


def test_write_lines_cut_short_by_an_error_leaves_none_of_the_batch(tmp_path: Path,
                                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    import errno
    import os

    w = JsonlWriter(tmp_path / "t.jsonl")
    w.write_line(b'{"ok":1}\n')
    real_write = os.write
    calls = {"n": 0}

    def short_then_enospc(fd: int, data: bytes | memoryview) -> int:
        calls["n"] += 1
        if calls["n"] == 1:
            return real_write(fd, bytes(data)[:12])  # one whole record and a part of the next
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(os, "write", short_then_enospc)
    with pytest.raises(OSError):
        w.write_lines([b'{"a":1}\n', b'{"b":2}\n', b'{"c":3}\n'])
    monkeypatch.undo()
    w.write_lines([b'{"ok":2}\n'])
    w.close()
    assert (tmp_path / "t.jsonl").read_bytes() == b'{"ok":1}\n{"ok":2}\n'


def test_atomic_file_context_publishes_on_success_only(tmp_path: Path) -> None:
    from opguard.staging.writers import atomic_file

    p = tmp_path / "t" / "x.pt"
    with atomic_file(p) as f:
        f.write(b"part1")
        assert not p.exists()  # nothing visible until the end
        f.write(b"part2")
    assert p.read_bytes() == b"part1part2"
    with pytest.raises(RuntimeError), atomic_file(p) as f:
        f.write(b"garbage")
        raise RuntimeError("producer failed")
    assert p.read_bytes() == b"part1part2"
    assert [x.name for x in p.parent.iterdir()] == ["x.pt"]


def test_atomic_rank_file(staging_env: dict[str, str]) -> None:
    from opguard.staging.writers import atomic_rank_file

    with atomic_rank_file("tensors/a.pt", rank=1, env=staging_env) as f:
        f.write(b"T")
    assert (Path(staging_env["OPGUARD_LOCAL_DUMP_BASE"]) / "ranks/rank-000001/tensors/a.pt").read_bytes() == b"T"


def test_parse_segment_inverts_segment_path() -> None:
    """The one parser of segment names (compare groups a rotated trace's segments with it)."""
    for base in ("trace.jsonl", "events.ndjson", "a.b.jsonl", ".jsonl"):
        for n in (0, 1, 42, 999_999):
            assert parse_segment(segment_path(Path(base), n).name) == (base, n)
    assert parse_segment("trace.json") is None and parse_segment("trace.000001.json") is None
    assert parse_segment("trace.00001.jsonl") == ("trace.00001.jsonl", 0)  # 5 digits: not a segment number
    assert parse_segment("trace.00000x.jsonl") == ("trace.00000x.jsonl", 0)
