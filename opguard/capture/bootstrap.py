"""What ``opguard-run --capture`` installs in every Python child (``docs/capture.md`` §1).

:func:`child_env` is pure and imports no torch: the launcher calls it to build the child's
environment. The ``_site`` directory it puts first on ``PYTHONPATH`` holds a ``sitecustomize``
that calls :func:`install_hook` in every Python process: capture starts right after the program
imports ``torch`` — except in the torchrun agent — and stops at interpreter exit.
"""

from __future__ import annotations

import atexit
import importlib.abc
import importlib.machinery
import importlib.util
import os
import secrets
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from types import ModuleType
from typing import Any

from opguard.capture.claim import RUN_ENV, HeldByThisRun
from opguard.capture.options import CaptureOptions
from opguard.errors import ConfigError, OpguardError

SITE_DIR = Path(__file__).resolve().parent / "_site"
ENABLE = "OPGUARD_CAPTURE"
# the pid of the process that captures this rank, set by the bootstrap in that process once capture
# started: a Python the program starts after that inherits it and is not a rank of its own (§1)
OWNER = "OPGUARD_CAPTURE_OWNER"
RUN = RUN_ENV  # one token per wrapper child: the captures of this same command (claim.py)
_AGENT_MODULES = ("torch.distributed.run", "torch.distributed.launch", "torch.distributed.elastic.agent",
                  "torch._inductor")  # the launcher agent; torch.compile's compile workers


def child_env(env: Mapping[str, str], options: CaptureOptions | None = None) -> dict[str, str]:
    """The environment for a child that must capture: ``env`` plus ``OPGUARD_CAPTURE=1``, the
    options as ``OPGUARD_CAPTURE_*`` and the bootstrap directory first on ``PYTHONPATH``.

    ``options`` defaults to the ``OPGUARD_CAPTURE_*`` already in ``env`` (validated here, so a bad
    value fails in the wrapper before any child starts)."""
    opts = CaptureOptions.from_env(env) if options is None else options
    if not (SITE_DIR / "sitecustomize.py").is_file():
        raise ConfigError(f"the capture bootstrap {SITE_DIR / 'sitecustomize.py'} is missing",
                          "reinstall opguard (the package data is incomplete)")
    if opts.host_kernel == "native" and not native_kernel_present():
        raise ConfigError(f"OPGUARD_CAPTURE_HOST_KERNEL=native, but the native host kernel is not built "
                          f"(no _hostkernel extension module in {SITE_DIR.parent})",
                          "reinstall opguard where a C compiler is available, or set "
                          "OPGUARD_CAPTURE_HOST_KERNEL=auto or torch (docs/capture.md §5.2)")
    out = dict(env)
    out.update(opts.to_env())
    out[ENABLE] = "1"
    out.pop(OWNER, None)    # the wrapper's child is a rank's process (an opguard-run inside a captured program too)
    out[RUN] = secrets.token_hex(8)
    parts = [p for p in out.get("PYTHONPATH", "").split(os.pathsep) if p and p != str(SITE_DIR)]
    # the bootstrap imports opguard from its own location (sitecustomize.py): the directory holding
    # the package is not put on the program's path (a source checkout's tests/ would be importable)
    out["PYTHONPATH"] = os.pathsep.join([str(SITE_DIR), *parts])
    return out


def native_kernel_present() -> bool:
    """Whether the built extension ``opguard.capture._hostkernel`` is installed (a file check: no
    import, no torch). The child still imports it and says why if it cannot."""
    here = SITE_DIR.parent
    return any((here / f"_hostkernel{suffix}").is_file() for suffix in importlib.machinery.EXTENSION_SUFFIXES)


def is_agent(orig_argv: Sequence[str], argv: Sequence[str]) -> bool:
    """True where capture must not start although torch is imported: the torchrun/launch agent
    (``torchrun ...``, ``python -m torch.distributed.run|launch ...``), torch.compile's compile
    workers, and multiprocessing children (DataLoader workers: they share their rank's directory)."""
    if argv and os.path.basename(argv[0]) in ("torchrun", "torchrun.exe"):
        return True
    if "--multiprocessing-fork" in orig_argv or any("from multiprocessing." in a for a in orig_argv):
        return True
    args = list(orig_argv)
    for i, a in enumerate(args[1:], 1):
        if a == "-m":
            return i + 1 < len(args) and args[i + 1].startswith(_AGENT_MODULES)
        if a.startswith("-m") and len(a) > 2:
            return a[2:].startswith(_AGENT_MODULES)
        if not a.startswith("-"):
            return os.path.basename(a) in ("torchrun", "torchrun.exe")
    return False


def enabled(env: Mapping[str, str]) -> bool:
    return env.get(ENABLE, "").strip().lower() in ("1", "true", "yes", "on")


_started: list[Any] = []


def start_capture() -> None:
    """Start capture in this process now (torch is imported), unless it is the torchrun agent."""
    if _started:
        return
    if is_agent(getattr(sys, "orig_argv", []), sys.argv):
        return
    from opguard.capture import api

    try:
        cap = api.Capture(CaptureOptions.from_env(os.environ)).start()
    except HeldByThisRun as held:  # another Python process of this command captures the rank: run as is
        print(f"opguard capture: warning: pid {os.getpid()} is not captured: its rank's capture is held by pid "
              f"{held.pid} of this same command (a script run after another, a process that re-executed "
              "itself, or a child started before its parent imported torch; only the first Python process "
              "of a rank that imports torch is captured, docs/capture.md §1)", file=sys.stderr, flush=True)
        _started.append(None)
        return
    _started.append(cap)
    os.environ[OWNER] = str(os.getpid())  # the Python processes it starts from now on are not ranks
    atexit.register(_stop_at_exit, cap)
    for name in ("execv", "execve"):  # os.execl/execvp/... call these: a new image runs no atexit
        orig = getattr(os, name, None)
        if orig is not None:
            setattr(os, name, _stopping_first(orig, cap))


def _stopping_first(orig: Any, cap: Any) -> Any:
    """``os.execv``/``os.execve`` that first end the capture (its records flushed, ``meta.json``
    final, a note saying so): the new program image runs no ``atexit`` of this one."""
    def exec_(*args: Any, **kwargs: Any) -> Any:
        if os.getpid() == getattr(cap.session, "pid", None):  # not in a child forked from it: not its trace
            try:
                cap.session.note("the process replaced itself (os.exec*); calls of the new program image are not "
                                 "in this trace")
                cap.stop()
            except Exception:  # pragma: no cover - ending capture must never stop the exec
                pass
        return orig(*args, **kwargs)

    exec_.__name__, exec_.__doc__, exec_.__wrapped__ = orig.__name__, orig.__doc__, orig  # type: ignore[attr-defined]
    return exec_


def _stop_at_exit(cap: Any) -> None:
    """Stop capture at interpreter exit; a program that ended with an uncaught exception (the
    interpreter printed it and set ``sys.last_value``) says so in the rank's meta notes, so compare
    can say which run stopped where (before, only its missing calls showed it)."""
    err = getattr(sys, "last_value", None)
    if isinstance(err, BaseException):
        try:
            s = cap.session
            text = " ".join(f"{type(err).__name__}: {err}".split())[:300]
            s.note(f"the program ended with an uncaught exception after record seq {s.seq - 1}: {text}")
        except Exception:  # pragma: no cover - a note must never stop the stop
            pass
    cap.stop()


class _TorchHook(importlib.abc.MetaPathFinder):
    """Runs :func:`start_capture` right after the first ``import torch`` finishes."""

    def find_spec(self, fullname: str, path: Sequence[str] | None = None,
                  target: ModuleType | None = None) -> importlib.machinery.ModuleSpec | None:
        if fullname != "torch":
            return None
        sys.meta_path.remove(self)
        spec = importlib.util.find_spec("torch")
        if spec is None or spec.loader is None:
            return spec
        loader = spec.loader
        original = loader.exec_module

        def exec_module(module: ModuleType) -> None:
            original(module)
            try:
                start_capture()
            except OpguardError as err:  # e.g. staging enabled but unusable: refuse, never run uncaptured
                print(f"opguard capture: refusing to start (pid {os.getpid()}): {err}", file=sys.stderr, flush=True)
                raise SystemExit(err.exit_code) from None

        loader.exec_module = exec_module  # type: ignore[method-assign]
        return spec


def install_hook() -> None:
    """Called by the bootstrap ``sitecustomize``: capture once torch is imported."""
    if not enabled(os.environ):
        return
    # validate now: a bad option fails at interpreter start, before the program runs
    CaptureOptions.from_env(os.environ)
    owner = os.environ.get(OWNER)
    if owner and owner != str(os.getpid()):
        return      # started by the captured program (subprocess.run([sys.executable, ...])): not a rank
    if "torch" in sys.modules:
        start_capture()
    else:
        sys.meta_path.insert(0, _TorchHook())
