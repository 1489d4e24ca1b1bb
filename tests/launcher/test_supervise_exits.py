"""The supervisor restores the signal handlers and the wake-up fd on every way out of its loop:
a command that cannot start, a normal exit, and an error raised inside the loop (here: while it
handles a real SIGUSR2). In-process, so the handlers of this very process are checked."""

from __future__ import annotations

import os
import signal
import sys
from collections.abc import Iterator

import pytest

from opguard.launcher.identity import resolve
from opguard.launcher.preflight import Preflight
from opguard.launcher.supervise import PR_SET_CHILD_SUBREAPER, Options, Supervisor, _prctl

SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGUSR1, signal.SIGUSR2)


def _supervisor(cmd: list[str], say: object) -> Supervisor:
    ident, problems = resolve({}, cmd, "node17")
    assert problems == []
    opts = Options(forward=[signal.SIGINT, signal.SIGHUP, signal.SIGUSR2], warning=signal.SIGUSR1, quiet=False)
    return Supervisor(cmd, Preflight(config=None, identity=ident), opts, say)  # type: ignore[arg-type]


@pytest.fixture
def handlers() -> Iterator[dict[int, object]]:
    """This process's handlers before the test (restored afterwards whatever happens)."""
    before = {int(s): signal.getsignal(s) for s in SIGNALS}
    yield before
    for s, h in before.items():
        signal.signal(s, h)  # type: ignore[arg-type]
    # run() made this (pytest's) process a child subreaper, as it does the wrapper: undo it, or every
    # orphan of the later tests (daemons, killed process trees) is reparented here and left a zombie
    _prctl(PR_SET_CHILD_SUBREAPER, 0)


def _assert_restored(before: dict[int, object]) -> None:
    assert {int(s): signal.getsignal(s) for s in SIGNALS} == before
    assert signal.set_wakeup_fd(-1) == -1  # no wake-up fd left installed


def test_command_that_cannot_start(handlers: dict[int, object]) -> None:
    lines: list[str] = []
    assert _supervisor(["/nonexistent/opguard-test-command"], lines.append).run() == 127
    assert any("cannot start" in line for line in lines)
    _assert_restored(handlers)


def test_normal_exit(handlers: dict[int, object]) -> None:
    assert _supervisor([sys.executable, "-c", "raise SystemExit(3)"], lambda _m: None).run() == 3
    _assert_restored(handlers)


def test_error_inside_the_loop(handlers: dict[int, object]) -> None:
    """A real SIGUSR2 reaches the wrapper while its command sleeps; handling it raises: the handlers
    are restored and the command's tree is killed before the error leaves run()."""
    started: list[int] = []

    def say(msg: str) -> None:
        if "received SIGUSR2" in msg:
            raise RuntimeError("boom inside the loop")

    sup = _supervisor([sys.executable, "-c", "import time; time.sleep(60)"],
                      say)
    real_start = sup._start

    def start_then_signal(env: dict[str, str]) -> int | None:
        code = real_start(env)
        assert sup.child is not None
        started.append(sup.child.pid)
        os.kill(os.getpid(), signal.SIGUSR2)  # handled by the loop, through the wake-up pipe
        return code

    sup._start = start_then_signal  # type: ignore[method-assign]
    with pytest.raises(RuntimeError, match="boom inside the loop"):
        sup.run()
    _assert_restored(handlers)
    assert started and sup.child is not None and sup.child.poll() is not None  # killed and reaped
