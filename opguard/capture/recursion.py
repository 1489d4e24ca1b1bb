"""Recursion-limit headroom for capture's own frames (``docs/capture.md`` §11).

Capture adds Python frames below the program's: one per nested module call (its global module hooks
make ``Module._call_impl`` call ``forward`` from an inner function) and its handler's per intercepted
call. A program that lowers the recursion limit to what its deepest recursion needs would raise
``RecursionError`` only under capture. While capture runs, ``sys.setrecursionlimit(n)`` sets ``n``
(so that a value Python refuses is refused as without capture) and then :func:`with_headroom` of it;
``sys.getrecursionlimit()`` returns ``n`` while the limit is the one set so. The limit in force when
capture starts gets the same headroom (a program 200 modules deep under the default 1000 ran plain
and raised ``RecursionError`` captured); a reference to ``getrecursionlimit`` taken before capture
started (``from sys import getrecursionlimit`` above ``import torch``) reads the raised value. The
program's ``n`` is set back when capture stops.
"""

from __future__ import annotations

import functools
import sys
from collections.abc import Callable
from typing import Any


def with_headroom(n: int) -> int:
    """The limit set for a program limit ``n``: half again as deep, and 100 frames more."""
    return n + n // 2 + 100


class RecursionHeadroom:
    """Install/uninstall the wrappers on ``sys.setrecursionlimit`` / ``sys.getrecursionlimit``."""

    def __init__(self) -> None:
        self.saved: tuple[Callable[[int], None], Callable[[], int]] | None = None
        self.program: int | None = None  # the limit the program set through the wrapper
        self.raised = 0  # the limit set for it

    def install(self) -> None:
        if self.saved is not None:
            return
        set_limit, get_limit = sys.setrecursionlimit, sys.getrecursionlimit
        owner = self
        start = get_limit()
        try:
            set_limit(with_headroom(start))
            self.program, self.raised = start, with_headroom(start)
        except (RecursionError, ValueError, OverflowError):
            pass  # the limit stays as it is

        @functools.wraps(set_limit)
        def setrecursionlimit(limit: Any) -> None:
            set_limit(limit)  # Python's own checks and errors (type, < 1, below the current depth)
            owner.program, owner.raised = int(limit), int(limit)
            try:
                set_limit(with_headroom(int(limit)))
                owner.raised = with_headroom(int(limit))
            except (RecursionError, ValueError, OverflowError):
                pass  # the program's own value stays

        @functools.wraps(get_limit)
        def getrecursionlimit() -> int:
            now = get_limit()
            return owner.program if owner.program is not None and now == owner.raised else now

        self.saved = (set_limit, get_limit)
        sys.setrecursionlimit = setrecursionlimit
        sys.getrecursionlimit = getrecursionlimit

    def uninstall(self) -> None:
        if self.saved is None:
            return
        set_limit, get_limit = self.saved
        self.saved = None
        if sys.setrecursionlimit is not set_limit:
            sys.setrecursionlimit = set_limit
        if sys.getrecursionlimit is not get_limit:
            sys.getrecursionlimit = get_limit
        if self.program is not None and get_limit() == self.raised:
            try:
                set_limit(self.program)
            except (RecursionError, ValueError, OverflowError):  # deeper than that now: the next check says so
                pass
        self.program = None
