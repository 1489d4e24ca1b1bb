"""``Work.wait()`` of an asynchronous collective under capture (``docs/capture.md`` §3.2).

A collective issued with ``async_op=True`` (and ``isend``/``irecv``, always asynchronous) has no
valid output when it returns: its record has ``"async": true`` and no outputs, and what it wrote was
digested only at its next use. On a rank that received other data, compare then found no call
that introduced the difference — only an "inherited" one at that use, with nothing naming the
receive. While capture runs, ``Work.wait`` (``torch.distributed.distributed_c10d.Work``, the object
such a call returns) is wrapped: when the program waits on the work of a recorded asynchronous
collective, on capture's thread, capture writes a record of the wait — ``api: "collective"``,
``fn: "<the collective's fn>.wait"``, the wait's call site, ``"async_of"`` the collective's ``seq``,
no inputs, and as outputs the tensors the collective writes, digested from memory — so a received
difference shows there, "in a collective". Works never waited on through ``wait()`` (polled with
``is_completed()``, or through ``get_future()``) make no such record; capture keeps at most
:data:`MAX_PENDING` of them (the oldest go first).
"""

from __future__ import annotations

import functools
import sys
import threading
from collections.abc import Callable
from typing import Any

import torch

from opguard.capture.session import Call, Session

MAX_PENDING = 1024
_no_modes = torch._C.DisableTorchFunction


def _work_class() -> Any:
    try:
        from torch.distributed.distributed_c10d import Work
    except Exception:  # a torch built without distributed
        return None
    return Work


class AsyncWaits:
    """The works of recorded asynchronous collectives, and the wrapper on ``Work.wait``."""

    def __init__(self, session: Session) -> None:
        self.session = session
        self.thread = threading.get_ident()
        # id(work) -> (work, the collective's record, the tensors it writes as (slot, tensor))
        self.pending: dict[int, tuple[Any, dict[str, Any], list[tuple[str, torch.Tensor]]]] = {}
        self.saved: Callable[..., Any] | None = None

    def issued(self, work: Any, call: Call, written: list[tuple[str, torch.Tensor]]) -> None:
        """``work`` was returned by the asynchronous collective ``call`` records, which writes ``written``."""
        if work is None or not callable(getattr(work, "wait", None)) or not written:
            return
        self.pending[id(work)] = (work, call.rec, written)
        while len(self.pending) > MAX_PENDING:
            del self.pending[next(iter(self.pending))]

    def install(self) -> None:
        cls = _work_class()
        orig = getattr(cls, "wait", None) if cls is not None else None
        if orig is None:
            return
        waits = self

        @functools.wraps(orig)
        def wait(work: Any, *args: Any, **kwargs: Any) -> Any:
            result = orig(work, *args, **kwargs)
            if waits.pending:
                try:
                    waits.waited(work, sys._getframe(1))
                except Exception as err:  # capture's own failure: said once, the program goes on
                    waits.session.failed("recording", err)
            return result

        try:
            cls.wait = wait
        except (AttributeError, TypeError):  # a build whose Work type refuses it: the use is digested
            return
        self.saved = orig

    def uninstall(self) -> None:
        if self.saved is not None:
            cls = _work_class()
            if cls is not None:
                cls.wait = self.saved
            self.saved = None
        self.pending.clear()

    def waited(self, work: Any, caller: Any) -> None:
        """The program waited on ``work``: the record of the wait (module docstring)."""
        held = self.pending.pop(id(work), None)
        if held is None or held[0] is not work:
            return
        s = self.session
        if (threading.get_ident() != self.thread or not s.active or s.busy or s.quiet is not None
                or s.cap_reached or s.closed or torch.compiler.is_dynamo_compiling()):
            return
        _, rec, written = held
        name = f"{rec['fn']}.wait"
        modules, contexts = s.modules, s.contexts
        module = modules[-1] if modules else None
        context = "/".join(contexts) if contexts else None
        if not (s.all_steps or s.step in s.options.steps) or not (s.select_all or s.selected(name, module, context)):
            return
        call = s.begin("collective", name, s.sites.lookup(caller), where=(module, context))
        call.rec["async_of"] = rec.get("seq")
        if "group_size" in rec:
            call.rec["group_size"] = rec["group_size"]
        s.busy += 1
        try:
            with _no_modes():
                s.outputs(call, written, fresh=True)
        finally:
            s.busy -= 1
        s.maybe_flush_contained()
