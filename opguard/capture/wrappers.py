"""Wrappers that only forward their call (``docs/capture.md`` §3.10).

A Python-level torch function (``F.relu``, ``F.layer_norm``, ``F.embedding``) is re-entered by the
function mode so the calls it makes are recorded. Many only pass their tensors on to one other
function (``torch.relu``): the nested record repeats its parent, and the re-entry doubles the cost
of the call. :class:`Wrappers` watches each such function on its first calls; after
:data:`FORWARDED_CALLS` calls that each only forwarded their tensors to one recorded call, the
function is *collapsed*: no longer re-entered, one record per call. A call that did anything else
first keeps the function re-entered for the rest of the run.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

FORWARDED_CALLS = 2  # calls of a function, each forwarded, before it is collapsed
_MAX_WATCHED = 4096  # functions with a verdict kept (functions made per call could otherwise pile up)
_NOT_A_WRAPPER = -1


class Wrappers:
    def __init__(self, enabled: bool) -> None:
        self.enabled = enabled
        self.collapsed: set[Any] = set()  # functions no longer re-entered
        self._forwarded: dict[Any, int] = {}  # function -> forwarded calls so far; -1: not a pass-through
        self.found: list[dict[str, Any]] = []  # meta.json collapsed_wrappers, in the order found
        # > 0 while a watched call runs: the calls made inside it keep their tensors' ids (Call.ids)
        self.watching = 0

    def watched(self, func: Any) -> bool:
        """Whether this call of ``func`` (re-entered, not collapsed) is one to watch."""
        if not self.enabled:
            return False
        n = self._forwarded.get(func)
        if n is None:
            return len(self._forwarded) < _MAX_WATCHED
        return n >= 0

    def observe(self, func: Any, name: str, call: Any, kids: Sequence[Any], in_ids: frozenset[int],
                out_ids: frozenset[int]) -> None:
        """The verdict on one watched call: ``call`` (a ``session.Call``) made the records ``kids``
        (every record begun while it ran, in order); ``in_ids`` / ``out_ids``: the ids of its tensor
        inputs and of its output tensors (outputs and written arguments)."""
        rec = call.rec
        kid = kids[0] if len(kids) == 1 else None
        forwarded = (
            kid is not None and kid.ids is not None and kid.rec.get("kind") == "op"
            and kid.rec.get("parent") == rec["seq"]
            and "error" not in rec and "error" not in kid.rec
            and "capture_error" not in rec and "capture_error" not in kid.rec
            and kid.ids[0] <= in_ids and kid.ids[1] == out_ids)
        if not forwarded:
            self._forwarded[func] = _NOT_A_WRAPPER
            return
        n = self._forwarded.get(func, 0) + 1
        self._forwarded[func] = n
        if n >= FORWARDED_CALLS:
            self.collapsed.add(func)
            self.found.append({"fn": name, "after_seq": rec["seq"]})

    def forwards(self, func: Any) -> bool:
        """``func`` (re-entered) has so far only forwarded its calls, or is collapsed: a call that
        forwards to it forwards too. A re-entered function that did anything else (no recorded call
        at all: ``torch.autograd.backward``, whose engine runs the program's hooks) is no such link."""
        return func in self.collapsed or self._forwarded.get(func, 0) > 0

    def failed(self, func: Any) -> None:
        """A watched call that raised, or whose recording failed: not a pass-through."""
        self._forwarded[func] = _NOT_A_WRAPPER

    def clear(self) -> None:
        self.collapsed.clear()
        self._forwarded.clear()
