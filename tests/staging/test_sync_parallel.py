"""Several streams of one sync built at once (in forked worker processes, or threads): the same
batches as one at a time, uploads never overlap (the sync's own mutex, then the node upload lock),
reports in the order of the streams, a dead worker costs its stream this sync only, and a killed
sync leaves no worker behind."""

from __future__ import annotations

import itertools
import os
import signal
import subprocess
import threading
import time
from pathlib import Path
from typing import Any

import pytest

from opguard.errors import ConfigError
from opguard.staging import sync as sync_mod
from opguard.staging.config import StagingConfig
from opguard.staging.layout import Layout
from opguard.staging.sync import stream_workers, sync_streams
from opguard.staging.writers import write_file_atomic
from tests.conftest import BIN
from tests.helpers.sync import forked_workers, kill_and_check_workers_die, rank_dir, replay


def _fill(env: dict[str, str], ranks: int) -> dict[int, dict[str, bytes]]:
    written: dict[int, dict[str, bytes]] = {}
    for r in range(ranks):
        d = rank_dir(env, r)
        files = {f"f{i}.bin": os.urandom(64 * 1024 + r) for i in range(20)}
        for name, data in files.items():
            write_file_atomic(d / name, data)
        written[r] = files
    return written


@pytest.mark.parametrize(("workers", "processes", "kind", "forks"),
                         [(1, None, "auto", False), (4, False, "auto", False), (4, True, "auto", True),
                          (4, None, "auto", True), (4, None, "threads", False), (4, None, "processes", True)],
                         ids=["one-at-a-time", "threads", "processes", "auto", "env-threads", "env-processes"])
def test_parallel_streams_publish_what_was_written_and_uploads_take_turns(
        staging_env: dict[str, str], monkeypatch: pytest.MonkeyPatch, tmp_path: Path, workers: int,
        processes: bool | None, kind: str, forks: bool) -> None:
    written = _fill(staging_env, 6)
    log = tmp_path / "uploads"  # one line per upload: start, end, pid (workers may be processes)
    real_upload = sync_mod.upload

    def logged_upload(*a: Any, **k: Any) -> Any:
        t0 = time.monotonic()
        time.sleep(0.02)  # widen the window in which an overlap would show
        try:
            return real_upload(*a, **k)
        finally:
            with open(log, "a") as f:
                f.write(f"{t0} {time.monotonic()} {os.getpid()}\n")

    monkeypatch.setattr(sync_mod, "upload", logged_upload)
    config = StagingConfig.from_env({**staging_env, "OPGUARD_SYNC_WORKERS": kind})
    streams = [f"rank-{r:06d}" for r in reversed(range(6))]
    rep = sync_streams(config, Layout(config), streams, node_id="node-a", workers=workers, processes=processes)
    assert [s.stream for s in rep.streams] == streams  # the order given, whatever finished first
    assert all(s.exit_code == 0 and s.batches == 1 and s.uploaded_bytes > 0 for s in rep.streams), rep.to_json()
    spans = sorted((float(a), float(b), int(pid)) for a, b, pid in (ln.split() for ln in log.read_text().splitlines()))
    assert len(spans) == 6
    assert all(x[1] <= y[0] for x, y in itertools.pairwise(spans)), f"two uploads at once: {spans}"
    pids = {pid for _, _, pid in spans}
    assert (os.getpid() not in pids and len(pids) >= 2) if forks else pids == {os.getpid()}
    for r, files in written.items():
        assert replay(staging_env, f"rank-{r:06d}") == files


def test_a_stream_whose_worker_process_dies_is_reported_and_the_next_sync_publishes_it(
        staging_env: dict[str, str], monkeypatch: pytest.MonkeyPatch) -> None:
    written = _fill(staging_env, 4)
    real = sync_mod._sync_stream

    def dying(ctx: Any, final: bool) -> None:
        if ctx.stream == "rank-000002":
            os.kill(os.getpid(), signal.SIGKILL)  # as the OOM killer would
        real(ctx, final)

    monkeypatch.setattr(sync_mod, "_sync_stream", dying)
    config = StagingConfig.from_env(staging_env)
    streams = [f"rank-{r:06d}" for r in range(4)]
    rep = sync_streams(config, Layout(config), streams, node_id="node-a", workers=2, processes=True)
    lost = rep.streams[2]
    assert lost.exit_code == 4 and rep.exit_code == 4
    assert lost.error is not None and "rank-000002: its worker process was killed by SIGKILL" in lost.error
    assert all(s.exit_code == 0 and s.batches == 1 for i, s in enumerate(rep.streams) if i != 2), rep.to_json()
    monkeypatch.setattr(sync_mod, "_sync_stream", real)
    again = sync_streams(config, Layout(config), streams, node_id="node-a", workers=2, processes=True)
    assert again.exit_code == 0 and [s.batches for s in again.streams] == [0, 0, 1, 0]
    for r, files in written.items():
        assert replay(staging_env, f"rank-{r:06d}") == files


def test_a_killed_sync_leaves_no_worker_behind(staging_env: dict[str, str]) -> None:
    _fill(staging_env, 4)
    env = {**staging_env, "OPGUARD_SYNC_MBPS": "0.25"}  # 1.3 MiB a stream: each upload takes seconds
    p = subprocess.Popen([str(BIN / "opguard"), "sync", "--all", "-q"], env=env, stderr=subprocess.DEVNULL)
    try:
        kill_and_check_workers_die(p, forked_workers(p, 2))
    finally:
        p.kill()
    r = subprocess.run([str(BIN / "opguard"), "sync", "--all", "--final", "-q"], env=staging_env,
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr  # no stream lock left held, everything resumes


def test_stream_workers_is_derived_from_the_cpus_and_bounded() -> None:
    cpus = len(os.sched_getaffinity(0))
    assert stream_workers(1) == 1
    assert stream_workers(64) == min(cpus, sync_mod.MAX_STREAM_WORKERS)
    assert 1 <= stream_workers(2) <= 2


def test_processes_asked_for_where_forking_is_unsafe_is_refused_before_anything_is_done(
        staging_env: dict[str, str]) -> None:
    _fill(staging_env, 2)
    config = StagingConfig.from_env({**staging_env, "OPGUARD_SYNC_WORKERS": "processes"})
    stop = threading.Event()
    other = threading.Thread(target=stop.wait)  # a second thread: a fork would copy only this one
    other.start()
    try:
        with pytest.raises(ConfigError, match="OPGUARD_SYNC_WORKERS=processes") as ei:
            sync_streams(config, Layout(config), ["rank-000000", "rank-000001"], node_id="node-a", workers=2)
        assert ei.value.exit_code == 2 and "threads" in ei.value.fix
    finally:
        stop.set()
        other.join()
    assert list(Path(staging_env["OPGUARD_LOCAL_DUMP_TARGET"]).iterdir()) == []  # not even the run identity


def test_processes_without_a_temporary_file_for_the_mutex_is_a_clear_error_and_auto_uses_threads(
        staging_env: dict[str, str], monkeypatch: pytest.MonkeyPatch) -> None:
    written = _fill(staging_env, 2)

    def no_tmp() -> None:  # injected at the use site: tempfile found no usable directory
        raise FileNotFoundError(2, "No usable temporary directory found")

    monkeypatch.setattr(sync_mod.forkpool, "ProcessMutex", no_tmp)
    streams = ["rank-000000", "rank-000001"]
    config = StagingConfig.from_env({**staging_env, "OPGUARD_SYNC_WORKERS": "processes"})
    with pytest.raises(ConfigError, match="temporary file for their upload mutex") as ei:
        sync_streams(config, Layout(config), streams, node_id="node-a", workers=2)
    assert ei.value.exit_code == 2 and "OPGUARD_SYNC_WORKERS=threads" in ei.value.fix and "TMPDIR" in ei.value.fix
    assert not (Path(staging_env["OPGUARD_LOCAL_DUMP_TARGET"]) / ".opguard-bundles" / "streams").exists()
    config = StagingConfig.from_env(staging_env)  # auto: threads, which need no temporary file
    rep = sync_streams(config, Layout(config), streams, node_id="node-a", workers=2)
    assert rep.exit_code == 0 and [s.batches for s in rep.streams] == [1, 1]
    for r, files in written.items():
        assert replay(staging_env, f"rank-{r:06d}") == files


@pytest.mark.parametrize(("cpus", "builders", "expected"),
                         [(1, 1, 0), (2, 1, 2), (2, 2, 0), (4, 1, 4), (16, 1, 4), (16, 2, 2), (16, 4, 1),
                          (3, 2, 1), (4, 8, 0)])
def test_zstd_workers_share_the_cpus_the_builders_leave(monkeypatch: pytest.MonkeyPatch, cpus: int, builders: int,
                                                        expected: int) -> None:
    monkeypatch.setattr(sync_mod, "usable_cpus", lambda: cpus)
    monkeypatch.setattr(sync_mod, "busy_cpus", lambda: 0.0)
    assert sync_mod.zstd_workers(builders) == expected
    assert expected * builders <= sync_mod.MAX_ZSTD_WORKERS


@pytest.mark.parametrize(("cpus", "load", "builders", "expected"),
                         [(2, 0.5, 1, 2), (2, 1.0, 1, 0), (2, 5.0, 1, 0), (16, 8.0, 1, 4), (16, 14.5, 1, 2),
                          (16, 15.0, 1, 0), (16, 12.5, 2, 2), (16, 13.5, 2, 1), (16, 14.0, 2, 0)])
def test_zstd_workers_compress_inline_when_the_cpus_are_busy(monkeypatch: pytest.MonkeyPatch, cpus: int,
                                                             load: float, builders: int, expected: int) -> None:
    """Workers cost CPU of their own: only where the CPUs left idle lately outnumber the builders."""
    monkeypatch.setattr(sync_mod, "usable_cpus", lambda: cpus)
    monkeypatch.setattr(sync_mod, "busy_cpus", lambda: load)
    assert sync_mod.zstd_workers(builders) == expected


@pytest.mark.parametrize(("load", "field", "expected"),
                         [(3.0, "1/310", 0.0), (3.0, "3/310", 2.0), (0.5, "6/310", 0.5), (1.4, "2/310", 1.0)])
def test_busy_cpus_is_the_smaller_of_the_load_average_and_the_threads_runnable_now(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, load: float, field: str, expected: float) -> None:
    """A load average still high from the last minute's work does not hide CPUs that are idle now
    (the reading thread itself is one of the runnable threads)."""
    fake = tmp_path / "loadavg"
    fake.write_text(f"{load:.2f} 1.00 1.00 {field} 12345\n")
    monkeypatch.setattr(sync_mod.os, "getloadavg", lambda: (load, 1.0, 1.0))
    assert sync_mod.busy_cpus(str(fake)) == expected


def test_busy_cpus_falls_back_to_the_load_average_without_a_runnable_count(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(sync_mod.os, "getloadavg", lambda: (2.5, 1.0, 1.0))
    assert sync_mod.busy_cpus(str(tmp_path / "missing")) == 2.5
    (tmp_path / "odd").write_text("2.50 1.00\n")
    assert sync_mod.busy_cpus(str(tmp_path / "odd")) == 2.5


def test_one_stream_compresses_with_zstd_workers_and_restores_the_same_bytes(
        staging_env: dict[str, str], monkeypatch: pytest.MonkeyPatch) -> None:
    """A single stream with CPUs to spare: the batch is compressed by zstd worker threads in jobs of
    ZSTD_JOB_SIZE (several jobs here), and the one frame reads back entry for entry."""
    from opguard.staging import build as build_mod
    from opguard.staging.bundle import ZSTD_JOB_SIZE, BatchWriter

    d = rank_dir(staging_env, 0)
    lines = b"".join(b'{"op": "aten::mm", "step": %d, "value": %d}\n' % (i, i * i) for i in range(200_000))
    assert len(lines) > 3 * ZSTD_JOB_SIZE
    (d / "trace.jsonl").write_bytes(lines)
    write_file_atomic(d / "t.bin", os.urandom(3 * ZSTD_JOB_SIZE + 17))
    threads: list[int] = []

    class Spy(BatchWriter):
        def __init__(self, *a: Any, **k: Any) -> None:
            threads.append(k.get("threads", -99))
            super().__init__(*a, **k)

    monkeypatch.setattr(build_mod, "BatchWriter", Spy)
    monkeypatch.setattr(sync_mod, "usable_cpus", lambda: 8)
    monkeypatch.setattr(sync_mod, "busy_cpus", lambda: 0.0)
    config = StagingConfig.from_env(staging_env)
    rep = sync_streams(config, Layout(config), ["rank-000000"], node_id="node-a", final=True)
    assert rep.exit_code == 0 and rep.streams[0].batches == 1, rep.to_json()
    assert threads == [sync_mod.MAX_ZSTD_WORKERS]
    assert replay(staging_env) == {"trace.jsonl": lines, "t.bin": (d / "t.bin").read_bytes()}


def test_the_node_stream_compresses_inline_and_leaves_the_workers_to_the_rank_stream(
        staging_env: dict[str, str], monkeypatch: pytest.MonkeyPatch) -> None:
    """The per-rank wrapper's ``--rank R --node`` on 2 CPUs: two builders, but the node stream is
    metadata, so rank R's batch gets the zstd workers of a one-stream sync."""
    written = _fill(staging_env, 1)
    config = StagingConfig.from_env(staging_env)
    layout = Layout(config)
    node = layout.node_dir("node-a")
    node.mkdir(parents=True)
    write_file_atomic(node / "attempts.json", b'{"version": 1}')
    seen: dict[str, int] = {}
    real = sync_mod._sync_one

    def spy(config: Any, layout: Any, sr: Any, final: bool, node_id: str, tb: Any, say: Any, zstd_threads: int,
            uploading: Any) -> Any:
        seen[sr.stream] = zstd_threads
        return real(config, layout, sr, final, node_id, tb, say, zstd_threads, uploading)

    monkeypatch.setattr(sync_mod, "_sync_one", spy)
    monkeypatch.setattr(sync_mod, "usable_cpus", lambda: 2)
    monkeypatch.setattr(sync_mod, "busy_cpus", lambda: 0.5)
    rep = sync_streams(config, layout, ["rank-000000", "node-node-a"], node_id="node-a", final=True,
                       processes=False)
    assert rep.exit_code == 0, rep.to_json()
    assert seen == {"rank-000000": 2, "node-node-a": 0}
    assert replay(staging_env) == written[0]
