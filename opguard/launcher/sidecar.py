"""Syncs as child processes of the wrapper: ``opguard sync ...`` at low CPU and I/O priority.

Never inside the training processes and never importing torch: each sync is a separate
``python -m opguard.staging.syncrun ...`` process (staging's entry point: the node-claim check runs
inside it, its report comes back typed). One sync at a time per wrapper; a failed sync is reported
on stderr and retried at the next interval, never fatal to the job.
"""

from __future__ import annotations

import dataclasses
import functools
import os
import signal
import subprocess
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import psutil

from opguard.launcher.identity import Identity
from opguard.staging.syncrun import SyncOutcome, SyncRequest, module_command
from opguard.staging.units import format_bytes


def sync_request(identity: Identity, final: bool, report: Path, started_at: float = 0.0) -> SyncRequest:
    """The sync of the streams this wrapper owns (``started_at``: the wrapper's start, wall clock, for
    the conflict check). A final drain is not quiet: its per-batch lines become the drain's progress."""
    ranks = identity.owned_ranks()
    return SyncRequest(ranks=() if ranks is None else tuple(ranks), node=ranks is not None and identity.node_duty,
                       all=ranks is None, final=final, since=started_at, report_json=report, quiet=not final)


# Signals a sync ignores (SIG_IGN survives exec). Slurm (proctrack linuxproc/cgroup) and srun deliver
# a step's signals to every process of the step, the wrapper's syncs included: the warning signal
# (--signal=USR1@N, forwarded to the step by the batch script) would otherwise kill the very drain it
# asks for (exit 138), and scancel's SIGTERM would kill the drain it starts, wasting the upload in
# flight out of KillWait. Only the wrapper decides when a sync stops: SIGKILL (its durable state makes
# that safe: docs/protocol.md), and Slurm's own SIGKILL after KillWait ends it like everything else.
SYNC_IGNORES = (signal.SIGTERM, signal.SIGUSR1, signal.SIGUSR2, signal.SIGINT, signal.SIGHUP)


def _sync_child_preexec(ignore: tuple[signal.Signals, ...]) -> None:  # in the sync child before exec
    os.setpriority(os.PRIO_PROCESS, 0, 19)  # it never runs at normal priority...
    lower_priority(os.getpid())  # ...nor at normal I/O priority, from its first instruction on
    for s in ignore:
        signal.signal(s, signal.SIG_IGN)


def lower_priority(pid: int) -> None:
    """Idle I/O class (best-effort class, lowest level, where idle is refused)."""
    try:
        p = psutil.Process(pid)
        try:
            p.ionice(psutil.IOPRIO_CLASS_IDLE)
        except (psutil.AccessDenied, OSError):
            p.ionice(psutil.IOPRIO_CLASS_BE, value=7)
    except (psutil.NoSuchProcess, psutil.AccessDenied, OSError, AttributeError):
        pass  # the sync still runs; priority is an optimisation


@dataclass
class SyncResult:
    """One finished sync: exit status, the sync's own report (if written) and its stderr tail."""

    number: int
    final: bool
    exit_code: int
    seconds: float
    report: SyncOutcome | None
    stderr_tail: str

    @property
    def ok(self) -> bool:
        return self.exit_code == 0

    @property
    def node_id_conflict(self) -> str | None:
        """The conflict a sync found before uploading (``staging.claim.sync_conflict``), if any."""
        return self.report.node_id_conflict if self.report is not None else None

    def line(self, kind: str | None = None) -> str:
        """The one stderr line per sync (``kind`` names it, default: final drain or sync #n)."""
        kind = kind or ("final drain" if self.final else f"sync #{self.number}")
        r = self.report
        batches = r.batches if r else 0
        up = float(r.uploaded_bytes) if r else 0.0
        backlog = float(r.backlog_bytes) if r else 0.0
        streams = r.streams if r else ()
        rate = up / self.seconds if self.seconds > 0 else 0.0
        head = (f"opguard-run: {kind} {'ok' if self.ok else f'FAILED (exit {self.exit_code})'}: {batches} batch(es), "
                f"{format_bytes(up)} in {self.seconds:.1f} s ({format_bytes(rate)}/s), backlog {format_bytes(backlog)}")
        if self.final and self.ok:
            sealed = sum(1 for s in streams if s.sealed)
            head += f", {sealed} stream(s) sealed"
        if not self.ok:
            errors = [s.error for s in streams if s.error]
            why = (errors[0] if errors else self.stderr_tail.strip().splitlines()[-1:] or ["no output"])
            why_s = why if isinstance(why, str) else " ".join(why)
            head += f"; {why_s.splitlines()[0]}" + ("" if self.final else "; retrying at the next interval")
        return head


@dataclass
class RunningSync:
    number: int
    final: bool
    proc: subprocess.Popen[bytes]
    started: float
    report_path: Path
    stderr_path: Path
    read_offset: int = 0

    def new_lines(self) -> list[str]:
        """Complete lines the sync wrote to its stderr since the last call."""
        try:
            with open(self.stderr_path, "rb") as f:
                f.seek(self.read_offset)
                data = f.read()
        except OSError:
            return []
        end = data.rfind(b"\n") + 1
        self.read_offset += end
        return data[:end].decode(errors="replace").splitlines()


@dataclass
class Sidecar:
    """Starts and collects syncs; the supervisor's event loop decides when."""

    identity: Identity
    env: dict[str, str]
    workdir: Path
    verbose: bool = False
    say: Callable[[str], None] = lambda _m: None
    started_at: float = 0.0  # the wrapper's start (wall clock): conflict markers older than it are stale
    warning: signal.Signals | None = None  # the wrapper's warning signal: its syncs ignore it too
    running: RunningSync | None = None
    results: list[SyncResult] = field(default_factory=list)
    count: int = 0

    def start(self, final: bool) -> RunningSync:
        assert self.running is None
        self.count += 1
        report = Path(tempfile.mkstemp(prefix=f"sync-{self.count}-", suffix=".json", dir=self.workdir)[1])
        report.unlink()
        errpath = self.workdir / f"sync-{self.count}.stderr"
        req = sync_request(self.identity, final, report, self.started_at)
        argv = module_command(req)
        if self.verbose:
            self.say("opguard-run: starting sync " + " ".join(dataclasses.replace(req, since=None).argv()))
        with open(errpath, "wb") as err:
            proc = subprocess.Popen(argv, env=self.env, stdin=subprocess.DEVNULL, stdout=err, stderr=err,
                                    start_new_session=True,
                                    preexec_fn=functools.partial(_sync_child_preexec, self._ignored()))
        self.running = RunningSync(self.count, final, proc, time.monotonic(), report, errpath)
        return self.running

    def _ignored(self) -> tuple[signal.Signals, ...]:
        extra = (self.warning,) if self.warning is not None and self.warning not in SYNC_IGNORES else ()
        return SYNC_IGNORES + extra

    def poll(self) -> SyncResult | None:
        """Collect the running sync if it has finished."""
        r = self.running
        if r is None or r.proc.poll() is None:
            return None
        return self._collect(r)

    def _collect(self, r: RunningSync) -> SyncResult:
        code = r.proc.returncode
        code = 128 - code if code < 0 else code
        report = SyncOutcome.read(r.report_path)
        try:
            tail = r.stderr_path.read_bytes()[-4000:].decode(errors="replace")
        except OSError:
            tail = ""
        for p in (r.report_path, r.stderr_path):
            p.unlink(missing_ok=True)
        res = SyncResult(r.number, r.final, code, time.monotonic() - r.started, report, tail)
        self.results.append(res)
        self.running = None
        return res

    def stop(self) -> SyncResult | None:
        """Kill a running sync (it ignores SIGTERM; its durable state makes SIGKILL safe: the next
        sync resumes a pending batch), then collect it."""
        r = self.running
        if r is None:
            return None
        kill_sync(r.proc)
        return self._collect(r)

    @property
    def pid(self) -> int | None:
        return self.running.proc.pid if self.running else None


def kill_sync(proc: subprocess.Popen[bytes]) -> None:
    """SIGKILL a sync and its stream workers (its own process group: ``start_new_session``), wait
    for it, and reap the workers that were reparented to this process (the wrapper is a child
    subreaper; a worker is never left a zombie here). Nothing else of this process's children is
    touched: the command runs in another process group."""
    if proc.poll() is not None:
        return
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        proc.kill()
    proc.wait()
    try:
        orphans = psutil.Process().children()
    except psutil.Error:
        return
    for child in orphans:
        try:
            if os.getpgid(child.pid) == proc.pid:
                os.waitpid(child.pid, 0)  # killed above: returns as soon as it has exited
        except (ProcessLookupError, ChildProcessError, PermissionError):
            pass


def node_env(base: dict[str, str], cap_mib_s: float) -> dict[str, str]:
    """The syncs' environment: the wrapper's, with the effective per-node cap."""
    env = dict(base)
    env["OPGUARD_SYNC_MBPS"] = f"{cap_mib_s:.6g}"
    env.pop("PYTHONSTARTUP", None)
    return env
