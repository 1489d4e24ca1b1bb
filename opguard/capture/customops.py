"""The program's own operators (``torch.library.custom_op``), recorded like any torch function
(``docs/capture.md`` §3.1).

At the function level a ``torch.ops`` call is not recorded (§3.7: those are the dispatch level's,
and PyTorch's own Python code calls them), so an operator a program defines with
``torch.library.custom_op`` — its own computation, called from its own lines — left no record,
and neither did the calls inside its Python implementation, which runs as the operator's kernel:
an edit of its argument was named downstream, or not at all. An operator counts as the program's
when ``torch.library.custom_op`` made it (``torch._library.custom_ops.OPDEFS``) from a function
defined outside PyTorch (the program's or a third-party package's); PyTorch defines many of its
own that way (``prims``, ``fsdp``, ...), which stay unrecorded. Its record is named
``torch.ops.<namespace>.<name>`` (``.<overload>`` unless ``default``); it is recorded as a builtin:
inputs, arguments by position, what its schema says it writes (``mutates_args``) as outputs, and
not the calls of its implementation.
"""

from __future__ import annotations

import os
from typing import Any

import torch

_TORCH_DIR = os.path.dirname(os.path.abspath(torch.__file__)) + os.sep
_OVERLOAD = torch._ops.OpOverload
_PACKET = torch._ops.OpOverloadPacket
_known: dict[Any, str | None] = {}


def program_op(func: Any) -> str | None:
    """The record name of a ``torch.ops`` operator the program defined, else None (cached)."""
    try:
        hit = _known.get(func, False)
    except TypeError:
        return None
    if hit is not False:
        return hit  # type: ignore[return-value]
    name = _name(func)
    if len(_known) < 4096:
        _known[func] = name
    return name


def _name(func: Any) -> str | None:
    try:
        from torch._library.custom_ops import OPDEFS
    except ImportError:  # a PyTorch without torch.library.custom_op
        return None
    try:
        if isinstance(func, _OVERLOAD):
            qual, overload = func._schema.name, func._overloadname
        elif isinstance(func, _PACKET):
            qual, overload = func._qualified_op_name, "default"
        else:
            return None
        opdef = OPDEFS.get(qual)
        init = getattr(opdef, "_init_fn", None)
        code = getattr(init, "__code__", None)
        if code is None or os.path.abspath(code.co_filename).startswith(_TORCH_DIR):
            return None
        namespace, _, op = qual.partition("::")
        return f"torch.ops.{namespace}.{op}" + ("" if overload in ("", "default") else f".{overload}")
    except Exception:  # an operator of another shape: not recorded, as before
        return None

