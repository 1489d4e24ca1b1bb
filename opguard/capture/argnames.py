"""The parameter names of recorded functions' positional arguments (``docs/capture.md`` §3.4).

A positional argument is recorded under its position, ``arg<i>`` (``torch.conv1d``'s padding is
``arg4``), so that slot names never depend on how a signature is read. This table, written to
``meta.json`` as ``arg_names``, lets compare say ``padding (arg4): [1] -> [2]``. A name is given
only where it is certain for every call of the function:

* a Python function: its positional parameters in order (``inspect.signature``, following
  ``__wrapped__``), up to ``*args``; one that takes only ``(*args, **kwargs)`` and forwards them
  (``F.max_pool2d``, made by ``boolean_dispatch``) as a builtin of its ``__name__``;
* a builtin (``torch.conv1d``, ``Tensor.transpose``, ``torch._C._nn.linear``): the positional
  arguments of its ATen schemas (``aten::<__name__>``; TorchScript's overloads on generic lists
  and on Python values left out), a position named only when every overload that has it agrees
  on the name; none from the position of a lone int-list argument on (Python takes
  ``x.view(3, 3)`` and ``torch.randn(2, 3)`` as varargs there), none for a protocol method
  (``Tensor.__mul__``) or a function without schemas.
"""

from __future__ import annotations

import inspect
from typing import Any

import torch

# at most this many functions are looked up per rank (functions made per call could pile up)
MAX_FUNCTIONS = 4096


def positional_names(func: Any) -> list[str | None] | None:
    """The names of ``func``'s positional arguments by position (``None`` where unknown), or None."""
    if isinstance(func, (torch._ops.OpOverload, torch._ops.OpOverloadPacket)):  # the program's operator
        return _op_names(func)
    try:
        sig = inspect.signature(func)
    except (TypeError, ValueError):  # a builtin: its ATen schemas
        return _schema_names(func)
    params = list(sig.parameters.values())
    if [p.kind for p in params] == [inspect.Parameter.VAR_POSITIONAL, inspect.Parameter.VAR_KEYWORD]:
        return _schema_names(func)  # fn(*args, **kwargs) forwarding to an op (F.max_pool2d's boolean_dispatch)
    out: list[str | None] = []
    for p in params:
        if p.kind not in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD):
            break
        out.append(p.name)
    return out if out else None


def _generic(type_text: str) -> bool:
    """A TorchScript builtin over generic lists (``aten::add_(t[] self, t[] b)``), not a tensor op."""
    return type_text == "t" or "[t]" in type_text or "(t" in type_text


def _schema_names(func: Any) -> list[str | None] | None:
    name = getattr(func, "__name__", None)
    if not isinstance(name, str) or not name or name.startswith("__"):
        return None
    schemas = torch._C._jit_get_schemas_for_operator("aten::" + name)
    overloads = []
    for schema in schemas:
        pos = [(a.name, str(a.type)) for a in schema.arguments if not a.kwarg_only]
        if any(_generic(t) for _, t in pos) or not any(
                "Tensor" in str(a.type) for a in (*schema.arguments, *schema.returns)):
            continue  # TorchScript's overloads on Python values (aten::add.int(int a, int b)): not tensor ops
        overloads.append(pos)
    if not overloads:
        return None
    width = max(len(p) for p in overloads)
    for pos in overloads:  # Python's varargs form of a lone int list: positions from it on are elements
        rest = [(i, t) for i, (n, t) in enumerate(pos) if n != "self"]
        if len(rest) == 1 and ("List[int]" in rest[0][1] or "List[SymInt]" in rest[0][1]):
            width = min(width, rest[0][0])
    return _agreeing([[n for n, _ in pos] for pos in overloads], width)


def _op_names(func: Any) -> list[str | None] | None:
    """A ``torch.ops`` operator's (the program's own, customops.py): its schema, every overload of a
    packet agreeing."""
    if isinstance(func, torch._ops.OpOverload):
        schemas = [func._schema]
    else:
        schemas = [getattr(func, o)._schema for o in func.overloads()]
    lists = [[a.name for a in s.arguments if not a.kwarg_only] for s in schemas]
    return _agreeing(lists, max((len(x) for x in lists), default=0))


def _agreeing(overloads: list[list[str]], width: int) -> list[str | None] | None:
    """Position by position up to ``width``, the name every overload that has the position agrees on."""
    out: list[str | None] = []
    for i in range(width):
        names = {p[i] for p in overloads if len(p) > i}
        out.append(names.pop() if len(names) == 1 else None)
    return out if any(out) else None


class ArgNames:
    """The table of one rank: function name (the records' ``fn``) -> positional names."""

    def __init__(self) -> None:
        self.known: dict[str, list[str | None] | None] = {}
        self.dirty = False

    def note(self, name: str, func: Any) -> None:
        """Look ``func`` up once (a failure, like no names, leaves ``arg<i>`` to stand alone)."""
        if name in self.known or len(self.known) >= MAX_FUNCTIONS:
            return
        try:
            got = positional_names(func)
        except Exception:
            got = None
        self.known[name] = got
        if got:
            self.dirty = True

    def as_json(self) -> dict[str, list[str | None]]:
        return {k: v for k, v in sorted(self.known.items()) if v}
