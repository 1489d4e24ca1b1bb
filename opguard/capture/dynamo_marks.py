"""Which of capture's frames run the program's code, for Dynamo (``docs/capture.md`` §10).

Dynamo never compiles a frame of capture's own code as a root frame (``compiles.skip_own_frames``):
where it runs a frame of the program eagerly with its frame callback still on (a graph break inside
a loop, ``torch.compiler.disable(recursive=False)``), every frame that frame calls is tried as a new
root, capture's own included. Most capture frames do capture's work only: they and everything they
call run without Dynamo. The frames listed here call the program's function (the intercepted op, an
original PyTorch function a wrapper stands in for, a callback the program gave): they run eagerly,
and what they call is treated by Dynamo as it would be without capture.
"""

from __future__ import annotations

from collections.abc import Callable
from types import CodeType
from typing import Any, TypeVar

F = TypeVar("F", bound=Callable[..., Any])

PROGRAM_CALLERS: set[CodeType] = set()
# set by compiles.skip_own_frames once Dynamo is imported: marks a code object made at run time
# (a stand-in, frames.py) as one that calls the program's function
mark_new: Callable[[CodeType], None] | None = None


def runs_program(fn: F) -> F:
    """Decorator: ``fn`` calls the program's function (its callees are treated as without capture)."""
    PROGRAM_CALLERS.add(fn.__code__)
    return fn


def new_program_code(code: CodeType) -> None:
    """A code object made at run time that calls the program's function (a stand-in)."""
    mark = mark_new
    if mark is not None:
        try:
            mark(code)
        except Exception:  # pragma: no cover - Dynamo's marking failed: the stand-in runs as before
            pass
