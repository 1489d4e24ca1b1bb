"""Record building: names of captured functions, tensor entries, non-tensor arguments, JSON encoding
(schema version 2, ``docs/capture.md`` §3)."""

from __future__ import annotations

import enum
import hashlib
import inspect
import json
import math
import numbers
import sys
import types
from typing import Any

import orjson
import torch

from opguard.capture.customops import program_op

SCHEMA = "opguard-capture"
VERSION = 2
# the revision of the argument forms (docs/capture.md §2.1, §3.4): raised whenever the canonical form
# of an argument a program already records changes, so compare can tell two runs' forms apart
ARG_FORMS = 3

_MODULE_ALIASES = {
    "torch._C._nn": "torch.nn.functional",
    "torch._C._linalg": "torch.linalg",
    "torch._C._fft": "torch.fft",
    "torch._C._special": "torch.special",
    "torch._C._VariableFunctions": "torch",
    "torch.functional": "torch",
    "torch._tensor": "torch",
}

# Calls that only read metadata (never recorded, their nested calls neither).
METADATA_METHODS = frozenset({
    "size", "dim", "numel", "stride", "storage_offset", "is_contiguous", "data_ptr", "element_size",
    "nelement", "ndimension", "is_floating_point", "is_complex", "get_device", "__len__", "__repr__",
    "__format__", "__str__", "__hash__", "__reduce_ex__", "__deepcopy__", "__setstate__", "__dir__",
    "untyped_storage", "storage", "_typed_storage", "is_shared", "is_pinned", "has_names", "type",
    "is_set_to", "__iter__", "__array__", "dim_order", "__dlpack__", "__dlpack_device__",
    "register_hook", "retain_grad", "requires_grad_", "_is_view", "is_inference",
    "_set_grad_enabled", "is_grad_enabled", "set_grad_enabled", "_get_tracing_state", "is_tensor",
    "is_conj", "is_neg", "is_signed", "is_coalesced", "is_same_size",
    "_set_view_replay_enabled",  # a mode switch of torch.compile's runtime wrapper (twice per compiled call)
    "_has_compatible_shallow_copy_type",  # Module._apply's type test per parameter (to_empty, .to())
})
# Properties that return tensor data: recorded when read only with ``record_noise`` (every other
# property read is metadata, never recorded).
TENSOR_PROPERTIES = frozenset({"grad", "data", "T", "mT", "H", "mH", "real", "imag"})
# Python protocol calls that convert or test a tensor without computing a tensor: recorded only with
# ``record_noise`` (docs/capture.md §3.5).
PROTOCOL_METHODS = frozenset({
    "__index__", "__bool__", "__int__", "__float__", "__complex__", "__nonzero__", "__contains__",
    "__array_wrap__", "__reversed__", "__getstate__", "__reduce__", "__copy__",
})
# Conversions that return their input itself when there is nothing to convert (``x.to(x.device)``,
# ``x.float()`` of a float32 tensor, ``x.contiguous()`` of a contiguous one): such a call did no
# computation, and its record is dropped unless ``record_noise`` (docs/capture.md §3.5). The test is
# the result's identity, after the call: a conversion that made a new tensor is recorded.
CONVERSION_METHODS = frozenset({
    "to", "type_as", "contiguous", "cpu", "cuda", "float", "double", "half", "bfloat16", "int",
    "long", "short", "char", "byte", "bool", "resolve_conj", "resolve_neg",
})
# Kinds returned by :func:`function_name`.
RECORD, METADATA, NOISE, CONVERSION = 0, 1, 2, 3
# Ops whose output is uninitialised memory (``uninitialized: true`` on that output, docs/capture.md §3.7).
UNINITIALIZED_FNS = frozenset({
    "torch.empty", "torch.empty_like", "torch.empty_strided", "torch.empty_permuted", "Tensor.new_empty",
    "Tensor.new_empty_strided", "aten::empty.memory_format", "aten::empty.names", "aten::empty.out",
    "aten::empty_like.default", "aten::empty_strided.default", "aten::new_empty.default",
    "aten::new_empty_strided.default", "aten::empty_permuted.default",
})

# Calls after which ``self``'s memory can be written by something that is not a torch op (the numpy
# array or DLPack consumer now sharing it): its contents are never served from the digest cache
# again (docs/capture.md §5.3).
SHARES_MEMORY_FNS = frozenset({"Tensor.numpy", "Tensor.__array__", "Tensor.__dlpack__"})

# In-place resizes: when they grow a tensor its new elements are uninitialised memory, so the output
# is recorded as uninitialised (docs/capture.md §3.7).
GROWS_FNS = frozenset({"Tensor.resize_", "Tensor.resize_as_", "aten::resize_.default", "aten::resize_as_.default"})

# Calls whose output is a copy of their tensor input (a cast at most): of uninitialised memory, an
# uninitialised output (docs/capture.md §3.7). ``Tensor.new`` given only sizes allocates without filling.
COPY_FNS = frozenset({
    "Tensor.clone", "torch.clone", "Tensor.contiguous", "Tensor.to", "Tensor.cpu", "Tensor.cuda", "Tensor.float",
    "Tensor.double", "Tensor.half", "Tensor.bfloat16", "Tensor.type", "Tensor.type_as", "Tensor.detach",
    "torch.detach", "Tensor.clone_", "aten::clone.default", "aten::contiguous.default", "aten::_to_copy.default",
    "aten::_to_copy", "aten::copy.default",
})

# Dispatch-level ops with an output their CPU kernel writes only in part (the rest is whatever the
# allocator left): those outputs (by position) are recorded as uninitialised (docs/capture.md §3.7).
# _ctc_loss's log_alpha: only the cells of each sequence's lattice are written.
PARTLY_WRITTEN_OUTPUTS: dict[str, frozenset[int]] = {
    "aten::_ctc_loss.default": frozenset({1}), "aten::_ctc_loss.Tensor": frozenset({1}),
}

_names: dict[Any, tuple[str, int]] = {}


def function_name(func: Any) -> tuple[str, int]:
    """(qualified name, kind) for a function seen by the torch function mode: kind ``RECORD``,
    ``METADATA`` (never recorded), ``NOISE`` (recorded only with ``record_noise``) or ``CONVERSION``
    (a ``Tensor`` conversion method: its record is dropped when it returned its input, unless
    ``record_noise``)."""
    try:
        hit = _names.get(func)
    except TypeError:  # unhashable callable
        hit = None
    if hit is not None:
        return hit
    own = program_op(func) if isinstance(func, (torch._ops.OpOverload, torch._ops.OpOverloadPacket)) else None
    name, meta = (own, RECORD) if own is not None else _compute_name(func)
    try:
        _names[func] = (name, meta)
    except TypeError:
        pass
    return name, meta


# Arguments written by the batch-norm family in training (the running statistics, updated in place
# without moving a version counter) that several ATen schemas do not mark as written
# (native_batch_norm, batch_norm, cudnn_batch_norm, batch_norm_update_stats, ...): taken as written
# wherever a schema or a Python signature names them.
RUNNING_STATS = frozenset({"running_mean", "running_var"})
_written: dict[str, frozenset[str]] = {}


def written_slots(name: str, func: Any = None) -> frozenset[str]:
    """The argument slots (§3.3: ``self`` / ``arg<i>`` / keyword) that the function ``name`` (``torch.X``
    / ``Tensor.X``) writes, from its ATen schemas (every overload): the arguments marked
    ``alias_info.is_write`` (``torch._amp_foreach_non_finite_check_and_unscale_`` writes ``arg0``,
    the gradients, and ``arg1``, ``found_inf``, returns nothing and moves no version counter) and
    :data:`RUNNING_STATS`; for a Python-level function ``func`` (``torch.nn.functional.batch_norm``),
    its parameters named in :data:`RUNNING_STATS`. Cached per name."""
    hit = _written.get(name)
    if hit is not None:
        return hit
    owner, _, op = name.partition(".")
    slots: set[str] = set()
    if isinstance(func, (torch._ops.OpOverload, torch._ops.OpOverloadPacket)):  # the program's operator (§3.1)
        positions, names = op_writes(func)
        out = frozenset({f"arg{i}" for i in positions} | names)
        _written[name] = out
        return out
    try:
        packet = getattr(torch.ops.aten, op) if owner in ("torch", "Tensor") and "." not in op else None
        for overload in packet.overloads() if packet is not None else ():
            for i, a in enumerate(getattr(packet, overload)._schema.arguments):
                if (a.alias_info is not None and a.alias_info.is_write) or a.name in RUNNING_STATS:
                    slots.add(a.name)  # passed by keyword
                    if not a.kwarg_only:
                        slots.add("self" if i == 0 and owner == "Tensor" else f"arg{i}")
    except Exception:  # no such ATen op: nothing known from a schema
        slots.clear()
    if not slots and func is not None and inspect.isfunction(func):
        try:
            for i, p in enumerate(inspect.signature(func).parameters.values()):
                if p.name in RUNNING_STATS:
                    slots.update((p.name, f"arg{i}"))
        except (TypeError, ValueError):
            pass
    out = _written[name] = frozenset(slots)
    return out


_seeded: dict[str, bool] = {}


def seeded(name: str, func: Any = None) -> bool:
    """Whether the call draws from a random-number generator (docs/capture.md §3.1 ``seeded``): an
    ATen operator named like the last part of ``name`` (every overload; ``func`` itself when it is
    one) carries the tag ``nondeterministic_seeded``, or ``func`` is a Python function with a
    ``generator`` parameter (``torch.nn.init.kaiming_uniform_``, whose draws happen in a nested
    call compare may leave out). Cached per name."""
    hit = _seeded.get(name)
    if hit is not None:
        return hit
    tag = getattr(torch.Tag, "nondeterministic_seeded", None)
    found = False
    try:
        if isinstance(func, torch._ops.OpOverload):
            found = tag in func.tags
        elif tag is not None:
            packet: Any = getattr(torch.ops.aten, name.rpartition(".")[2], None)
            if packet is not None and hasattr(packet, "overloads"):
                found = any(tag in getattr(packet, o).tags for o in packet.overloads())
    except Exception:  # no such operator, no tags: not known to draw
        found = False
    if not found and isinstance(func, types.FunctionType):
        try:
            found = "generator" in inspect.signature(func).parameters
        except (TypeError, ValueError):
            found = False
    _seeded[name] = found
    return found


_op_writes: dict[Any, tuple[tuple[int, ...], frozenset[str]]] = {}


def op_writes(op: Any) -> tuple[tuple[int, ...], frozenset[str]]:
    """(positions, names) of the arguments a ``torch.ops`` operator or ATen overload writes (its
    schema's ``alias_info.is_write``, and :data:`RUNNING_STATS`; every overload of a packet), cached
    per operator; nothing when unknown. The dispatch level's written outputs and the function
    level's unrecorded ``torch.ops`` calls both read it."""
    try:
        hit = _op_writes.get(op)
    except TypeError:
        hit = None
    if hit is not None:
        return hit
    positions: set[int] = set()
    names: set[str] = set()
    try:
        packet: Any = op if isinstance(op, torch._ops.OpOverloadPacket) else None
        schemas = [getattr(packet, o)._schema for o in packet.overloads()] if packet is not None else [op._schema]
        for schema in schemas:
            for i, a in enumerate(schema.arguments):
                if (a.alias_info is not None and a.alias_info.is_write) or a.name in RUNNING_STATS:
                    names.add(a.name)
                    if not a.kwarg_only:
                        positions.add(i)
    except Exception:  # no schema: nothing known
        positions.clear()
        names.clear()
    out = (tuple(sorted(positions)), frozenset(names))
    try:
        _op_writes[op] = out
    except TypeError:
        pass
    return out


def _kind(method: str) -> int:
    if method in METADATA_METHODS:
        return METADATA
    return NOISE if method in PROTOCOL_METHODS else RECORD


def _compute_name(func: Any) -> tuple[str, int]:
    owner = getattr(func, "__self__", None)
    fname = getattr(func, "__name__", None) or type(func).__name__
    if fname in ("__get__", "__set__", "__delete__") and owner is not None and hasattr(owner, "__objclass__"):
        attr = getattr(owner, "__name__", "?")
        return f"Tensor.{attr}", NOISE if fname == "__get__" and attr in TENSOR_PROPERTIES else METADATA
    if func is torch.device:  # a device object built: no tensor, no computation
        return "torch.device", METADATA
    if isinstance(func, torch._ops.OpOverload):
        return f"aten::{func._opname}.{func._overloadname}" if func.namespace == "aten" else str(func), RECORD
    qual = getattr(func, "__qualname__", fname)
    if "<locals>" in qual and isinstance(fname, str) and qual.rpartition(".")[2] != fname:
        # a function made inside another and given its public name (torch.nn.functional.max_pool2d is
        # boolean_dispatch.<locals>.fn, __name__ 'max_pool2d'): the name it was published under
        qual = fname
    head = qual.split(".", 1)[0]
    if head in ("TensorBase", "Tensor", "_TensorBase"):
        method = qual.split(".", 1)[1] if "." in qual else fname
        return f"Tensor.{method}", CONVERSION if method in CONVERSION_METHODS else _kind(method)
    if head == "_VariableFunctionsClass":
        return f"torch.{fname}", _kind(fname)
    module = getattr(func, "__module__", None) or "torch"
    public = _MODULE_ALIASES.get(module, module)
    if public != module and public.startswith("torch.") and qual.startswith(public[6:] + "_"):
        # torch._C._fft.fft_rfft is torch.fft.rfft (linalg_, special_ alike): the public name, when it is one
        bare = qual[len(public) - 5:]
        if getattr(sys.modules.get(public), bare, None) is not None:
            qual = bare
    if module.startswith("torch._C._") and public != module and getattr(sys.modules.get(public), qual, None) is None:
        public = module  # a builtin its public module does not publish (torch._C._nn._parse_to): its own name
    return f"{public}.{qual}", _kind(fname)


_dtype_names: dict[torch.dtype, str] = {}
_device_names: dict[torch.device, str] = {}


def dtype_name(dtype: torch.dtype) -> str:
    name = _dtype_names.get(dtype)
    if name is None:
        name = _dtype_names[dtype] = str(dtype).removeprefix("torch.")
    return name


def device_name(device: torch.device) -> str:
    name = _device_names.get(device)
    if name is None:
        name = _device_names[device] = str(device)
    return name


def plain_data_reason(t: torch.Tensor) -> str | None:
    """Why a tensor has no digestible data (``None`` when it has)."""
    if type(t) is torch.Tensor and t.layout is torch.strided and (t.is_cpu or t.is_cuda) and not t.is_quantized:
        return None  # the common case, decided in four attribute reads (no device object)
    if type(t) not in (torch.Tensor, torch.nn.Parameter):
        return f"tensor subclass {type(t).__name__}"
    if t.layout != torch.strided:
        return f"layout {t.layout}"
    if t.is_meta:
        return "meta tensor"
    if t.is_quantized:
        return "quantized tensor"
    if t.device.type not in ("cpu", "cuda", "xpu", "mps", "hpu", "privateuseone", "mtia"):
        return f"device {t.device.type}"
    return None


def json_float(x: float) -> float | str:
    if math.isfinite(x):
        return x
    return "nan" if x != x else ("inf" if x > 0 else "-inf")


def encode(obj: dict[str, Any]) -> bytes:
    """One compact JSON line, UTF-8 (orjson). Records hold no non-finite float (statistics go
    through :func:`json_float`; orjson would write ``null``). A string that is not valid UTF-8 (a
    source path with surrogate escapes, an exception message) makes orjson refuse the record: such
    a record is written by ``json`` with ASCII escapes, so it is kept, never dropped. A symbolic
    size (``torch.SymInt``: a tensor torch.export or FakeTensor tracing made, whose shape holds a
    symbol) is written as its text (``"s77"``): what the record held, not a lost record."""
    try:
        return orjson.dumps(obj, option=orjson.OPT_APPEND_NEWLINE)
    except TypeError:
        return (json.dumps(obj, separators=(",", ":"), allow_nan=False, default=_symbolic) + "\n").encode()


_SYMBOLIC = tuple(t for t in (getattr(torch, n, None) for n in ("SymInt", "SymFloat", "SymBool")) if t is not None)


def _symbolic(v: Any) -> str:
    if isinstance(v, _SYMBOLIC):
        return str(v)
    raise TypeError(f"Object of type {type(v).__name__} is not JSON serializable")


def encode_strict(obj: dict[str, Any]) -> bytes:
    """:func:`encode` by orjson only (``TypeError`` where :func:`encode` falls back to ``json``)."""
    return orjson.dumps(obj, option=orjson.OPT_APPEND_NEWLINE)


# ---- non-tensor arguments (schema v2, docs/capture.md §3.4) ----------------------------------------
ARG_VALUE_MAX = 64  # canonical JSON text longer than this: digest + length instead of the value


def _canonical(v: Any) -> tuple[str, Any]:
    """(type, canonical JSON value) of one non-tensor argument."""
    t = type(v)
    if v is None:
        return "none", None
    if t is bool:
        return "bool", v
    if t is int:
        return "int", v
    if t is float:
        return "float", json_float(v)
    if t is str:
        return "str", v
    if t is torch.dtype:
        return "dtype", str(v).removeprefix("torch.")
    if t is torch.device:
        return "device", str(v)
    if t is torch.Size:
        return "shape", list(v)
    if t is torch.layout:
        return "layout", str(v).removeprefix("torch.")
    if t is torch.memory_format:
        return "memory_format", str(v).removeprefix("torch.")
    if t is slice:
        return "slice", [_canonical(x)[1] for x in (v.start, v.stop, v.step)]
    if v is Ellipsis:
        return "ellipsis", None
    if t is range:
        return "range", [v.start, v.stop, v.step]
    if t.__name__ == "ndarray" and t.__module__ == "numpy":
        return "ndarray", _ndarray(v)
    if isinstance(v, (list, tuple)):
        if any(type(x) is slice or x is Ellipsis for x in v):  # an index tuple: None, ... and : distinct
            return "index", ", ".join(map(_index_part, v))
        return "list", [_element(x) for x in v]
    if isinstance(v, enum.Enum):
        return "enum", f"{t.__name__}.{v.name}"
    if isinstance(v, bool):
        return "bool", bool(v)
    if isinstance(v, numbers.Integral):
        return "int", int(v)
    if isinstance(v, numbers.Real):
        return "float", json_float(float(v))
    if isinstance(v, numbers.Complex):
        c = complex(v)
        return "complex", [json_float(c.real), json_float(c.imag)]
    if isinstance(v, str):
        return "str", str(v)
    if isinstance(v, torch.Tensor):  # a tensor nested deeper than tensor entries reach (a slice's bound is
        return "object", "torch.Tensor"  # an input entry of its own, §3.3: never its value here)
    if isinstance(v, (types.FunctionType, types.BuiltinFunctionType, types.MethodType, type)):
        # a callable or class argument (distance_function=, a loss class): which one, by its qualified
        # name (never an address); it was its type, "builtins.function", whichever function it was
        if isinstance(v, types.BuiltinFunctionType) and str(getattr(v, "__module__", None)).startswith("torch"):
            return "function", function_name(v)[0]  # torch.relu: the name capture records it under
        return "function", f"{getattr(v, '__module__', None) or '?'}.{getattr(v, '__qualname__', '?')}"
    return "object", f"{t.__module__}.{t.__qualname__}"


ARRAY_VALUES_MAX = 16  # a NumPy array or a nested CPU tensor of at most this many elements: by its values


def _ndarray(v: Any) -> dict[str, Any]:
    """A NumPy array argument (an index, ``torch.as_tensor``'s data): dtype, shape, and its values
    when small, else a digest of its bytes; arrays of objects, strings or dates: dtype and shape."""
    out: dict[str, Any] = {"dtype": str(v.dtype), "shape": list(v.shape)}
    if v.dtype.kind not in "biufc":
        return out
    if v.size <= ARRAY_VALUES_MAX:
        out["values"] = _canonical(v.tolist())[1]
    else:
        out["sha256"] = hashlib.sha256(v.tobytes()).hexdigest()[:16]
    return out


def _element(x: Any) -> Any:
    """An element of a list argument: a small CPU tensor by its values (:func:`_small_tensor`)."""
    if isinstance(x, torch.Tensor):
        small = _small_tensor(x)
        if small is not None:
            return small
    return _canonical(x)[1]


def _small_tensor(v: torch.Tensor) -> Any:
    """A plain CPU tensor of at most ARRAY_VALUES_MAX elements nested in an argument (``betas`` as
    tensors): its values (a number for a 0-d tensor, else nested lists), read without a device sync
    or a recorded call; None for anything else (a device tensor, a subclass, one that needs grad or
    that NumPy cannot hold)."""
    if (type(v) is not torch.Tensor and type(v) is not torch.nn.Parameter) or v.device.type != "cpu" or \
            v.requires_grad or v.layout != torch.strided or v.is_quantized or v.numel() > ARRAY_VALUES_MAX:
        return None
    try:
        with torch._C.DisableTorchFunction():
            values = v.numpy().tolist()
    except Exception:  # bfloat16, a conjugate view, ...: by type, as before
        return None
    return _canonical(values)[1]


def _index_part(x: Any) -> str:
    """One element of an index tuple as Python writes it in ``t[...]``: ``1:5:2``, ``...``, ``None``."""
    if x is Ellipsis:
        return "..."
    if type(x) is slice:
        text = f"{_bound(x.start)}:{_bound(x.stop)}"
        return text if x.step is None else f"{text}:{_bound(x.step)}"
    kind, value = _canonical(x)
    if kind in ("none", "bool", "str"):
        return repr(value)
    if kind == "ndarray":
        what = (canonical_text(value["values"]).replace(",", ", ") if "values" in value else
                f"shape={value['shape']}, sha256={value.get('sha256')}")
        return f"array({what}, dtype={value['dtype']})"
    return canonical_text(value).replace(",", ", ")


def _bound(b: Any) -> str:
    if b is None:
        return ""
    if isinstance(b, torch.Tensor):         # x[:k] with a tensor k: its value is an input entry (§3.3)
        return "<tensor>"
    return canonical_text(_canonical(b)[1])


def canonical_text(value: Any) -> str:
    """The canonical JSON text of a canonical value: compact separators, keys as given, ASCII escapes."""
    return json.dumps(value, separators=(",", ":"), allow_nan=False)


def arg_entry(slot: str, v: Any) -> dict[str, Any]:
    """One ``args`` entry: ``{"slot", "type", "value"}`` or, for a canonical JSON text longer than
    ARG_VALUE_MAX characters, ``{"slot", "type", "digest", "len"}``."""
    kind, value = _canonical(v)
    if kind in ("none", "bool", "float", "dtype", "device", "layout", "memory_format", "ellipsis"):
        return {"slot": slot, "type": kind, "value": value}
    if kind == "function":  # a qualified name reads better than its digest: kept up to 200 characters
        return {"slot": slot, "type": kind, "value": value[:200]}
    text = canonical_text(value)
    if len(text) > ARG_VALUE_MAX:
        return {"slot": slot, "type": kind, "digest": hashlib.sha256(text.encode()).hexdigest()[:16], "len": len(text)}
    return {"slot": slot, "type": kind, "value": value}
