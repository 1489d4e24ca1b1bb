"""The torch function mode: one record per ``torch.*``, ``torch.nn.functional.*`` and ``Tensor`` call.

Nested calls (a Python-level torch function calling others, ``backward()`` calling autograd) are
recorded too: the handler re-enters the mode around ``redispatch_function``, so inner calls come
back here with ``depth`` + 1 and ``parent`` set.
"""

from __future__ import annotations

import sys
import types as pytypes
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import torch
from torch.overrides import TorchFunctionMode, redispatch_function

from opguard.capture import records
from opguard.capture.session import Call, Session

_OPS = (torch._ops.OpOverload, torch._ops.OpOverloadPacket)


def tensors_in(value: Any, slot: str) -> Iterator[tuple[str, torch.Tensor]]:
    """(slot, tensor) for every tensor in ``value`` (lists/tuples/dicts two levels deep)."""
    if isinstance(value, torch.Tensor):
        yield slot, value
    elif isinstance(value, (list, tuple)):
        for j, v in enumerate(value):
            if isinstance(v, torch.Tensor):
                yield f"{slot}.{j}", v
            elif isinstance(v, (list, tuple)):
                for k, w in enumerate(v):
                    if isinstance(w, torch.Tensor):
                        yield f"{slot}.{j}.{k}", w
    elif isinstance(value, Mapping):
        for k, v in value.items():
            if isinstance(v, torch.Tensor):
                yield f"{slot}.{k}", v


def input_slots(args: Sequence[Any], kwargs: Mapping[str, Any], method: bool) -> list[tuple[str, torch.Tensor]]:
    out: list[tuple[str, torch.Tensor]] = []
    for i, a in enumerate(args):
        out.extend(tensors_in(a, "self" if method and i == 0 else f"arg{i}"))
    for k, v in kwargs.items():
        out.extend(tensors_in(v, k))
    return out


class CaptureMode(TorchFunctionMode):
    def __init__(self, session: Session, on_output: Callable[[Call, Any], None] | None = None) -> None:
        super().__init__()
        self.session = session
        self.nested = session.options.nested
        self.on_output = on_output  # dispatch level: tag grad_fn of outputs

    def __torch_function__(self, func: Any, types: Any, args: Sequence[Any] = (),
                           kwargs: Mapping[str, Any] | None = None) -> Any:
        kwargs = kwargs or {}
        s = self.session
        if s.busy or isinstance(func, _OPS):  # capture's own work; torch.ops (the dispatch level's)
            return func(*args, **kwargs)
        name, meta = records.function_name(func)
        if meta or not s.active:
            return func(*args, **kwargs)
        # only Python-level torch functions call other torch functions: re-enter the mode for them
        reenter = self.nested and isinstance(func, pytypes.FunctionType)
        module, context = s.module, s.context
        if not s.selected(name, module, context):
            if not reenter:
                return func(*args, **kwargs)
            with self:
                return redispatch_function(func, types, args, kwargs)  # type: ignore[no-untyped-call]
        site = s.sites.lookup(sys._getframe(1))
        call = s.begin("function", name, site, where=(module, context))
        ins = input_slots(args, kwargs, name.startswith("Tensor."))
        s.inputs(call, ins)
        if s.policy.enabled and not s.parents and s.policy.wants(s.step, name, module, context, site):
            s.dump(call.rec["seq"], ins)
            dump_out = True
        else:
            dump_out = False
        s.parents.append(call.rec["seq"])
        try:
            if reenter:
                with self:
                    result = redispatch_function(func, types, args, kwargs)  # type: ignore[no-untyped-call]
            else:
                result = func(*args, **kwargs)
        except BaseException as e:
            call.rec["error"] = f"{type(e).__name__}: {e}"[:500]
            raise
        finally:
            s.parents.pop()
        if not s.cap_reached:
            outs = list(tensors_in(result, "out"))
            s.outputs(call, outs)
            if dump_out:
                s.dump(call.rec["seq"], [(f"{slot}", t) for slot, t in outs])
            if self.on_output is not None:
                self.on_output(call, outs)
        s.maybe_flush()
        return result
