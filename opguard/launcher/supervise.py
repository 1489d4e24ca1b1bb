"""Run the child: own process group, signal forwarding, periodic syncs, final drain, exit code.

One single-threaded event loop waits (``selectors``) on the child's pidfd, the running sync's
pidfd and a signal wake-up pipe, with timers for the next periodic sync, the scheduler
countdown, the tree refresh and the kill deadline. Facts it is built on (see
``../shared/recipes/slurm-in-namespaces/README.md``): Slurm signals only what srun started and
SIGKILLs after KillWait; torchrun exits 1 on SIGTERM, dies on SIGUSR1 and orphans workers that
run in their own session. Hence: forward to the child's process group, start the final drain
at once on SIGTERM, consume the warning signal, and track descendants by pid (the wrapper is a
child subreaper, so orphans stay in its tree) to terminate, then kill, whatever is left.
"""

from __future__ import annotations

import contextlib
import ctypes
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


@dataclass
class Tree:
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


class Supervisor:
    def __init__(self, cmd: list[str], pf: Preflight, opts: Options, say: Callable[[str], None]) -> None:
        self.cmd, self.pf, self.opts, self.say = cmd, pf, opts, say
        self.identity = pf.identity
        self.config = pf.config
        self.staging = bool(self.config and self.config.enabled)
        self.pending_signals: list[int] = []
        self.received: list[dict[str, Any]] = []
        self.tree = Tree()
        self.report = RunReport(cmd, self.identity.as_dict())
        self.child: subprocess.Popen[bytes] | None = None
        self.child_code: int | None = None
        self.kill_at: float | None = None
        self.killed = False
        self.drain_requested: str | None = None  # why the final drain started
        self.final_after_exit_done = False
        self.next_drain: float | None = None  # after an early drain request: when the next drain starts
        self.settle_until: float | None = None  # no sync before (node ID conflict markers, see LAUNCH_SKEW_S)
        self.conflict: str | None = None  # a node ID conflict found by a sync: stop, exit 2
        self.started_at = _process_start()
        self.next_sync: float | None = None
        self.sync_phase = 0.0  # wall-clock phase of this node's periodic syncs within the interval
        self.next_countdown: float | None = None
        self._end_query: threading.Thread | None = None
        self._end_answer: tuple[float | None] | None = None
        self._wake_w = -1
        self.sidecar: Sidecar | None = None
        self.workdir = Path(tempfile.mkdtemp(prefix="opguard-run-"))

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
        old = [(int(s), signal.signal(s, self._handler)) for s in sigs]
        return r, old

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
            if forwarded:
                what = "forwarded to the child's process group"
            elif wanted:
                what = "the child already exited"
            else:
                what = "consumed (--forward-warning forwards it)" if is_warning else "not forwarded (--forward-signals)"
            self.say(f"opguard-run: received {name}: {what}")
        if signum == signal.SIGTERM and forwarded and self.kill_at is None:
            self.kill_at = now + self.opts.kill_grace
        if signum == signal.SIGTERM or is_warning:
            self.request_drain("SIGTERM" if signum == signal.SIGTERM else f"warning signal {name}")

    # ---- drain -------------------------------------------------------------------------------
    def request_drain(self, why: str) -> None:
        if not self.staging or self.drain_requested is not None:
            return
        self.drain_requested = why
        self.say(f"opguard-run: final drain requested ({why})")
        self._maybe_start_sync(time.monotonic())

    def _maybe_start_sync(self, now: float) -> None:
        """One sync at a time: the last final drain after the child exits; once a drain was
        requested early, drains back to back while the child runs (paused only after one that found
        nothing new); otherwise periodic syncs on the staggered schedule."""
        sc = self.sidecar
        if sc is None or sc.running is not None or self.conflict is not None:
            return
        if self.settle_until is not None and now < self.settle_until:
            return
        if self.child_code is not None:
            if not self.final_after_exit_done:
                self.final_after_exit_done = True
                self._capture_sources()
                sc.start(final=True)
            return
        if self.drain_requested is not None:
            if self.next_drain is None or now >= self.next_drain:
                self.next_drain = None
                self._capture_sources()
                sc.start(final=True)
            return
        if self.next_sync is not None and now >= self.next_sync:
            assert self.config is not None
            sc.start(final=False)
            wall = time.time()  # the next slot of this node's wall-clock schedule (see schedule.next_slot)
            self.next_sync = now + next_slot(wall + 1e-3, self.sync_phase, self.config.sync_interval) - wall

    def on_sync_done(self, res: SyncResult) -> None:
        if res.node_id_conflict is not None:
            self._on_conflict(res)
            return
        last = res.final and self.child_code is not None
        published = res.report.batches if res.report is not None else 0
        early = res.final and not last
        if early and self.child_code is None:  # keep draining: back to back while there is new data
            now = time.monotonic()
            self.next_drain = now if res.ok and published else now + (DRAIN_PAUSE_S if res.ok else DRAIN_RETRY_S)
        quiet_drain = early and res.ok and not published and not self.opts.verbose  # an idle rescan
        if (not self.opts.quiet or not res.ok or last) and not quiet_drain:
            self.say(res.line(f"drain #{res.number} (the command still runs)" if early else None))
        self.report.add_sync(res, last)

    def _on_conflict(self, res: SyncResult) -> None:
        """Another machine uses this node ID: no more syncs, the command is stopped, exit 2."""
        self.report.add_sync(res, False)
        self.conflict = res.node_id_conflict
        self.report.error = self.conflict
        fix = res.report.fix if res.report is not None else None
        self.say(f"opguard-run: error: {self.conflict}" + (f"\n  fix: {fix}" if fix else ""))
        self.final_after_exit_done = True
        self.next_sync = self.next_drain = None
        if self.child is not None and self.child_code is None:
            self.say(f"opguard-run: terminating the command (SIGTERM to its process group, SIGKILL after "
                     f"{self.opts.kill_grace:g} s); the job is misconfigured")
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(self.child.pid, signal.SIGTERM)
            if self.kill_at is None:
                self.kill_at = time.monotonic() + self.opts.kill_grace

    # ---- main loop ---------------------------------------------------------------------------
    def run(self) -> int:
        opts = self.opts
        env = dict(os.environ)
        env.update(self.identity.exports())
        if opts.child_env:
            env.update(opts.child_env)
        if self.staging:
            self._node_setup(env)
        _prctl(PR_SET_CHILD_SUBREAPER, 1)
        wake_r, old = self.install()
        self.pending_signals.extend(opts.early_signals or [])  # a warning that came during preflight
        sel = selectors.DefaultSelector()
        sel.register(wake_r, selectors.EVENT_READ, "signal")
        try:
            # close_fds=False: a wrapper passes inherited descriptors through (Hydra's PMI_FD, srun's
            # PMI sockets); its own pipes and pidfds are close-on-exec.
            ignore = (opts.warning,) if opts.warning is not None and not opts.forward_warning else ()
            self.child = subprocess.Popen(self.cmd, env=env, start_new_session=True, close_fds=False,
                                          preexec_fn=functools.partial(_child_preexec, ignore))
        except OSError as e:
            self.say(f"opguard-run: cannot start {self.cmd[0]!r}: {e.strerror or e}")
            return 127 if isinstance(e, FileNotFoundError) else 126
        self.report.child_pid = self.child.pid
        self.tree.protected.add(self.child.pid)
        child_fd = os.pidfd_open(self.child.pid)
        sel.register(child_fd, selectors.EVENT_READ, "child")
        if self.staging:
            self._start_sidecar(env)
        if self.staging and self.identity.node_duty:
            self._node_metadata(env)
        now = time.monotonic()
        if self.staging:
            assert self.config is not None
            # the staggered schedule starts after the settle time, so the stagger between nodes stays whole
            settle = max(0.0, self.settle_until - now) if self.settle_until is not None else 0.0
            interval = self.config.sync_interval
            # node k of N syncs at phase k/N of the interval on the wall clock (shifted per run), so the
            # stagger holds whatever each wrapper's start-up and settle time were
            from opguard.launcher.plan import stagger

            self.sync_phase = (stagger(self.identity, interval)
                               + run_phase_shift(self.config.run_id or "", interval)) % interval
            wall = time.time()
            self.next_sync = now + next_slot(wall + settle, self.sync_phase, interval) - wall
            if opts.countdown and countdown.job_id(os.environ):
                self.next_countdown = now
        sync_fd: int | None = None
        next_tree = now + TREE_REFRESH_S  # at t=0 the tree is the command itself
        drain_deadline: float | None = None
        try:
            while True:
                now = time.monotonic()
                progress = now + DRAIN_PROGRESS_S if self._draining() else None
                timers = [t for t in (self.next_sync if self.child_code is None and self.drain_requested is None
                                      else None, self.next_drain if self.child_code is None else None,
                                      self.next_countdown, self.settle_until if self.settle_until is not None
                                      and self.settle_until > now else None,
                                      progress, next_tree if self.child_code is None or self.tree.seen else None,
                                      self.kill_at, drain_deadline) if t is not None]
                timeout = max(0.0, min(timers) - now) if timers else None
                for key, _ in sel.select(timeout):
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
                    if opts.drain_timeout is not None and self.staging:
                        drain_deadline = now + opts.drain_timeout
                if now >= next_tree:
                    self.tree.refresh({self.sidecar.pid} if self.sidecar and self.sidecar.pid else set())
                    # after the command exited, leftovers are watched closely (orphans give no pidfd)
                    next_tree = now + (TREE_REFRESH_S if self.child_code is None else 0.2)
                    if self.child_code is not None:
                        self.tree.alive()
                if self.kill_at is not None and now >= self.kill_at:
                    self._kill_tree()
                if self.next_countdown is not None and now >= self.next_countdown and self.child_code is None:
                    self._countdown(now)
                if self.sidecar is not None:
                    self._relay_drain_progress()
                    if self.sidecar.running is not None and self.sidecar.running.proc.poll() is not None:
                        self._relay_drain_progress()  # its last lines, before the result line
                    res = self.sidecar.poll()
                    if res is not None:
                        if sync_fd is not None:
                            sel.unregister(sync_fd)
                            os.close(sync_fd)
                            sync_fd = None
                        self.on_sync_done(res)
                    if drain_deadline is not None and now >= drain_deadline and self.sidecar.running:
                        self.say(f"opguard-run: final drain exceeded --drain-timeout={opts.drain_timeout:g} s; "
                                 "stopping it (resume with: opguard sync --all --final)")
                        res = self.sidecar.stop()
                        if res is not None:
                            self.on_sync_done(res)
                        if sync_fd is not None:
                            sel.unregister(sync_fd)
                            os.close(sync_fd)
                            sync_fd = None
                        self.final_after_exit_done = True
                        self.report.drain_timed_out = True
                    self._maybe_start_sync(now)
                    if self.sidecar.running is not None and sync_fd is None:
                        sync_fd = os.pidfd_open(self.sidecar.running.proc.pid)
                        sel.register(sync_fd, selectors.EVENT_READ, "sync")
                if self.child_code is not None and self._done():
                    break
        finally:
            for signum, handler in old:
                signal.signal(signum, handler)
            signal.set_wakeup_fd(-1)
            if self.sidecar is not None and self.sidecar.running is not None:
                res = self.sidecar.stop()
                if res is not None:
                    self.report.add_sync(res, res.final)
            self._cleanup_tree()
        assert self.child_code is not None
        return self._finish()

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
        if self.tree.alive():
            return False
        if self.sidecar is None:
            return True
        return self.sidecar.running is None and self.final_after_exit_done

    def _on_child_exit(self, now: float) -> None:
        assert self.child is not None and self.child.returncode is not None
        self.child_code = self.child.returncode
        self.report.child_returncode = self.child_code
        self.tree.refresh({self.sidecar.pid} if self.sidecar and self.sidecar.pid else set())
        left = self.tree.alive()
        if left:
            self.say(f"opguard-run: the child exited; terminating {len(left)} process(es) left in its tree "
                     f"(pids {', '.join(str(p.pid) for p in left[:8])}), SIGKILL after {self.opts.kill_grace:g} s")
            self.tree.signal_all(signal.SIGTERM)
            self.kill_at = now + self.opts.kill_grace
        elif not self.killed:
            self.kill_at = None
        if self.staging and not self.opts.quiet:
            then = "; final drain" if self.conflict is None else " (no final drain: node ID conflict)"
            self.say(f"opguard-run: child exited ({_describe(self.child_code)}){then}")

    def _kill_tree(self) -> None:
        self.kill_at = None
        assert self.child is not None
        self.tree.refresh({self.sidecar.pid} if self.sidecar and self.sidecar.pid else set())
        if self.child_code is None:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(self.child.pid, signal.SIGKILL)
        n = self.tree.signal_all(signal.SIGKILL)
        if n or self.child_code is None:
            self.killed = True
            self.report.killed = True
            self.say(f"opguard-run: grace of {self.opts.kill_grace:g} s over: SIGKILL to the child's tree "
                     f"({n} process(es))")

    def _cleanup_tree(self) -> None:
        if self.child is not None and self.child.poll() is None:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(self.child.pid, signal.SIGKILL)
            self.child.wait()
        if self.tree.alive():
            self.tree.signal_all(signal.SIGKILL)
            deadline = time.monotonic() + 5
            while self.tree.alive() and time.monotonic() < deadline:
                time.sleep(0.05)

    def _countdown(self, now: float) -> None:
        """Ask the scheduler for the job's end time in a thread (a slow controller must not delay
        signal forwarding); the answer wakes the loop through the signal pipe."""
        self.next_countdown = None
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
        if self.child_code is not None or self.drain_requested is not None:
            return
        if end is None:
            self.next_countdown = now + 60.0
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
            self.next_countdown = now + max(1.0, min(60.0, (remaining - needed) / 2))

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
        self.settle_until = time.monotonic() + max(0.0, time.time() - self.started_at) + LAUNCH_SKEW_S
        for r in self.identity.owned_ranks() or []:
            layout.rank_dir(r).mkdir(parents=True, exist_ok=True)  # the rank's stream exists from the start

    def _start_sidecar(self, env: dict[str, str]) -> None:
        """Right after the command started: no sync runs before the settle time, so the sidecar (and
        psutil) need not delay the command's start."""
        assert self.config is not None
        from opguard.launcher.plan import effective_cap

        cap = effective_cap(self.config, self.identity.node_count).cap_mib_s
        from opguard.launcher.sidecar import Sidecar, node_env

        self.sidecar = Sidecar(self.identity, node_env(env, cap), self.workdir, self.opts.verbose, self.say,
                               started_at=self.started_at, warning=self.opts.warning)

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
        self.report.drain_reason = self.drain_requested or ("child exit" if self.staging else None)
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
