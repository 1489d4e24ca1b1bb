"""Local locks really held by another process: a timeout fails the sync (exit 3), never a second upload."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from opguard.staging.writers import write_file_atomic
from tests.helpers.sync import batches, opguard, rank_dir, replay, sync

HOLDER = """
import sys, filelock
lock = filelock.FileLock(sys.argv[1])
lock.acquire()
print("locked", flush=True)
sys.stdin.read()  # hold until the test closes our stdin
lock.release()
"""


@contextmanager
def held(path: Path) -> Iterator[None]:
    path.parent.mkdir(parents=True, exist_ok=True)
    p = subprocess.Popen([sys.executable, "-c", HOLDER, str(path)], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                         text=True)
    try:
        assert p.stdout is not None and p.stdout.readline().strip() == "locked"  # an event, not a sleep
        yield
    finally:
        assert p.stdin is not None
        p.stdin.close()
        p.wait(timeout=30)


def test_stream_lock_timeout_fails_without_uploading(staging_env: dict[str, str]) -> None:
    env = {**staging_env, "OPGUARD_SYNC_LOCK_TIMEOUT": "0.3"}
    write_file_atomic(rank_dir(env) / "x.bin", b"x")
    sync(env)  # creates state and identity
    write_file_atomic(rank_dir(env) / "y.bin", b"y")
    lock = Path(env["OPGUARD_LOCAL_DUMP_BASE"]) / "state" / "locks" / "stream-rank-000000.lock"
    with held(lock):
        r = opguard(env, "sync")
        assert r.returncode == 3, r.stderr
        assert str(lock) in r.stderr and "OPGUARD_SYNC_LOCK_TIMEOUT" in r.stderr
        assert len(batches(env)) == 1
        assert not (Path(env["OPGUARD_LOCAL_DUMP_BASE"]) / "state/streams/rank-000000/pending.json").exists()
    sync(env)
    assert replay(env) == {"x.bin": b"x", "y.bin": b"y"}


def test_node_upload_lock_timeout_keeps_the_batch_pending(staging_env: dict[str, str]) -> None:
    env = {**staging_env, "OPGUARD_SYNC_LOCK_TIMEOUT": "0.3"}
    write_file_atomic(rank_dir(env) / "x.bin", b"x")
    lock = Path(env["OPGUARD_LOCAL_DUMP_BASE"]) / "state" / "locks" / "node-upload.lock"
    with held(lock):
        r = opguard(env, "sync")
        assert r.returncode == 3, r.stderr
        assert "node upload lock" in r.stderr and "stays pending" in r.stderr
        assert batches(env) == []
        assert (Path(env["OPGUARD_LOCAL_DUMP_BASE"]) / "state/streams/rank-000000/pending.json").exists()
    write_file_atomic(rank_dir(env) / "y.bin", b"y")
    sync(env)  # publishes the retained batch: this sync's one batch
    assert replay(env) == {"x.bin": b"x"}
    sync(env)
    assert replay(env) == {"x.bin": b"x", "y.bin": b"y"}


def test_other_streams_proceed_when_one_is_locked(staging_env: dict[str, str]) -> None:
    env = {**staging_env, "OPGUARD_SYNC_LOCK_TIMEOUT": "0.2"}
    write_file_atomic(rank_dir(env, 0) / "a", b"0")
    write_file_atomic(rank_dir(env, 1) / "a", b"1")
    lock = Path(env["OPGUARD_LOCAL_DUMP_BASE"]) / "state" / "locks" / "stream-rank-000001.lock"
    with held(lock):
        r = opguard(env, "sync", "--all")
    assert r.returncode == 3
    assert replay(env, "rank-000000") == {"a": b"0"} and batches(env, "rank-000001") == []
