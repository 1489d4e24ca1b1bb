"""Run the child: own process group, signal forwarding, periodic syncs, final drain, exit code.

One single-threaded event loop (:class:`Supervisor`) waits (``selectors``) on the child's pidfd,
the running sync's pidfd and a signal wake-up pipe, or the earliest deadline of one timer table
(:class:`Timers`), and moves through explicit phases (:class:`Phase`: starting, running,
draining, exited, done). When syncs run is the :class:`SyncScheduler`'s decision; the command's
process tree is the :class:`TreeWatcher`'s. The signal handlers are restored on every way out. Facts it is built on (see
``../shared/recipes/slurm-in-namespaces/README.md``): Slurm signals only what srun started and
SIGKILLs after KillWait; torchrun exits 1 on SIGTERM, dies on SIGUSR1 and orphans workers that
run in their own session. Hence: forward to the child's process group, start the final drain
at once on SIGTERM, consume the warning signal, and track descendants by pid (the wrapper is a
child subreaper, so orphans stay in its tree) to terminate, then kill, whatever is left.
"""

from __future__ import annotations

import contextlib
import ctypes
import enum
import functools
import os
import selectors
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from types import FrameType
from typing import TYPE_CHECKING, Any

from opguard.launcher import countdown
from opguard.launcher.preflight import Preflight
from opguard.launcher.report import RunReport, default_report_path, write_report
from opguard.launcher.schedule import next_slot, run_phase_shift

if TYPE_CHECKING:  # psutil and the sidecar load after the command started (start-up: docs/benchmarks.md)
    import psutil

    from opguard.launcher.sidecar import Sidecar, SyncResult

PR_SET_PDEATHSIG = 1
PR_SET_CHILD_SUBREAPER = 36
DRAIN_PROGRESS_S = 2.0
# after the command exits, a process of its tree that exits because the command did (multiprocessing's
# resource tracker reads EOF from the command's end of a pipe) is gone within milliseconds: what is
# still alive this long after is a leftover, said on stderr and terminated
LEFTOVER_SETTLE_S = 1.0
TREE_REFRESH_S = 5.0  # the subreaper keeps orphans in the tree; the snapshot is a second net
# After an early drain request the wrapper drains back to back until the command exits; a drain that
# found nothing new waits this long before the next (a scan of an idle staging base costs little, and
# a second is small next to any KillWait), a failed one waits DRAIN_RETRY_S.
DRAIN_PAUSE_S = 1.0
DRAIN_RETRY_S = 5.0
# No sync starts before the settle time after the node claim: a second machine with this node ID
# records its refusal (claim.record_conflict) after the same start-up this wrapper went through, so
# the settle time is this wrapper's own start-up (process start to claim) plus the launcher's start
# skew between nodes (srun and torchrun start a step's tasks together: allow LAUNCH_SKEW_S).
LAUNCH_SKEW_S = 1.0


@dataclass
class Options:
    forward: list[signal.Signals]
    warning: signal.Signals | None
    forward_warning: bool = False
    kill_grace: float = 20.0
    drain_timeout: float | None = None
    report_json: Path | None = None
    quiet: bool = False
    verbose: bool = False
    countdown: bool = True
    child_env: dict[str, str] | None = None  # extra environment for the command (e.g. the capture bootstrap)
    early_signals: list[int] | None = None  # warning signals received during preflight, handled at start


def _prctl(option: int, arg: int) -> bool:
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        return int(libc.prctl(option, arg, 0, 0, 0)) == 0
    except (OSError, AttributeError):
        return False


def _child_preexec(ignore: tuple[signal.Signals, ...] = ()) -> None:  # in the child between fork and exec
    # if the wrapper itself is SIGKILLed, its child must not outlive it (nor keep the GPUs)
    _prctl(PR_SET_PDEATHSIG, int(signal.SIGKILL))
    # A consumed warning signal is ignored by the child's tree (SIG_IGN survives exec): srun and
    # slurmstepd deliver it to every process of the step, not only to the wrapper, and its default
    # action would kill the program (torchrun with default options dies on SIGUSR1).
    for s in ignore:
        signal.signal(s, signal.SIG_IGN)


def exit_status(returncode: int) -> int:
    """The child's exact code, or 128+signal for a signal death (never 0 on a signal)."""
    return 128 - returncode if returncode < 0 else returncode


class Phase(enum.Enum):
    """Where the wrapper is. Every state flag of the loop follows from the phase and the timers."""

    STARTING = "starting"  # node setup, signal handlers; the command has not started
    RUNNING = "running"  # the command runs; periodic syncs on the node's staggered schedule
    DRAINING = "draining"  # the command runs after a drain request: final drains back to back
    EXITED = "exited"  # the command exited: the last final drain, the leftovers of its tree
    DONE = "done"  # nothing runs any more: the report and the exit status


class Timers:
    """The one table of the event loop's deadlines (``time.monotonic()`` seconds; None: not armed).

    ``sync`` the next periodic sync, ``drain`` the next back-to-back drain, ``settle`` no sync before
    (node ID conflict markers, ``LAUNCH_SKEW_S``), ``countdown`` the next end-time query, ``progress``
    the next drain progress relay, ``tree`` the next process-tree snapshot, ``kill`` the SIGKILL after
    the grace, ``drain_deadline`` ``--drain-timeout``."""

    NAMES = ("sync", "drain", "settle", "countdown", "progress", "tree", "kill", "drain_deadline")

    def __init__(self) -> None:
        self._at: dict[str, float | None] = dict.fromkeys(self.NAMES)

    def __getitem__(self, name: str) -> float | None:
        return self._at[name]

    def __setitem__(self, name: str, when: float | None) -> None:
        if name not in self._at:
            raise KeyError(name)
        self._at[name] = when

    def due(self, name: str, now: float) -> bool:
        t = self._at[name]
        return t is not None and now >= t

    def timeout(self, now: float, names: list[str]) -> float | None:
        """How long the loop may wait: until the earliest of ``names`` that is armed."""
        armed = [t for t in (self._at[n] for n in names) if t is not None]
        return max(0.0, min(armed) - now) if armed else None


@dataclass
class ProcessTree:
    """Every descendant of the wrapper seen so far (pid, create time), except its syncs."""

    seen: dict[int, float] = field(default_factory=dict)
    protected: set[int] = field(default_factory=set)  # direct children reaped by Popen, never here

    def refresh(self, exclude: set[int]) -> None:
        import psutil

        try:
            kids = psutil.Process().children(recursive=True)
        except psutil.Error:
            return
        for p in kids:
            if p.pid in exclude:
                continue
            with contextlib.suppress(psutil.Error):
                self.seen.setdefault(p.pid, p.create_time())

    def alive(self) -> list[psutil.Process]:
        import psutil

        out = []
        for pid, ctime in list(self.seen.items()):
            try:
                p = psutil.Process(pid)
                if p.create_time() != ctime or p.status() == psutil.STATUS_ZOMBIE:
                    raise psutil.NoSuchProcess(pid)
                out.append(p)
            except psutil.Error:
                self.seen.pop(pid, None)
                if pid not in self.protected:
                    with contextlib.suppress(ChildProcessError, OSError):
                        os.waitpid(pid, os.WNOHANG)  # reap an orphan that was reparented to us
        return out

    def signal_all(self, sig: int) -> int:
        import psutil

        n = 0
        for p in self.alive():
            with contextlib.suppress(psutil.Error):
                p.send_signal(sig)
                n += 1
        return n


class TreeWatcher:
    """The command's process tree (the wrapper is its subreaper, so orphans stay in it): snapshots
    while it runs, close watch after it exited, its leftovers terminated and, after the grace
    (``kill`` timer), killed."""

    def __init__(self, timers: Timers, grace: float, say: Callable[[str], None], report: RunReport,
                 sync_pid: Callable[[], int | None]) -> None:
        self.timers, self.grace, self.say, self.report, self.sync_pid = timers, grace, say, report, sync_pid
        self.tree = ProcessTree()
        self.killed = False
        self.settle_until: float | None = None  # the command exited with processes left: checked again then

    def _exclude(self) -> set[int]:
        pid = self.sync_pid()
        return {pid} if pid else set()

    def step(self, now: float, child_exited: bool) -> None:
        if not self.timers.due("tree", now):
            return
        self.tree.refresh(self._exclude())
        # after the command exited, leftovers are watched closely (orphans give no pidfd)
        self.timers["tree"] = now + (0.2 if child_exited else TREE_REFRESH_S)
        if child_exited:
            left = self.tree.alive()
            if self.settle_until is not None and now >= self.settle_until:
                self.settle_until = None
                self._terminate(left, now)

    def on_child_exit(self, now: float) -> None:
        """Processes left when the command exits get LEFTOVER_SETTLE_S to exit on their own (checked
        every 0.2 s by :meth:`step`); what is still alive then is terminated."""
        self.tree.refresh(self._exclude())
        if self.tree.alive():
            self.settle_until = now + LEFTOVER_SETTLE_S
            self.timers["tree"] = now + 0.2
        elif not self.killed:
            self.timers["kill"] = None

    def _terminate(self, left: list[psutil.Process], now: float) -> None:
        if left:
            self.say(f"opguard-run: the child exited; terminating {len(left)} process(es) left in its tree "
                     f"(pids {', '.join(str(p.pid) for p in left[:8])}), SIGKILL after {self.grace:g} s")
            self.tree.signal_all(signal.SIGTERM)
            self.timers["kill"] = now + self.grace
        elif not self.killed:
            self.timers["kill"] = None

    def kill(self, child: subprocess.Popen[bytes], child_running: bool) -> None:
        """The grace is over: SIGKILL to the command's process group and every process of its tree."""
        self.timers["kill"] = None
        self.tree.refresh(self._exclude())
        if child_running:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(child.pid, signal.SIGKILL)
        n = self.tree.signal_all(signal.SIGKILL)
        if n or child_running:
            self.killed = True
            self.report.killed = True
            self.say(f"opguard-run: grace of {self.grace:g} s over: SIGKILL to the child's tree ({n} process(es))")

    def cleanup(self, child: subprocess.Popen[bytes] | None) -> None:
        """On every way out of the loop: nothing of the command's tree survives the wrapper."""
        if child is not None and child.poll() is None:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(child.pid, signal.SIGKILL)
            child.wait()
        if self.tree.alive():
            self.tree.signal_all(signal.SIGKILL)
            deadline = time.monotonic() + 5
            while self.tree.alive() and time.monotonic() < deadline:
                time.sleep(0.05)


class SyncScheduler:
    """When syncs run (``docs/launcher.md`` §3), one at a time: periodic syncs on the node's staggered
    wall-clock schedule (``sync`` timer), none before the settle time (``settle``); after a drain
    request, final drains back to back while the command runs (``drain``); after the command exits,
    the last final drain. A sync that reports a node ID conflict stops all of it."""

    def __init__(self, sidecar: Sidecar, timers: Timers, interval: float, phase_s: float, opts: Options,
                 say: Callable[[str], None], report: RunReport, before_drain: Callable[[], None]) -> None:
        self.sidecar, self.timers, self.interval, self.phase_s = sidecar, timers, interval, phase_s
        self.opts, self.say, self.report, self.before_drain = opts, say, report, before_drain
        self.drain_requested: str | None = None  # why the final drain started
        self.last_drain_started = False  # the final drain after the command exited (or none: a conflict)
        self.conflict: str | None = None  # a node ID conflict found by a sync: stop, exit 2

    def schedule_first(self, now: float) -> None:
        """The staggered schedule starts after the settle time, so the stagger between nodes stays whole:
        node k of N syncs at phase k/N of the interval on the wall clock (shifted per run)."""
        settle_at = self.timers["settle"]
        settle = max(0.0, settle_at - now) if settle_at is not None else 0.0
        wall = time.time()
        self.timers["sync"] = now + next_slot(wall + settle, self.phase_s, self.interval) - wall

    def request_drain(self, why: str, child_exited: bool) -> bool:
        """True when this request started the draining (the first one)."""
        if self.drain_requested is not None:
            return False
        self.drain_requested = why
        self.say(f"opguard-run: final drain requested ({why})")
        self.maybe_start(time.monotonic(), child_exited)
        return True

    def maybe_start(self, now: float, child_exited: bool) -> None:
        sc, t = self.sidecar, self.timers
        if sc.running is not None or self.conflict is not None:
            return
        settle = t["settle"]
        if settle is not None and now < settle:
            return
        if child_exited:
            if not self.last_drain_started:
                self.last_drain_started = True
                self.before_drain()
                sc.start(final=True)
            return
        if self.drain_requested is not None:
            if t["drain"] is None or t.due("drain", now):
                t["drain"] = None
                self.before_drain()
                sc.start(final=True)
            return
        if t.due("sync", now):
            sc.start(final=False)
            wall = time.time()  # the next slot of this node's wall-clock schedule (see schedule.next_slot)
            t["sync"] = now + next_slot(wall + 1e-3, self.phase_s, self.interval) - wall

    def on_done(self, res: SyncResult, child_exited: bool) -> None:
        if res.node_id_conflict is not None:
            self._on_conflict(res)
            return
        last = res.final and child_exited
        published = res.report.batches if res.report is not None else 0
        early = res.final and not last
        if early and not child_exited:  # keep draining: back to back while there is new data
            now = time.monotonic()
            self.timers["drain"] = now if res.ok and published else now + (DRAIN_PAUSE_S if res.ok else DRAIN_RETRY_S)
        quiet_drain = early and res.ok and not published and not self.opts.verbose  # an idle rescan
        if (not self.opts.quiet or not res.ok or last) and not quiet_drain:
            self.say(res.line(f"drain #{res.number} (the command still runs)" if early else None))
        self.report.add_sync(res, last)

    def _on_conflict(self, res: SyncResult) -> None:
        """Another machine uses this node ID: no more syncs (the supervisor stops the command)."""
        self.report.add_sync(res, False)
        self.conflict = res.node_id_conflict
        self.report.error = self.conflict
        fix = res.report.fix if res.report is not None else None
        self.say(f"opguard-run: error: {self.conflict}" + (f"\n  fix: {fix}" if fix else ""))
        self.last_drain_started = True
        self.timers["sync"] = self.timers["drain"] = None

    def done(self) -> bool:
        return self.sidecar.running is None and self.last_drain_started


class Supervisor:
    """The event loop: explicit phases (:class:`Phase`), one timer table (:class:`Timers`), the sync
    scheduler and the process-tree watcher; signal handlers restored on every way out of :meth:`run`."""

    def __init__(self, cmd: list[str], pf: Preflight, opts: Options, say: Callable[[str], None]) -> None:
        self.cmd, self.pf, self.opts, self.say = cmd, pf, opts, say
        self.identity = pf.identity
        self.config = pf.config
        self.staging = bool(self.config and self.config.enabled)
        self.phase = Phase.STARTING
        self.timers = Timers()
        self.pending_signals: list[int] = []
        self.received: list[dict[str, Any]] = []
        self.report = RunReport(cmd, self.identity.as_dict())
        self.watcher = TreeWatcher(self.timers, opts.kill_grace, say, self.report,
                                   lambda: self.sidecar.pid if self.sidecar is not None else None)
        self.child: subprocess.Popen[bytes] | None = None
        self.child_code: int | None = None
        self.started_at = _process_start()
        self._end_query: threading.Thread | None = None
        self._end_answer: tuple[float | None] | None = None
        self._wake_w = -1
        self._sync_fd: int | None = None
        self.sidecar: Sidecar | None = None
        self.syncs: SyncScheduler | None = None
        self.workdir = Path(tempfile.mkdtemp(prefix="opguard-run-"))

    @property
    def conflict(self) -> str | None:
        return self.syncs.conflict if self.syncs is not None else None

    # ---- signals ---------------------------------------------------------------------------
    def _handler(self, signum: int, _frame: FrameType | None) -> None:
        self.pending_signals.append(signum)

    def install(self) -> tuple[int, list[tuple[int, Any]]]:
        r, w = os.pipe()
        os.set_blocking(r, False)
        os.set_blocking(w, False)
        signal.set_wakeup_fd(w, warn_on_full_buffer=False)
        self._wake_w = w
        # SIGTERM always starts the drain, forwarded or not
        sigs = set(self.opts.forward) | {signal.SIGTERM} | ({self.opts.warning} if self.opts.warning else set())
        # ... except a signal whoever started the wrapper ignores (nohup: SIGHUP; a shell's trap '' INT):
        # it stays ignored for the wrapper and, SIG_IGN surviving exec, for the command (a handler here
        # would give the command the default action back)
        sigs = {s for s in sigs if signal.getsignal(s) != signal.SIG_IGN}
        old = [(int(s), signal.signal(s, self._handler)) for s in sigs]
        return r, old

    def restore(self, wake_r: int, old: list[tuple[int, Any]]) -> None:
        """Undo :meth:`install`: the previous handlers, no wake-up fd, the pipe closed."""
        for signum, handler in old:
            signal.signal(signum, handler)
        signal.set_wakeup_fd(-1)
        for fd in (wake_r, self._wake_w):
            with contextlib.suppress(OSError):
                os.close(fd)
        self._wake_w = -1

    def handle_signal(self, signum: int, now: float) -> None:
        name = signal.Signals(signum).name
        forwarded = False
        is_warning = self.opts.warning is not None and signum == self.opts.warning
        child_running = self.child is not None and self.child_code is None
        wanted = self.opts.forward_warning if is_warning else signum in self.opts.forward
        if wanted and child_running:
            assert self.child is not None
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(self.child.pid, signum)
                forwarded = True
        self.received.append({"signal": name, "at": time.time(), "forwarded": forwarded})
        if self.opts.verbose or not self.opts.quiet:
            self.say(f"opguard-run: received {name}: {_signal_outcome(forwarded, wanted, is_warning)}")
        if signum == signal.SIGTERM and forwarded and self.timers["kill"] is None:
            self.timers["kill"] = now + self.opts.kill_grace
        if signum == signal.SIGTERM or is_warning:
            self.request_drain("SIGTERM" if signum == signal.SIGTERM else f"warning signal {name}")

    # ---- drain -------------------------------------------------------------------------------
    def request_drain(self, why: str) -> None:
        if self.syncs is None:  # staging disabled (a request comes only once the command runs)
            return
        if self.syncs.request_drain(why, self.child_code is not None) and self.phase is Phase.RUNNING:
            self.phase = Phase.DRAINING

    def _on_sync_done(self, res: SyncResult) -> None:
        assert self.syncs is not None
        self.syncs.on_done(res, self.child_code is not None)
        if res.node_id_conflict is not None and self.child is not None and self.child_code is None:
            self.say(f"opguard-run: terminating the command (SIGTERM to its process group, SIGKILL after "
                     f"{self.opts.kill_grace:g} s); the job is misconfigured")
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(self.child.pid, signal.SIGTERM)
            if self.timers["kill"] is None:
                self.timers["kill"] = time.monotonic() + self.opts.kill_grace

    # ---- phases ------------------------------------------------------------------------------
    def run(self) -> int:
        env = self._child_env()
        if self.staging:
            self._node_setup(env)
        _prctl(PR_SET_CHILD_SUBREAPER, 1)
        wake_r, old = self.install()
        try:
            self.pending_signals.extend(self.opts.early_signals or [])  # a warning that came during preflight
            code = self._start(env)
            if code is not None:
                return code  # the command could not start (the handlers are restored below)
            self._loop(wake_r)
        finally:
            self.restore(wake_r, old)
            if self.sidecar is not None and self.sidecar.running is not None:
                res = self.sidecar.stop()
                if res is not None:
                    self.report.add_sync(res, res.final)
            self.watcher.cleanup(self.child)
            self.phase = Phase.DONE
        assert self.child_code is not None
        return self._finish()

    def _child_env(self) -> dict[str, str]:
        env = dict(os.environ)
        env.update(self.identity.exports())
        if self.opts.child_env:
            env.update(self.opts.child_env)
        return env

    def _start(self, env: dict[str, str]) -> int | None:
        """STARTING -> RUNNING: the command in its own session, then the syncs' scheduler and the node
        metadata. Returns the exit status when the command cannot start."""
        try:
            # close_fds=False: a wrapper passes inherited descriptors through (Hydra's PMI_FD, srun's
            # PMI sockets); its own pipes and pidfds are close-on-exec.
            opts = self.opts
            ignore = (opts.warning,) if opts.warning is not None and not opts.forward_warning else ()
            self.child = subprocess.Popen(self.cmd, env=env, start_new_session=True, close_fds=False,
                                          preexec_fn=functools.partial(_child_preexec, ignore))
        except OSError as e:
            self.say(f"opguard-run: cannot start {self.cmd[0]!r}: {e.strerror or e}")
            return 127 if isinstance(e, FileNotFoundError) else 126
        self.phase = Phase.RUNNING
        self.report.child_pid = self.child.pid
        self.watcher.tree.protected.add(self.child.pid)
        if self.staging:
            self._start_syncs(env)
        if self.staging and self.identity.node_duty:
            self._node_metadata(env)
        now = time.monotonic()
        if self.syncs is not None:
            self.syncs.schedule_first(now)
            if self.opts.countdown and countdown.job_id(os.environ):
                self.timers["countdown"] = now
        self.timers["tree"] = now + TREE_REFRESH_S  # at t=0 the tree is the command itself
        return None

    def _wakeups(self, now: float) -> list[str]:
        """The timers the loop waits for in this phase."""
        running = self.phase in (Phase.RUNNING, Phase.DRAINING)
        names = ["kill", "drain_deadline", "progress"]
        if self.phase is Phase.RUNNING:
            names.append("sync")
        if self.phase is Phase.DRAINING:
            names.append("drain")
        if running:
            names.append("countdown")
        settle = self.timers["settle"]
        if settle is not None and settle > now:
            names.append("settle")
        if running or self.watcher.tree.seen:
            names.append("tree")
        return names

    def _loop(self, wake_r: int) -> None:
        """RUNNING/DRAINING -> EXITED -> (the loop ends): wait on the signal pipe, the command's pidfd
        and the running sync's pidfd, or the earliest timer; then handle what is due."""
        assert self.child is not None
        t = self.timers
        sel = selectors.DefaultSelector()
        sel.register(wake_r, selectors.EVENT_READ, "signal")
        child_fd = os.pidfd_open(self.child.pid)
        sel.register(child_fd, selectors.EVENT_READ, "child")
        try:
            while True:
                now = time.monotonic()
                t["progress"] = now + DRAIN_PROGRESS_S if self._draining() else None
                for key, _ in sel.select(t.timeout(now, self._wakeups(now))):
                    if key.data == "signal":
                        with contextlib.suppress(BlockingIOError):
                            while os.read(wake_r, 512):
                                pass
                now = time.monotonic()
                while self.pending_signals:
                    self.handle_signal(self.pending_signals.pop(0), now)
                if self._end_answer is not None:
                    answer, self._end_answer = self._end_answer, None
                    self._on_end_time(answer[0], now)
                if self.child_code is None and self.child.poll() is not None:
                    self._on_child_exit(now)
                    sel.unregister(child_fd)
                    os.close(child_fd)
                    child_fd = -1
                self.watcher.step(now, self.child_code is not None)
                if t.due("kill", now):
                    self.watcher.kill(self.child, self.child_code is None)
                if t.due("countdown", now) and self.child_code is None:
                    self._countdown(now)
                if self.syncs is not None:
                    self._step_syncs(now, sel)
                if self.child_code is not None and self._done():
                    break
        finally:
            if child_fd >= 0:
                with contextlib.suppress(OSError):
                    os.close(child_fd)
            sel.close()

    def _step_syncs(self, now: float, sel: selectors.BaseSelector) -> None:
        """Relay drain progress, collect a finished sync, stop a drain past --drain-timeout, start the
        next sync that is due, and watch its pidfd."""
        assert self.sidecar is not None and self.syncs is not None
        sc = self.sidecar
        self._relay_drain_progress()
        if sc.running is not None and sc.running.proc.poll() is not None:
            self._relay_drain_progress()  # its last lines, before the result line
        res = sc.poll()
        if res is not None:
            self._unwatch_sync(sel)
            self._on_sync_done(res)
        if self.timers.due("drain_deadline", now) and sc.running:
            self.say(f"opguard-run: final drain exceeded --drain-timeout={self.opts.drain_timeout:g} s; "
                     "stopping it (resume with: opguard sync --all --final)")
            res = sc.stop()
            if res is not None:
                self._on_sync_done(res)
            self._unwatch_sync(sel)
            self.syncs.last_drain_started = True
            self.report.drain_timed_out = True
        self.syncs.maybe_start(now, self.child_code is not None)
        if sc.running is not None and self._sync_fd is None:
            self._sync_fd = os.pidfd_open(sc.running.proc.pid)
            sel.register(self._sync_fd, selectors.EVENT_READ, "sync")

    def _unwatch_sync(self, sel: selectors.BaseSelector) -> None:
        if self._sync_fd is not None:
            sel.unregister(self._sync_fd)
            os.close(self._sync_fd)
            self._sync_fd = None

    def _draining(self) -> bool:
        r = self.sidecar.running if self.sidecar is not None else None
        return r is not None and r.final

    def _relay_drain_progress(self) -> None:
        """The drain progress lines: what the final sync published so far."""
        r = self.sidecar.running if self.sidecar is not None else None
        if r is None or not r.final:
            return
        for line in r.new_lines():
            if self.opts.verbose or (not self.opts.quiet and "published batch" in line):
                self.say("opguard-run: drain: " + line.removeprefix("opguard sync: "))

    def _done(self) -> bool:
        if self.watcher.tree.alive():
            return False
        return self.syncs is None or self.syncs.done()

    def _on_child_exit(self, now: float) -> None:
        """RUNNING/DRAINING -> EXITED."""
        assert self.child is not None and self.child.returncode is not None
        self.phase = Phase.EXITED
        self.child_code = self.child.returncode
        self.report.child_returncode = self.child_code
        self.watcher.on_child_exit(now)
        if self.staging and not self.opts.quiet:
            then = "; final drain" if self.conflict is None else " (no final drain: node ID conflict)"
            self.say(f"opguard-run: child exited ({_describe(self.child_code)}){then}")
        if self.opts.drain_timeout is not None and self.staging:
            self.timers["drain_deadline"] = now + self.opts.drain_timeout

    def _countdown(self, now: float) -> None:
        """Ask the scheduler for the job's end time in a thread (a slow controller must not delay
        signal forwarding); the answer wakes the loop through the signal pipe."""
        self.timers["countdown"] = None
        if self._end_query is not None and self._end_query.is_alive():
            return

        def ask() -> None:
            self._end_answer = (countdown.end_time(os.environ),)
            with contextlib.suppress(OSError):
                os.write(self._wake_w, b"c")

        self._end_query = threading.Thread(target=ask, name="opguard-run-countdown", daemon=True)
        self._end_query.start()

    def _on_end_time(self, end: float | None, now: float) -> None:
        """Start the final drain when the time left falls to what a drain of the backlog needs."""
        assert self.config is not None
        if self.child_code is not None or (self.syncs is not None and self.syncs.drain_requested is not None):
            return
        if end is None:
            self.timers["countdown"] = now + 60.0
            return
        from opguard.launcher.plan import effective_cap
        from opguard.staging.backlog import backlog_bytes
        from opguard.staging.layout import Layout

        remaining = end - time.time()
        cap = effective_cap(self.config, self.identity.node_count).cap_mib_s
        pending = backlog_bytes(Layout(self.config), self.identity.owned_ranks(),
                                self.identity.node_id if self.identity.node_duty else None)
        needed = countdown.lead_seconds(pending, cap)
        if remaining <= needed:
            self.request_drain(f"job ends in {remaining:.0f} s; a drain of {pending} bytes needs ~{needed:.0f} s")
        else:  # ask again, sooner as the end nears (the end time is never cached)
            self.timers["countdown"] = now + max(1.0, min(60.0, (remaining - needed) / 2))

    def _node_setup(self, env: dict[str, str]) -> None:
        from opguard.launcher.claim import take_node_duty
        from opguard.staging.claim import NodeIdConflict, make_claim, record_conflict
        from opguard.staging.layout import Layout

        assert self.config is not None
        layout = Layout(self.config)
        if self.identity.node_duty:
            self._duty_lock = take_node_duty(layout)
        assert self.config.target is not None
        try:
            make_claim(self.config, self.identity.node_id)
        except NodeIdConflict as e:  # a race lost at the claim itself (preflight saw none)
            _say_recorded(self.say, record_conflict(self.config.target, e, self.identity.node_id))
            raise
        self.timers["settle"] = time.monotonic() + max(0.0, time.time() - self.started_at) + LAUNCH_SKEW_S
        for r in self.identity.owned_ranks() or []:
            layout.rank_dir(r).mkdir(parents=True, exist_ok=True)  # the rank's stream exists from the start

    def _start_syncs(self, env: dict[str, str]) -> None:
        """Right after the command started: no sync runs before the settle time, so the sidecar (and
        psutil) need not delay the command's start."""
        assert self.config is not None
        from opguard.launcher.plan import effective_cap, stagger
        from opguard.launcher.sidecar import Sidecar, node_env

        cap = effective_cap(self.config, self.identity.node_count).cap_mib_s
        self.sidecar = Sidecar(self.identity, node_env(env, cap), self.workdir, self.opts.verbose, self.say,
                               started_at=self.started_at, warning=self.opts.warning)
        interval = self.config.sync_interval
        # node k of N syncs at phase k/N of the interval on the wall clock (shifted per run), so the
        # stagger holds whatever each wrapper's start-up and settle time were
        phase_s = (stagger(self.identity, interval) + run_phase_shift(self.config.run_id or "", interval)) % interval
        self.syncs = SyncScheduler(self.sidecar, self.timers, interval, phase_s, self.opts, self.say, self.report,
                                   self._capture_sources)

    def _node_metadata(self, env: dict[str, str]) -> None:
        """Local rank 0, right after the command started (it needs nothing from it)."""
        from opguard.launcher.nodeinfo import write_node_metadata
        from opguard.staging.layout import Layout

        c = self.config
        assert c is not None
        exclude = [p for p in (c.local_base, c.target, c.output_base) if p is not None]
        try:
            n = write_node_metadata(Layout(c).node_dir(self.identity.node_id), self.identity, self.cmd, env, exclude)
        except OSError as e:
            self.say(f"opguard-run: could not write the node metadata: {e}")
            return
        if self.opts.verbose:
            self.say(f"opguard-run: node metadata written ({n} source file(s) indexed)")

    def _capture_sources(self) -> None:
        """Local rank 0, before a final drain: the files the capture's call sites name, into the node
        metadata (docs/capture.md §9), so a comparison can show the source lines that ran."""
        if not self.identity.node_duty or self.config is None:
            return
        from opguard.launcher.nodeinfo import add_capture_sources
        from opguard.staging.layout import Layout

        layout = Layout(self.config)
        try:
            n, problems = add_capture_sources(layout.node_dir(self.identity.node_id), layout.rank_dir(0).parent)
        except OSError as e:
            self.say(f"opguard-run: warning: could not copy the capture's source files into the node metadata: {e}; "
                     "a comparison of this run shows no source lines for them")
            return
        for p in problems:  # each once: the index remembers it
            self.say(f"opguard-run: warning: {p}")
        if n and self.opts.verbose:
            self.say(f"opguard-run: {n} source file(s) named by the capture copied into the node metadata")

    def _finish(self) -> int:
        assert self.child_code is not None
        code = exit_status(self.child_code) if self.conflict is None else 2
        self.report.exit_code = code
        self.report.signals = self.received
        self.report.drain_reason = (self.syncs.drain_requested if self.syncs is not None else None) or (
            "child exit" if self.staging else None)
        path = self.opts.report_json
        if path is None and self.staging:
            assert self.config is not None
            path = default_report_path(self.config, self.identity)
        if self.conflict is not None:
            self.say(f"opguard-run: stopped on a node ID conflict before uploading more; {self.report.syncs} "
                     "sync(s); exit 2 (the command's own status is in the report)")
        elif self.staging or self.opts.verbose:
            self.say(self.report.summary(self.staging))
        if path is not None:
            try:
                write_report(path, self.report.to_json())
            except OSError as e:
                self.say(f"opguard-run: could not write the report {path}: {e.strerror or e}")
        with contextlib.suppress(OSError):
            for p in self.workdir.iterdir():
                p.unlink()
            self.workdir.rmdir()
        return code


def _process_start() -> float:
    """This process's start (wall clock): /proc/self/stat's start time after boot (clock ticks) plus
    the boot time from /proc/stat (what psutil computes, without importing it before the command)."""
    try:
        stat = Path("/proc/self/stat").read_text()
        ticks = int(stat[stat.rindex(")") + 2:].split()[19])
        btime = next(int(x.split()[1]) for x in Path("/proc/stat").read_text().splitlines() if x.startswith("btime "))
        return btime + ticks / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError, StopIteration):
        return time.time()


def _say_recorded(say: Callable[[str], None], path: Path | None) -> None:
    if path is not None:
        say(f"opguard-run: recorded the node ID conflict at {path}: the machine that claimed it first stops "
            "before it uploads anything")
    else:
        say("opguard-run: could not record the node ID conflict on the target: the machine that claimed it "
            "first may keep running; stop the job")


def _signal_outcome(forwarded: bool, wanted: bool, is_warning: bool) -> str:
    if forwarded:
        return "forwarded to the child's process group"
    if wanted:
        return "the child already exited"
    return "consumed (--forward-warning forwards it)" if is_warning else "not forwarded (--forward-signals)"


def _describe(returncode: int) -> str:
    if returncode < 0:
        try:
            return f"killed by {signal.Signals(-returncode).name}"
        except ValueError:
            return f"killed by signal {-returncode}"
    return f"exit {returncode}"


def run(cmd: list[str], pf: Preflight, opts: Options) -> int:
    def say(msg: str) -> None:
        sys.stderr.write(msg + "\n")
        sys.stderr.flush()

    return Supervisor(cmd, pf, opts, say).run()
