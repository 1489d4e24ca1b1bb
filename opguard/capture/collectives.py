"""``torch.distributed`` collectives recorded as such (``api: collective``, ``docs/capture.md`` §3.2).

The public functions of ``torch.distributed`` are wrapped while capture runs and restored after.
Inputs are summarised before the call, in-place and output tensors after it (``fresh``: never
from the cache, whatever ``_version`` says).
"""

from __future__ import annotations

import functools
import inspect
import sys
import threading
from collections.abc import Callable
from types import FunctionType
from typing import Any

import torch
import torch.distributed as dist

from opguard.capture import records
from opguard.capture.dynamo_marks import runs_program
from opguard.capture.frames import standin
from opguard.capture.mode import tensors_in
from opguard.capture.session import ANY, Call, Session

# name -> (parameters written by the collective, parameters only written: not summarised as inputs)
COLLECTIVES: dict[str, tuple[tuple[str, ...], tuple[str, ...]]] = {
    "all_reduce": (("tensor",), ()),
    "broadcast": (("tensor",), ()),
    "reduce": (("tensor",), ()),
    "all_gather": (("tensor_list",), ("tensor_list",)),
    "all_gather_into_tensor": (("output_tensor",), ("output_tensor",)),
    "reduce_scatter": (("output",), ("output",)),
    "reduce_scatter_tensor": (("output",), ("output",)),
    "all_to_all": (("output_tensor_list",), ("output_tensor_list",)),
    "all_to_all_single": (("output",), ("output",)),
    "send": ((), ()),
    "recv": (("tensor",), ("tensor",)),
    "isend": ((), ()),
    "irecv": (("tensor",), ("tensor",)),
    "barrier": ((), ()),
    "scatter": (("tensor",), ("tensor",)),
    "gather": (("gather_list",), ("gather_list",)),
    "all_gather_single": (("output_tensor",), ("output_tensor",)),   # FSDP2's all-gather (torch >= 2.12)
    "reduce_scatter_single": (("output",), ("output",)),             # FSDP2's reduce-scatter
    "all_reduce_coalesced": (("tensors",), ()),
    "all_gather_coalesced": (("output_tensor_lists",), ("output_tensor_lists",)),
}


def collectives() -> dict[str, tuple[tuple[str, ...], tuple[str, ...]]]:
    """The collectives to wrap: :data:`COLLECTIVES`, and every other public function of
    ``torch.distributed`` with an ``async_op`` parameter (one a later PyTorch adds): capture does not
    know which of its tensors it writes, so every tensor parameter is summarised before the call
    and again after it."""
    out = {name: spec for name, spec in COLLECTIVES.items() if callable(getattr(dist, name, None))}
    for name, fn in list(vars(dist).items()):
        # type(), never an attribute of the object: reading one of a deprecated alias warns (reduce_op)
        if name.startswith("_") or name in out or type(fn) is not FunctionType:
            continue
        try:
            params = tuple(inspect.signature(fn).parameters)
        except (TypeError, ValueError):
            continue
        if "async_op" in params:
            out[name] = (params, ())
    return out
ASYNC_ALWAYS = ("isend", "irecv")


def _group_size(group: Any) -> int | None:
    """The size of ``group`` (None: the default group), None when this rank is not part of it."""
    try:
        return dist.get_world_size(group) if dist.is_initialized() else None
    except Exception:  # a group this rank is not part of
        return None


_no_modes = torch._C.DisableTorchFunction  # capture's own tensor reads skip the function mode


def _settings(arguments: dict[str, Any]) -> list[dict[str, Any]]:
    """The ``args`` entries of a tensor collective: every argument that holds no tensor (``op`` by
    its name, ``src``/``dst``, split sizes, ``async_op``, ...), ``group`` as its global ranks (None:
    the default group), so compare names an edited reduce op, root or split as an argument."""
    out = []
    for p, v in arguments.items():
        if isinstance(v, torch.Tensor) or (isinstance(v, (list, tuple)) and any(
                isinstance(x, torch.Tensor) or (isinstance(x, (list, tuple)) and x and isinstance(x[0], torch.Tensor))
                for x in v)):
            continue
        if p == "op" and v is not None:
            v = getattr(v, "name", str(v))
        elif p == "group" and v is not None:
            v = _group_ranks(v)
        elif not isinstance(v, (type(None), bool, int, float, str, list, tuple)):
            v = str(v)[:200]
        out.append(records.arg_entry(p, v))
    return out


def _group_ranks(group: Any) -> Any:
    """A process group's global ranks; None for the default group (``group=None`` and
    ``group=dist.group.WORLD`` are one group); its type's name when this rank cannot read them."""
    try:
        if group is dist.distributed_c10d._get_default_group():
            return None
        return list(dist.get_process_group_ranks(group))
    except Exception:
        return type(group).__name__


def _begin(s: Session, fn: str, sig: inspect.Signature, args: Any, kwargs: Any, caller: Any,
           fill: Callable[[Call, dict[str, Any]], Any]) -> tuple[Call, dict[str, Any], Any] | None:
    """The record of a wrapped call, its bound arguments and what ``fill(call, arguments)`` gave;
    None when the call is to run unrecorded: arguments that do not bind (torch raises its own
    error), or capture's own failure (said once, §11)."""
    call = None
    try:
        bound = sig.bind(*args, **kwargs)
        bound.apply_defaults()
        call = s.begin("collective", fn, s.sites.lookup(caller))
        return call, bound.arguments, fill(call, bound.arguments)
    except Exception as err:
        if call is not None or not isinstance(err, TypeError):
            s.failed("recording", err, call)
        return None


def _wrap(session: Session, name: str, orig: Callable[..., Any], thread: int,
          spec: tuple[tuple[str, ...], tuple[str, ...]]) -> Callable[..., Any]:
    sig = inspect.signature(orig)
    written, only_written = spec
    fn = f"torch.distributed.{name}"

    @functools.wraps(orig)
    @runs_program
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        s = session
        if not s.active or s.busy or torch.compiler.is_dynamo_compiling() or threading.get_ident() != thread:
            return orig(*args, **kwargs)  # capture is the starting thread's (its records, its stacks)
        caller = sys._getframe(1)
        via = standin(caller)  # calls from a frame that reads as the caller's (frames.py)

        def fill(call: Call, arguments: dict[str, Any]) -> bool:
            with _no_modes():  # capture's own tensor reads are not the program's calls
                s.inputs(call, [st for p, v in arguments.items() if p not in only_written for st in tensors_in(v, p)])
            call.rec["group_size"] = _group_size(arguments.get("group"))
            if "op" in arguments:
                call.rec["op"] = getattr(arguments["op"], "name", str(arguments["op"]))
            xs = _settings(arguments)
            if xs:
                call.rec["args"] = xs
            return name in ASYNC_ALWAYS or bool(arguments.get("async_op", False))

        begun = _begin(s, fn, sig, args, kwargs, caller, fill)
        if begun is None:
            return via(orig, args, kwargs)
        call, arguments, is_async = begun
        rec = call.rec
        s.parents.append(rec["seq"])
        # torch.distributed's own functions come back to the function mode for this call
        # (handle_torch_function): the collective record is the call, the mode runs it unrecorded
        s.inflight.append((orig, ANY))
        try:
            result = via(orig, args, kwargs)
        except BaseException as e:
            rec["error"] = f"{type(e).__name__}: {e}"[:500]
            raise
        finally:
            s.inflight.pop()
            s.parents.pop()
        try:
            if is_async:  # written later (by wait()), with no version change: read from memory at the next use
                rec["async"] = True
                s.written_unrecorded([arguments.get(p) for p in written])
                if s.waits is not None:  # and recorded at the program's wait() (waits.py)
                    s.waits.issued(result, call, [st for p in written for st in tensors_in(arguments.get(p), p)])
            elif not s.cap_reached:
                with _no_modes():
                    s.outputs(call, [st for p in written for st in tensors_in(arguments.get(p), p)], fresh=True)
        except Exception as err:
            s.failed("recording", err, call)
        s.maybe_flush_contained()
        return result

    return wrapper


# collectives of picklable Python objects: torch.distributed pickles the objects into byte tensors and
# runs tensor collectives on them, inside the call
OBJECT_COLLECTIVES = ("all_gather_object", "gather_object", "broadcast_object_list", "scatter_object_list",
                      "send_object_list", "recv_object_list")


def _object_arg(slot: str, value: Any) -> dict[str, Any]:
    """An object collective's argument: the objects (and lists of them) by their type only; ``group``
    as its global ranks, as for a tensor collective (before: by its type, so an edited group was
    never named)."""
    if "obj" in slot and value is not None:
        t = type(value)
        return {"slot": slot, "type": "object", "value": f"{t.__module__}.{t.__qualname__}"}
    if slot == "group" and value is not None:
        return records.arg_entry(slot, _group_ranks(value))
    return records.arg_entry(slot, value)


def _wrap_objects(session: Session, name: str, orig: Callable[..., Any], thread: int) -> Callable[..., Any]:
    """An object collective as one record (``api: collective``) with its arguments and no tensor: the
    byte tensors of pickles it moves, and the tensor collectives and calls it makes on them, are its
    implementation and are not recorded (a pickle can differ between two identical runs: a uuid, a
    time — ``torch.distributed.checkpoint`` gathers such metadata at every save). What it gives back
    are new Python objects: no tensor the program held is written."""
    sig = inspect.signature(orig)
    fn = f"torch.distributed.{name}"

    @functools.wraps(orig)
    @runs_program
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        s = session
        if not s.active or s.busy or torch.compiler.is_dynamo_compiling() or threading.get_ident() != thread:
            return orig(*args, **kwargs)
        caller = sys._getframe(1)
        via = standin(caller)

        def fill(call: Call, arguments: dict[str, Any]) -> None:
            call.rec["args"] = [_object_arg(p, v) for p, v in arguments.items()]
            call.rec["group_size"] = _group_size(arguments.get("group"))

        begun = _begin(s, fn, sig, args, kwargs, caller, fill)
        if begun is None:
            return via(orig, args, kwargs)
        rec = begun[0].rec
        s.parents.append(rec["seq"])
        s.busy += 1  # its pickles' tensors and collectives: not the program's calls
        try:
            result = via(orig, args, kwargs)
        except BaseException as e:
            rec["error"] = f"{type(e).__name__}: {e}"[:500]
            raise
        finally:
            s.busy -= 1
            s.parents.pop()
        s.maybe_flush_contained()
        return result

    return wrapper


class Collectives:
    """Install/uninstall the wrappers on the ``torch.distributed`` module."""

    def __init__(self, session: Session) -> None:
        self.session = session
        self.saved: dict[str, Any] = {}
        self.originals: dict[Any, Any] = {}  # wrapper -> the function it wraps
        self.p2p_saved: dict[str, Any] = {}  # P2POp's own __new__/__init__ (class dict entries)

    def install(self) -> None:
        if not dist.is_available():
            return
        for name, spec in collectives().items():
            orig = getattr(dist, name)
            self.saved[name] = orig
            setattr(dist, name, _wrap(self.session, name, orig, threading.get_ident(), spec))
        for name in OBJECT_COLLECTIVES:
            orig = getattr(dist, name, None)
            if callable(orig) and name not in self.saved:
                self.saved[name] = orig
                setattr(dist, name, _wrap_objects(self.session, name, orig, threading.get_ident()))
        self.originals = {getattr(dist, name): orig for name, orig in self.saved.items()}
        self._p2p_install()

    def _p2p_install(self) -> None:
        """``dist.P2POp(dist.isend, ...)`` (``torch.distributed.pipelining``): PyTorch checks the op by
        identity against its own ``isend``/``irecv`` (``P2POp.__new__``, ``batch_isend_irecv``), so a
        P2POp is given the function capture's wrapper wraps; run by ``batch_isend_irecv``, that
        function is recorded as library code's collective (``distributed_c10d.isend``, §3.2)."""
        cls = getattr(dist, "P2POp", None)
        if not isinstance(cls, type) or "__new__" not in vars(cls) or "__init__" not in vars(cls):
            return
        new, init = vars(cls)["__new__"], vars(cls)["__init__"]
        new_fn = new.__func__ if isinstance(new, staticmethod) else new
        if not callable(new_fn) or not callable(init):
            return
        originals = self.originals

        @functools.wraps(new_fn)
        @runs_program
        def p2p_new(klass: Any, op: Any, *args: Any, **kwargs: Any) -> Any:
            return new_fn(klass, originals.get(op, op), *args, **kwargs)

        @functools.wraps(init)
        @runs_program
        def p2p_init(self_: Any, op: Any, *args: Any, **kwargs: Any) -> None:
            init(self_, originals.get(op, op), *args, **kwargs)

        self.p2p_saved = {"__new__": new, "__init__": init}
        setattr(cls, "__new__", staticmethod(p2p_new))  # noqa: B010 (a class attribute, restored at uninstall)
        setattr(cls, "__init__", p2p_init)  # noqa: B010

    def uninstall(self) -> None:
        for name, orig in self.saved.items():
            setattr(dist, name, orig)
        self.saved.clear()
        self.originals = {}
        cls = getattr(dist, "P2POp", None)
        for attr, value in self.p2p_saved.items():
            setattr(cls, attr, value)
        self.p2p_saved = {}


__all__ = ["COLLECTIVES", "Collectives", "torch"]
