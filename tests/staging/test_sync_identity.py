"""Run identity is checked before the first upload; every refusal exits 6 and writes nothing."""

from __future__ import annotations

import gzip
import json
import shutil
from pathlib import Path

import pytest

from opguard.errors import IdentityError
from opguard.staging.config import StagingConfig
from opguard.staging.layout import Layout
from opguard.staging.target import check_target
from opguard.staging.writers import write_file_atomic
from tests.helpers.sync import batches, opguard, rank_dir, sync, tree_of


def snapshot(root: Path) -> dict[str, bytes | None]:
    """Every path under root with its content (None for directories)."""
    return {p.relative_to(root).as_posix(): (p.read_bytes() if p.is_file() else None)
            for p in sorted(root.rglob("*"))}


def refused(env: dict[str, str], *needles: str) -> str:
    target, local = Path(env["OPGUARD_LOCAL_DUMP_TARGET"]), Path(env["OPGUARD_LOCAL_DUMP_BASE"])
    before_t, before_l = snapshot(target), snapshot(local)
    r = opguard(env, "sync", "--all", "--final")
    assert r.returncode == 6, r.stderr
    for n in needles:
        assert n in r.stderr, r.stderr
    assert "fix:" in r.stderr
    assert snapshot(target) == before_t, "a refusal wrote to the target"
    after_l = snapshot(local)
    assert {k: v for k, v in after_l.items() if "/locks" not in k and not k.endswith("locks")} == \
        {k: v for k, v in before_l.items() if "/locks" not in k and not k.endswith("locks")}, "local state changed"
    return r.stderr


def _data(env: dict[str, str]) -> None:
    write_file_atomic(rank_dir(env) / "x.bin", b"x")


def test_target_of_another_run(staging_env: dict[str, str]) -> None:
    _data(staging_env)
    b = Path(staging_env["OPGUARD_LOCAL_DUMP_TARGET"]) / ".opguard-bundles"
    b.mkdir()
    (b / "format.json").write_text(json.dumps({"format": "opguard-bundles", "version": 2, "run_id": "other"}))
    refused(staging_env, "'other'", "experiment-001")


def test_target_of_a_newer_format(staging_env: dict[str, str]) -> None:
    _data(staging_env)
    b = Path(staging_env["OPGUARD_LOCAL_DUMP_TARGET"]) / ".opguard-bundles"
    b.mkdir()
    (b / "format.json").write_text(json.dumps({"format": "opguard-bundles", "version": 3,
                                               "run_id": "experiment-001"}))
    refused(staging_env, "version 3", "upgrade opguard")


def test_legacy_snapshot_target(staging_env: dict[str, str]) -> None:
    _data(staging_env)
    legacy = Path(staging_env["OPGUARD_LOCAL_DUMP_TARGET"]) / "exec_trace" / "gpu_003" / "sync.tar.gz"
    legacy.parent.mkdir(parents=True)
    legacy.write_bytes(gzip.compress(b""))
    refused(staging_env, str(legacy), "new output directory")


def test_reference_v1_bundles_target(staging_env: dict[str, str]) -> None:
    _data(staging_env)
    v1 = Path(staging_env["OPGUARD_LOCAL_DUMP_TARGET"]) / ".opguard-bundles" / "node1-rank000000"
    v1.mkdir(parents=True)
    (v1 / f"{1:012d}-{'0' * 64}.tar").write_bytes(b"")
    refused(staging_env, "node1-rank000000", "new output directory")


def test_local_state_of_another_run(staging_env: dict[str, str]) -> None:
    _data(staging_env)
    sync(staging_env)
    refused({**staging_env, "OPGUARD_RUN_ID": "experiment-002"}, "experiment-002", "OPGUARD_LOCAL_DUMP_BASE")


def test_local_state_for_another_target(staging_env: dict[str, str], tmp_path: Path) -> None:
    _data(staging_env)
    sync(staging_env)
    other = tmp_path / "elsewhere" / "experiment-001"
    other.mkdir(parents=True)
    refused({**staging_env, "OPGUARD_LOCAL_DUMP_TARGET": str(other)}, str(other))


def test_published_stream_without_local_checkpoint(staging_env: dict[str, str]) -> None:
    _data(staging_env)
    sync(staging_env)
    shutil.rmtree(Path(staging_env["OPGUARD_LOCAL_DUMP_BASE"]) / "state" / "streams")
    err = refused(staging_env, "rank-000000", "restore the staging directory or choose a new run ID")
    assert "no local checkpoint" in err


def test_target_ahead_of_the_checkpoint(staging_env: dict[str, str], tmp_path: Path) -> None:
    env = staging_env
    _data(env)
    sync(env)
    state = Path(env["OPGUARD_LOCAL_DUMP_BASE"]) / "state"
    saved = tmp_path / "saved-state"
    shutil.copytree(state, saved)
    write_file_atomic(rank_dir(env) / "y.bin", b"y")
    sync(env)
    assert len(batches(env)) == 2
    shutil.rmtree(state)
    shutil.copytree(saved, state)  # a stale checkpoint
    refused(env, "ends at batch 2", "expects batch 1")


def test_preflight_check_target_reads_only(staging_env: dict[str, str]) -> None:
    env = staging_env
    config = StagingConfig.from_env(env)
    layout = Layout(config)
    target = Path(env["OPGUARD_LOCAL_DUMP_TARGET"])
    check_target(config, layout, ["rank-000000"])  # a fresh target is fine
    assert snapshot(target) == {} and not (Path(env["OPGUARD_LOCAL_DUMP_BASE"]) / "state").exists()
    legacy = target / "gpu_000" / "sync.tar.gz"
    legacy.parent.mkdir()
    legacy.write_bytes(b"")
    before = snapshot(target)
    with pytest.raises(IdentityError, match=r"sync\.tar\.gz"):
        check_target(config, layout, ["rank-000000"])
    assert snapshot(target) == before


def test_accepted_target_round_trip_is_untouched_by_a_second_identical_sync(staging_env: dict[str, str]) -> None:
    _data(staging_env)
    sync(staging_env)
    target = Path(staging_env["OPGUARD_LOCAL_DUMP_TARGET"])
    before = tree_of(target)
    sync(staging_env)
    assert tree_of(target) == before


def test_pending_batch_that_does_not_follow_the_checkpoint(staging_env: dict[str, str]) -> None:
    env = {**staging_env, "OPGUARD_SYNC_LOCK_TIMEOUT": "0.2"}
    _data(env)
    sd = Path(env["OPGUARD_LOCAL_DUMP_BASE"]) / "state" / "streams" / "rank-000000"
    # leave a pending batch behind: the node upload lock is held by "someone"
    import filelock

    lock = filelock.FileLock(str(Path(env["OPGUARD_LOCAL_DUMP_BASE"]) / "state" / "locks" / "node-upload.lock"))
    (Path(env["OPGUARD_LOCAL_DUMP_BASE"]) / "state" / "locks").mkdir(parents=True)
    with lock:
        r = opguard(env, "sync")  # another process: the lock is really contended
    assert r.returncode == 3 and (sd / "pending.json").exists()
    doc = json.loads((sd / "pending.json").read_text())
    doc["sequence"] = 5
    (sd / "pending.json").write_text(json.dumps(doc))
    refused(env, "pending.json holds batch 5", "checkpoint's next batch is 1")
