"""The native host kernel: mix64-v1 digest sum and statistics of a CPU tensor in one pass.

``opguard.capture._hostkernel`` is a small C extension (``_hostkernel.c``, built by ``setup.py``
when a C compiler is present; optional). It computes exactly the ``S`` of ``docs/capture.md`` §5.1
(the same value as the PyTorch-ops path of ``digest.Digester``, which stays the path for
accelerator tensors and the fallback) and the statistics row of §3.3, reading each byte once
instead of the eight passes of the eager ops. ``docs/capture.md`` §5.2 describes it.
"""

from __future__ import annotations

import importlib
import sys
from types import ModuleType
from typing import Any

import torch

from opguard.errors import ConfigError

_module: ModuleType | None
try:
    _module = importlib.import_module("opguard.capture._hostkernel")
    LOAD_ERROR: str | None = None
except ImportError as e:  # not built (no C compiler at install time) or built for another ABI
    _module = None
    LOAD_ERROR = f"{type(e).__name__}: {e}"

# element codes of _hostkernel.c (the statistics' element type); other dtypes: statistics by torch ops
CODES: dict[torch.dtype, int] = {
    torch.float32: 0, torch.float64: 1, torch.float16: 2, torch.bfloat16: 3, torch.int8: 4,
    torch.uint8: 5, torch.bool: 5, torch.int16: 6, torch.int32: 7, torch.int64: 8,
}


def available() -> bool:
    return _module is not None


def resolve(choice: str, *, warn: bool = True) -> ModuleType | None:
    """The kernel module to use for ``OPGUARD_CAPTURE_HOST_KERNEL=choice`` (None: PyTorch ops).

    ``native`` without a built kernel is a configuration error; ``auto`` falls back to PyTorch ops
    and says so once on stderr (never silently slower)."""
    if choice == "torch":
        return None
    if _module is not None:
        return _module
    if choice == "native":
        raise ConfigError(
            f"OPGUARD_CAPTURE_HOST_KERNEL=native, but the native host kernel opguard.capture._hostkernel "
            f"is not built ({LOAD_ERROR})",
            "reinstall opguard where a C compiler is available (pip install --force-reinstall --no-binary "
            "opguard opguard), or set OPGUARD_CAPTURE_HOST_KERNEL=auto or torch")
    if warn:
        print(f"opguard capture: the native host kernel opguard.capture._hostkernel is not built ({LOAD_ERROR}); "
              "CPU tensors are summarised with PyTorch ops, 2-47x slower per tensor (docs/capture.md §5.2). "
              "Reinstall opguard with a C compiler available, or set OPGUARD_CAPTURE_HOST_KERNEL=torch to "
              "choose that path explicitly.", file=sys.stderr, flush=True)
    return None


def host_data(t: torch.Tensor) -> torch.Tensor:
    """The tensor's logical element sequence as a contiguous real tensor (a view when it already is
    one; grad mode must be off). Complex: its ``view_as_real`` float pairs."""
    if t.is_conj() or t.is_neg():
        t = t.resolve_conj().resolve_neg()
    if t.is_complex():
        t = torch.view_as_real(t)
    return t if t.is_contiguous() else t.contiguous()


def summary_strided(kernel: Any, t: torch.Tensor, digest: bool, code: int | None) -> tuple[int | None, Any] | None:
    """``summary`` of a non-contiguous real tensor read in place (the kernel gathers its logical
    element sequence piecewise: no contiguous copy); None when the kernel cannot (built before
    ``strided`` existed, a complex/conjugate/negative view, a contiguous tensor) or the statistics'
    sum is not finite (the NaN/Inf counts need the copy)."""
    fn = getattr(kernel, "strided", None)
    if fn is None or t.is_contiguous() or t.is_complex() or t.is_conj() or t.is_neg():
        return None
    result: tuple[int | None, Any] | None = fn(
        t.data_ptr(), t.element_size(), tuple(t.shape), tuple(t.stride()), -1 if code is None else code, digest,
        code is not None)
    return result


def summary(kernel: Any, d: torch.Tensor, digest: bool, code: int | None) -> tuple[int | None, Any]:
    """``(S, row)`` for the contiguous real tensor ``d``: ``S`` of mix64-v1 (None unless ``digest``),
    ``row`` = (min, max, sum, sum of squares, non-finite count, Inf count) (None when ``code`` is None)."""
    result: tuple[int | None, Any] = kernel.summary(
        d.data_ptr(), d.numel() * d.element_size(), -1 if code is None else code, digest, code is not None)
    return result
