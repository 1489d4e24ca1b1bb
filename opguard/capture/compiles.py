"""Compilation that happens while the program runs is not the program's computation (``docs/capture.md`` §10).

``torch.compile`` compiles a graph's backward lazily, at its first backward call (AOTAutograd's lazy
backward), outside Dynamo's compile session: ``torch.compiler._is_compiling_flag`` is off there, and
a backend's lowering of that graph makes torch calls (inductor: dtype promotions, constant tensors,
...), which capture would record as calls of the program's ``backward()`` — about 1,000 records in a
run that compiled and none in a rerun that found the graph in PyTorch's compile cache, so identical
runs did not align. PyTorch announces such work through its compilation callbacks
(``torch._dynamo.callback``: a start when the outermost compilation begins, an end when it ends;
Dynamo's own compiles, the lazy backward, CUDA graph recording and run-time autotuning): between a
start and its end, capture's session is busy (``Session.busy``: nothing is recorded, as for
capture's own work).

Importing Dynamo costs seconds, so capture does not import it: the callbacks are registered when the
program imports ``torch._dynamo`` (``wrapt``'s post-import hook; at once if it is imported already).
"""

from __future__ import annotations

import importlib
import sys
from typing import Any

from opguard.capture.session import Session

try:  # the [torch] extra installs it; without it, only a Dynamo imported before capture starts is seen
    wrapt: Any = importlib.import_module("wrapt")
except ImportError:  # pragma: no cover - the extra is installed wherever the tests run
    wrapt = None

_DYNAMO = "torch._dynamo"


class CompileWindows:
    """While PyTorch compiles at run time, capture records nothing (install/uninstall)."""

    def __init__(self, session: Session) -> None:
        self.session = session
        self.installed = False
        self.handler: Any = None  # torch._dynamo.callback's handler, once registered
        self.open = 0  # starts not yet ended (0 or 1: PyTorch announces the outermost compilation only)

    def install(self) -> None:
        self.installed = True
        if _DYNAMO in sys.modules or wrapt is None:
            self._register(sys.modules.get(_DYNAMO))
        else:
            wrapt.register_post_import_hook(self._register, _DYNAMO)

    def _register(self, _module: Any) -> None:
        if not self.installed or self.handler is not None or _module is None:
            return
        try:
            from torch._dynamo.callback import callback_handler
            callback_handler.register_start_callback(self._start)
            callback_handler.register_end_callback(self._end)
        except Exception as err:  # a PyTorch without these callbacks: said once, the program goes on
            self.session.failed("recording", err)
            return
        self.handler = callback_handler

    def _start(self, *_args: Any) -> None:
        if self.installed:
            self.open += 1
            self.session.busy += 1

    def _end(self, *_args: Any) -> None:
        if self.open:
            self.open -= 1
            self.session.busy -= 1

    def uninstall(self) -> None:
        self.installed = False
        h, self.handler = self.handler, None
        if h is not None:
            for remove, fn in ((h.remove_start_callback, self._start), (h.remove_end_callback, self._end)):
                try:
                    remove(fn)
                except ValueError:  # the program cleared PyTorch's callbacks itself
                    pass
        while self.open:
            self._end()
