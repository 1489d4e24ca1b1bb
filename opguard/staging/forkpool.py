"""Independent jobs in forked worker processes (``docs/protocol.md``, "One sync of several streams").

One ``opguard sync --all`` builds its streams in parallel. Building a batch of many small files is
per-file Python (open, fstat, read, the entry, the checkpoint record) between calls that release
the GIL: builder *threads* spent most of their time handing the GIL back and forth, so two of them
on two cores were barely faster than one (``bench/staging_bench.py files``). Forked workers share
no interpreter.

Protocol between the parent and each worker (pipes, never a shared queue):

* the parent writes a job index (``<q``, 8 bytes) to the worker's task pipe, one at a time, or
  closes it when no job is left (the worker then exits 0);
* the worker answers each index with one message on its result pipe: an 8-byte length (``<Q``)
  and a pickled ``(index, ok, value)``; ``ok`` false carries the exception and its traceback text;
* a worker whose result pipe ends before it answered (killed, out of memory) loses that job only:
  the caller's ``lost(job, why)`` gives its result; the other jobs go on in the other workers.

Workers die with the parent (``PR_SET_PDEATHSIG``, checked against a parent that already died), so
a SIGKILLed sync leaves no orphan holding a stream lock. They leave by ``os._exit``: no ``atexit``,
no ``finally`` of the parent's frames, no second flush of buffers copied at the fork.

Two entry points: :func:`run` (the sync: a dead worker's job gets the caller's ``lost`` result, the
other jobs go on) and :func:`map_jobs` (any caller with independent pure jobs, e.g. compare's
passes: the :func:`available` check and the in-process fallback built in, a dead worker raises
:class:`WorkerError`). Jobs and ``fn`` reach the workers through the fork itself (a closure over
large objects costs nothing to send); only results are pickled back.
"""

from __future__ import annotations

import ctypes
import fcntl
import os
import pickle
import selectors
import signal
import struct
import sys
import tempfile
import threading
import traceback
from collections.abc import Callable, Sequence
from types import TracebackType
from typing import Any, TypeVar

T = TypeVar("T")
R = TypeVar("R")

_INDEX = struct.Struct("<q")
_LENGTH = struct.Struct("<Q")
_PR_SET_PDEATHSIG = 1
_FAILED_START = 70  # a worker's exit status when it could not tie its life to the parent's


def available() -> bool:
    """Whether forking workers is safe here: Linux (the parent-death signal) and a caller that runs
    a single thread (a fork copies only the calling thread; locks other threads hold stay held)."""
    return sys.platform.startswith("linux") and hasattr(os, "fork") and threading.active_count() == 1


class WorkerError(Exception):
    """A job raised in its worker and the exception could not be sent back as it was."""


class ProcessMutex:
    """A mutex for one process and the workers it forks after creating it (and their threads).

    A POSIX record lock (``lockf``) on an anonymous file opened before the fork: record locks
    belong to processes, so the workers exclude each other through the shared descriptor, and the
    kernel releases the lock of a worker that dies holding it.
    """

    def __init__(self) -> None:
        self._file = tempfile.TemporaryFile()  # noqa: SIM115 - lives as long as the mutex
        self._thread = threading.Lock()

    def __enter__(self) -> ProcessMutex:
        self._thread.acquire()
        try:
            fcntl.lockf(self._file, fcntl.LOCK_EX)
        except BaseException:
            self._thread.release()
            raise
        return self

    def __exit__(self, et: type[BaseException] | None, e: BaseException | None, tb: TracebackType | None) -> None:
        try:
            fcntl.lockf(self._file, fcntl.LOCK_UN)
        finally:
            self._thread.release()

    def close(self) -> None:
        self._file.close()


def describe_status(status: int) -> str:
    """A worker's wait status in words."""
    if os.WIFSIGNALED(status):
        sig = os.WTERMSIG(status)
        try:
            name = signal.Signals(sig).name
        except ValueError:
            name = f"signal {sig}"
        return f"was killed by {name}" + (" (the kernel's OOM killer sends SIGKILL)" if sig == signal.SIGKILL else "")
    code = os.waitstatus_to_exitcode(status)
    if code == _FAILED_START:
        return "could not start (prctl(PR_SET_PDEATHSIG) failed or its parent had already exited)"
    return f"exited with status {code} before it answered"


def _write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view):]


def _read_exact(fd: int, n: int) -> bytes | None:
    parts = []
    while n:
        b = os.read(fd, n)
        if not b:
            return None
        parts.append(b)
        n -= len(b)
    return b"".join(parts)


def _answer(i: int, fn: Callable[[Any], Any], job: Any) -> bytes:
    try:
        return pickle.dumps((i, True, fn(job)))
    except BaseException as e:  # every failure goes back to the parent
        text = traceback.format_exc()
        try:
            return pickle.dumps((i, False, (e, text)))
        except Exception:  # an exception that does not pickle
            return pickle.dumps((i, False, (WorkerError(f"{type(e).__name__}: {e}"), text)))


def _worker(jobs: Sequence[Any], fn: Callable[[Any], Any], task_r: int, result_w: int, parent: int,
            libc: Any) -> None:
    code = _FAILED_START
    try:
        if libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0) == 0 and os.getppid() == parent:
            while True:
                b = _read_exact(task_r, _INDEX.size)
                if b is None:
                    code = 0
                    break
                (i,) = _INDEX.unpack(b)
                msg = _answer(i, fn, jobs[i])
                _write_all(result_w, _LENGTH.pack(len(msg)) + msg)
    finally:
        for f in (sys.stdout, sys.stderr):
            try:
                f.flush()
            except Exception:  # leaving anyway
                pass
        os._exit(code)


class _Child:
    def __init__(self, pid: int, task_w: int, result_r: int) -> None:
        self.pid = pid
        self.task_w: int | None = task_w
        self.result_r = result_r
        self.buf = bytearray()
        self.job: int | None = None


def map_jobs(fn: Callable[[T], R], jobs: Sequence[T], workers: int) -> list[R]:
    """``[fn(job) for job in jobs]``, in ``workers`` forked processes where :func:`available` says
    forking is safe and there is more than one job and one worker; in this process otherwise.

    Results in job order; ``fn``'s results must pickle (when forked). A job that raised raises here
    (the first one, with its worker's traceback as a note); a worker that died (killed, out of
    memory) raises :class:`WorkerError` naming the job and how the worker ended. The fallback runs
    the same jobs in the same order, so a caller never needs a second code path.
    """
    if workers <= 1 or len(jobs) <= 1 or not available():
        return [fn(job) for job in jobs]

    def one(i: int) -> R:
        return fn(jobs[i])

    def lost(i: int, why: str) -> R:
        raise WorkerError(f"job {i} of {len(jobs)} was lost: {why}")

    return run(range(len(jobs)), workers, one, lost, where="a forked worker process")


def run(jobs: Sequence[T], workers: int, fn: Callable[[T], R], lost: Callable[[T, str], R],
        before_fork: Callable[[], None] | None = None, where: str = "a sync worker process") -> list[R]:
    """``[fn(job) for job in jobs]``, computed by ``workers`` forked processes; results in job order.

    ``fn``'s results must pickle. A job whose worker died gets ``lost(job, why)``. If a job raised,
    the first such exception is raised here once every worker has exited (the others' results are
    then lost with it, as with :class:`concurrent.futures.ThreadPoolExecutor`'s ``map``).
    """
    if not jobs:
        return []
    libc = ctypes.CDLL(None, use_errno=True)
    results: list[Any] = [_MISSING] * len(jobs)
    errors: list[tuple[BaseException, str]] = []
    children: list[_Child] = []
    parent = os.getpid()
    for f in (sys.stdout, sys.stderr):
        f.flush()  # a buffer copied by the fork would be written twice
    if before_fork:
        before_fork()
    try:
        for _ in range(max(1, min(workers, len(jobs)))):
            task_r, task_w = os.pipe()
            result_r, result_w = os.pipe()
            pid = os.fork()
            if pid == 0:
                for c in children:  # the other workers' ends: their pipes must end when they do
                    for fd in (c.task_w, c.result_r):
                        if fd is not None:
                            os.close(fd)
                os.close(task_w)
                os.close(result_r)
                _worker(jobs, fn, task_r, result_w, parent, libc)
            os.close(task_r)
            os.close(result_w)
            children.append(_Child(pid, task_w, result_r))
        _serve(children, jobs, results, errors, lost)
    except BaseException:
        for c in children:
            if c.pid > 0:
                try:
                    os.kill(c.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
        raise
    finally:
        for c in children:
            for fd in (c.task_w, c.result_r):
                if fd is not None:
                    try:
                        os.close(fd)
                    except OSError:
                        pass
            if c.pid > 0:  # not reaped yet (an error in this process)
                try:
                    os.waitpid(c.pid, 0)
                except ChildProcessError:
                    pass
    if errors:
        e, text = errors[0]
        if hasattr(e, "add_note"):
            e.add_note(f"in {where}:\n{text}")
        raise e
    return results


class _Missing:
    pass


_MISSING = _Missing()


def _serve(children: list[_Child], jobs: Sequence[T], results: list[Any],
           errors: list[tuple[BaseException, str]], lost: Callable[[T, str], Any]) -> None:
    nxt = 0

    def give(c: _Child) -> None:
        nonlocal nxt
        c.job = None
        if nxt < len(jobs) and not errors and c.task_w is not None:
            try:
                os.write(c.task_w, _INDEX.pack(nxt))
                c.job = nxt
                nxt += 1
                return
            except BrokenPipeError:  # died meanwhile: its result pipe's end says how
                pass
        if c.task_w is not None:
            os.close(c.task_w)
            c.task_w = None

    sel = selectors.DefaultSelector()
    try:
        for c in children:
            sel.register(c.result_r, selectors.EVENT_READ, c)
            give(c)
        while sel.get_map():
            for key, _ in sel.select():
                c = key.data
                data = os.read(c.result_r, 1 << 16)
                if not data:
                    sel.unregister(c.result_r)
                    _reap(c, jobs, results, lost)
                    continue
                c.buf += data
                while len(c.buf) >= _LENGTH.size:
                    (n,) = _LENGTH.unpack_from(c.buf)
                    if len(c.buf) < _LENGTH.size + n:
                        break
                    i, ok, value = pickle.loads(bytes(c.buf[_LENGTH.size:_LENGTH.size + n]))
                    del c.buf[:_LENGTH.size + n]
                    if ok:
                        results[i] = value
                    else:
                        errors.append(value)
                    give(c)
        for i, r in enumerate(results):  # never started: every worker had died
            if r is _MISSING and not errors:
                results[i] = lost(jobs[i], "it was never started: every worker process had died")
    finally:
        sel.close()


def _reap(c: _Child, jobs: Sequence[T], results: list[Any], lost: Callable[[T, str], Any]) -> None:
    _, status = os.waitpid(c.pid, 0)
    c.pid = -1
    if c.job is not None and results[c.job] is _MISSING:
        results[c.job] = lost(jobs[c.job], f"its worker process {describe_status(status)}")
    if c.task_w is not None:
        os.close(c.task_w)
        c.task_w = None
