"""Calls made on the program's behalf from a frame that reads as the program's own (``docs/capture.md`` §11).

Capture's handlers (the function mode, the dispatch mode, the collective wrappers) sit between the
program's frame and the torch function it called. Whatever reads the stack from inside that function
would see capture's frame where the caller's was: above all warnings — ``warnings.warn(...,
stacklevel=N)`` in PyTorch's Python code and the warnings PyTorch raises from C++ (attributed to the
innermost Python frame). The message would name capture's file and line, ``filterwarnings(module=...)``
would test capture's module, and once-per-location de-duplication would use capture's
``__warningregistry__``: the program would behave differently.

So a handler calls the function through a *stand-in*: a one-line function ``f(*a, **k)`` whose code
object carries the caller's file name, function name and current line (no column positions, so a
traceback draws no carets under the wrong columns) and whose globals are the caller's globals (its
``__name__`` and ``__warningregistry__``). A warning that reaches up to the caller therefore gets
exactly the file, line, module and registry it gets without capture. The caller is the frame that
called the handler, or — for a Python-level torch function, which reaches the handler through
``torch.overrides.handle_torch_function`` — the frame that called that function. Stand-ins are
cached per (code object, instruction); building one is a ``CodeType.replace``.

A Python-level torch function that capture re-enters (``Tensor.backward`` calling
``torch.autograd.backward``) runs below the stand-in of *its* caller, with capture's frames above
that: a warning whose ``stacklevel`` reaches past the function to the program's line (a full backward
hook's warning, ``stacklevel=5`` from inside the engine) would land on capture's handler. So when the
caller's own caller is a stand-in, the call goes through a chain of stand-ins, outermost first, one
per frame hidden that way (the frame the outer stand-in stands for: found by walking from it to
the handler that made it, as :func:`standin` does): the stack above the function reads as it does
without capture as far as the program's frame that made the outermost call.

While a trace or profile function is set on the thread (``sys.settrace``: a debugger, coverage;
``sys.setprofile``: ``cProfile``), calls are made directly instead: the tracer would see each stand-in
as a call of a function in the program's file that the program never made (a program counting its
own functions' calls printed other counts). Warnings raised meanwhile name capture's frame.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Mapping, Sequence
from types import CodeType, FrameType, FunctionType
from typing import Any

import torch.overrides

from opguard.capture.dynamo_marks import new_program_code, runs_program

Call = Callable[[Callable[..., Any], Sequence[Any], Mapping[str, Any]], Any]
_HANDLE = torch.overrides.handle_torch_function.__code__
_gettrace, _getprofile = sys.gettrace, sys.getprofile
_MAX = 1 << 13  # stand-ins kept (each holds its caller's globals); cleared when full (generated code can make many)


@runs_program
def plain(f: Callable[..., Any], a: Sequence[Any], k: Mapping[str, Any]) -> Any:
    """The call without a stand-in (no Python caller, or stand-ins unavailable)."""
    return f(*a, **k)


_TEMPLATE: CodeType = (lambda f, a, k: f(*a, **k)).__code__  # one line: every instruction on it


def _linetable(units: int) -> bytes:
    """A location table (CPython >= 3.11, ``Objects/locations.md``) putting every one of ``units``
    code units on ``co_firstlineno`` without columns: entries of kind 13 (line delta, no columns)."""
    out = bytearray()
    while units > 0:
        n = min(units, 8)
        out += bytes((0x80 | (13 << 3) | (n - 1), 0))  # header (kind 13, n units), line delta 0
        units -= n
    return bytes(out)


# every stand-in's code object holds this very object as its location table: a frame runs a stand-in
# when its code's co_linetable *is* it (an identity test; hashing a code object costs ~0.5-1 µs)
_MARK: bytes = (_linetable(len(_TEMPLATE.co_code) // 2) if sys.version_info >= (3, 11)
                else _TEMPLATE.co_linetable)


def _code_for(code: CodeType, line: int) -> CodeType:
    if sys.version_info >= (3, 11):
        return _TEMPLATE.replace(co_filename=code.co_filename, co_name=code.co_name,
                                 co_qualname=code.co_qualname, co_firstlineno=line, co_linetable=_MARK)
    return _TEMPLATE.replace(co_filename=code.co_filename, co_name=code.co_name, co_firstlineno=line)


def _works() -> bool:
    """The stand-in's code reads as intended on this interpreter (one line, no columns)."""
    try:
        c = _code_for(_TEMPLATE, 12345)
        if {ln for _s, _e, ln in c.co_lines()} != {12345}:
            return False
        if sys.version_info >= (3, 11) and any(p != (12345, 12345, None, None) for p in c.co_positions()):
            return False
        return bool(FunctionType(c, {})(len, ((1,),), {}) == 1)
    except Exception:
        return False


ENABLED = _works()
# (id(code), instruction) -> (code, stand-in): the entry holds the code, so its id is not reused while
# the entry lives (hashing a code object hashes its constants: µs for a script's module code)
_standins: dict[tuple[int, int], tuple[CodeType, Any]] = {}
# the code of every handler that calls through stand-ins (CaptureMode.__torch_function__): register()
_handlers: set[int] = set()  # ids of their code objects (alive as long as their functions: always)
_NEST = 8  # stand-ins chained at most (re-entries nested deeper keep capture's frames above that)


def register(handler: Callable[..., Any]) -> None:
    """``handler`` (a Python function) calls the functions it intercepts through :func:`standin`."""
    _handlers.add(id(handler.__code__))


def _new(frame: FrameType, key: tuple[int, int]) -> Call:
    code = frame.f_code
    line = frame.f_lineno or code.co_firstlineno
    fn: Call = FunctionType(_code_for(code, line), frame.f_globals)
    new_program_code(fn.__code__)  # Dynamo: it calls the program's function (dynamo_marks)
    if len(_standins) >= _MAX:
        _standins.clear()
    _standins[key] = (code, fn)
    return fn


def standin_codes() -> list[CodeType]:
    """The code objects of the stand-ins made so far."""
    return [fn.__code__ for _code, fn in list(_standins.values())]


def _caller(frame: FrameType | None) -> FrameType | None:
    """The frame a handler entered from ``frame`` stands for: ``frame`` itself, or for a Python-level
    torch function the frame that called it."""
    if frame is not None and frame.f_code is _HANDLE:  # handle_torch_function <- the function <- caller
        back = frame.f_back
        frame = back.f_back if back is not None else None
    return frame


def _one(frame: FrameType) -> Any:
    key = (id(frame.f_code), frame.f_lasti)
    hit = _standins.get(key)
    if hit is None or hit[1].__globals__ is not frame.f_globals:
        return _new(frame, key)
    return hit[1]


def _hidden(frame: FrameType) -> FrameType | None:
    """When ``frame`` runs below a stand-in (a function capture re-entered), the frame that stand-in
    stands for; else ``None``."""
    back = frame.f_back
    if back is None or back.f_code.co_linetable is not _MARK:
        return None
    f = back.f_back
    for _ in range(_NEST + 4):  # the stand-in <- [stand-ins, the chain <-] [the Python handler <-] its handler
        if f is None:
            return None
        if id(f.f_code) in _handlers:
            return _caller(f.f_back)
        f = f.f_back
    return None


def standin(frame: FrameType | None) -> Call:
    """How a handler called from ``frame`` calls the function: through the caller's stand-in (a chain
    of them when the caller runs below one); directly while a trace or profile function is set on
    this thread (``sys.settrace``, a debugger, coverage, ``cProfile``): a tracer would see each
    stand-in as a call of a function of the program's file that the program never made."""
    if frame is None or not ENABLED or _gettrace() is not None or _getprofile() is not None:
        return plain
    code = frame.f_code
    if code is _HANDLE:  # a Python-level torch function: handle_torch_function <- the function <- caller
        back = frame.f_back
        frame = back.f_back if back is not None else None
        if frame is None:
            return plain
        code = frame.f_code
    key = (id(code), frame.f_lasti)
    hit = _standins.get(key)
    fn: Any = hit[1] if hit is not None else None
    if fn is None or fn.__globals__ is not frame.f_globals:
        fn = _new(frame, key)
    back = frame.f_back
    if back is None or back.f_code.co_linetable is not _MARK:
        return fn  # type: ignore[no-any-return]
    chain = [fn]  # the caller runs below a stand-in (capture re-entered it): innermost first
    outer = _hidden(frame)
    while outer is not None and len(chain) < _NEST:
        chain.append(_one(outer))
        outer = _hidden(outer)
    return _chained(chain)


def _chained(chain: list[Any]) -> Call:
    @runs_program
    def call(f: Callable[..., Any], a: Sequence[Any], k: Mapping[str, Any]) -> Any:
        for s in chain[:-1]:  # chain[-1](chain[-2], (... chain[0], (f, a, k) ...)): outermost runs first
            f, a, k = s, (f, a, k), {}
        return chain[-1](f, a, k)
    return call
