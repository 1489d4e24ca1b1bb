"""The explicit API: ``capture()``, ``context(name)``, ``step(n)``, ``name_modules(module, name)``.

``capture()`` installs, for the calling thread: the torch function mode, global forward hooks for
module paths, the ``torch.distributed`` wrappers and (``level=dispatch``) the aten mode; on exit
it removes them and writes the end of the trace. ``context``/``step`` are no-ops without an
active capture, so instrumented programs run unchanged without it.
"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Iterator
from typing import Any

import torch
from torch.nn.modules import module as nn_module

from opguard.capture.collectives import Collectives
from opguard.capture.dispatch import AtenMode, tag_outputs
from opguard.capture.mode import CaptureMode
from opguard.capture.options import CaptureOptions
from opguard.capture.session import Session
from opguard.errors import ConfigError

_root_names: weakref.WeakKeyDictionary[torch.nn.Module, str] = weakref.WeakKeyDictionary()
_active: Capture | None = None


def name_modules(module: torch.nn.Module, name: str) -> torch.nn.Module:
    """Name a root module: its submodules' paths then read ``<name>.layers.3.attn``."""
    if not name or "/" in name:
        raise ConfigError(f"module name {name!r} is empty or contains '/'", "pass a name like 'model'")
    _root_names[module] = name
    return module


class ModulePaths:
    """Forward pre-/post-hooks on every module: the path of the innermost running module."""

    def __init__(self, session: Session) -> None:
        self.session = session
        self.paths: weakref.WeakKeyDictionary[torch.nn.Module, str] = weakref.WeakKeyDictionary()
        self.running: list[torch.nn.Module] = []
        self.handles: list[Any] = []

    def path(self, m: torch.nn.Module) -> str:
        p = self.paths.get(m)
        if p is not None:
            return p
        if self.running:
            parent = self.running[-1]
            for name, child in parent.named_modules():
                if child is m and name:
                    p = f"{self.path(parent)}.{name}"
                    break
        if p is None:
            p = _root_names.get(m) or type(m).__name__
        self.paths[m] = p
        return p

    def _pre(self, m: torch.nn.Module, _args: Any) -> None:
        self.session.modules.append(self.path(m))
        self.running.append(m)

    def _post(self, m: torch.nn.Module, _args: Any, _out: Any) -> None:
        if self.running and self.running[-1] is m:
            self.running.pop()
            self.session.modules.pop()

    def install(self) -> None:
        self.handles = [nn_module.register_module_forward_pre_hook(self._pre),
                        nn_module.register_module_forward_hook(self._post, always_call=True)]

    def uninstall(self) -> None:
        for h in self.handles:
            h.remove()
        self.handles = []


class Capture:
    """An active capture in this process (at most one)."""

    def __init__(self, options: CaptureOptions, env: dict[str, str] | None = None) -> None:
        self.options = options
        self.session = Session(options, env)
        self.mode = CaptureMode(self.session, tag_outputs if options.level == "dispatch" else None)
        self.aten = AtenMode(self.session) if options.level == "dispatch" else None
        self.modules = ModulePaths(self.session)
        self.collectives = Collectives(self.session)
        self._entered: list[Any] = []

    @property
    def path(self) -> Any:
        return self.session.path

    def start(self) -> Capture:
        global _active
        if _active is not None:
            raise ConfigError("a capture is already active in this process",
                              "nest no capture() blocks (opguard-run --capture already captures the whole program)")
        self.modules.install()
        self.collectives.install()
        if self.aten is not None:
            self.aten.__enter__()  # type: ignore[no-untyped-call]
            self._entered.append(self.aten)
        self.mode.__enter__()  # type: ignore[no-untyped-call]
        self._entered.append(self.mode)
        _active = self
        return self

    def stop(self) -> None:
        global _active
        if _active is not self:
            return
        _active = None
        try:
            while self._entered:
                self._entered.pop().__exit__(None, None, None)
        finally:
            self.modules.uninstall()
            self.collectives.uninstall()
            self.session.close()


@contextlib.contextmanager
def capture(env: dict[str, str] | None = None, **options: Any) -> Iterator[Capture]:
    """Capture every operation in the block; keywords as in ``docs/capture.md`` §1.1 (defaults from env)."""
    cap = Capture(CaptureOptions.from_env(env, **options), env).start()
    try:
        yield cap
    finally:
        cap.stop()


def active() -> Capture | None:
    return _active


@contextlib.contextmanager
def context(name: str) -> Iterator[None]:
    """Records made inside carry ``context`` = the enclosing names joined by '/'."""
    if not isinstance(name, str) or not name or "/" in name:
        raise ConfigError(f"capture context name {name!r} is empty, not a string or contains '/'",
                          "pass a short name like 'fwd' (nest contexts for a path)")
    cap = _active
    if cap is None:
        yield
        return
    ctxs = cap.session.contexts
    ctxs.append(name)
    try:
        yield
    finally:
        if ctxs and ctxs[-1] == name:
            ctxs.pop()


def step(n: int | None = None) -> int:
    """Set the current step (``n``) or advance it by one; returns it. Flushes at step boundaries."""
    cap = _active
    if n is not None and (not isinstance(n, int) or isinstance(n, bool) or n < 0):
        raise ConfigError(f"step {n!r} is not an integer >= 0", "call step(i) with the training iteration")
    if cap is None:
        return -1 if n is None else n
    s = cap.session
    s.step = s.step + 1 if n is None else n
    if not s.cap_reached and not s.closed:
        from opguard.capture.session import Call

        s.pending.append(Call({"v": 1, "kind": "step", "seq": s.seq, "step": s.step, "rank": s.rank}))
        s.maybe_flush()
    return s.step
