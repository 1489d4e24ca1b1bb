"""Shared helpers for launcher tests: run the real ``opguard-run`` console script, snapshot trees."""

from __future__ import annotations

import hashlib
import os
import signal
import subprocess
import time
from collections.abc import Callable, Sequence
from pathlib import Path

from tests.conftest import BIN

OPGUARD_RUN = str(BIN / "opguard-run")
OPGUARD = str(BIN / "opguard")
PY = str(BIN / "python")


LIVE: list[subprocess.Popen[str]] = []  # wrappers a test started; the conftest kills leftovers


def default_signals() -> None:
    """preexec: the signals the tests send with their default disposition. A test run started in the
    background by a shell without job control (``.ci/run &``) inherits SIGINT and SIGQUIT ignored,
    and the wrapper leaves ignored signals ignored (docs/launcher.md §4): it would forward nothing."""
    for s in (signal.SIGINT, signal.SIGQUIT, signal.SIGHUP, signal.SIGTERM, signal.SIGUSR1, signal.SIGUSR2):
        signal.signal(s, signal.SIG_DFL)


def spawn(args: Sequence[str], env: dict[str, str]) -> subprocess.Popen[str]:
    """Start ``opguard-run ARGS`` in the background (stdout/stderr captured as text)."""
    p = subprocess.Popen([OPGUARD_RUN, *args], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                         preexec_fn=default_signals)
    LIVE.append(p)
    return p


def run_wrapper(args: Sequence[str], env: dict[str, str], timeout: float = 120,
                cwd: Path | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run([OPGUARD_RUN, *args], env=env, capture_output=True, text=True, timeout=timeout,
                          cwd=cwd)


def tree_snapshot(root: Path) -> dict[str, str]:
    """Every path under root with a digest of regular files ('dir' for directories)."""
    out: dict[str, str] = {}
    if not root.exists():
        return out
    for dirpath, dirnames, filenames in os.walk(root):
        for d in dirnames:
            out[os.path.relpath(os.path.join(dirpath, d), root)] = "dir"
        for f in filenames:
            p = os.path.join(dirpath, f)
            out[os.path.relpath(p, root)] = hashlib.sha256(Path(p).read_bytes()).hexdigest()
    return out


def wait_for(cond: Callable[[], bool], timeout: float, what: str, interval: float = 0.05) -> None:
    """Poll a condition with a deadline (the event to await is a file or a process state)."""
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout} s waiting for {what}")
        time.sleep(interval)


def pid_alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            state = f.read().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"
