"""Every preflight refusal: its message, exit 2, the child never started, the target untouched."""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from opguard.launcher.mounts import is_network_fstype, mount_of, parse_mountinfo
from tests.launcher.helpers import PY, run_wrapper, tree_snapshot


def refused(env: dict[str, str], tmp_path: Path, *needles: str, extra: tuple[str, ...] = ()) -> str:
    """Run opguard-run on a child that would leave a marker; assert the refusal."""
    marker = tmp_path / "child-ran"
    target = Path(env.get("OPGUARD_LOCAL_DUMP_TARGET", str(tmp_path / "none")))
    before = tree_snapshot(target)
    r = run_wrapper([*extra, PY, "-c", f"open({str(marker)!r}, 'w').write('x')"], env)
    assert r.returncode == 2, r.stderr
    assert not marker.exists(), "the child was started"
    assert tree_snapshot(target) == before, "the target was modified"
    assert r.stdout == ""
    for n in needles:
        assert n in r.stderr, r.stderr
    assert "fix:" in r.stderr
    return r.stderr


def test_plan_ok_and_all_numbers(staging_env: dict[str, str], tmp_path: Path) -> None:
    env = {**staging_env, "OPGUARD_SYNC_AGGREGATE_MBPS": "100", "OPGUARD_NODE_COUNT": "4",
           "OPGUARD_NODE_INDEX": "2", "OPGUARD_SYNC_BATCH_MB": "64"}
    rank_dir = Path(env["OPGUARD_LOCAL_DUMP_BASE"]) / "ranks" / "rank-000000"
    rank_dir.mkdir(parents=True)
    (rank_dir / "t.jsonl").write_bytes(b"x" * (5 << 20))
    before = tree_snapshot(Path(env["OPGUARD_LOCAL_DUMP_TARGET"]))
    r = run_wrapper(["--plan", "--json", PY, "app.py"], env)
    assert r.returncode == 0, r.stderr
    plan = json.loads(r.stdout)
    assert plan["ok"] and plan["problems"] == []
    assert plan["sync"]["aggregate_share_mib_s"] == 25.0 and plan["sync"]["cap_mib_s"] == 25.0
    assert plan["derived"]["pending_bytes"] == 5 << 20
    assert plan["derived"]["drain_seconds_at_cap"] == pytest.approx(0.2)
    assert plan["derived"]["keeps_up"] is False  # 64 MiB at 25 MiB/s = 2.56 s > the 2 s interval
    assert any("cannot publish a full batch" in n for n in plan["identity"]["notes"])
    assert plan["identity"]["node_index"] == 2 and plan["sync"]["stagger_offset_s"] >= 1.0
    assert "stagger_offset_s" in r.stderr and "ok: no problems found" in r.stderr
    assert tree_snapshot(Path(env["OPGUARD_LOCAL_DUMP_TARGET"])) == before


def test_plan_lists_every_problem(staging_env: dict[str, str]) -> None:
    env = {**staging_env, "OPGUARD_SYNC_MBPS": "fast", "OPGUARD_SYNC_BATCH_MB": "0", "OPGUARD_NODE_ID": "localhost",
           "PMI_RANK": "9", "PMI_SIZE": "4"}
    r = run_wrapper(["--plan", "no-such-program-xyz"], env)
    assert r.returncode == 2
    for needle in ("OPGUARD_SYNC_MBPS='fast'", "OPGUARD_SYNC_BATCH_MB='0'", "loopback", "PMI_RANK=9",
                   "no-such-program-xyz"):
        assert needle in r.stderr, r.stderr
    assert "no local rank" in r.stderr and "6 problem(s)" in r.stderr


def test_opguard_plan_alias(staging_env: dict[str, str]) -> None:
    r = subprocess.run([os.path.join(os.path.dirname(PY), "opguard"), "plan", PY, "app.py"], env=staging_env,
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    assert "mode: single" in r.stderr


def test_staging_enabled_without_variables(staging_env: dict[str, str], tmp_path: Path) -> None:
    env = {k: v for k, v in staging_env.items() if k not in ("OPGUARD_LOCAL_DUMP_BASE",)}
    refused(env, tmp_path, "OPGUARD_LOCAL_DUMP_BASE is not set")


def test_local_base_parent_missing(staging_env: dict[str, str], tmp_path: Path) -> None:
    env = {**staging_env, "OPGUARD_LOCAL_DUMP_BASE": str(tmp_path / "nope" / "base")}
    refused(env, tmp_path, f"OPGUARD_LOCAL_DUMP_BASE={tmp_path / 'nope' / 'base'} does not exist",
            f"neither does its parent {tmp_path / 'nope'}")
    assert not (tmp_path / "nope").exists()


def test_target_parent_missing(staging_env: dict[str, str], tmp_path: Path) -> None:
    target = tmp_path / "unmounted" / "exp"
    env = {**staging_env, "OPGUARD_LOCAL_DUMP_TARGET": str(target), "OPGUARD_TRACE_OUTPUT_BASE": str(target)}
    refused(env, tmp_path, f"OPGUARD_LOCAL_DUMP_TARGET={target} does not exist",
            f"neither does its parent {tmp_path / 'unmounted'}")
    assert not (tmp_path / "unmounted").exists()
    r = run_wrapper(["--plan", PY, "app.py"], env)  # --plan says the same
    assert r.returncode == 2 and "neither does its parent" in r.stderr


@pytest.fixture
def readonly_dir(tmp_path: Path) -> Iterator[Path]:
    d = tmp_path / "ro"
    d.mkdir()
    if os.geteuid() != 0:
        d.chmod(0o555)
        yield d
        d.chmod(0o755)
        return
    # root ignores permissions: a read-only bind mount is the real thing
    r = subprocess.run(["mount", "--bind", str(d), str(d)], capture_output=True)
    if r.returncode != 0:
        pytest.skip(f"root cannot bind-mount here to make a read-only directory: {r.stderr!r}")
    subprocess.run(["mount", "-o", "remount,ro,bind", str(d)], check=True)
    try:
        yield d
    finally:
        subprocess.run(["umount", str(d)], check=True)


def test_local_base_unwritable(staging_env: dict[str, str], tmp_path: Path, readonly_dir: Path) -> None:
    env = {**staging_env, "OPGUARD_LOCAL_DUMP_BASE": str(readonly_dir)}
    refused(env, tmp_path, "is not writable")


def test_local_base_out_of_space(staging_env: dict[str, str], tmp_path: Path) -> None:
    free = os.statvfs(staging_env["OPGUARD_LOCAL_DUMP_BASE"])
    batch_mb = free.f_bavail * free.f_frsize // 2**20 + 1024
    env = {**staging_env, "OPGUARD_SYNC_BATCH_MB": str(batch_mb)}
    refused(env, tmp_path, "less than one batch", f"OPGUARD_SYNC_BATCH_MB={batch_mb}")


@pytest.mark.parametrize("fstype", ["nfs4", "lustre", "gpfs", "beegfs", "ceph", "cifs", "fuse.sshfs"])
def test_local_base_on_network_filesystem(staging_env: dict[str, str], tmp_path: Path, fstype: str) -> None:
    """Lustre/NFS cannot exist here: the mount table is the one faked part (a real file the CLI reads)."""
    base = os.path.realpath(staging_env["OPGUARD_LOCAL_DUMP_BASE"])
    mi = tmp_path / "mountinfo"
    mi.write_text("27 1 254:0 / / rw,relatime - ext4 /dev/vda rw\n"
                  f"90 27 0:50 / {os.path.dirname(base)} rw,relatime - {fstype} server:/export rw\n")
    refused(staging_env, tmp_path, f"on a {fstype} filesystem", "node-local", extra=("--mountinfo", str(mi)))


def test_local_base_and_target_contain_each_other(staging_env: dict[str, str], tmp_path: Path) -> None:
    inner = Path(staging_env["OPGUARD_LOCAL_DUMP_TARGET"]) / "local"
    inner.mkdir()
    env = {**staging_env, "OPGUARD_LOCAL_DUMP_BASE": str(inner)}
    refused(env, tmp_path, "contain each other")


def test_node_id_claimed_by_another_machine(staging_env: dict[str, str], tmp_path: Path) -> None:
    nodes = Path(staging_env["OPGUARD_LOCAL_DUMP_TARGET"]) / ".opguard-bundles" / "nodes"
    nodes.mkdir(parents=True)
    (nodes / "node-a.json").write_text(json.dumps({
        "version": 2, "node_id": "node-a", "hostname": "elsewhere", "machine_id": "0" * 32, "boot_id": "b",
        "run_id": "experiment-001", "claimed_at": 1.0}))
    # a normal run also leaves a conflict marker (tests/launcher/test_node_conflict.py); --plan writes nothing
    target = Path(staging_env["OPGUARD_LOCAL_DUMP_TARGET"])
    before = tree_snapshot(target)
    r = run_wrapper(["--plan", PY, "-c", "pass"], staging_env)
    assert r.returncode == 2
    for needle in ("node ID 'node-a' is already claimed", "elsewhere", "unique OPGUARD_NODE_ID"):
        assert needle in r.stderr, r.stderr
    assert tree_snapshot(target) == before


def test_target_of_another_run(staging_env: dict[str, str], tmp_path: Path) -> None:
    b = Path(staging_env["OPGUARD_LOCAL_DUMP_TARGET"]) / ".opguard-bundles"
    b.mkdir()
    (b / "format.json").write_text(json.dumps({"format": "opguard-bundles", "version": 2, "run_id": "other-run",
                                               "created_at": 1.0, "created_by": "x"}))
    refused(staging_env, tmp_path, "other-run")


def test_legacy_snapshot_target(staging_env: dict[str, str], tmp_path: Path) -> None:
    d = Path(staging_env["OPGUARD_LOCAL_DUMP_TARGET"]) / "exec_trace" / "gpu_000"
    d.mkdir(parents=True)
    (d / "sync.tar.gz").write_bytes(b"\x1f\x8b")
    refused(staging_env, tmp_path, "sync.tar.gz")


def test_local_base_of_another_run(staging_env: dict[str, str], tmp_path: Path) -> None:
    state = Path(staging_env["OPGUARD_LOCAL_DUMP_BASE"]) / "state"
    state.mkdir()
    (state / "run.json").write_text(json.dumps({"version": 2, "run_id": "old-run",
                                                "target": staging_env["OPGUARD_LOCAL_DUMP_TARGET"],
                                                "created_at": 1.0}))
    refused(staging_env, tmp_path, "old-run")


def test_identity_inconsistency_refused(staging_env: dict[str, str], tmp_path: Path) -> None:
    env = {**staging_env, "RANK": "5", "WORLD_SIZE": "4", "LOCAL_RANK": "0", "GROUP_RANK": "0"}
    refused(env, tmp_path, "RANK=5 is not below WORLD_SIZE=4")


def test_same_node_id_own_claim_is_fine(staging_env: dict[str, str], tmp_path: Path) -> None:
    nodes = Path(staging_env["OPGUARD_LOCAL_DUMP_TARGET"]) / ".opguard-bundles" / "nodes"
    nodes.mkdir(parents=True)
    mid = Path("/etc/machine-id").read_text().strip() if Path("/etc/machine-id").exists() else ""
    (nodes / "node-a.json").write_text(json.dumps({"version": 2, "node_id": "node-a",
                                                   "hostname": socket.gethostname(), "machine_id": mid}))
    r = run_wrapper(["--plan", PY, "x.py"], staging_env)
    assert r.returncode == 0, r.stderr


# ---- the mount table parser ------------------------------------------------------------------

def test_mountinfo_longest_prefix_and_escapes() -> None:
    text = ("27 1 254:0 / / rw - ext4 /dev/vda rw\n"
            "40 27 0:40 / /scratch rw - lustre 10.0.0.1@tcp:/fs rw\n"
            "41 40 0:41 / /scratch/local\\040ssd rw - xfs /dev/nvme0n1 rw\n")
    mounts = parse_mountinfo(text)
    assert [m.fstype for m in mounts] == ["ext4", "lustre", "xfs"]
    assert mount_of(Path("/scratch/x"), mounts).fstype == "lustre"  # type: ignore[union-attr]
    assert mount_of(Path("/scratch/local ssd/a"), mounts).fstype == "xfs"  # type: ignore[union-attr]
    assert mount_of(Path("/scratchy"), mounts).fstype == "ext4"  # type: ignore[union-attr]
    assert is_network_fstype("fuse.glusterfs") and is_network_fstype("nfs") and not is_network_fstype("tmpfs")


def test_lost_checkpoint_of_a_published_run(staging_env: dict[str, str], tmp_path: Path) -> None:
    """A run that already published rank 0, whose local checkpoint is then lost: refused before start."""
    code = "from opguard.staging.writers import open_jsonl; open_jsonl('t.jsonl').write({'a': 1})"
    first = run_wrapper([PY, "-c", code], staging_env)
    assert first.returncode == 0, first.stderr
    shutil.rmtree(Path(staging_env["OPGUARD_LOCAL_DUMP_BASE"]) / "state" / "streams" / "rank-000000")
    refused(staging_env, tmp_path, "already has 1 batch(es) on the target", "no local checkpoint",
            "restore the staging directory or choose a new run ID")


def _plan(env: dict[str, str], *cmd: str) -> tuple[dict[str, object], str]:
    r = run_wrapper(["--plan", "--json", *cmd], env)
    assert r.returncode == 0, r.stderr
    plan = json.loads(r.stdout)
    assert isinstance(plan, dict)
    return plan, r.stderr


def test_plan_warning_without_a_rate_is_called_a_floor(staging_env: dict[str, str]) -> None:
    plan, err = _plan(staging_env, PY, "app.py")
    derived = plan["derived"]
    assert isinstance(derived, dict)
    assert derived["suggested_warning_seconds"] == 30 and derived["expected_mib_s"] is None
    assert derived["stream_count"] == 2  # rank 0 and the node stream (node duty)
    assert "is the 30 s floor because no expected data rate was given" in err
    assert "OPGUARD_EXPECTED_MBPS" in err


def test_plan_warning_from_the_expected_rate(staging_env: dict[str, str]) -> None:
    """20 MiB/s per node, 60 s interval, 256 MiB batches, 32 MiB/s cap (docs/slurm.md's example):
    two streams publish at most 2 × 256 MiB per minute (8.5 MiB/s), so the backlog at the warning is
    one interval (1200 MiB) plus a batch in flight = 1456 MiB; an early drain while 20 MiB/s keep
    coming takes 1456 / (32 − 20) = 121.3 s, above 1.5 × 1456 / 32 = 68.3 s: 122 s."""
    env = {**staging_env, "OPGUARD_LOCAL_DUMP_SYNC_INTERVAL": "60", "OPGUARD_SYNC_MBPS": "32",
           "OPGUARD_EXPECTED_MBPS": "20"}
    plan, err = _plan(env, PY, "app.py")
    d = plan["derived"]
    assert isinstance(d, dict)
    assert d["expected_mib_s"] == 20 and d["expected_keeps_up"] is False
    assert d["expected_backlog_at_warning_mib"] == 1456.0
    assert d["suggested_warning_seconds"] == 122
    assert "periodic syncs fall behind by 11.5 MiB/s" in err
    assert "more than Slurm's default KillWait" in err and "--signal=B:USR1@122" in err
    assert "floor because no expected data rate" not in err
    # a rate the syncs keep up with: one interval of data, drained at the cap: 120 MiB / 32 MiB/s -> floor
    plan, err = _plan({**env, "OPGUARD_EXPECTED_MBPS": "2"}, PY, "app.py")
    d = plan["derived"]
    assert isinstance(d, dict)
    assert d["expected_keeps_up"] is True and d["suggested_warning_seconds"] == 30
    assert "expected rate 2 MiB/s" in str(d["suggested_warning_basis"])


def test_plan_torchrun_counts_every_local_rank_as_a_stream(staging_env: dict[str, str]) -> None:
    env = {**staging_env, "OPGUARD_SYNC_BATCH_MB": "1", "OPGUARD_SYNC_MBPS": "1000"}
    plan, _err = _plan(env, "torchrun", "--standalone", "--nproc-per-node=4", "app.py")
    d = plan["derived"]
    assert isinstance(d, dict)
    assert d["stream_count"] == 5  # four ranks and the node stream
    assert d["periodic_capacity_mib_s"] == pytest.approx(5 / 2, abs=1e-3)  # 5 × 1 MiB per 2 s interval


@pytest.mark.parametrize("value", ["fast", "0", "-3", "nan", "inf"])
def test_bad_expected_rate_is_refused(staging_env: dict[str, str], tmp_path: Path, value: str) -> None:
    env = {**staging_env, "OPGUARD_EXPECTED_MBPS": value}
    err = refused(env, tmp_path, f"OPGUARD_EXPECTED_MBPS={value!r}")
    assert "MiB/s of trace data one node writes" in err
