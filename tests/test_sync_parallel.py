"""Several streams of one sync built at once: the same batches as one at a time, uploads never
overlap (the in-process mutex, then the node upload lock), reports in the order of the streams."""

from __future__ import annotations

import os
import threading
import time
from typing import Any

import pytest

from opguard.staging import sync as sync_mod
from opguard.staging.config import StagingConfig
from opguard.staging.layout import Layout
from opguard.staging.sync import stream_workers, sync_streams
from opguard.staging.writers import write_file_atomic
from tests.test_sync_support import rank_dir, replay


def _fill(env: dict[str, str], ranks: int) -> dict[int, dict[str, bytes]]:
    written: dict[int, dict[str, bytes]] = {}
    for r in range(ranks):
        d = rank_dir(env, r)
        files = {f"f{i}.bin": os.urandom(64 * 1024 + r) for i in range(20)}
        for name, data in files.items():
            write_file_atomic(d / name, data)
        written[r] = files
    return written


@pytest.mark.parametrize("workers", [1, 4])
def test_parallel_streams_publish_what_was_written_and_uploads_take_turns(
        staging_env: dict[str, str], monkeypatch: pytest.MonkeyPatch, workers: int) -> None:
    written = _fill(staging_env, 6)
    active: list[int] = [0]
    most: list[int] = [0]
    guard = threading.Lock()
    real_upload = sync_mod.upload

    def counting_upload(*a: Any, **k: Any) -> Any:
        with guard:
            active[0] += 1
            most[0] = max(most[0], active[0])
        try:
            time.sleep(0.02)  # widen the window in which an overlap would show
            return real_upload(*a, **k)
        finally:
            with guard:
                active[0] -= 1

    monkeypatch.setattr(sync_mod, "upload", counting_upload)
    config = StagingConfig.from_env(staging_env)
    streams = [f"rank-{r:06d}" for r in reversed(range(6))]
    rep = sync_streams(config, Layout(config), streams, node_id="node-a", workers=workers)
    assert [s.stream for s in rep.streams] == streams  # the order given, whatever finished first
    assert all(s.exit_code == 0 and s.batches == 1 for s in rep.streams), rep.to_json()
    assert most[0] == 1  # never two uploads at once from one node
    for r, files in written.items():
        assert replay(staging_env, f"rank-{r:06d}") == files


def test_stream_workers_is_derived_from_the_cpus_and_bounded() -> None:
    cpus = len(os.sched_getaffinity(0))
    assert stream_workers(1) == 1
    assert stream_workers(64) == min(cpus, sync_mod.MAX_STREAM_WORKERS)
    assert 1 <= stream_workers(2) <= 2
