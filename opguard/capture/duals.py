"""Forward-mode AD tangents made from uninitialised memory (``docs/capture.md`` §3.7).

A tangent rides on its dual tensor: capture records the dual's primal, never its tangent, and
forward AD computes the tangents of every op's outputs inside the op. ``torch.func.linearize``
attaches ``p.new_empty(()).expand_as(p)`` — uninitialised memory — as the tangents it traces
with; the tangent ``torch._unpack_dual`` then returns is computed from whatever the allocator left,
and two identical runs differed there with "outputs differ, inputs and arguments equal".

So: a dual level at which ``torch._make_dual`` attached a tangent whose input entry is
uninitialised is *tainted*; a tangent ``torch._unpack_dual`` returns at a tainted level is an
uninitialised output (no digest, never compared). The taint ends when the level is exited
(``torch.autograd.forward_ad.exit_dual_level``, which ``dual_level()`` calls, is wrapped while
capture runs). Capture does not follow tangents through ops: every tangent unpacked at such a
level is marked, also one computed from an initialised tangent attached at the same level.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch.autograd.forward_ad as fwad

from opguard.capture.dynamo_marks import runs_program
from opguard.capture.session import Session

MAKE = "torch._make_dual"
UNPACK = "torch._unpack_dual"
NAMES = frozenset({MAKE, UNPACK})


def level_of(name: str, args: Sequence[Any], kwargs: Mapping[str, Any]) -> Any:
    """The ``level`` argument of a ``_make_dual(tensor, tangent, level)`` / ``_unpack_dual(tensor, level)`` call."""
    at = 2 if name == MAKE else 1
    return kwargs.get("level", args[at] if len(args) > at else None)


def made(s: Session, args: Sequence[Any], kwargs: Mapping[str, Any], entries: list[dict[str, Any]]) -> None:
    """After a recorded ``_make_dual``: its tangent (the second tensor input) uninitialised taints the level."""
    if len(entries) > 1 and entries[1].get("uninitialized"):
        level = level_of(MAKE, args, kwargs)
        if isinstance(level, int):
            s.tainted_levels.add(level)


def tainted(s: Session, args: Sequence[Any], kwargs: Mapping[str, Any]) -> bool:
    """A ``_unpack_dual`` call at a tainted level: its tangent output is uninitialised."""
    return bool(s.tainted_levels) and level_of(UNPACK, args, kwargs) in s.tainted_levels


class DualLevels:
    """Install/uninstall the wrapper on ``forward_ad.exit_dual_level`` that ends a level's taint."""

    def __init__(self, session: Session) -> None:
        self.session = session
        self.saved: Callable[..., Any] | None = None

    def install(self) -> None:
        orig = getattr(fwad, "exit_dual_level", None)
        if orig is None:
            return
        session = self.session

        @functools.wraps(orig)
        @runs_program
        def exit_dual_level(*, level: int | None = None) -> Any:
            try:
                gone = fwad._current_level if level is None else level
            except Exception:  # capture's own failure: the level keeps its taint (more marked, never less)
                gone = None
            result = orig(level=level)
            session.tainted_levels.discard(gone)
            return result

        self.saved = orig
        fwad.exit_dual_level = exit_dual_level

    def uninstall(self) -> None:
        if self.saved is not None:
            fwad.exit_dual_level = self.saved
            self.saved = None
