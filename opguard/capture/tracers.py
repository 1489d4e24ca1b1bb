"""Tracers that turn the program into a graph run without capture (``docs/capture.md`` §10).

``torch.jit.trace`` / ``torch.jit.trace_module`` write the Python location of each traced call into
the graph (its printed code, ``graph`` and the file ``torch.jit.save`` writes): under capture that
location was capture's ``__torch_function__`` frame, so a program printing its traced code, or
saving it, printed and saved other text and bytes than without capture. ``torch.export.export(...,
strict=True)`` refuses global module hooks (``Attempted to inline function marked as skipped``), and
capture's module paths are global hooks: strict export failed under capture only.

While one of these runs on capture's thread, capture steps aside: its mode is off PyTorch's mode
stack (``modestack``, put back where it was) and its global module hooks are out of PyTorch's hook
dicts (put back at their positions). Nothing the tracer runs is recorded; the traced or exported
program's later calls are recorded as any others.
"""

from __future__ import annotations

import functools
import importlib
import threading
from collections.abc import Callable
from typing import Any

from opguard.capture import modestack
from opguard.capture.dynamo_marks import runs_program
from opguard.capture.session import Session

# (module, attribute) of each tracer wrapped
TRACERS = (("torch.jit", "trace"), ("torch.jit", "trace_module"), ("torch.export", "export"))


class TracerWindows:
    """Capture steps aside while a graph tracer runs (install/uninstall)."""

    def __init__(self, session: Session, mode: Any, modules: Any) -> None:
        self.session = session
        self.mode = mode  # capture's torch function mode
        self.modules = modules  # api.ModulePaths: suspend()/resume() its global hooks
        self.saved: list[tuple[Any, str, Any]] = []
        self.thread = 0
        self.depth = 0

    def install(self) -> None:
        self.thread = threading.get_ident()
        for mod_name, attr in TRACERS:
            try:
                mod = importlib.import_module(mod_name)
                orig = getattr(mod, attr)
            except (ImportError, AttributeError):  # an older PyTorch without it
                continue
            self.saved.append((mod, attr, orig))
            setattr(mod, attr, self._wrap(orig))

    def _wrap(self, orig: Callable[..., Any]) -> Callable[..., Any]:
        windows = self

        @functools.wraps(orig)
        @runs_program
        def tracer(*args: Any, **kwargs: Any) -> Any:
            if windows.depth or threading.get_ident() != windows.thread or not windows.session.active:
                return orig(*args, **kwargs)
            windows.depth += 1
            taken = modestack.take_off(windows.mode)
            hooks = windows.modules.suspend()
            try:
                return orig(*args, **kwargs)
            finally:
                windows.modules.resume(hooks)
                if taken is not None:
                    modestack.put_back(taken)
                windows.depth -= 1

        return tracer

    def uninstall(self) -> None:
        for mod, attr, orig in reversed(self.saved):
            setattr(mod, attr, orig)
        self.saved = []
