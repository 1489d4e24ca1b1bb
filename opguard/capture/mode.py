"""The torch function mode: one record per ``torch.*``, ``torch.nn.functional.*`` and ``Tensor`` call.

Nested calls (a Python-level torch function calling others, ``backward()`` calling autograd) are
recorded too: the handler re-enters the mode around ``redispatch_function``, so inner calls come
back here with ``depth`` + 1 and ``parent`` set.

Two rules keep the program as it is without capture (``docs/capture.md`` §11):

* **No re-entry of the call being handled.** Some Python-level torch functions come back to the mode
  for *the same call* once the mode is re-entered (``Tensor.unflatten`` -> ``handle_torch_function``
  -> ``super().unflatten`` -> the mode with ``Tensor.unflatten`` again, forever). A call whose function
  and first argument are those of the innermost call this mode re-entered for is that same call: it
  runs directly (the mode is off the stack inside the handler), unrecorded.
* **Capture's own failures are contained.** Everything capture does around the call (naming,
  call site, tensor entries, arguments, writing) runs in ``try``; a failure is reported by the
  session (stderr once per stage and kind, ``capture_error`` on the record) and the op runs exactly
  as without capture. Only the op's own exception propagates.

The handler calls the function through a stand-in for its caller (``frames.py``), so warnings raised
inside it (``stacklevel``, PyTorch's C++ warnings) name the caller's file, line and module as without
capture.

When the C extension ``_fastcall`` is built, ``__torch_function__`` hands every call to it: it takes
the common call (a planned function, plain arguments, the whole run selected) through the same
Python steps as :meth:`CaptureMode.handle` and hands every other call to it (``docs/capture.md``
§3.11; ``fast_call=0`` switches it off).

Under ``torch.compile`` tracing the mode does nothing (``torch.compiler.is_dynamo_compiling()``): Dynamo
sees a plain call; nor while ``torch.jit.trace`` traces (sizes are traced values then, and capture's own
reads would enter the traced graph).
"""

from __future__ import annotations

import inspect
import math
import os
import sys
import types as pytypes
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import torch
from torch.overrides import TorchFunctionMode

from opguard.capture import duals, records
from opguard.capture.customops import _TORCH_DIR, program_op
from opguard.capture.dynamo_marks import runs_program
from opguard.capture.frames import register, standin
from opguard.capture.session import ANY as _ANY
from opguard.capture.session import Call, Session
from opguard.capture.session import _fastcall as _fastcall  # the C handler (_fastcall.c, §3.11), or None
from opguard.staging.layout import capture_dump_slot

_OPS = (torch._ops.OpOverload, torch._ops.OpOverloadPacket)
_HOP = torch._ops.HigherOrderOperator  # calls the program's functions (an autograd.Function under torch.func)
_MAX_PLANS = 1 << 13
_compiling = torch.compiler.is_dynamo_compiling  # False in eager code, True while Dynamo traces


class _NoFlags:
    _is_compiling_flag = False


# torch.compiler._is_compiling_flag: True for a whole torch.compile session (AOTAutograd, a backend's
# make_fx) and while torch.export traces (strict or not: its FakeTensors and SymInts are not the
# program's computation); False while compiled code runs. A PyTorch without it: Dynamo's test alone.
_compile_flags = torch.compiler if hasattr(torch.compiler, "_is_compiling_flag") else _NoFlags
_jit_tracing = torch._C._get_tracing_state  # None in eager code; the tracer's state inside torch.jit.trace
# FakeTensorMode on the dispatch mode stack (AOTAutograd run directly: aot_function, opcheck; a program's
# own shape inference): the calls then compute nothing, on FakeTensors, and are not the program's computation
_FAKE = getattr(getattr(torch._C, "_TorchDispatchModeKey", None), "FAKE", None)
_dispatch_mode: Callable[[Any], Any] = getattr(torch._C, "_get_dispatch_mode", lambda _key: None)
_skip_one_hop = torch._C._skip_one_hop_torch_function  # redispatch_function without its Python frame
_getframe = sys._getframe


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


_Tensor, _Parameter = torch.Tensor, torch.nn.Parameter
_names_get = records._names.get
_UNINITIALIZED_FNS = records.UNINITIALIZED_FNS
_SHARES_MEMORY = records.SHARES_MEMORY_FNS
_GROWS = records.GROWS_FNS
_COPIES = records.COPY_FNS
# names that need a look before the call (one set test per call)
_SPECIAL = _SHARES_MEMORY | {"Tensor.data", "Tensor.share_memory_"} | duals.NAMES
_written_get = records._written.get
_seeded_get = records._seeded.get
_isfinite = math.isfinite


def _unselected(s: Session, name: str, func: Any, args: Sequence[Any], kwargs: Mapping[str, Any],
                result: Any) -> Any:
    """After a call that is not recorded because a filter (steps, functions, modules, contexts) left it
    out: what it wrote is still seen (§5.3), so the records that are selected keep true digests (an
    in-place write through ``p.data`` moves no version counter). Returns ``result``."""
    try:
        ts: list[Any] = [result] if args and result is args[0] and isinstance(result, torch.Tensor) else []
        written = _written_get(name)
        if written is None:
            written = records.written_slots(name, func)
        if written:
            ts.extend(a for i, a in enumerate(args) if f"arg{i}" in written or (i == 0 and "self" in written))
            ts.extend(v for k, v in kwargs.items() if k in written)
        if ts:
            s.written_unrecorded(ts)
    except Exception as err:
        s.failed("recording", err)
    return result


_OPS_FILE = os.path.join(_TORCH_DIR, "_ops.py")


def _first(func: Any, args: Sequence[Any]) -> Any:
    """What tells a call apart from PyTorch coming back for the same call (the re-entry rule): its
    first argument; a higher-order operator's second (``custom_function_call(Function, x, ...)``:
    the Function is the same at every torch.func level, ``x`` is unwrapped one level further)."""
    if isinstance(func, _HOP) and len(args) > 1:
        return args[1]
    return args[0] if args else None


def _aten_by_program(s: Session, caller: Any, func: Any) -> None:
    """Count an ATen operator called by code outside PyTorch (an exported program's module, whose
    generated ``forward`` calls ``torch.ops.aten.*``): unrecorded at level=function, said in the
    meta notes (docs/capture.md §10)."""
    try:
        f = caller
        while f is not None and f.f_code.co_filename == _OPS_FILE:  # OpOverload.__call__
            f = f.f_back
        if f is None or os.path.abspath(f.f_code.co_filename).startswith(_TORCH_DIR) \
                or not str(getattr(func, "__module__", "")).startswith("torch._ops.aten"):
            return
        s.aten_unrecorded += 1
        if s.aten_first is None:
            s.aten_first = f"torch.ops.{func} at {f.f_code.co_filename}:{f.f_lineno}"
    except Exception as err:
        s.failed("recording", err)


def _drawn_inside(call: Call, name: str, pending: list[Any], start: int) -> None:
    """A re-entered function one of whose nested calls drew random numbers (``F.dropout2d`` ->
    ``torch.feature_dropout``, ``F.gumbel_softmax`` -> ``Tensor.exponential_``) draws too: its record
    is ``seeded``, and so are its later calls (collapsed ones too, whose nested call is not recorded)."""
    for item in pending[start:]:
        if item.rec.get("seeded") if isinstance(item, Call) else b'"seeded":true' in item:
            call.rec["seeded"] = True
            records._seeded[name] = True
            return


def _grew(inputs: list[dict[str, Any]], outs: list[tuple[str, Any]]) -> bool:
    """A ``resize_`` that made its tensor larger: the new elements are whatever the allocator left."""
    if not inputs or not outs or not isinstance(outs[0][1], torch.Tensor):
        return False
    return bool(outs[0][1].numel() > math.prod(inputs[0].get("shape") or [0]))


def _split(value: Any, slot: str, ts: list[tuple[str, torch.Tensor]], xs: list[dict[str, Any]]) -> None:
    """Tensor entries of ``value`` into ``ts``, its non-tensor argument entries into ``xs`` (schema v2:
    a list/tuple holding tensors gives one entry per element, ``<slot>.<j>``; one without, one entry)."""
    t = type(value)
    if t is _Tensor or t is _Parameter:
        ts.append((slot, value))
    elif t is float and _isfinite(value):  # the common scalars, without the general canonical form
        xs.append({"slot": slot, "type": "float", "value": value})
    elif t is int and -(1 << 53) < value < (1 << 53):
        xs.append({"slot": slot, "type": "int", "value": value})
    elif t is bool:
        xs.append({"slot": slot, "type": "bool", "value": value})
    elif value is None:
        xs.append({"slot": slot, "type": "none", "value": None})
    elif isinstance(value, torch.Tensor):
        ts.append((slot, value))
    elif type(value) is slice:  # x[:k] with a tensor k: the bound is an input (slot <slot>.stop), §3.3
        _slice(value, slot, ts, xs)
    elif isinstance(value, (list, tuple)) and type(value) is not torch.Size and any(
            isinstance(v, torch.Tensor) or (type(v) is slice and _bounds(v)) for v in value):
        for j, v in enumerate(value):
            if isinstance(v, torch.Tensor):
                ts.append((f"{slot}.{j}", v))
            elif type(v) is slice:
                _slice(v, f"{slot}.{j}", ts, xs)
            elif isinstance(v, (list, tuple)) and any(isinstance(w, torch.Tensor) for w in v):
                ts.extend((f"{slot}.{j}.{k}", w) for k, w in enumerate(v) if isinstance(w, torch.Tensor))
            else:
                xs.append(records.arg_entry(f"{slot}.{j}", v))
    elif isinstance(value, Mapping) and any(isinstance(v, torch.Tensor) for v in value.values()):
        ts.extend(tensors_in(value, slot))
    else:
        xs.append(records.arg_entry(slot, value))


def _bounds(s: slice) -> list[tuple[str, torch.Tensor]]:
    """The tensor bounds of a slice (``x[:k]`` with a 0-d tensor ``k``), by name."""
    return [(n, v) for n, v in (("start", s.start), ("stop", s.stop), ("step", s.step))
            if isinstance(v, torch.Tensor)]


def _slice(value: slice, slot: str, ts: list[tuple[str, torch.Tensor]], xs: list[dict[str, Any]]) -> None:
    """A slice argument: its canonical form in ``xs``, its tensor bounds as inputs ``<slot>.<bound>``."""
    xs.append(records.arg_entry(slot, value))
    ts.extend((f"{slot}.{n}", v) for n, v in _bounds(value))


def _written_outputs(written: frozenset[str], ins: list[tuple[str, torch.Tensor]], outs: list[tuple[str, Any]]
                     ) -> None:
    """Add to ``outs`` the input tensors in the ``written`` slots (``records.written_slots``) that the
    result does not already hold: written without a version change (``found_inf`` of
    ``torch._amp_foreach_non_finite_check_and_unscale_``, batch norm's running statistics) or
    returned as nothing (§3.1)."""
    held: set[int] | None = None  # built at the first written slot (most calls have none: only out=)
    for slot, t in ins:
        if slot in written or ("." in slot and slot.partition(".")[0] in written):
            if held is None:
                held = {id(x) for _, x in outs}
            if id(t) not in held:
                outs.append((slot, t))
                held.add(id(t))


# in-place functions that write every element of the tensor they write, whatever it held (§3.7)
_WRITES_WHOLE = frozenset({
    "Tensor.copy_", "Tensor.fill_", "Tensor.zero_", "Tensor.normal_", "Tensor.uniform_", "Tensor.random_",
    "Tensor.bernoulli_", "Tensor.exponential_", "Tensor.geometric_", "Tensor.cauchy_", "Tensor.log_normal_",
    "torch.fill_", "torch.zero_",
})


def _full_index(index: Any) -> bool:
    """``t[index]`` is all of ``t``: ``...``, ``:``, or a tuple of those."""
    if index is Ellipsis or (type(index) is slice and index == slice(None)):
        return True
    return type(index) is tuple and all(i is Ellipsis or (type(i) is slice and i == slice(None)) for i in index)


def writes_whole(name: str, args: Sequence[Any], kwargs: Mapping[str, Any]) -> bool:
    """The call ``name(*args, **kwargs)`` writes every element of the tensor it writes: an ``out=``
    result, ``copy_``/``fill_``/``zero_`` and the random fills, ``torch.nn.init``, ``t[...] = v``
    or ``t[:] = v``. Any other write (``t[i] = v``, ``index_copy_``, ``scatter_``, ``masked_fill_``,
    an in-place op reading what it overwrites) may leave elements as they were (§3.7)."""
    if "out" in kwargs or name in _WRITES_WHOLE or name.startswith("torch.nn.init."):
        return True
    return name == "Tensor.__setitem__" and len(args) > 1 and _full_index(args[1])


def _collective_writes(func: Any, params: tuple[str, ...], args: Sequence[Any], kwargs: Mapping[str, Any]
                       ) -> frozenset[int]:
    """ids of the tensors a collective ``func`` wrote, those in its ``params`` (each written whole)."""
    try:
        bound = inspect.signature(func).bind(*args, **kwargs)
    except (TypeError, ValueError):
        return frozenset()
    return frozenset(id(t) for p in params for _, t in tensors_in(bound.arguments.get(p), p))


OUT_REASON = "out= argument: overwritten by the call, its content before it is not read"


def _out_entry(s: Session, call: Call, slot: str, t: torch.Tensor) -> dict[str, Any]:
    """The input entry of an ``out=`` tensor: its shape and type, not its content, which the call
    overwrites without reading (compiled code's ``extern_kernels.addmm(..., out=buf)`` passes a
    buffer it allocated uninitialised: digested, identical runs differed there). Marked
    ``uninitialized`` so that compare never compares it (§3.7)."""
    e = s.entry(call, slot, t, False, uninitialized=True)
    e["reason"] = OUT_REASON
    return e


def _copies_unwritten(entries: list[dict[str, Any]]) -> bool:
    """A copy's tensor input (its first entry) was uninitialised memory: so is the copy."""
    return bool(entries) and entries[0].get("uninitialized") is True


def _sizes_only(args: Sequence[Any]) -> bool:
    """``t.new(3, 4)`` / ``t.new(torch.Size(...))``: sizes only, an uninitialised tensor (``t.new([3, 4])``
    is data, copied)."""
    rest = args[1:]
    if len(rest) == 1 and isinstance(rest[0], torch.Size):
        return True
    return bool(rest) and all(type(a) is int for a in rest)


def unwritten_inputs(ins: list[tuple[str, torch.Tensor]], entries: list[dict[str, Any]]) -> set[int]:
    """ids of the input tensors whose entries were uninitialised memory (§3.7) when the call began."""
    # (fewer entries than inputs when recording them failed part-way: those are not known as such)
    return {id(t) for (_slot, t), e in zip(ins, entries, strict=False) if e.get("uninitialized")}


def split_args(args: Sequence[Any], kwargs: Mapping[str, Any], method: bool
               ) -> tuple[list[tuple[str, torch.Tensor]], list[dict[str, Any]]]:
    """(tensor slots, non-tensor ``args`` entries) of one call, in argument order."""
    ts: list[tuple[str, torch.Tensor]] = []
    xs: list[dict[str, Any]] = []
    for i, a in enumerate(args):
        _split(a, "self" if method and i == 0 else f"arg{i}", ts, xs)
    for k, v in kwargs.items():
        _split(v, k, ts, xs)
    return ts, xs


class CaptureMode(TorchFunctionMode):
    def __init__(self, session: Session, on_output: Callable[[Call, Any], None] | None = None,
                 c10d: Mapping[str, tuple[str, ...]] | None = None) -> None:
        super().__init__()
        # torch.distributed.distributed_c10d.<collective>: called by library code through the module's
        # own globals, not through capture's torch.distributed wrappers (collectives.py) -> the
        # parameters it writes (collectives.COLLECTIVES), each written whole
        self.c10d: Mapping[str, tuple[str, ...]] = c10d or {}
        self.session = session
        self.nested = session.options.nested
        self.noise = session.options.record_noise
        self.on_output = on_output  # dispatch level: tag grad_fn of outputs
        # (function, first argument) of the calls this mode re-entered itself for, innermost last;
        # a collective wrapper's (function, ANY) while it runs (collectives.py)
        self.inflight = session.inflight
        # the C handler of the common call (_fastcall.c, §3.11), and the functions it may handle:
        # function -> (name, method, draws random numbers, written slots or None)
        self.fast = _fast_handle if session.options.fast_call and on_output is None else None
        self.plans: dict[Any, tuple[str, bool, bool, frozenset[str] | None]] = {}
        self.passes: set[Any] = set()  # functions it passes through unrecorded

    def _pass(self, func: Any) -> None:
        """Let the C handler pass ``func``'s calls through (metadata, and noise not recorded, §3.5)."""
        try:
            if len(self.passes) >= _MAX_PLANS:
                self.passes.clear()
            self.passes.add(func)
        except TypeError:  # unhashable
            return

    def _plan(self, func: Any, name: str, kind: int) -> None:
        """Let the C handler take ``func``'s calls from now on when nothing but the common steps of
        :meth:`handle` applies to it: recorded (not metadata, noise or a conversion), not special
        (memory shared with numpy, ``t.data = ``, ``__setitem__``, a collective), not an
        uninitialised or growing result, and not re-entered (a builtin, or a collapsed wrapper)."""
        if (kind or name in _SPECIAL or name in self.c10d or name in _UNINITIALIZED_FNS or name in _GROWS
                or name == "Tensor.__setitem__"):
            return
        try:
            written = _written_get(name)
            if written is None:
                written = records.written_slots(name, func)
            sd = _seeded_get(name)
            seeded = bool(sd or (sd is None and records.seeded(name, func)))
            if len(self.plans) >= _MAX_PLANS:  # functions made per call could pile up
                self.plans.clear()
            self.plans[func] = (name, name.startswith("Tensor."), seeded, written or None)
        except TypeError:  # an unhashable callable: always the Python handler
            return

    @runs_program
    def __torch_function__(self, func: Any, types: Any, args: Sequence[Any] = (),
                           kwargs: Mapping[str, Any] | None = None) -> Any:
        if (_compiling() or _compile_flags._is_compiling_flag or _jit_tracing() is not None  # Dynamo, torch.export,
                or (_FAKE is not None and _dispatch_mode(_FAKE) is not None)):  # torch.jit.trace, fake tensors:
            # capture is invisible to them (Dynamo folds _compiling() to True: the rest is not traced)
            return func(*args, **(kwargs or {}))
        fast = self.fast
        if fast is not None:  # the common call in C, every other call back to handle() (§3.11)
            return fast(self, _getframe(1), func, types, args, kwargs)
        return self.handle(_getframe(1), func, types, args, kwargs)

    @runs_program
    def handle(self, caller: Any, func: Any, types: Any, args: Sequence[Any], kwargs: Mapping[str, Any] | None
               ) -> Any:
        """One intercepted call of ``func`` made from the frame ``caller``."""
        kwargs = kwargs or {}
        s = self.session
        if s.busy:  # capture's own work
            return func(*args, **kwargs)
        via = standin(caller)  # calls from a frame that reads as the caller's (frames.py)
        quiet = s.quiet
        if quiet is not None:  # inside an Optimizer.step() recorded as one record (optim.py): run it as it is
            if isinstance(func, _OPS):
                quiet.profiler_op(func)
            return via(func, args, kwargs)
        if isinstance(func, _OPS) and program_op(func) is None:  # torch.ops (the dispatch level's): not recorded,
            if not s.parents and s.aten_op is None:  # (called by no recorded call: the program's own code?)
                _aten_by_program(s, caller, func)
            seq = s.seq  # but what it wrote is seen; the program's own operators are recorded
            result = via(func, args, kwargs)
            if s.seq != seq or s.aten_op is func:  # level=dispatch recorded it (or what it decomposes into):
                return result  # its writes, marks (a write to part of unwritten memory, §3.7) and cached
            try:  # contents are done there
                positions, names = records.op_writes(func)
                if positions or names:
                    s.written_unrecorded([args[i] for i in positions if i < len(args)]
                                         + [v for k, v in kwargs.items() if k in names])
            except Exception as err:
                s.failed("recording", err)
            return result
        inflight = self.inflight
        if inflight:
            f0, a0 = inflight[-1]
            if f0 is func and (a0 is _ANY or _first(func, args) is a0):
                return via(func, args, kwargs)  # PyTorch came back for the call being handled: run it
        try:
            try:
                hit = _names_get(func)  # the cache of records.function_name, read here (one call less)
            except TypeError:  # unhashable callable
                hit = None
            name, kind = hit if hit is not None else records.function_name(func)
        except Exception as err:
            s.failed("recording", err)
            return via(func, args, kwargs)
        if name in self.c10d and inflight and inflight[-1][1] is _ANY:  # inside a recorded collective: its
            return via(func, args, kwargs)  # implementation (a deprecated name forwarding to its successor)
        if name in _SPECIAL and args:
            if name == "Tensor.share_memory_":  # moves t to shared memory, which other processes write
                result = via(func, args, kwargs)  # (computes nothing: not recorded)
                try:
                    s.shared(args[0])
                except Exception as err:
                    s.failed("recording", err)
                return result
            try:
                if name in _SHARES_MEMORY:  # t.numpy(), np.asarray(t): numpy can write t's memory now (§5.3)
                    s.shared(args[0])
                elif getattr(func, "__name__", None) == "__set__":  # t.data = ...: another memory, layout, dtype
                    s.rebound(args[0], args[1] if len(args) > 1 else None)
            except Exception as err:
                s.failed("recording", err)
        if kind and (kind == records.METADATA or (kind == records.NOISE and not self.noise)):
            if self.fast is not None and name not in _SPECIAL:  # always passed through: by the C handler from now on
                self._pass(func)
            return via(func, args, kwargs)
        if s.cap_reached or s.closed:
            return via(func, args, kwargs)
        if not (s.all_steps or s.step in s.options.steps):  # a step left out: its writes are still seen
            return _unselected(s, name, func, args, kwargs, via(func, args, kwargs))
        # only Python-level torch functions and higher-order operators (custom_function_call runs an
        # autograd.Function under torch.func) call other torch functions: re-enter the mode for them,
        # unless the function was found to only forward its call (wrappers.py)
        wrappers = s.wrappers
        reenter = self.nested and ((isinstance(func, pytypes.FunctionType) and func not in wrappers.collapsed)
                                   or isinstance(func, _HOP))
        if self.fast is not None and not reenter:
            try:
                planned = func in self.plans
            except TypeError:  # an unhashable callable: always this handler
                planned = True
            if not planned:
                self._plan(func, name, kind)
        call: Call | None = None
        ins: list[tuple[str, torch.Tensor]] = []
        dump_out = False
        try:
            modules, contexts = s.modules, s.contexts
            module = modules[-1] if modules else None  # s.module, s.context
            context = "/".join(contexts) if contexts else None
            site = s.sites.call_site(caller) if s.select_all or s.selected(name, module, context) else None
            if site is not None:  # None: left out by a filter, or made by torch's tensor rebuilding (§3.5)
                call = s.begin("function", name, site, where=(module, context))
                if name not in s.arg_names.known:  # its first record (the C handler takes planned ones only)
                    s.arg_names.note(name, func)
                sd = _seeded_get(name)
                if sd or (sd is None and records.seeded(name, func)):  # draws random numbers (§3.1)
                    call.rec["seeded"] = True
                ins, xs = split_args(args, kwargs, name.startswith("Tensor."))
                if xs:
                    call.rec["args"] = xs
                entry, put = s.entry, call.rec["inputs"].append  # s.inputs(call, ins), one call less
                fast = s._entry_fast if s.host_digest and not s._uninit else None  # what entry() tries first
                for slot, t in ins:
                    if slot == "out" or slot.startswith("out."):  # overwritten, never read: not an input's content
                        put(_out_entry(s, call, slot, t))
                        continue
                    ent = None
                    if fast is not None:
                        try:
                            ent = fast(call, slot, t, False, False)
                        except Exception:  # entry() below says what failed
                            ent = None
                    put(ent if ent is not None else entry(call, slot, t, False))
                if s.policy.enabled and not s.parents and s.policy.wants(s.step, name, module, context, site):
                    s.dump(call.rec["seq"], [(capture_dump_slot(slot, False), t) for slot, t in ins])
                    dump_out = True
        except Exception as err:
            s.failed("recording", err, call)
        if call is None and not reenter:  # left out by a filter (or capture's own failure)
            return _unselected(s, name, func, args, kwargs, via(func, args, kwargs))
        watch: int | None = None  # a watched wrapper call (wrappers.py): where the records it makes begin
        marked = bool(s._uninit)  # uninitialised memory is marked (§3.7): its inputs may be some
        drew: tuple[list[Any], int] | None = None  # where its nested records begin (a draw among them?)
        if call is not None:
            s.parents.append(call.rec["seq"])
            if reenter and "seeded" not in call.rec:
                drew = (s.pending, len(s.pending))
            if reenter and s.select_all and wrappers.watched(func):
                watch = len(s.pending)
                wrappers.watching += 1
        try:
            if reenter:
                inflight.append((func, _first(func, args)))
                try:
                    with self:
                        result = via(_skip_one_hop, (func, types, args, kwargs), {})
                finally:
                    inflight.pop()
            else:
                result = via(func, args, kwargs)
        except BaseException as e:
            if call is not None:
                call.rec["error"] = f"{type(e).__name__}: {e}"[:500]
                if watch is not None:
                    wrappers.failed(func)
            raise
        finally:
            if call is not None:
                s.parents.pop()
                if watch is not None:
                    wrappers.watching -= 1
        if call is None:
            return _unselected(s, name, func, args, kwargs, result)
        if drew is not None and drew[0] is s.pending:
            _drawn_inside(call, name, drew[0], drew[1])
        if (kind == records.CONVERSION and not self.noise and not dump_out and args and result is args[0]
                and s.drop(call)):  # a conversion that returned its input: it computed nothing (§3.5)
            return result
        try:
            whole_ids: frozenset[int] = frozenset()  # tensors a library collective wrote (whole)
            if not s.cap_reached:
                outs = [("out", result)] if type(result) is _Tensor else list(tensors_in(result, "out"))
                if result is None and name == "Tensor.__setitem__" and args and isinstance(args[0], _Tensor):
                    outs = [("self", args[0])]  # what the assignment wrote: self after the call (§3.1)
                elif name in self.c10d and ins:  # a collective called by library code (DTensor, DCP, object
                    if kwargs.get("async_op") or name.endswith(("isend", "irecv")):  # collectives): §3.2
                        s.written_unrecorded([t for _, t in ins])  # written at wait(): read again at next use
                        if s.waits is not None:  # and recorded at the program's wait() (waits.py)
                            by_wait = _collective_writes(func, self.c10d[name], args, kwargs)
                            s.waits.issued(result, call, [(slot, t) for slot, t in ins if id(t) in by_wait])
                    else:
                        outs.extend(ins)  # every tensor argument after the call, as derived collectives
                        if marked:  # what it wrote, it wrote whole: no longer uninitialised memory (§3.7)
                            whole_ids = _collective_writes(func, self.c10d[name], args, kwargs)
                elif ins:  # every argument the function wrote is an output (in-place ones, running statistics)
                    written = _written_get(name)
                    if written is None:
                        written = records.written_slots(name, func)
                    if written:
                        _written_outputs(written, ins, outs)
                if (name in _UNINITIALIZED_FNS or (name in _GROWS and _grew(call.rec["inputs"], outs))
                        or (marked and name in _COPIES and _copies_unwritten(call.rec["inputs"]))
                        or (name == "Tensor.new" and _sizes_only(args))):
                    s.outputs(call, outs, uninitialized=True)
                elif name == duals.UNPACK and duals.tainted(s, args, kwargs):  # a tangent computed from
                    s.outputs(call, outs[:1])  # uninitialised memory (duals.py)
                    s.outputs(call, outs[1:], uninitialized=True)
                else:  # s.outputs(call, outs), with entry()'s fast path tried here (one or two calls less)
                    entry, put = s.entry, call.rec["outputs"].append
                    fast = s._entry_fast if s.host_digest and not s._uninit else None
                    # inputs that were uninitialised memory: a write to part of one leaves the rest (§3.7)
                    # (marked when the call began: at level=dispatch a nested aten write may have cleared it)
                    unwritten = unwritten_inputs(ins, call.rec["inputs"]) if marked and ins else None
                    for slot, t in outs:
                        # an input object as output (in-place, out=, __setitem__): a write, digested from
                        # memory: a cached key can be another alias's (p.data has a version counter of
                        # its own, whose value can equal p's) (docs/capture.md §5.3)
                        wrote = False
                        for _, x in ins:
                            if x is t:
                                wrote = True
                                break
                        if wrote and unwritten and id(t) in unwritten:
                            whole = ((writes_whole(name, args, kwargs) or id(t) in whole_ids)  # and not from
                                     and not any(id(x) in unwritten for _, x in ins if x is not t))  # unwritten memory
                            put(s.written_marked(call, slot, t, whole))
                            continue
                        ent = None
                        if fast is not None:
                            try:
                                ent = fast(call, slot, t, True, wrote)
                            except Exception:  # entry() below says what failed
                                ent = None
                        put(ent if ent is not None else entry(call, slot, t, True, fresh=wrote))
                if dump_out:
                    s.dump(call.rec["seq"], [(capture_dump_slot(slot, True), t) for slot, t in outs])
                if name == duals.MAKE:
                    duals.made(s, args, kwargs, call.rec["inputs"])
                if self.on_output is not None:
                    self.on_output(call, outs)
                if watch is not None:
                    wrappers.observe(func, name, call, s.pending[watch:], frozenset([id(t) for _, t in ins]),
                                     frozenset([id(t) for _, t in outs]))
                # inside a watched wrapper call: what this call took and gave; none for a re-entered
                # call that is no pass-through itself (Tensor.backward -> torch.autograd.backward, whose
                # engine runs the program's hooks and backward code): its caller is never collapsed
                if wrappers.watching and (not reenter or wrappers.forwards(func)):
                    call.ids = (frozenset([id(t) for _, t in ins]), frozenset([id(t) for _, t in outs]))
        except Exception as err:
            s.failed("recording", err, call)
            if watch is not None:
                wrappers.failed(func)
        if not s.parents:  # sealed, and written once the buffer is full
            s.maybe_flush_contained()
        return result


# its calls go through stand-ins: a function it re-entered reads its stand-in's caller (frames.py)
register(CaptureMode.__torch_function__)

if _fastcall is not None:  # what the C handler calls: the same objects handle() uses
    _fastcall.configure(sys.modules[__name__],
                        (str, torch.dtype, torch.device, torch.layout, torch.memory_format, torch.Size))
    _fast_handle: Any = _fastcall.handle
else:
    _fast_handle = None
