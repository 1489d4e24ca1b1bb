"""opguard.staging.forkpool: jobs in forked workers, results in order, a dead worker loses its job
only, a raising job raises in the caller, workers die with their parent, the process mutex
excludes across workers, and a shared token bucket is one bucket for all of them."""

from __future__ import annotations

import itertools
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import psutil
import pytest

from opguard.staging import forkpool
from opguard.staging.ratelimit import TokenBucket
from tests.helpers.sync import forked_workers, kill_and_check_workers_die

pytestmark = pytest.mark.skipif(not forkpool.available(), reason="forkpool needs Linux and a single-threaded caller")


def _lost(job: int, why: str) -> str:
    return f"lost {job}: {why}"


def test_results_come_back_in_job_order_from_several_processes() -> None:
    def job(i: int) -> tuple[int, int]:
        time.sleep(0.001 * (i % 3))  # finish out of order
        return i * i, os.getpid()

    out = forkpool.run(list(range(20)), 3, job, _lost)
    assert [sq for sq, _ in out] == [i * i for i in range(20)]
    pids = {pid for _, pid in out}
    assert os.getpid() not in pids and 2 <= len(pids) <= 3


def test_a_worker_that_dies_loses_its_job_only() -> None:
    def job(i: int) -> int:
        if i == 2:
            os.kill(os.getpid(), signal.SIGKILL)
        return i

    out = forkpool.run(list(range(6)), 2, job, _lost)
    assert out[:2] == [0, 1] and out[3:] == [3, 4, 5]
    assert out[2] == "lost 2: its worker process was killed by SIGKILL (the kernel's OOM killer sends SIGKILL)"


def test_when_every_worker_died_the_remaining_jobs_are_reported_lost() -> None:
    def job(i: int) -> int:
        os._exit(3)

    out = forkpool.run([0, 1, 2], 1, job, _lost)
    assert out == ["lost 0: its worker process exited with status 3 before it answered",
                   "lost 1: it was never started: every worker process had died",
                   "lost 2: it was never started: every worker process had died"]


def test_an_exception_in_a_job_is_raised_in_the_caller_with_the_workers_traceback() -> None:
    def job(i: int) -> int:
        if i == 1:
            raise KeyError("stream-1")
        return i

    with pytest.raises(KeyError, match="stream-1") as info:
        forkpool.run([0, 1, 2, 3], 2, job, _lost)
    notes = getattr(info.value, "__notes__", [])
    if sys.version_info >= (3, 11):
        assert any("in a sync worker process" in n and "raise KeyError" in n for n in notes)
    assert psutil.Process().children() == []  # every worker reaped


def test_an_exception_that_does_not_pickle_still_reaches_the_caller() -> None:
    class Local(Exception):  # defined in a function: pickle cannot name it
        pass

    def job(i: int) -> int:
        raise Local("no pickle")

    with pytest.raises(forkpool.WorkerError, match="Local: no pickle"):
        forkpool.run([0], 1, job, _lost)


def test_output_buffered_before_the_fork_is_written_once(tmp_path: Path) -> None:
    code = ("import sys; from opguard.staging import forkpool; sys.stdout.write('before'); "
            "forkpool.run([1, 2], 2, lambda i: i, lambda j, w: w); print('|after')")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True).stdout
    assert out == "before|after\n"


def test_workers_die_when_their_parent_is_killed(tmp_path: Path) -> None:
    ready = tmp_path / "ready"
    code = ("import os, sys, time; from opguard.staging import forkpool\n"
            "def job(i):\n"
            f"    open({str(ready)!r} + str(i), 'w').close()\n"
            "    time.sleep(120)\n"
            "forkpool.run([0, 1], 2, job, lambda j, w: w)\n")
    p = subprocess.Popen([sys.executable, "-c", code])
    try:
        workers = forked_workers(p, 2, ready=lambda: Path(f"{ready}0").exists() and Path(f"{ready}1").exists())
        kill_and_check_workers_die(p, workers)
    finally:
        p.kill()


def test_process_mutex_excludes_workers_and_survives_a_holder_that_dies(tmp_path: Path) -> None:
    mutex = forkpool.ProcessMutex()
    log = tmp_path / "intervals"

    def job(i: int) -> int:
        with mutex:
            t0 = time.monotonic()
            if i == 0:
                os.kill(os.getpid(), signal.SIGKILL)  # dies holding it: the kernel releases the lock
            time.sleep(0.02)
            with open(log, "a") as f:
                f.write(f"{t0} {time.monotonic()}\n")
        return i

    try:
        out = forkpool.run(list(range(6)), 3, job, _lost)
    finally:
        mutex.close()
    assert out[1:] == [1, 2, 3, 4, 5] and str(out[0]).startswith("lost 0")
    spans = sorted(tuple(map(float, line.split())) for line in log.read_text().splitlines())
    assert len(spans) == 5
    assert all(a[1] <= b[0] for a, b in itertools.pairwise(spans)), f"overlapping holders: {spans}"


def test_a_shared_token_bucket_is_one_bucket_for_every_worker() -> None:
    now = [100.0]
    waits: list[float] = []
    shared = TokenBucket(1000, burst=1000, clock=lambda: now[0], sleep=waits.append)
    shared.share()
    private = TokenBucket(1000, burst=1000, clock=lambda: now[0], sleep=waits.append)
    assert forkpool.run([shared, private], 2, lambda b: b.consume(1000), lambda b, why: why) == [0.0, 0.0]
    # the worker's 1000 bytes emptied the shared bucket, not this process's private copy
    assert shared.consume(500) == pytest.approx(0.5)
    assert private.consume(500) == 0.0
    assert shared.slept == pytest.approx(0.5)


def test_map_jobs_forks_where_available_and_keeps_job_order() -> None:
    def job(i: int) -> tuple[int, int]:
        time.sleep(0.001 * (i % 3))
        return i * i, os.getpid()

    out = forkpool.map_jobs(job, list(range(12)), 3)
    assert [sq for sq, _ in out] == [i * i for i in range(12)]
    assert os.getpid() not in {pid for _, pid in out}


def test_map_jobs_runs_in_process_with_one_worker_one_job_or_another_thread() -> None:
    def job(i: int) -> tuple[int, int]:
        return i + 1, os.getpid()

    assert forkpool.map_jobs(job, [1, 2, 3], 1) == [(2, os.getpid()), (3, os.getpid()), (4, os.getpid())]
    assert forkpool.map_jobs(job, [7], 4) == [(8, os.getpid())]
    release = threading.Event()
    t = threading.Thread(target=release.wait)
    t.start()
    try:
        assert not forkpool.available()  # forking with a second thread running is unsafe
        assert forkpool.map_jobs(job, [1, 2], 2) == [(2, os.getpid()), (3, os.getpid())]
    finally:
        release.set()
        t.join()


def test_map_jobs_raises_what_a_job_raised_and_names_a_dead_worker() -> None:
    def raising(i: int) -> int:
        if i == 2:
            raise KeyError("job two")
        return i

    with pytest.raises(KeyError, match="job two") as info:
        forkpool.map_jobs(raising, [0, 1, 2, 3], 2)
    assert any("in a forked worker process" in n for n in getattr(info.value, "__notes__", []))

    def dying(i: int) -> int:
        if i == 1:
            os.kill(os.getpid(), signal.SIGKILL)
        return i

    with pytest.raises(forkpool.WorkerError, match=r"job 1 of 3 was lost: its worker process was killed by SIGKILL"):
        forkpool.map_jobs(dying, [0, 1, 2], 2)
