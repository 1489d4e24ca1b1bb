"""Callbacks of ``torch.futures.Future`` under capture (``docs/capture.md`` §10).

A callback attached with ``fut.then(cb)`` or ``fut.add_done_callback(cb)`` (a DDP communication
hook's decompression, an async collective's post-processing) runs on the thread that attaches it
when the future is already complete, and on the backend's thread when it completes later. Capture
records only its own thread's calls, so which of the two happened — a race — decided whether the
callback's calls were recorded: identical runs differed by such records (hand test, DDP's
``fp16_compress_hook``, 2 ranks). While capture runs, both methods of ``torch._C.Future`` (which
``torch.futures.Future`` extends) wrap the callback so that on capture's thread it runs as
capture's own work (``Session.busy``): its calls are never recorded, on either thread. What it
writes with in-place ops moves their version counters, so their next recorded use is digested anew.
"""

from __future__ import annotations

import functools
import threading
from collections.abc import Callable
from typing import Any

import torch

from opguard.capture.dynamo_marks import runs_program
from opguard.capture.session import Session

_METHODS = ("then", "add_done_callback")


class FutureCallbacks:
    """Install/uninstall the callback wrapper on ``torch._C.Future``'s ``then`` and ``add_done_callback``."""

    def __init__(self, session: Session) -> None:
        self.session = session
        self.thread = threading.get_ident()
        self.saved: dict[str, Callable[..., Any]] = {}

    def install(self) -> None:
        cls = getattr(torch._C, "Future", None)
        for name in _METHODS if cls is not None else ():
            orig = getattr(cls, name, None)
            if orig is None:
                continue
            try:
                setattr(cls, name, self._wrapper(orig))
            except (AttributeError, TypeError):  # a build whose Future type refuses it: the race stays
                continue
            self.saved[name] = orig

    def uninstall(self) -> None:
        cls = getattr(torch._C, "Future", None)
        while self.saved:
            name, orig = self.saved.popitem()
            setattr(cls, name, orig)

    def _wrapper(self, orig: Callable[..., Any]) -> Callable[..., Any]:
        session, thread = self.session, self.thread

        def unrecorded(callback: Callable[[Any], Any]) -> Callable[[Any], Any]:
            @functools.wraps(callback)
            @runs_program
            def run(fut: Any) -> Any:
                if threading.get_ident() != thread:  # the backend's thread: not recorded anyway
                    return callback(fut)
                session.busy += 1
                try:
                    return callback(fut)
                finally:
                    session.busy -= 1
            return run

        @functools.wraps(orig)
        @runs_program
        def attach(fut: Any, callback: Callable[[Any], Any]) -> Any:
            return orig(fut, unrecorded(callback) if callable(callback) else callback)

        return attach
