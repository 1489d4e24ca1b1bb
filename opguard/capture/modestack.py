"""Capture's torch function mode taken off PyTorch's mode stack for a while, and put back where it was.

An optimizer step recorded as one record (``optim.py``) and a module kept on PyTorch's fused fast
path (``fused.py``) run without capture's mode. The mode is taken off only when it is the innermost
(the top of the stack); meanwhile the program may push modes of its own (a mode entered in a module
pre-hook and left in its post-hook). Putting capture's mode back on top would then make the
program's ``__exit__`` pop capture's mode instead of its own, leaving its mode on for the rest of the
run and capture's off: so capture's mode goes back at the position it was taken from, under what the
program pushed since.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

_stack_len = torch._C._len_torch_function_stack
_stack_at = torch._C._get_function_stack_at
_pop_mode = torch._C._pop_torch_function_stack
_push_mode = torch._C._push_on_torch_function_stack


@dataclass
class Taken:
    """A mode taken off the stack, and the stack index it had."""

    mode: Any
    index: int


def innermost(mode: Any) -> bool:
    """Whether ``mode`` is the top of this thread's torch function mode stack."""
    n = _stack_len()
    return bool(n) and _stack_at(n - 1) is mode


def take_off(mode: Any) -> Taken | None:
    """Pop ``mode`` when it is the innermost mode; None (nothing done) otherwise."""
    if not innermost(mode):
        return None
    index = _stack_len() - 1
    return Taken(_pop_mode(), index)


def put_back(taken: Taken) -> None:
    """Push the mode back at its index: the modes pushed since are lifted and pushed again above it
    (a stack shorter than the index, modes popped meanwhile: on top)."""
    above = []
    while _stack_len() > taken.index:
        above.append(_pop_mode())
    _push_mode(taken.mode)
    for m in reversed(above):
        _push_mode(m)
