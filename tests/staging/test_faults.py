"""Faults at the publish's use sites, in real ``opguard sync`` subprocesses.

ENOSPC comes from a really full tmpfs (space, and inodes); EIO and a rename that fails but
happened come from ``tests/staging/faultinject/sitecustomize.py`` (no real mechanism here). Each fault:
exit status 4, a message naming the step, the path and errno and telling the fix, no temporary
left on the target, the batch kept locally, and the next normal sync publishes it exactly once.
(A lock really held by another process is covered by tests/staging/test_sync_lock.py: exit 3, batch kept.)
"""

from __future__ import annotations

import errno
import json
import os
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from opguard.staging.writers import write_file_atomic
from tests.helpers.sync import batches, rank_dir, replay, stream_dir
from tests.staging.faultinject.checks import TargetChecker, opguard, state_leftovers

FAULTINJECT = Path(__file__).resolve().parent / "faultinject"


def _pending(env: dict[str, str]) -> dict[str, object] | None:
    p = Path(env["OPGUARD_LOCAL_DUMP_BASE"]) / "state/streams/rank-000000/pending.json"
    return dict(json.loads(p.read_text())) if p.exists() else None


@pytest.fixture
def tmpfs_env(staging_env: dict[str, str], tmp_path: Path) -> Iterator[dict[str, str]]:
    """The staging environment with its shared target on a 4 MiB, 64-inode tmpfs (really fillable)."""
    mnt = tmp_path / "tiny"
    mnt.mkdir()
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=4m,nr_inodes=64", "tmpfs", str(mnt)],
                       capture_output=True, text=True)
    if r.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs (needs root / CAP_SYS_ADMIN): {r.stderr.strip()}")
    try:
        target = mnt / "experiment-001"
        target.mkdir()
        yield {**staging_env, "OPGUARD_LOCAL_DUMP_TARGET": str(target), "OPGUARD_TRACE_OUTPUT_BASE": str(target)}
    finally:
        subprocess.run(["umount", str(mnt)], check=False)
        if os.path.ismount(mnt):
            subprocess.run(["umount", "-l", str(mnt)], check=True)


def _fill(directory: Path, *, inodes: bool) -> list[Path]:
    """Fill the filesystem of ``directory``: its space (one big file) or its inodes (empty files)."""
    directory.mkdir(exist_ok=True)
    made: list[Path] = []
    if inodes:
        while True:
            p = directory / f"f{len(made)}"
            try:
                p.touch()
            except OSError as e:
                assert e.errno == errno.ENOSPC, e
                return made
            made.append(p)
    p = directory / "space"
    made.append(p)
    with open(p, "wb", buffering=0) as f:
        try:
            while True:
                f.write(b"\1" * 4096)
        except OSError as e:
            assert e.errno == errno.ENOSPC, e
    return made


def _free(paths: list[Path]) -> None:
    for p in paths:
        p.unlink()


def _assert_retained(env: dict[str, str], r: subprocess.CompletedProcess[str], *needles: str) -> str:
    """Exit 4 with a clear message, nothing partial on the target, the batch kept locally; returns its name."""
    assert r.returncode == 4, f"exit {r.returncode}: {r.stderr}"
    for n in needles:
        assert n in r.stderr, f"{n!r} not in: {r.stderr}"
    assert "next sync uploads it again" in r.stderr or "run the final sync again" in r.stderr, r.stderr
    sd = stream_dir(env)
    assert [n for n in os.listdir(sd) if n.startswith(".")] == [], "an upload temporary was left on the target"
    pending = _pending(env)
    assert pending is not None, "the batch was not kept for the retry"
    local = Path(env["OPGUARD_LOCAL_DUMP_BASE"]) / "state/streams/rank-000000/pending" / str(pending["name"])
    assert local.stat().st_size == pending["size"]
    return str(pending["name"])


def _published_once(env: dict[str, str], name: str, expected: dict[str, bytes], before: int = 0) -> None:
    """The next normal syncs publish the retained batch exactly once, and nothing is left over."""
    r = opguard(env, "sync")
    assert r.returncode == 0, r.stderr
    r = opguard(env, "sync")  # nothing new: no second copy
    assert r.returncode == 0, r.stderr
    assert [p.name for p in batches(env)][before:] == [name], "the retained batch was not published exactly once"
    assert state_leftovers(env) == []
    TargetChecker(env).check_visible()
    assert replay(env) == expected


def _data(env: dict[str, str], size: int) -> dict[str, bytes]:
    d = rank_dir(env)
    blob = os.urandom(size)  # incompressible: the batch is as large as the payload
    write_file_atomic(d / "t.pt", blob)
    lines = b"".join(b'{"i":%d}\n' % i for i in range(500))
    (d / "log.jsonl").write_bytes(lines + b'{"partial"')
    return {"t.pt": blob, "log.jsonl": lines}


def test_enospc_writing_the_upload_on_a_really_full_target(tmpfs_env: dict[str, str]) -> None:
    env = tmpfs_env
    write_file_atomic(rank_dir(env) / "first.bin", b"first")
    assert opguard(env, "sync").returncode == 0  # identity and stream directory exist
    filler = _fill(Path(env["OPGUARD_LOCAL_DUMP_TARGET"]).parent / "filler", inodes=False)
    expected = {"first.bin": b"first", **_data(env, 1 << 20)}
    r = opguard(env, "sync")
    name = _assert_retained(env, r, "writing the upload", "No space left on device", "errno 28",
                            "free space or quota on the shared target")
    _free(filler)
    _published_once(env, name, expected, before=1)


def test_full_target_at_the_first_sync_is_a_clear_error(tmpfs_env: dict[str, str]) -> None:
    env = tmpfs_env
    filler = _fill(Path(env["OPGUARD_LOCAL_DUMP_TARGET"]).parent / "filler", inodes=False)
    expected = _data(env, 1000)
    r = opguard(env, "sync")
    assert r.returncode == 4, f"exit {r.returncode}: {r.stderr}"
    assert "run identity" in r.stderr and "No space left on device" in r.stderr and "free space" in r.stderr
    assert "Traceback" not in r.stderr
    assert not (Path(env["OPGUARD_LOCAL_DUMP_TARGET"]) / ".opguard-bundles" / "format.json").exists()
    _free(filler)
    assert opguard(env, "sync").returncode == 0
    assert replay(env) == expected and state_leftovers(env) == []


def test_enospc_creating_the_upload_when_inodes_run_out(tmpfs_env: dict[str, str]) -> None:
    env = tmpfs_env
    write_file_atomic(rank_dir(env) / "first.bin", b"first")
    assert opguard(env, "sync").returncode == 0  # identity and stream directory exist
    filler = _fill(Path(env["OPGUARD_LOCAL_DUMP_TARGET"]).parent / "filler", inodes=True)
    expected = {"first.bin": b"first", **_data(env, 1000)}
    r = opguard(env, "sync")
    _free(filler)
    name = _assert_retained(env, r, "creating the upload", "No space left on device", "errno 28")
    r = opguard(env, "sync")
    assert r.returncode == 0, r.stderr
    r = opguard(env, "sync")
    assert r.returncode == 0, r.stderr
    assert [p.name for p in batches(env)][1:] == [name]
    assert replay(env) == expected and state_leftovers(env) == []


def test_enospc_writing_the_seal_then_a_final_sync_seals(tmpfs_env: dict[str, str]) -> None:
    env = tmpfs_env
    write_file_atomic(rank_dir(env) / "a.bin", b"a")
    assert opguard(env, "sync").returncode == 0
    filler = _fill(Path(env["OPGUARD_LOCAL_DUMP_TARGET"]).parent / "filler", inodes=True)
    r = opguard(env, "sync", "--final")
    _free(filler)
    assert r.returncode == 4 and "writing the seal" in r.stderr and "No space left" in r.stderr, r.stderr
    assert [n for n in os.listdir(stream_dir(env)) if n.endswith(".seal") or n.startswith(".")] == []
    r = opguard(env, "sync", "--final")
    assert r.returncode == 0, r.stderr
    assert opguard(env, "verify", env["OPGUARD_LOCAL_DUMP_TARGET"], "--require-sealed").returncode == 0
    assert len(batches(env)) == 1 and state_leftovers(env) == []


INJECTED = [  # (fault, errno, what stderr must name)
    ("write", "EIO", "writing the upload"),
    ("fsync", "EIO", "fsyncing the upload"),
    ("fsync", "ENOSPC", "fsyncing the upload"),
    ("close", "EIO", "closing the upload"),
    ("close", "EDQUOT", "closing the upload"),
    ("rename", "EIO", "renaming the upload"),
]


def _inject(env: dict[str, str], fault: str, code: str, log: Path) -> dict[str, str]:
    return {**env, "PYTHONPATH": str(FAULTINJECT), "OPGUARD_TEST_FAULT": f"{fault}:{code}",
            "OPGUARD_TEST_FAULT_UNDER": str(Path(env["OPGUARD_LOCAL_DUMP_TARGET"]) / ".opguard-bundles" / "streams"),
            "OPGUARD_TEST_FAULT_LOG": str(log)}


@pytest.mark.parametrize(("fault", "code", "step"), INJECTED, ids=[f"{f}-{c}" for f, c, _ in INJECTED])
def test_injected_fault_exits_4_keeps_the_batch_and_publishes_once(
        staging_env: dict[str, str], tmp_path: Path, fault: str, code: str, step: str) -> None:
    env = staging_env
    expected = _data(env, 3 << 20)  # several write() chunks
    log = tmp_path / "faults.log"
    r = opguard(_inject(env, fault, code, log), "sync")
    num = getattr(errno, code)
    name = _assert_retained(env, r, step, os.strerror(num), f"errno {num}")
    injected = log.read_text().splitlines()
    assert len(injected) == 1, f"the failing call was retried: {injected}"  # never fsync (or write) again
    if code in ("ENOSPC", "EDQUOT"):
        assert "free space or quota" in r.stderr
    _published_once(env, name, expected)


def test_rename_that_fails_but_happened_is_published(staging_env: dict[str, str], tmp_path: Path) -> None:
    env = staging_env
    expected = _data(env, 1000)
    r = opguard(_inject(env, "rename-happened", "EIO", tmp_path / "log"), "sync")
    assert r.returncode == 0, r.stderr  # recognised by the final name existing with the batch's size
    assert len(batches(env)) == 1 and state_leftovers(env) == []
    r = opguard(env, "sync")
    assert r.returncode == 0 and len(batches(env)) == 1
    assert replay(env) == expected


def test_directory_fsync_failure_after_the_rename(staging_env: dict[str, str], tmp_path: Path) -> None:
    env = staging_env
    expected = _data(env, 1000)
    r = opguard(_inject(env, "fsync-dir", "EIO", tmp_path / "log"), "sync")
    assert r.returncode == 4 and "fsyncing the directory" in r.stderr and "errno 5" in r.stderr, r.stderr
    pending = _pending(env)
    assert pending is not None and [p.name for p in batches(env)] == [pending["name"]]
    _published_once(env, str(pending["name"]), expected)


@pytest.fixture
def tmpfs_local_env(staging_env: dict[str, str], tmp_path: Path) -> Iterator[dict[str, str]]:
    """The staging environment with its node-local base on a 4 MiB tmpfs (a really full staging disk)."""
    mnt = tmp_path / "tiny-local"
    mnt.mkdir()
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=4m", "tmpfs", str(mnt)], capture_output=True, text=True)
    if r.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs (needs root / CAP_SYS_ADMIN): {r.stderr.strip()}")
    try:
        yield {**staging_env, "OPGUARD_LOCAL_DUMP_BASE": str(mnt / "opguard")}
    finally:
        subprocess.run(["umount", str(mnt)], check=False)
        if os.path.ismount(mnt):
            subprocess.run(["umount", "-l", str(mnt)], check=True)


def _full_local_sync(env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    big = rank_dir(env) / "big.bin"
    write_file_atomic(big, os.urandom(2_500_000))  # the pending batch (~2.5 MB) does not fit beside it
    return opguard(env, "sync")


def test_full_staging_disk_while_building_fails_cleanly(tmpfs_local_env: dict[str, str]) -> None:
    env = tmpfs_local_env
    r = _full_local_sync(env)
    assert r.returncode == 4 and "No space left on device" in r.stderr, r.stderr
    state = Path(env["OPGUARD_LOCAL_DUMP_BASE"]) / "state/streams/rank-000000"
    assert not (state / "pending.json").exists() and list((state / "pending").iterdir()) == []  # no half batch
    assert batches(env) == []
    (rank_dir(env) / "big.bin").unlink()  # the producer frees space
    write_file_atomic(rank_dir(env) / "small.bin", b"s")
    assert opguard(env, "sync").returncode == 0
    assert replay(env) == {"small.bin": b"s"} and state_leftovers(env) == []


def test_full_staging_disk_message_names_the_staging_base(tmpfs_local_env: dict[str, str]) -> None:
    r = _full_local_sync(tmpfs_local_env)
    assert r.returncode == 4
    base = tmpfs_local_env["OPGUARD_LOCAL_DUMP_BASE"]
    assert f"OPGUARD_LOCAL_DUMP_BASE={base}" in r.stderr, r.stderr
    assert f"{base}/state/streams/rank-000000/pending" in r.stderr, r.stderr  # the pending directory
    assert "errno 28" in r.stderr and "traces plus one pending batch" in r.stderr, r.stderr  # cause and fix
    assert "changed while being read" not in r.stderr, r.stderr  # a full disk is not a torn source
