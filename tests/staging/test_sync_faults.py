"""Injected I/O faults at the publish's use sites, torn reads, and a real SIGKILL mid-upload."""

from __future__ import annotations

import errno
import os
import signal
import subprocess
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from opguard.staging import publish
from opguard.staging.bundle import BatchWriter
from opguard.staging.config import StagingConfig
from opguard.staging.layout import Layout
from opguard.staging.sync import SyncReport, sync_streams
from opguard.staging.writers import JsonlWriter, write_file_atomic
from tests.conftest import BIN
from tests.helpers.sync import batches, rank_dir, replay, stream_dir, sync


class FaultyOs:
    """``os`` for opguard.staging.publish, with one call replaced. A fault of ``write`` hides
    ``copy_file_range`` (the upload then copies by read/write, as across filesystems that the
    kernel cannot copy between)."""

    def __init__(self, name: str, fn: Callable[..., Any]) -> None:
        self._name, self._fn = name, fn

    def __getattr__(self, attr: str) -> Any:
        if attr == "copy_file_range" and self._name == "write":
            raise AttributeError(attr)
        return self._fn if attr == self._name else getattr(os, attr)


def fail(code: int) -> Callable[..., Any]:
    def f(*_a: Any, **_k: Any) -> Any:
        raise OSError(code, os.strerror(code))
    return f


def run(env: dict[str, str]) -> SyncReport:
    config = StagingConfig.from_env(env)
    return sync_streams(config, Layout(config), ["rank-000000"], node_id="node-a")


def state(env: dict[str, str]) -> Path:
    return Path(env["OPGUARD_LOCAL_DUMP_BASE"]) / "state" / "streams" / "rank-000000"


def _rename_then_fail(src: Any, dst: Any) -> None:
    os.rename(src, dst)
    raise OSError(errno.EIO, "reply lost")


def _close_fail(fd: int) -> None:
    os.close(fd)
    raise OSError(errno.EIO, os.strerror(errno.EIO))


FAULTS = [
    ("write", fail(errno.ENOSPC), "No space left", True),
    ("write", fail(errno.EIO), "Input/output error", True),
    ("fsync", fail(errno.EIO), "fsyncing", True),
    ("close", _close_fail, "closing", True),
    ("rename", fail(errno.EIO), "renaming", True),
    ("rename", _rename_then_fail, None, False),  # failed but happened: published
    ("copy_file_range", fail(errno.ENOSPC), "No space left", True),
    ("copy_file_range", fail(errno.EIO), "Input/output error", True),
    ("copy_file_range", fail(errno.EXDEV), None, False),  # another filesystem: read/write instead, published
]


@pytest.mark.parametrize(("call", "fn", "needle", "fails"), FAULTS, ids=[f"{f[0]}-{i}" for i, f in enumerate(FAULTS)])
def test_fault_keeps_the_batch_and_the_next_sync_publishes_it(
        staging_env: dict[str, str], monkeypatch: pytest.MonkeyPatch,
        call: str, fn: Callable[..., Any], needle: str | None, fails: bool) -> None:
    env = staging_env
    d = rank_dir(env)
    with JsonlWriter(d / "log.jsonl") as w:
        for i in range(100):
            w.write({"i": i})
    monkeypatch.setattr(publish, "os", FaultyOs(call, fn))
    report = run(env)
    monkeypatch.undo()
    sd = stream_dir(env)
    assert [p.name for p in sd.iterdir() if p.name.startswith(".tmp-")] == []
    if fails:
        assert report.exit_code == 4
        err = report.streams[0].error or ""
        assert needle in err and "kept locally" in err
        assert batches(env) == []
        assert (state(env) / "pending.json").exists()
    else:
        assert report.exit_code == 0 and len(batches(env)) == 1
    with open(d / "log.jsonl", "ab") as f:
        f.write(b'{"later":1}\n')
    sync(env)
    sync(env)
    assert replay(env) == {"log.jsonl": (d / "log.jsonl").read_bytes()}
    assert not (state(env) / "pending.json").exists()


def test_directory_fsync_failure_after_rename_is_recovered(staging_env: dict[str, str],
                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    env = staging_env
    write_file_atomic(rank_dir(env) / "x.bin", b"x")
    monkeypatch.setattr(publish, "fsync_dir", fail(errno.EIO))
    report = run(env)
    monkeypatch.undo()
    assert report.exit_code == 4 and "fsyncing the directory" in (report.streams[0].error or "")
    assert len(batches(env)) == 1 and (state(env) / "pending.json").exists()
    sync(env)  # finds it published (same name and size), fsyncs, advances the checkpoint
    assert len(batches(env)) == 1 and not (state(env) / "pending.json").exists()
    assert replay(env) == {"x.bin": b"x"}


def _torn_add_bytes(times: int, root: Path) -> tuple[Callable[..., str], list[str]]:
    """``BatchWriter.add_bytes`` (a small file is read in one ``read``) that first rewrites ``t.pt`` in place."""
    real = BatchWriter.add_bytes
    seen: list[str] = []

    def add_bytes(self: BatchWriter, entry: dict[str, Any], data: bytes) -> str:
        if entry["path"] == "t.pt" and len(seen) < times:
            seen.append(entry["path"])
            with open(root / "t.pt", "r+b") as f:  # an in-place rewrite while the uploader reads
                f.write(b"Z")
                f.flush()
            os.utime(root / "t.pt", ns=(1, time.time_ns() + 10**9))
        return real(self, entry, data)

    return add_bytes, seen


def test_large_file_changing_while_streamed_is_retried_not_published_torn(
        staging_env: dict[str, str], monkeypatch: pytest.MonkeyPatch) -> None:
    env = staging_env
    big = rank_dir(env) / "big.pt"
    write_file_atomic(big, b"a" * (2 << 20))  # above build.SMALL_FILE: streamed in chunks
    real = BatchWriter.add_stream
    seen: list[str] = []

    def add_stream(self: BatchWriter, entry: dict[str, Any], src: Any, size: int, on_chunk: Any = None) -> str:
        if not seen:
            seen.append(entry["path"])
            with open(big, "r+b") as f:
                f.write(b"Z")
            os.utime(big, ns=(1, time.time_ns() + 10**9))
        return real(self, entry, src, size, on_chunk)

    monkeypatch.setattr(BatchWriter, "add_stream", add_stream)
    report = run(env)
    monkeypatch.undo()
    assert report.exit_code == 0 and seen == ["big.pt"]
    assert replay(env) == {"big.pt": b"Z" + b"a" * ((2 << 20) - 1)}


def test_file_changing_while_read_is_retried_not_published_torn(staging_env: dict[str, str],
                                                                monkeypatch: pytest.MonkeyPatch) -> None:
    env = staging_env
    write_file_atomic(rank_dir(env) / "t.pt", b"a" * 1000)
    fn, seen = _torn_add_bytes(1, rank_dir(env))
    monkeypatch.setattr(BatchWriter, "add_bytes", fn)
    report = run(env)
    monkeypatch.undo()
    assert report.exit_code == 0 and seen == ["t.pt"]
    assert replay(env) == {"t.pt": b"Z" + b"a" * 999}


def test_file_always_changing_is_left_out_with_a_clear_error(staging_env: dict[str, str],
                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    env = staging_env
    write_file_atomic(rank_dir(env) / "t.pt", b"a" * 1000)
    write_file_atomic(rank_dir(env) / "ok.pt", b"ok")
    fn, _ = _torn_add_bytes(100, rank_dir(env))
    monkeypatch.setattr(BatchWriter, "add_bytes", fn)
    report = run(env)
    monkeypatch.undo()
    err = report.streams[0].error or ""
    assert report.exit_code == 4 and "t.pt" in err and "changed while being read" in err
    assert "atomic rename" in err
    assert replay(env) == {"ok.pt": b"ok"}


def test_sigkill_during_upload_then_normal_sync(staging_env: dict[str, str]) -> None:
    env = {**staging_env, "OPGUARD_SYNC_MBPS": "2"}
    d = rank_dir(env)
    with JsonlWriter(d / "log.jsonl") as w:
        for i in range(20000):
            w.write({"i": i, "r": os.urandom(24).hex()})
    p = subprocess.Popen([str(BIN / "opguard"), "sync"], env=env, stderr=subprocess.PIPE)
    sd = stream_dir(env)
    deadline = time.monotonic() + 30
    while not (sd.is_dir() and any(n.startswith(".tmp-") for n in os.listdir(sd))):
        assert time.monotonic() < deadline, "upload never started"
        assert p.poll() is None, "sync finished before it could be killed"
        time.sleep(0.005)
    p.send_signal(signal.SIGKILL)
    p.wait()
    assert batches(env) == []
    sync({**env, "OPGUARD_SYNC_MBPS": "1000"})
    assert [n for n in os.listdir(sd) if n.startswith(".tmp-")] == []
    lines = replay(env)["log.jsonl"].splitlines()
    assert len(lines) == 20000 and len(set(lines)) == 20000


def test_log_rewritten_in_place_during_the_build_becomes_a_new_version(staging_env: dict[str, str],
                                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    env = staging_env
    log = rank_dir(env) / "log.jsonl"
    log.write_bytes(b'{"old":1}\n{"old":2}\n')
    sync(env)
    with open(log, "ab") as f:
        f.write(b'{"old":3}\n')
    real = BatchWriter.add_stream
    done: list[bool] = []

    def add_stream(self: BatchWriter, entry: dict[str, Any], src: Any, size: int, on_chunk: Any = None) -> str:
        if not done:
            done.append(True)
            with open(log, "r+b") as f:  # truncate and regrow the same inode, past the scanned size
                f.truncate(0)
                f.write(b'{"NEW":1}\n{"NEW":2}\n{"NEW":3}\n')
        return real(self, entry, src, size, on_chunk)

    monkeypatch.setattr(BatchWriter, "add_stream", add_stream)
    report = run(env)
    monkeypatch.undo()
    assert report.exit_code == 0 and done, report
    assert report.batches == 1, report
    assert replay(env) == {"log.jsonl": log.read_bytes()}


def test_final_drain_is_bounded_by_what_was_visible_at_its_start(staging_env: dict[str, str],
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    env = {**staging_env, "OPGUARD_SYNC_BATCH_MB": "1"}
    d = rank_dir(env)
    log = d / "log.jsonl"
    with JsonlWriter(log) as w:
        for i in range(12000):
            w.write({"i": i, "pad": os.urandom(100).hex()})
    visible = log.read_bytes()
    write_file_atomic(d / "t.pt", b"v1")
    real_finish = BatchWriter.finish
    finished: list[int] = []

    def finish(self: BatchWriter) -> tuple[str, int]:
        finished.append(1)
        with JsonlWriter(log) as w:  # a producer that never stops while the drain runs
            w.write({"late": len(finished)})
        write_file_atomic(d / "t.pt", f"v{len(finished) + 1}".encode())
        return real_finish(self)

    monkeypatch.setattr(BatchWriter, "finish", finish)
    config = StagingConfig.from_env(env)
    report = sync_streams(config, Layout(config), ["rank-000000"], final=True, node_id="node-a")
    monkeypatch.undo()
    assert report.exit_code == 0 and report.streams[0].sealed
    n = len(visible) // (1 << 20) + 2
    assert report.batches <= n, f"{report.batches} batches for ~{n} MiB: the drain chased new data"
    got = replay(env)
    assert got["log.jsonl"].startswith(visible)
    assert got["t.pt"].startswith(b"v")
