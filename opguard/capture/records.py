"""Record building: names of captured functions, tensor entries, JSON encoding (schema version 1)."""

from __future__ import annotations

import json
import math
from typing import Any

import orjson
import torch

SCHEMA = "opguard-capture"
VERSION = 1

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
})
# Properties recorded when read (they return tensor data); every other property read is metadata.
TENSOR_PROPERTIES = frozenset({"grad", "data", "T", "mT", "H", "mH", "real", "imag"})

_names: dict[Any, tuple[str, bool]] = {}


def function_name(func: Any) -> tuple[str, bool]:
    """(qualified name, is metadata-only) for a function seen by the torch function mode."""
    try:
        hit = _names.get(func)
    except TypeError:  # unhashable callable
        hit = None
    if hit is not None:
        return hit
    name, meta = _compute_name(func)
    try:
        _names[func] = (name, meta)
    except TypeError:
        pass
    return name, meta


def _compute_name(func: Any) -> tuple[str, bool]:
    owner = getattr(func, "__self__", None)
    fname = getattr(func, "__name__", None) or type(func).__name__
    if fname in ("__get__", "__set__", "__delete__") and owner is not None and hasattr(owner, "__objclass__"):
        attr = getattr(owner, "__name__", "?")
        return f"Tensor.{attr}", fname != "__get__" or attr not in TENSOR_PROPERTIES
    if isinstance(func, torch._ops.OpOverload):
        return f"aten::{func._opname}.{func._overloadname}" if func.namespace == "aten" else str(func), False
    qual = getattr(func, "__qualname__", fname)
    head = qual.split(".", 1)[0]
    if head in ("TensorBase", "Tensor", "_TensorBase"):
        method = qual.split(".", 1)[1] if "." in qual else fname
        return f"Tensor.{method}", method in METADATA_METHODS
    if head == "_VariableFunctionsClass":
        return f"torch.{fname}", fname in METADATA_METHODS
    module = getattr(func, "__module__", None) or "torch"
    module = _MODULE_ALIASES.get(module, module)
    return f"{module}.{qual}", fname in METADATA_METHODS


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
    a record is written by ``json`` with ASCII escapes, so it is kept, never dropped."""
    try:
        return orjson.dumps(obj, option=orjson.OPT_APPEND_NEWLINE)
    except TypeError:
        return (json.dumps(obj, separators=(",", ":"), allow_nan=False) + "\n").encode()
