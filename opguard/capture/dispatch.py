"""The optional dispatch level (``level=dispatch``): every aten op, backward included (§4).

Forward aten ops are children of the function record running them. Backward ops are tied to the
forward call that created the autograd node being executed: the function mode stores that
record's identity in ``grad_fn.metadata`` of its outputs, and ``torch._C._current_autograd_node()``
names the node the engine is running.
"""

from __future__ import annotations

import sys
from collections.abc import Mapping, Sequence
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from opguard.capture import records
from opguard.capture.dynamo_marks import runs_program
from opguard.capture.frames import standin
from opguard.capture.mode import _grew, _split, tensors_in, unwritten_inputs
from opguard.capture.session import Call, Session

META_KEY = "opguard"
_SKIP = frozenset({"detach", "alias", "lift_fresh", "_to_copy"})
# in-place aten ops that write every element of self (the function level's mode._WRITES_WHOLE)
_WRITES_WHOLE = frozenset({"copy_", "fill_", "zero_", "normal_", "uniform_", "random_", "bernoulli_",
                           "exponential_", "geometric_", "cauchy_", "log_normal_"})


_VIEWS: dict[Any, bool] = {}  # per overload: it returns a view of an argument (its schema's non-write alias)


def _returns_view(func: Any) -> bool:
    """The aten overload returns a view of one of its arguments (``select``, ``view``, ``slice``:
    a return with a non-write alias annotation in its schema)."""
    hit = _VIEWS.get(func)
    if hit is None:
        try:
            hit = any(r.alias_info is not None and not r.alias_info.is_write for r in func._schema.returns)
        except Exception:  # no schema to read: not taken for a view
            hit = False
        _VIEWS[func] = hit
    return hit


def tag_outputs(call: Call, outs: list[tuple[str, torch.Tensor]]) -> None:
    """Remember on each output's autograd node which function record produced it."""
    rec = call.rec
    ident = {k: rec[k] for k in ("seq", "fn", "file", "line", "func", "src", "site", "module")}
    with _no_torch_function():  # capture's own read: never the program's tensor subclass's __torch_function__
        _tag(ident, outs)


_no_torch_function = torch._C.DisableTorchFunction


def _tag(ident: dict[str, Any], outs: list[tuple[str, torch.Tensor]]) -> None:
    for _slot, t in outs:
        try:  # reading grad_fn raises on a view made under no_grad of a tensor that requires grad
            gf: Any = t.grad_fn
            if gf is None:
                continue
            meta = gf.metadata
            old = meta.get(META_KEY)
            # the node's producer is the outermost call that created it: a nested child (larger seq)
            # is replaced by its parent; a later call returning an alias (e.g. broadcast_tensors) is not
            if old is None or old["seq"] > ident["seq"]:
                meta[META_KEY] = ident
        except (AttributeError, RuntimeError):
            pass


class AtenMode(TorchDispatchMode):  # type: ignore[no-untyped-call]
    # an eager higher-order operator (torch.cond, while_loop, scan, flex_attention) comes here as
    # itself (its namespace is not aten: it runs as it is) instead of raising NotImplementedError
    # ("no rule registered for HigherOrderOperator cond and mode AtenMode")
    supports_higher_order_operators = True

    def __init__(self, session: Session) -> None:
        super().__init__()  # type: ignore[no-untyped-call]
        self.session = session

    @runs_program
    def __torch_dispatch__(self, func: Any, types: Any, args: Sequence[Any] = (),
                           kwargs: Mapping[str, Any] | None = None) -> Any:
        kwargs = kwargs or {}
        s = self.session
        if s.busy:
            return func(*args, **kwargs)
        via = standin(sys._getframe(1))  # calls from a frame that reads as the caller's (frames.py)
        if s.quiet is not None or not s.active or func.namespace != "aten" or func._opname in _SKIP:
            return via(func, args, kwargs)
        name = f"aten::{func._opname}.{func._overloadname}"
        node: Any = torch._C._current_autograd_node()
        fwd: dict[str, Any] | None = None
        if node is not None:
            meta = node.metadata
            fwd = meta.get(META_KEY) if meta is not None else None
        if not s.selected(name, s.module, s.context):
            return via(func, args, kwargs)
        call: Call | None = None
        ins: list[tuple[str, torch.Tensor]] = []
        try:
            site = s.sites.lookup(sys._getframe(1))
            call = s.begin("aten", name, site, phase="backward" if node is not None else "forward")
            rec = call.rec
            if records.seeded(name, func):  # draws random numbers (§3.1)
                rec["seeded"] = True
            if node is not None:
                rec["fwd"] = fwd
                if fwd is not None:
                    for k in ("file", "line", "func", "src", "site", "module"):
                        rec[k] = fwd[k]
            names = [a.name for a in func._schema.arguments]
            xs: list[dict[str, Any]] = []
            for i, a in enumerate(args):
                _split(a, names[i] if i < len(names) else f"arg{i}", ins, xs)
            for k, v in kwargs.items():
                _split(v, k, ins, xs)
            if xs:
                rec["args"] = xs
            s.busy += 1  # capture's own tensor reads (t.is_neg(), ...): the function mode is still on the stack
            try:
                s.inputs(call, ins)
            finally:
                s.busy -= 1
        except Exception as err:
            s.failed("recording", err, call)
        if call is None:
            return via(func, args, kwargs)
        rec = call.rec
        s.parents.append(rec["seq"])
        outer, s.aten_op = s.aten_op, func
        try:
            result = via(func, args, kwargs)
        except BaseException as e:
            rec["error"] = f"{type(e).__name__}: {e}"[:500]
            raise
        finally:
            s.parents.pop()
            s.aten_op = outer
        try:
            if not s.cap_reached:
                outs = list(tensors_in(result, "out"))
                written = records.op_writes(func)[1]  # cached per overload (batch norm's running stats too)
                if written:  # every argument the op wrote is an output (some move no version counter)
                    held = {id(t) for _, t in outs}
                    for slot, t in ins:
                        if slot.partition(".")[0] in written and id(t) not in held:
                            outs.append((slot, t))
                            held.add(id(t))
                s.busy += 1
                try:
                    if name in records.UNINITIALIZED_FNS or (name in records.GROWS_FNS and _grew(rec["inputs"], outs)):
                        s.outputs(call, outs, uninitialized=True)
                    elif name in records.PARTLY_WRITTEN_OUTPUTS:  # an output the kernel writes in part only
                        part = records.PARTLY_WRITTEN_OUTPUTS[name]
                        s.outputs(call, [o for i, o in enumerate(outs) if i not in part])
                        s.outputs(call, [o for i, o in enumerate(outs) if i in part], uninitialized=True)
                    elif (_returns_view(func) and s._uninit
                          and any(e.get("uninitialized") for e in rec["inputs"])):
                        # a view of uninitialised memory (aten::select of a torch.empty buffer): the view
                        # op wrote nothing; below autograd a view has no _base to find its mark by (§3.7)
                        s.outputs(call, outs, uninitialized=True)
                    elif func._opname == "set_":  # self now refers to other memory: nothing was written;
                        for slot, t in outs:  # marked there or not (a regrown storage; §3.7)
                            rec["outputs"].append(s.entry(call, slot, t, True, fresh=True,
                                                          uninitialized=s._still_uninitialized(t)))
                    else:  # an input object as output (in-place, out=): a write, digested from memory (§5.3)
                        put = rec["outputs"].append
                        # inputs that were uninitialised memory: a write to part of one leaves the rest
                        # marked (§3.7); autograd moves the version counter once this op returns
                        unwritten = unwritten_inputs(ins, rec["inputs"]) if ins else None
                        for slot, t in outs:
                            wrote = any(t is x for _, x in ins)
                            if wrote and unwritten and id(t) in unwritten:
                                # written whole, and not from other uninitialised memory (a copy_
                                # from a view of the same unwritten buffer: F.pad's circular mode)
                                whole = (("out" in kwargs or func._opname in _WRITES_WHOLE)
                                         and not any(id(x) in unwritten for _, x in ins if x is not t))
                                put(s.written_marked(call, slot, t, whole, below_autograd=True))
                                continue
                            put(s.entry(call, slot, t, True, fresh=wrote))
                finally:
                    s.busy -= 1
        except Exception as err:
            s.failed("recording", err, call)
        s.maybe_flush_contained()
        return result

