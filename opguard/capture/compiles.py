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
import types
from typing import Any

from opguard.capture import dynamo_marks
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
        try:
            skip_own_frames()
        except Exception as err:  # pragma: no cover - a PyTorch without code marks: said once, the program goes on
            self.session.failed("recording", err)

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
        dynamo_marks.mark_new = None


def _codes(obj: Any, out: set[types.CodeType]) -> None:
    """Every code object of ``obj`` (a function, a class's methods and properties), nested ones too."""
    if isinstance(obj, (staticmethod, classmethod)):
        obj = obj.__func__
    if isinstance(obj, property):
        for f in (obj.fget, obj.fset, obj.fdel):
            _codes(f, out)
        return
    code = getattr(obj, "__code__", None) if isinstance(obj, types.FunctionType) else None
    stack = [code] if isinstance(code, types.CodeType) else []
    while stack:
        c = stack.pop()
        if c in out:
            continue
        out.add(c)
        stack.extend(k for k in c.co_consts if isinstance(k, types.CodeType))


def own_codes() -> set[types.CodeType]:
    """The code objects of capture's own modules (functions, methods, nested functions)."""
    out: set[types.CodeType] = set()
    for name, mod in list(sys.modules.items()):
        if mod is None or not (name == "opguard.capture" or name.startswith("opguard.capture.")):
            continue
        for obj in list(vars(mod).values()):
            if isinstance(obj, type) and obj.__module__ == name:
                for member in list(vars(obj).values()):
                    _codes(member, out)
            elif getattr(obj, "__module__", None) == name:
                _codes(obj, out)
    return out


def skip_own_frames() -> int:
    """Dynamo never compiles a frame of capture's own code as a root frame (§10, ``dynamo_marks``).

    Where Dynamo runs a frame of the program eagerly with its frame callback still on (a graph
    break inside a loop, ``torch.compiler.disable(recursive=False)``), it tries every frame that
    frame calls as a new root: it compiled capture's ``__torch_function__`` with the first ``func``
    baked in and no guard on it, and ran that graph for later calls of other functions
    (``x.amax()`` returned ``x.sum()``); it compiled ``Module.named_modules`` called by capture's
    module hook, which raised. Every capture frame now runs as it is (``skip_code``'s marking):
    the frames that call the program's function (``dynamo_marks.runs_program``, stand-ins) leave
    their callees to Dynamo as without capture; every other capture frame runs its callees without
    Dynamo. Dynamo still inlines capture's mode where it traces a program's frame. Returns how many
    code objects were marked.
    """
    from torch._C._dynamo.eval_frame import _FrameAction, _FrameExecStrategy, set_code_exec_strategy

    from opguard.capture import frames

    own = _FrameExecStrategy(_FrameAction.SKIP, _FrameAction.SKIP)
    caller = _FrameExecStrategy(_FrameAction.SKIP, _FrameAction.DEFAULT)

    def mark_caller(code: types.CodeType) -> None:
        set_code_exec_strategy(code, caller)

    codes = own_codes()
    for c in codes:
        set_code_exec_strategy(c, caller if c in dynamo_marks.PROGRAM_CALLERS else own)
    dynamo_marks.mark_new = mark_caller
    for code in frames.standin_codes():  # stand-ins made before Dynamo was imported
        mark_caller(code)
    return len(codes)
