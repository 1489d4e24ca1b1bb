"""One capture session per process: where records go, the bounded buffer, the digest cache, the cap.

The interception layers (``mode.py``, ``dispatch.py``, ``collectives.py``) call
:meth:`Session.begin` / :meth:`Session.outputs`; tensor work is queued on the device and fetched
with one stacked ``.cpu()`` per device, kind and dtype every ``buffer`` records (``docs/capture.md`` §8).
"""

from __future__ import annotations

import importlib
import json
import math
import os
import platform
import re
import socket
import sys
import time
import weakref
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import Any

import orjson
import torch

from opguard import __version__ as opguard_version
from opguard.capture import dumps, hostkernel, records
from opguard.capture.argnames import ArgNames
from opguard.capture.callsite import Site, SiteTable
from opguard.capture.claim import RUN_ENV, HeldByThisRun, holder, meta_of
from opguard.capture.digest import ALGORITHM, SAMPLE, Digester, finish, finish_moments, finish_stats, stats_row
from opguard.capture.dumps import DumpPolicy, matches
from opguard.capture.options import CaptureOptions
from opguard.capture.sourceindex import SourceIndex
from opguard.capture.wrappers import Wrappers
from opguard.errors import ConfigError
from opguard.staging.identity import process_identity
from opguard.staging.layout import (
    CAPTURE_CALLSITES_FILE,
    CAPTURE_META_FILE,
    CAPTURE_SOURCES_FILE,
    CAPTURE_TRACE_FILE,
    capture_dirname,
)
from opguard.staging.writers import JsonlWriter, open_jsonl, rank_dir, write_rank_file

SEGMENT_BYTES = 64 << 20
_Tensor, _Parameter, _STRIDED, _CPU = torch.Tensor, torch.nn.Parameter, torch.strided, torch.device("cpu")
_PLAIN = (_Tensor, _Parameter)
_tf_enabled = torch._C._is_torch_function_enabled  # False inside DisableTorchFunction(Subclass)
_any_autocast: Callable[[], bool] = getattr(torch._C, "_is_any_autocast_enabled", lambda: False)
_grad_on: Callable[[], bool] = torch.is_grad_enabled
_AUTOCAST_DEVICES = ("cpu", "cuda", "xpu")
_NO_SUBCLASS_TF = torch._C.DisableTorchFunctionSubclass  # tensor subclasses' __torch_function__ off
_DTYPE_NAMES = {d: str(d).removeprefix("torch.") for d in (
    torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int64, torch.int32, torch.int16, torch.int8,
    torch.uint8, torch.bool)}
CACHE_ENTRIES = 8192
try:  # the common tensor entry and the function mode's common call in C (_fastcall.c, docs/capture.md §3.11)
    _fastcall: Any = importlib.import_module("opguard.capture._fastcall")
except ImportError:  # not built (no C compiler at install time): the Python code alone
    _fastcall = None
_live: weakref.WeakSet[Session] = weakref.WeakSet()  # the sessions of this process, for the fork hooks


def _after_fork_in_child() -> None:
    for s in list(_live):
        s._forked_child()


def _after_fork_in_parent() -> None:
    for s in list(_live):
        s._forked_parent()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child, after_in_parent=_after_fork_in_parent)
ANY = object()  # an ``inflight`` entry matching its function with any arguments


def _dense(t: torch.Tensor) -> bool:
    """Non-overlapping and dense: the elements fill exactly ``numel`` consecutive memory slots
    starting at ``data_ptr`` (strides are never negative), whatever their order."""
    expect = 1
    for stride, size in sorted((st, sz) for sz, st in zip(t.shape, t.stride(), strict=True) if sz != 1):
        if stride != expect:
            return False
        expect *= size
    return True


def _coalesced(shape: Any, stride: Any) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """(sizes, strides) of the same logical element sequence with size-1 dimensions dropped and
    each dimension merged into the one before it where they step through memory as one
    (``stride[i] == stride[i+1] * size[i+1]``): every view with the same sequence of elements
    (``q.view(8, 64, 4, 16)`` of a slice ``q`` of shape (8, 64, 64), ``unsqueeze``, ``flatten``) has
    the same form."""
    sizes: list[int] = []
    strides: list[int] = []
    for size, step in zip(shape, stride, strict=True):
        if size == 1:
            continue
        if sizes and strides[-1] == step * size:
            sizes[-1] *= size
            strides[-1] = step
        else:
            sizes.append(size)
            strides.append(step)
    return tuple(sizes), tuple(strides)


def _element_set(sizes: tuple[int, ...], strides: tuple[int, ...]) -> tuple[tuple[int, ...], tuple[int, ...]] | None:
    """The coalesced form of the same elements in memory order (strides decreasing): every
    permutation of a view's dimensions (``transpose``, ``permute``) has the same one; ``None`` when
    elements repeat (a zero or repeated stride: ``expand``)."""
    if 0 in strides or len(set(strides)) != len(strides):
        return None
    order = sorted(range(len(strides)), key=lambda i: -strides[i])
    return _coalesced([sizes[i] for i in order], [strides[i] for i in order])


FUNCTORCH_REASON = "torch.func wrapper: no storage of its own"
ZERO_REASON = "efficient zero tensor: no memory (every element is zero)"
_is_functorch_wrapped = getattr(getattr(torch._C, "_functorch", None), "is_functorch_wrapped_tensor", None)
_is_batched = getattr(getattr(torch._C, "_functorch", None), "is_batchedtensor", None)


def _functorch_wrapper(t: torch.Tensor) -> bool:
    """A torch.func wrapper or a batched tensor (``vmap``; the legacy batching of ``is_grads_batched``
    and ``jacobian(vectorize=True)``): no storage of its own, nothing to digest or dump."""
    try:
        return bool((_is_functorch_wrapped is not None and _is_functorch_wrapped(t))
                    or (_is_batched is not None and _is_batched(t))
                    # the legacy batching's dispatch key, not in torch._C.DispatchKey: read from its printed set
                    or "Batched" in str(torch._C._dispatch_keys(t)))
    except Exception:
        return False


def _zero_tensor(t: torch.Tensor) -> bool:
    """An efficient zero tensor (forward-mode AD's zero tangent, ``torch._efficientzerotensor``): a
    shape without memory (its data pointer is null)."""
    try:
        with torch._C.DisableTorchFunction():
            return bool(t._is_zerotensor())
    except Exception:
        return False


def autocast_state() -> str | None:
    """``"cpu:bfloat16"`` (``"cpu:bfloat16,cuda:float16"``, ...): the devices autocast is on for now
    and the type it casts to there; None when it is on for none (docs/capture.md §3.1)."""
    on = []
    for dev in _AUTOCAST_DEVICES:
        try:
            if torch.is_autocast_enabled(dev):
                on.append(f"{dev}:{records.dtype_name(torch.get_autocast_dtype(dev))}")
        except (RuntimeError, TypeError, ValueError):  # a device type this build does not know
            continue
    return ",".join(on) or None


def _address(t: torch.Tensor) -> int | None:
    """The data pointer of a plain tensor with data; None for a tensor subclass, one without storage
    (sparse, a torch.func wrapper) or without elements (address 0): uninitialised-memory marks
    (§3.7) are kept by address, and such tensors have no memory of their own to mark."""
    if type(t) is not _Tensor and type(t) is not _Parameter:
        return None
    try:
        ptr = int(t.data_ptr())
    except (RuntimeError, NotImplementedError):
        return None
    return ptr or None


def _dtensor_local(t: torch.Tensor) -> torch.Tensor | None:
    """The local shard of a ``torch.distributed.tensor.DTensor`` (FSDP2, tensor parallel), else None."""
    cls = type(t)
    if cls.__name__ != "DTensor" or not cls.__module__.startswith("torch.distributed"):
        return None
    local = getattr(t, "_local_tensor", None)
    return local if isinstance(local, torch.Tensor) else None


def _span(t: torch.Tensor, base: torch.Tensor) -> tuple[int, int] | None:
    """The bytes ``[lo, hi)`` of ``base``'s memory that ``t`` (a view of it) covers, counted from
    ``base``'s first element, when ``t`` covers them densely (contiguous, with elements); else None."""
    try:
        n = t.numel()
        if not n or not t.is_contiguous():
            return None
        size = t.element_size()
        lo = (t.storage_offset() * size) - (base.storage_offset() * base.element_size())
        return (int(lo), int(lo + n * size)) if lo >= 0 else None
    except Exception:  # no storage (a wrapper subclass)
        return None


def _merged(spans: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """Byte ranges sorted and joined where they touch or overlap."""
    out: list[tuple[int, int]] = []
    for lo, hi in sorted(spans):
        if out and lo <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], hi))
        else:
            out.append((lo, hi))
    return out


def _region(t: torch.Tensor, ptr: int) -> int:
    """The address where ``t``'s storage starts (``ptr`` is ``t.data_ptr()``): the same for every alias
    of that memory — views at any offset, and ``p.data`` / ``detach()``, which have a version counter
    of their own (a write through ``p.data[i]`` leaves ``p._version`` as it was). Cache entries are
    grouped by it, so a recorded write through any alias drops every other cached content of the
    storage (:meth:`Session._wrote`)."""
    try:
        off = t.storage_offset()
        return ptr - int(off) * t.element_size() if off else ptr
    except Exception:  # no storage (a wrapper subclass): its own address
        return ptr


def _holds(t: torch.Tensor | None, ptr: Any) -> bool:
    """``t`` (a cached summary's tensor) is alive and still at ``ptr``: a tensor that lives on can
    lose its memory to another tensor (``Tensor.set_``, which no torch function mode sees; a
    storage resize), and then its cached content is not that memory's (§5.3)."""
    if t is None:
        return False
    try:
        return bool(t.data_ptr() == ptr)
    except Exception:  # a tensor without memory of its own now: not at ptr
        return False


def _NO_TENSOR() -> None:
    """The tensor of an uninitialised mark that has none (memory a storage resize grew, resized())."""
    return None


# a sealed record's placeholder for a value the flush fetches (Session._seal): a string no program
# argument or name holds (a NUL and this process's random tag), encoded by orjson as "\u0000og..."
_FILL = f"\x00og{os.urandom(6).hex()}:"
_FILL_BYTES = orjson.dumps(_FILL)[:-1]  # the JSON string's opening quote and text, no closing quote
_FILL_RE = re.compile(re.escape(_FILL_BYTES) + rb'(\d+[ds])"')


class _Ref(weakref.ref):  # type: ignore[type-arg]
    """A weak reference to a summarised tensor that knows its cache key and the tensor's id (no
    closure per entry); made as ``_Ref(t, callback)`` then ``.key`` and ``.tid`` set (no
    Python-level constructor: ~1 µs less)."""

    __slots__ = ("key", "tid")
    key: tuple[Any, ...] | None  # None: a same-object record's reference only (Session._known)
    tid: int


class _Summary:
    """Device-side results for one tensor content version (shared by every use of it)."""

    __slots__ = ("dead", "digest", "hex", "n", "ref", "region", "stats", "values")

    def __init__(self, digest: torch.Tensor | None, stats: torch.Tensor | None, n: int) -> None:
        self.ref: _Ref | None = None  # the tensor it was computed for (see _remember)
        self.digest = digest
        self.stats = stats
        self.n = n
        self.hex: str | None = None  # the printed digest, once known (shared by every later use)
        self.values: dict[str, Any] | None = None  # the JSON statistics, once known
        self.dead = False  # dropped from the cache (its tensor died, or a write made it stale)
        self.region = 0  # where its tensor's storage starts (_region): the group of _at it is in

    @property
    def has_digest(self) -> bool:
        return self.digest is not None or self.hex is not None

    @property
    def has_stats(self) -> bool:
        return self.stats is not None or self.values is not None


def _moments_json(mn: float, mx: float, total: float, squares: float, nonfinite: int, inf: int,
                  n: int) -> dict[str, Any]:
    """The JSON statistics of a kernel row; the all-finite case without :func:`records.json_float`."""
    if nonfinite:
        return _json_stats(finish_moments(mn, mx, total, squares, nonfinite, inf, n))
    mean = total / n
    if n > 1:
        var = (squares - total * total / n) / (n - 1)
        std = var ** 0.5 if var > 0.0 else 0.0
    else:
        std = 0.0
    if not (math.isfinite(mean) and math.isfinite(std)):  # an overflowing sum of finite elements
        return _json_stats(finish_moments(mn, mx, total, squares, nonfinite, inf, n))
    return {"min": mn, "max": mx, "mean": mean, "std": std, "absmax": max(abs(mn), abs(mx)),
            "nan": 0, "inf": 0}


_FINISH, _MOMENTS_JSON = finish, _moments_json  # what the native kernel's entry() computes


def _json_stats(st: dict[str, float | int]) -> dict[str, Any]:
    return {k: (records.json_float(x) if isinstance(x, float) else x) for k, x in st.items()}


class Call:
    """A record being built: the JSON dict plus the device results it waits for."""

    __slots__ = ("fills", "ids", "rec")

    def __init__(self, rec: dict[str, Any]) -> None:
        self.rec = rec
        self.fills: list[tuple[dict[str, Any], _Summary, bool]] = []
        # (ids of the tensor inputs, ids of the output tensors): kept only while a wrapper is watched
        self.ids: tuple[frozenset[int], frozenset[int]] | None = None


RESTART_ENV = "TORCHELASTIC_RESTART_COUNT"  # torchrun's attempt number (0: the first), set in its workers


def restart_count(env: Mapping[str, str]) -> int:
    """The torchrun attempt this process belongs to (0 without torchrun or on its first attempt)."""
    raw = env.get(RESTART_ENV, "").strip()
    if not raw:
        return 0
    if not (raw.isascii() and raw.isdigit()) or len(raw) > 9:
        raise ConfigError(f"{RESTART_ENV}={raw!r} is not a restart count (an integer >= 0)",
                          f"unset {RESTART_ENV}: torchrun sets it in the processes it starts")
    return int(raw)


_forward_ad = torch.autograd.forward_ad  # its _current_level: >= 0 while a dual level is open
_dispatch_modes = torch._C._len_torch_dispatch_stack  # TorchDispatchModes on the stack (Python key)
_pre_dispatch_modes: Any = torch._ops._len_torch_dispatch_stack_pre_dispatch  # make_fx(pre_dispatch=True)'s
_no_dispatch_modes: Any = torch.utils._python_dispatch._disable_current_modes


def _outside_modes(fn: Callable[..., Any], *args: Any) -> Any:
    """``fn(*args)`` with the program's TorchDispatchModes off the stack, when there are any:
    capture's own torch calls are never traced into its graph nor seen by its mode."""
    if _dispatch_modes() or _pre_dispatch_modes():
        with _no_dispatch_modes():
            return fn(*args)
    return fn(*args)


class Session:
    def __init__(self, options: CaptureOptions, env: dict[str, str] | None = None) -> None:
        environ = dict(os.environ) if env is None else env
        self.options = options
        self.who = process_identity(environ)  # the writers' and the launcher's resolver (docs/launcher.md §1)
        self.rank = self.who.rank
        self.restart = restart_count(environ)  # torchrun's restarted attempts each have their own directory
        self.dir = rank_dir(self.rank, environ) / capture_dirname(self.restart)
        if (self.dir / CAPTURE_META_FILE).exists():
            held = holder(self.dir / CAPTURE_META_FILE, environ)
            if held is not None:
                raise HeldByThisRun(held)
            if meta_of(self.dir / CAPTURE_META_FILE).get("pid") == os.getpid():  # an earlier capture() block here
                raise ConfigError(f"this process (pid {os.getpid()}) already captured into {self.dir} in an earlier "
                                  "capture() block; a rank's directory holds one capture",
                                  "keep one capture() block open over every part to capture (choose the steps with "
                                  "steps= or OPGUARD_CAPTURE_STEPS), or give a later block its own "
                                  "OPGUARD_TRACE_OUTPUT_BASE (docs/capture.md §1)")
            raise ConfigError(f"{self.dir} already holds a capture (meta.json): traces of two runs, or of two "
                              f"processes that both resolved to rank {self.rank}, would mix",
                              "use a new OPGUARD_TRACE_OUTPUT_BASE (or run ID) for every captured run; within one run, "
                              "give every captured process its own rank (RANK in its environment before capture "
                              "starts); a process that starts processes capturing themselves (torch.multiprocessing."
                              "spawn children calling opguard.capture) is not captured itself: run it under "
                              "opguard-run without --capture (docs/capture.md §1)")
        self.env = environ
        self.digester = Digester(options.digest)
        # CPU tensors: the native one-pass kernel (hostkernel.py), else the same PyTorch ops as on accelerators
        self.host = hostkernel.resolve(options.host_kernel, warn=self.who.local_rank == 0)
        self.host_digest = self.host is not None and options.digest == "full"
        # the kernel's one-call entry values (digest hex + statistics dict): exactly the host's finish()
        # and _moments_json(), done in C; None with a kernel built before it existed, and while either
        # host step is not the module's own (an instrumented or fault-injected one is honoured)
        own = globals()
        self.host_entry: Any = (getattr(self.host, "entry", None) if self.host_digest and own["finish"] is _FINISH
                                and own["_moments_json"] is _MOMENTS_JSON else None)
        # the kernel's in-place read of non-contiguous tensors (None: built before it existed)
        self.host_strided: Any = getattr(self.host, "strided", None) if self.host_digest else None
        # _entry_fast's common cases in C (same results; §3.11), while _entry_fast is this module's own
        self.c_entry: Any = _fastcall.entry if _fastcall is not None and options.fast_call else None
        # the same for a list of tensors at once (None: an extension built before it existed)
        self.c_entries: Any = getattr(self.c_entry and _fastcall, "entries", None)
        self.buffer = options.buffer  # records held before a flush (read per op)
        self.sites = SiteTable(rebuilds_recorded=options.record_noise)
        self.sources = SourceIndex()
        self.policy = DumpPolicy(options)
        self.select_all = not (options.functions or options.modules or options.contexts)
        self._max_bytes = options.max_bytes  # the cap, read once per record
        self.all_steps = options.steps.ranges is None  # every step selected (no StepSet call per op)
        self.seq = 0
        self.step = 0
        self.contexts: list[str] = []
        self.modules: list[str] = []
        self.parents: list[int] = []
        # ATen operators the program's own code (an exported program's module, an FX graph) called
        # at level=function, unrecorded there (mode.py): how many, and the first (a meta note)
        self.aten_unrecorded = 0
        self.aten_first: str | None = None
        # records begun and not written yet, in seq order: a finished op record with nothing left to
        # fill is kept encoded (bytes, _seal), the others as Call
        self.pending: list[Call | bytes] = []
        self._sealed = 0  # pending[:_sealed] was looked at by _seal
        # the summaries whose results sealed records wait for (the flush fetches them): the k-th one's
        # digest and statistics stand in those records as the strings _FILL + "<k>d" / "<k>s"
        self._fills: list[_Summary] = []
        self._batch: list[bytes] | None = None  # encoded records of the flush in progress, not yet written
        self._batch_ops = 0  # op records among them
        self._cache: dict[tuple[Any, ...], _Summary] = {}
        # storage start (_region) -> the cache keys of that storage's contents (dropped ones pruned lazily)
        self._at: dict[int, list[tuple[Any, ...]]] = {}
        # id(tensor) -> (weak ref, _version, data pointer, summary, dtype name, size, shape) of its last
        # finished entry: the same tensor object used again unchanged costs one lookup (_entry_fast)
        self._seen: dict[int, tuple[Any, int, int, _Summary, str, torch.Size, list[int]]] = {}
        self._dead = self._dead_entry  # one bound method for every weak reference's callback
        self.written = 0
        self._file_sizes: dict[str, int] = {}
        self._tables_bytes = 0
        self.records = 0
        self.dropped = 0
        self.cap_reached = False
        self.closed = False
        self.busy = 0  # > 0 while capture itself runs tensor work (the dispatch level ignores it)
        self.quiet: Any = None  # the Optimizer.step() recorded as one record while it runs (optim.OpenStep)
        # the aten op the dispatch level is recording while it runs (dispatch.AtenMode): its writes and
        # marks (§3.7) are that record's, not an unrecorded torch.ops call's (mode.CaptureMode.handle)
        self.aten_op: Any = None
        self.dispatch_level = options.level == "dispatch"
        self.waits: Any = None  # waits.AsyncWaits while capture runs: asynchronous collectives' works
        # forward-AD dual levels with a tangent of uninitialised memory attached (duals.py, §3.7)
        self.tainted_levels: set[Any] = set()
        # (function, first argument or ANY) of the calls being handled, innermost last: the function
        # mode's re-entries and the collective wrappers (mode.py, collectives.py)
        self.inflight: list[tuple[Any, Any]] = []
        self.wrappers = Wrappers(options.collapse_wrappers and options.nested)  # §3.10
        self.arg_names = ArgNames()  # positional parameter names of the recorded functions (§3.4)
        self.on_cap: list[Any] = []  # callables run when the cap stops interception
        self._failures: set[tuple[str, torch.dtype]] = set()  # summary failures already said on stderr
        self._stage_failures: dict[tuple[str, str], int] = {}  # (stage, exception type) -> count
        # outputs of uninitialised-memory ops not written since: data_ptr -> (weak ref, _version)
        self._uninit: dict[int, tuple[Callable[[], torch.Tensor | None], int | None]] = {}
        # base address -> (the marked base, byte ranges of it written whole since it was marked, §3.7)
        self._parts: dict[int, tuple[Callable[[], torch.Tensor | None], list[tuple[int, int]]]] = {}
        # storage start (_region) -> the tensor seen sharing that memory outside torch (numpy, DLPack):
        # its contents are never cached (shared())
        self._shared: dict[int, weakref.ref[torch.Tensor]] = {}
        # tensors pickled for another process (sent.py), marked shared at the next record's begin
        self.sent: list[weakref.ref[torch.Tensor]] = []
        self.step_source = "none"  # "marker" once step() was called, "optimizer" once Optimizer.step advanced it
        self.notes: list[str] = []
        self.ops_recorded = 0
        self.max_step = 0
        self.started_at = time.time()
        self.writer: JsonlWriter = open_jsonl(f"{self.dir.name}/{CAPTURE_TRACE_FILE}", rank=self.rank, env=environ,
                                                  rotate_bytes=SEGMENT_BYTES)
        self.pid = os.getpid()
        self.forks = 0  # processes forked from this one while capturing (not captured)
        self._write_meta(final=False)
        _live.add(self)

    def _forked_child(self) -> None:
        """In a process forked from this one (a DataLoader worker, ``os.fork``): record and write
        nothing. The trace file, tables and meta are the parent's; the child's records would
        interleave with its own under the same ``seq`` numbers. The mode stays on the child's stack
        and passes every call through."""
        self.closed = True
        self.pending = []
        self._sealed = 0
        self._fills = []
        self.quiet = None
        try:
            self.writer.close()  # the child's copy of the descriptor
        except OSError:
            pass

    def _forked_parent(self) -> None:
        if os.getpid() == self.pid and not self.closed:
            self.forks += 1
            self.note("processes forked from this rank while capturing (DataLoader workers with the fork start "
                      "method, os.fork) are not captured: their calls are not in this trace (docs/capture.md §11)")

    # ---- selection --------------------------------------------------------------------------
    @property
    def active(self) -> bool:
        return not self.cap_reached and not self.closed and (self.all_steps or self.step in self.options.steps)

    def selected(self, fn: str, module: str | None, context: str | None) -> bool:
        o = self.options
        if self.select_all:
            return True
        return matches(o.functions, fn) and matches(o.modules, module) and matches(o.contexts, context)

    @property
    def module(self) -> str | None:
        return self.modules[-1] if self.modules else None

    @property
    def context(self) -> str | None:
        return "/".join(self.contexts) if self.contexts else None

    # ---- tensor work --------------------------------------------------------------------------
    def summarize(self, t: torch.Tensor, want_stats: bool, *, fresh: bool = False) -> _Summary | str:
        """Queue digest (+ statistics) of ``t`` on its device, reusing the cached result of this
        exact content version; a string is the reason there is no data to summarise.

        A contiguous tensor is keyed by its memory range (address, element count, dtype, device,
        version) rather than its shape: its logical element sequence *is* that range, so every
        contiguous view of it (``view``, ``reshape``, ``flatten``, ...) has the same digest and
        statistics. A non-contiguous but dense tensor (e.g. a transpose) covers the same elements
        as the range it spans: its statistics (order-independent) are reused from that range's
        entry, only its digest (logical order) is computed."""
        reason = records.plain_data_reason(t)
        if reason is not None:
            return reason
        n = t.numel()
        contiguous = t.is_contiguous()
        version: object
        try:
            version = t._version
        except RuntimeError:  # an inference tensor: no version counter, so never served from the cache
            version = object()
            fresh = True
        if contiguous:
            key: tuple[Any, ...] = (t.data_ptr(), n, t.dtype, t.device, version)
        else:
            key = (t.data_ptr(), *_coalesced(t.shape, t.stride()), t.dtype, t.device, version)
        conj, neg = t.is_conj(), t.is_neg()
        if conj or neg:  # a lazy conjugate/negative view: another content than its memory holds
            key = (*key, conj, neg)
        if want_stats and fresh and self._at:  # a write (an input object as output, §5.3): see _wrote
            region = _region(t, key[0])
            if region in self._at:
                self._wrote(region, key)
        s = None if fresh or n == 0 else self._lookup(key)
        if s is not None and (not want_stats or s.has_stats):
            return s
        if s is None and n and contiguous and self.host_digest and t.is_cpu and not (conj or neg):
            code = hostkernel.CODES.get(t.dtype)
            if code is not None:
                return self._fast_host(t, key, n, code if want_stats else None)
        # the statistics of the memory range it spans serve a dense non-contiguous tensor, not a lazy view
        range_stats = not contiguous and not fresh and not (conj or neg)
        if self.dispatch_level and _forward_ad._current_level >= 0 and not (self.host is not None and t.is_cpu):
            # PyTorch-ops path below autograd (level=dispatch) inside a forward-mode AD level: its
            # out= kernels on such tensors crashed the process (segfault; docs/capture.md §5.2)
            return "forward-mode AD below autograd: not summarised on the PyTorch-ops path"
        self.busy += 1
        try:
            # outside the program's TorchDispatchModes (a tracer: make_fx, and torch.func.linearize
            # through it; a FlopCounterMode; capture's own dispatch level): never traced into its
            # graph nor seen by its mode (before, the torch path's hashing ops were in make_fx's graph)
            run = self._summarize_host if self.host is not None and t.is_cpu else self._summarize
            out: _Summary | str = _outside_modes(run, t, key, s, n, want_stats and bool(n), range_stats)
            return out
        finally:
            self.busy -= 1

    def _fast_host(self, t: torch.Tensor, key: tuple[Any, ...], n: int, code: int | None) -> _Summary:
        """The common case of :meth:`_summarize_host`: a contiguous real CPU tensor of an element type
        the kernel reads, not seen before: one kernel call on its memory, no copy, no dispatch."""
        kernel: Any = self.host  # not None: the caller checked host_digest
        S, row = kernel.summary(t.data_ptr(), n * t.element_size(), -1 if code is None else code, True,
                                   code is not None)
        out = _Summary(None, None, n)
        out.hex = finish(S, n)
        if row is not None:
            mn, mx, total, squares, nonfinite, inf = row
            out.values = _moments_json(mn, mx, total, squares, nonfinite, inf, n)
        self._remember(key, out, t)
        return out

    def _summarize_host(self, t: torch.Tensor, key: tuple[Any, ...], s: _Summary | None, n: int,
                        want_stats: bool, range_stats: bool) -> _Summary:
        """``_summarize`` for a CPU tensor with the native kernel: digest and statistics known at
        once (nothing to fetch), one read of the data; a non-contiguous tensor is read in place by the
        kernel's strided path (a contiguous copy first where it cannot)."""
        prev = torch.is_grad_enabled()
        torch._C._set_grad_enabled(False)
        try:
            count = self.digester.count(t)
            digest = s.digest if s is not None else None
            hexed = s.hex if s is not None else None
            st: torch.Tensor | None = None
            values: dict[str, Any] | None = None
            if want_stats and range_stats and _dense(t):
                same = self._lookup((t.data_ptr(), n, t.dtype, t.device, t._version))
                if same is not None:
                    st, values = same.stats, same.values
            need_stats = want_stats and st is None and values is None
            native_digest = s is None and self.host_digest
            if s is None and not native_digest and self.digester.compute is not None:
                digest = self.digester.compute(t)  # sample / xor modes: the PyTorch-ops digest
            if native_digest or need_stats:
                code = hostkernel.CODES.get(t.dtype) if need_stats else None
                got = hostkernel.summary_strided(self.host, t, native_digest, code) if (
                    not need_stats or code is not None) else None
                if got is not None:  # read in place, no contiguous copy
                    S, row = got
                else:
                    d = hostkernel.host_data(t)
                    code = hostkernel.CODES.get(d.dtype) if need_stats else None
                    if need_stats and code is None:
                        st = stats_row(d)  # an element type the kernel does not read (float8, uint16, ...)
                    S, row = hostkernel.summary(self.host, d, native_digest, code) if (
                        native_digest or code is not None) else (None, None)
                if S is not None:
                    hexed = finish(S, count)
                if row is not None:
                    mn, mx, total, squares, nonfinite, inf = row
                    values = _json_stats(finish_moments(mn, mx, total, squares, nonfinite, inf, count))
        finally:
            torch._C._set_grad_enabled(prev)
        out = _Summary(digest, st, count)
        out.hex = hexed
        out.values = values
        if n:
            self._remember(key, out, t)
        return out

    def _summarize(self, t: torch.Tensor, key: tuple[Any, ...], s: _Summary | None, n: int,
                   want_stats: bool, range_stats: bool) -> _Summary:
        prev = torch.is_grad_enabled()
        torch._C._set_grad_enabled(False)
        try:
            d = t  # grad mode is off: no graph is built, no detach (one dispatch) needed
            digest = None
            if s is not None:
                digest = s.digest
            elif self.digester.compute is not None:
                digest = self.digester.compute(d)
            st = None
            if want_stats:
                if range_stats and _dense(t):
                    same = self._lookup((t.data_ptr(), n, t.dtype, t.device, t._version))
                    st = same.stats if same is not None else None
                if st is None:
                    st = stats_row(d)
        finally:
            torch._C._set_grad_enabled(prev)
        hexed = s.hex if s is not None else None
        s = _Summary(digest, st, self.digester.count(d))
        s.hex = hexed
        if n:
            self._remember(key, s, t)
        return s

    def _lookup(self, key: tuple[Any, ...]) -> _Summary | None:
        """The cached summary of ``key`` while the tensor it was computed for is alive: that tensor
        holds the memory, so the address cannot have been reused by another tensor. A dead entry
        (normally already dropped by its callback) is stale: the memory may hold a new tensor at
        the same address and version."""
        s = self._cache.get(key)
        if s is None or s.ref is None or not _holds(s.ref(), key[0]):
            return None
        return s

    def _remember(self, key: tuple[Any, ...], s: _Summary, t: torch.Tensor) -> None:
        """Cache ``s`` under ``key`` while ``t`` is alive: the entry is dropped when ``t`` dies
        (bounded memory: only live tensors' entries stay; at most CACHE_ENTRIES, oldest first)."""
        try:
            ref = _Ref(t, self._dead)
        except TypeError:
            return  # not weakly referenceable: never reused
        ref.key = key
        ref.tid = id(t)
        s.ref = ref
        s.region = region = _region(t, key[0])
        if self._shared and region in self._shared:  # memory others can write: read again at every use
            s.dead = True
            return
        cache = self._cache
        old = cache.get(key)
        if old is not None and old is not s:  # content re-read at this key (a write): the old one is stale
            old.dead = True  # for every same-object record holding it (_seen)
        cache[key] = s
        at = self._at.get(region)  # the keys of this storage: may hold dropped ones, pruned here
        if at is None:
            at_all = self._at
            if len(at_all) > 4 * CACHE_ENTRIES:  # storages of dead tensors only: rebuilt from the cache
                self._at = at_all = {}
                for k, known in cache.items():
                    at_all.setdefault(known.region, []).append(k)
            at_all[region] = [key]
        else:
            at.append(key)
            n = len(at)
            if n > 8 and not n & (n - 1):  # pruned at 16, 32, 64, ... keys: amortised O(1) per key (a
                at[:] = [k for k in at if k in cache]  # storage's views all alive stay listed)
        if len(cache) > CACHE_ENTRIES:
            self._forget(next(iter(cache)))  # the oldest entry (dicts keep insertion order)

    def _forget(self, key: tuple[Any, ...]) -> None:
        self._cache.pop(key).dead = True

    def _wrote(self, region: int, key: tuple[Any, ...]) -> None:
        """A recorded write landed in the storage starting at ``region`` (content version ``key``):
        every other cached content of that storage is stale. Views share their base's
        version counter, so a write through one changes every key anyway; this catches writes
        through an alias with a counter of its own, at any offset (``p.data.mul_(...)``,
        ``p.data[i].fill_(...)``, ``p.data[i] = v``, which leave ``p._version`` as it was)."""
        at = self._at.get(region)
        if at is not None:
            cache = self._cache
            for k in at:
                if k != key:
                    s = cache.pop(k, None)
                    if s is not None:
                        s.dead = True
            self._at[region] = [key] if key in cache else []

    def _mark_sent(self) -> None:
        sent = self.sent
        while sent:
            t = sent.pop()()
            if t is not None:
                try:
                    self.shared(t)
                except Exception as err:
                    self.failed("recording", err)

    def shared(self, t: Any) -> None:
        """``t`` now shares its memory with something outside torch (a numpy array, a DLPack consumer),
        which can write it without a version change: its storage's cached contents are dropped, and
        nothing in it is cached again (every use is digested from memory). Bounded: dead tensors'
        storages are pruned, the oldest go first."""
        ptr = _address(t) if isinstance(t, torch.Tensor) else None
        if ptr is None:
            return
        region = _region(t, ptr)
        try:
            self._shared[region] = weakref.ref(t)
        except TypeError:
            return
        self._drop_storage(region)
        if len(self._shared) > CACHE_ENTRIES:
            self._shared = {r: ref for r, ref in self._shared.items() if ref() is not None}
            while len(self._shared) > CACHE_ENTRIES:
                del self._shared[next(iter(self._shared))]

    def written_unrecorded(self, values: list[Any]) -> None:
        """The tensors in ``values`` were written by a call that is not recorded (a ``torch.ops``
        custom operator writing its ``out`` arguments: FSDP2's ``fsdp::split_with_sizes_copy`` fills
        the unsharded parameters, under ``_unsafe_preserve_version_counter``, so no version moves):
        their storages' cached contents are dropped and their uninitialised marks cleared (§3.7,
        §5.3): the next use is digested from memory, as a result."""
        for value in values:
            for t in ([value] if isinstance(value, torch.Tensor) else
                      [v for v in value if isinstance(v, torch.Tensor)] if isinstance(value, (list, tuple)) else []):
                ptr = _address(t)
                if ptr is None:
                    continue
                region = _region(t, ptr)
                self._uninit.pop(region, None)
                self._uninit.pop(ptr, None)
                self._drop_storage(region)

    def partly_written(self, t: torch.Tensor, whole: bool, pending: int = 0) -> None:
        """A recorded call wrote ``t``, uninitialised memory until then (§3.7): all of it (``whole``:
        ``copy_``, ``fill_``, ``out=``, ``t[:] = v``) or only some elements (``t[i] = v``,
        ``index_copy_``, ...). What was not written is still whatever the allocator left: unless the
        call wrote all of the marked tensor itself, the mark stays on it (``t``, or the tensor ``t``
        is a view of), moved to its version after this write. (A write through a view of the first
        row cleared the mark of the whole buffer, and a partial write's ``self`` was digested with
        its unwritten rows: identical runs compared with false divergences.) ``pending``: version
        bumps still to come for this write (an aten op seen at ``level=dispatch``, below autograd,
        which moves the version counter after the op returns)."""
        base = t._base if t._base is not None else t
        ptr = _address(base)
        if ptr is None:
            return
        mark = self._uninit.get(ptr)
        if mark is not None and mark[1] is None:  # memory a storage resize grew: marked whatever is there
            return
        if whole and base is t:
            self._uninit.pop(ptr, None)
            self._parts.pop(ptr, None)
            return
        if whole and mark is not None and mark[0]() is base:  # a dense view written whole: that part
            span = _span(t, base)  # of the base is a result now (PowerSGD writes its views of one
            if span is not None:  # torch.empty buffer one by one: the written ones read as unwritten)
                held = self._parts.get(ptr)
                parts = _merged([*(held[1] if held is not None and held[0]() is base else []), span])
                if base.is_contiguous() and parts == [(0, base.numel() * base.element_size())]:
                    self._uninit.pop(ptr, None)  # every byte of the base written
                    self._parts.pop(ptr, None)
                    return
                self._parts[ptr] = (mark[0], parts)
                while len(self._parts) > CACHE_ENTRIES:
                    del self._parts[next(iter(self._parts))]
        try:
            self._uninit[ptr] = (weakref.ref(base), base._version + pending)
        except (TypeError, RuntimeError):  # not weakly referenceable; an inference tensor
            return
        while len(self._uninit) > CACHE_ENTRIES:  # bounded: the oldest marks go first
            del self._uninit[next(iter(self._uninit))]

    def _rewrote_part(self, t: torch.Tensor) -> bool:
        """``t``, a recorded op's output, is a view in a part of a marked base already written whole:
        the op wrote result memory again (``q.div_(norm)`` after ``q.copy_(...)``), which moved the
        counter the base's views share; the mark keeps the rest unwritten, at the new version. (Before,
        such a write at the base's own address ended the whole base's mark, and the never-written
        views of the buffer were digested: PowerSGD.)"""
        found = self._base_mark(t)
        if found is None:
            return False
        base, ptr, mark = found
        if mark[1] is None or mark[0]() is not base:
            return False
        if not self._written_part(t, base, ptr):
            return False
        try:
            self._uninit[ptr] = (mark[0], base._version)
        except RuntimeError:  # an inference tensor
            return False
        return True

    def _written_part(self, t: torch.Tensor, base: torch.Tensor, ptr: int) -> bool:
        """``t`` lies in the parts of the marked ``base`` (at ``ptr``) written whole since it was marked."""
        held = self._parts.get(ptr)
        if held is None or held[0]() is not base:
            return False
        span = _span(t, base)
        return span is not None and any(lo <= span[0] and span[1] <= hi for lo, hi in held[1])

    def resized(self, old: int, new: int, old_bytes: int, new_bytes: int) -> None:
        """A storage was resized (``UntypedStorage.resize_``, which capture's mode does not see: FSDP2
        frees its unsharded parameters' memory with ``resize_(0)`` while the parameter objects live
        on, and re-allocates it before the next all-gather). Its old memory (``old``) may now hold
        another tensor, and its new memory (``new``) whatever the allocator left: the cached contents
        of both are dropped (a cached entry is otherwise served while its tensor lives, which this
        one does), and memory grown from nothing is uninitialised until something writes it (a mark
        with no tensor and no version, cleared by the first write there, §3.7)."""
        for region in {old, new} - {0}:
            self._drop_storage(region)
            self._uninit.pop(region, None)
        if new and new_bytes and not old_bytes:
            self._uninit[new] = (_NO_TENSOR, None)
            while len(self._uninit) > CACHE_ENTRIES:  # bounded: the oldest marks go first
                del self._uninit[next(iter(self._uninit))]

    def storage_copied(self, dest: int, src: int) -> None:
        """A storage's bytes were copied from another's (``UntypedStorage.copy_``, run unrecorded):
        what capture cached for the destination is stale, and it holds uninitialised memory exactly
        when the source did (marked at its start)."""
        if not dest:
            return
        self._drop_storage(dest)
        self._uninit.pop(dest, None)
        mark = self._uninit.get(src) if src else None
        if mark is not None and (mark[1] is None or mark[0]() is not None):
            self._uninit[dest] = (_NO_TENSOR, None)

    def _drop_storage(self, region: int) -> None:
        """Drop every cached content of the storage starting at ``region`` (and mark it stale for the
        same-object records holding it): its next use is digested from memory."""
        for k in self._at.pop(region, None) or ():
            s = self._cache.pop(k, None)
            if s is not None:
                s.dead = True

    def rebound(self, t: Any, other: Any = None) -> None:
        """``t.data = other`` gives ``t`` another memory, layout or element type with its version
        unchanged: its same-object record (§5.3, which compares version, address and shape, not
        strides or dtype: ``w.data = w.data.T`` of a square ``w``) no longer describes it, and
        neither do the cached contents of its old memory: ``m.half(); m.float()`` puts the rounded
        weight back at the old address with the old version, and the entry (still alive: it refers
        to ``t``) was served for it."""
        self._seen.pop(id(t), None)
        ptr = _address(t) if isinstance(t, torch.Tensor) else None
        if ptr is None:
            return
        self._drop_entries_of(t, _region(t, ptr))
        # t.data = torch.empty_like(t) (module.to_empty(), a materialised meta module): t now holds
        # uninitialised memory, under its own version counter (a parameter's is not 0): the mark
        # moves to t (§3.7)
        if not isinstance(other, torch.Tensor):
            return
        optr = _address(other)
        mark = self._uninit.get(optr) if optr is not None else None
        if optr is not None and mark is not None and mark[0]() is other:
            try:
                if other._version == mark[1]:
                    self._uninit[optr] = (weakref.ref(t), t._version)
            except RuntimeError:  # an inference tensor: no version counter
                pass

    def release(self, t: Any) -> None:
        """Drop every weak reference capture holds to ``t`` (its cache entries, its same-object record,
        its uninitialised and shared marks): ``torch.utils.swap_tensors`` refuses a tensor that has
        weak references, and so does ``nn.Module._apply`` when it swaps parameters. The entries go;
        records already made keep their values."""
        if not isinstance(t, torch.Tensor):
            return
        hit = self._seen.pop(id(t), None)
        if hit is not None and hit[3].ref is not None and hit[3].ref() is t:
            hit[3].ref = None
        ptr = _address(t)
        if ptr is None:
            return
        region = _region(t, ptr)
        self._drop_entries_of(t, region)
        for at in (ptr, region):
            mark = self._uninit.get(at)
            if mark is not None and mark[0]() is t:
                del self._uninit[at]
        shared = self._shared.get(region)
        if shared is not None and shared() is t:
            del self._shared[region]

    def _drop_entries_of(self, t: torch.Tensor, region: int) -> None:
        """Drop the cached contents of the storage at ``region`` that were computed for ``t`` (their
        weak references to ``t`` go with them)."""
        cache = self._cache
        for k in list(self._at.get(region) or ()):
            s = cache.get(k)
            if s is not None and s.ref is not None and s.ref() is t:
                del cache[k]
                s.dead = True
                s.ref = None

    def _dead_entry(self, ref: _Ref) -> None:
        """A summarised tensor died: its cache entry, its storage's list of keys when no other is
        cached, and its same-object record go with it (kept, they would pile up to ``CACHE_ENTRIES``
        each: live objects that Python's collector walks, docs/capture.md §3.12). A weak reference's
        callback: a failure here would be printed by Python as an ignored exception, so it is
        capture's own, contained like any other."""
        try:
            self._drop_dead(ref)
        except Exception as err:
            self.failed("recording", err)

    def _drop_dead(self, ref: _Ref) -> None:
        key = ref.key
        s = self._cache.get(key) if key is not None else None
        if key is not None and s is not None and s.ref is ref:  # not an entry re-made since for another tensor
            self._forget(key)
            at_all = self._at
            at = at_all.get(s.region)
            if at is not None:  # the storage's keys still cached (none when it died with the tensor)
                cache = self._cache
                kept = [k for k in at if k in cache]
                if kept:
                    at_all[s.region] = kept
                else:
                    del at_all[s.region]
        seen = self._seen
        hit = seen.get(ref.tid)
        if hit is not None and hit[0] is ref:
            del seen[ref.tid]

    def _entry_fast(self, call: Call, slot: str, t: torch.Tensor, output: bool, fresh: bool) -> dict[str, Any] | None:
        """:meth:`entry` for the common case in one frame: a plain, contiguous, non-empty CPU tensor
        of an element type the native kernel reads (digest ``full``). Same cache key and results as
        :meth:`summarize`; ``None`` when the general path must decide."""
        if not output and not fresh:  # the same tensor object, unchanged since its last entry
            hit = self._seen.get(id(t))
            if hit is not None:
                ref, version, at, known, dn, size, shape = hit
                # t.data = ... can change the data pointer or (a view of the same memory) the shape
                # while _version stays
                if (ref() is t and not known.dead and t._version == version and t.data_ptr() == at
                        and t.shape == size):
                    return {"slot": slot, "dtype": dn, "shape": shape, "device": "cpu", "digest": known.hex}
        tt = type(t)
        if tt is not _Tensor and tt is not _Parameter:  # a subclass: the general path (read as a Tensor, entry())
            return None
        dtype = t.dtype
        code = hostkernel.CODES.get(dtype)  # None for quantized element types too (no is_quantized read)
        if (code is None or not t.is_cpu or t.layout is not _STRIDED
                or t.is_neg()):
            return None
        if not t.is_contiguous():
            return self._entry_strided(slot, t, output, fresh, dtype, code)
        n = t.numel()
        if not n:
            return None
        try:
            version = t._version
        except RuntimeError:  # an inference tensor: the general path
            return None
        ptr = t.data_ptr()
        key = (ptr, n, dtype, _CPU, version)
        if output and fresh and self._at:  # a write (an input object as output); a view op writes nothing
            region = _region(t, ptr)
            if region in self._at:
                self._wrote(region, key)
        s = None if fresh else self._cache.get(key)
        if s is not None and (s.ref is None or not _holds(s.ref(), ptr)):  # self._lookup(key), inline
            s = None
        if s is None:  # self._fast_host(t, key, n, code if output else None), inline
            s = _Summary(None, None, n)
            native = self.host_entry
            if native is not None:  # digest and statistics finished by the kernel, one call
                s.hex, row = native(ptr, n, code, output)
                if row is not None:
                    if type(row) is dict:
                        s.values = row
                    else:  # a non-finite element or overflowing moments: the general formula
                        mn, mx, total, squares, nonfinite, inf = row
                        s.values = _json_stats(finish_moments(mn, mx, total, squares, nonfinite, inf, n))
            else:
                kernel: Any = self.host  # not None: the caller checked host_digest
                S, row = kernel.summary(ptr, n * t.element_size(), code if output else -1, True, output)
                s.hex = finish(S, n)
                if row is not None:
                    mn, mx, total, squares, nonfinite, inf = row
                    s.values = _moments_json(mn, mx, total, squares, nonfinite, inf, n)
            self._remember(key, s, t)
        elif output and not s.has_stats:
            return None
        hexed, values = s.hex, s.values
        if hexed is not None and (values is not None or not output):  # known now: written in, no fill
            return self._known(slot, t, s, dtype, t.shape, version, ptr, output)
        e: dict[str, Any] = {"slot": slot, "dtype": _DTYPE_NAMES.get(dtype) or records.dtype_name(dtype),
                             "shape": list(t.shape), "device": "cpu", "digest": None}
        if s.digest is None and hexed is None:
            e["reason"] = "digest mode none"
        if output:
            e["stats"] = None
        call.fills.append((e, s, output))
        return e

    def _entry_strided(self, slot: str, t: torch.Tensor, output: bool, fresh: bool, dtype: torch.dtype,
                       code: int) -> dict[str, Any] | None:
        """:meth:`_entry_fast` for a non-contiguous plain CPU tensor (a transpose, a split's part): the
        kernel reads it in place (``strided``). Same cache key, reuse of the spanned range's
        statistics and values as :meth:`summarize` / :meth:`_summarize_host`; ``None`` when the
        general path must decide (a kernel without ``strided``, a non-finite sum, a cached entry
        without the statistics an output needs)."""
        strided = self.host_strided
        n = t.numel()
        if strided is None or not n:
            return None
        try:
            version = t._version
        except RuntimeError:  # an inference tensor: the general path
            return None
        ptr = t.data_ptr()
        size = t.shape
        stride = t.stride()
        sizes, steps = _coalesced(size, stride)
        key = (ptr, sizes, steps, dtype, _CPU, version)
        if output and fresh and self._at:  # a write (an input object as output); a view op writes nothing
            region = _region(t, ptr)
            if region in self._at:
                self._wrote(region, key)
        s = None if fresh else self._cache.get(key)
        if s is not None and (s.ref is None or not _holds(s.ref(), ptr)):
            s = None
        if s is None:
            values = None
            want = output
            if output and not fresh:  # its elements were summarised in another order: their statistics
                if _dense(t):  # the range it spans
                    same = self._lookup((ptr, n, dtype, _CPU, version))
                else:  # a permutation of another view's dimensions (a transpose of a slice)
                    other = _element_set(sizes, steps)
                    same = (self._lookup((ptr, *other, dtype, _CPU, version))
                            if other is not None and other != (sizes, steps) else None)
                if same is not None:
                    if same.stats is not None:
                        return None
                    values = same.values
                    want = values is None
            got = strided(ptr, t.element_size(), tuple(size), stride, code if want else -1, True, want)
            if got is None:  # a non-finite sum: the NaN/Inf counts come from the copy
                return None
            S, row = got
            s = _Summary(None, None, n)
            s.hex = finish(S, n)
            if row is not None:
                mn, mx, total, squares, nonfinite, inf = row
                s.values = _json_stats(finish_moments(mn, mx, total, squares, nonfinite, inf, n))
            else:
                s.values = values
            self._remember(key, s, t)
        if s.hex is None or (output and s.values is None):
            return None
        return self._known(slot, t, s, dtype, size, version, ptr, output)

    def _known(self, slot: str, t: torch.Tensor, s: _Summary, dtype: torch.dtype, size: torch.Size, version: int,
               ptr: int, output: bool) -> dict[str, Any]:
        """The entry of a CPU tensor whose summary is known now (digest, and statistics for an output:
        nothing to fill at the flush), and ``t``'s same-object record for its next use as an input."""
        dn = _DTYPE_NAMES.get(dtype) or records.dtype_name(dtype)
        shape = list(size)
        e: dict[str, Any] = {"slot": slot, "dtype": dn, "shape": shape, "device": "cpu", "digest": s.hex}
        if output:
            e["stats"] = s.values
        seen = self._seen
        if len(seen) >= CACHE_ENTRIES:
            seen.clear()
        ref = s.ref
        if ref is None or ref() is not t:  # the summary is another tensor's (an alias at the same key)
            ref = _Ref(t, self._dead)  # its death drops this record (_dead_entry)
            ref.key = None
            ref.tid = id(t)
        seen[id(t)] = (ref, version, ptr, s, dn, size, shape)
        return e

    def entry(self, call: Call, slot: str, t: torch.Tensor, output: bool, *, fresh: bool = False,
              uninitialized: bool = False) -> dict[str, Any]:
        if type(t) not in _PLAIN and _tf_enabled():
            # a tensor subclass: capture reads it as a Tensor, never through its __torch_function__
            # (capture's reads are not the program's calls: a subclass that counts or logs them, §11)
            with _NO_SUBCLASS_TF():
                return self.entry(call, slot, t, output, fresh=fresh, uninitialized=uninitialized)
        if output and self._uninit and not uninitialized:
            if self._unwritten_view(t):  # a view of unwritten memory (view, chunk, ...): still unwritten
                uninitialized = True
            else:
                ptr = _address(t)
                if ptr is not None and not self._rewrote_part(t):
                    self._uninit.pop(ptr, None)  # a recorded op wrote this memory: its content is a result now
        if self.host_digest and not uninitialized and (output or not self._uninit or not self._still_uninitialized(t)):
            try:
                c = self.c_entry
                fast = (c(self, call, slot, t, output, fresh) if c is not None and type(self)._entry_fast is _ENTRY_FAST
                        else NotImplemented)
                if fast is NotImplemented:
                    fast = self._entry_fast(call, slot, t, output, fresh)
            except Exception:  # the general path below says what failed
                fast = None
            if fast is not None:
                return fast
        if not uninitialized:
            local = _dtensor_local(t)
            if local is not None:  # a DTensor: its local shard's digest and statistics, the global shape
                shard = self.entry(call, slot, local, output, fresh=fresh)
                shard["shape"] = list(t.shape)
                shard["local_shape"] = list(local.shape)
                shard["placements"] = [str(p) for p in getattr(t, "placements", ())]
                return shard
        e: dict[str, Any]
        if t.is_nested and t.layout == torch.strided:  # no single shape (nor one memory block to digest)
            e = {"slot": slot, "dtype": records.dtype_name(t.dtype), "shape": None,
                 "device": records.device_name(t.device), "digest": None, "reason": "nested tensor"}
            if output:
                e["stats"] = None
            return e
        e = {"slot": slot, "dtype": records.dtype_name(t.dtype), "shape": list(t.shape),
             "device": records.device_name(t.device), "digest": None}
        if uninitialized or (self._uninit and not output and self._still_uninitialized(t)):
            e["uninitialized"] = True  # its content is whatever the allocator left: never summarised
            e["reason"] = "uninitialized memory"
            if output:
                e["stats"] = None
                self._mark_uninitialized(t)
            return e
        try:
            s: _Summary | str = self.summarize(t, output, fresh=fresh)
        except Exception as err:  # capture's own tensor work must never break the program: say so instead
            s = self._summary_failed(err, t)
        if isinstance(s, str):
            e["reason"] = s
            if output:
                e["stats"] = None
            return e
        if not s.has_digest:
            e["reason"] = "digest mode none"
        if output:
            e["stats"] = None
        call.fills.append((e, s, output))
        return e

    def written_marked(self, call: Call, slot: str, t: torch.Tensor, whole: bool, below_autograd: bool = False
                       ) -> dict[str, Any]:
        """The output entry of ``t``, uninitialised memory until ``call`` wrote it, in whole (``whole``)
        or in part; what is left unwritten of its base stays marked (§3.7). ``below_autograd``: an aten
        op (``level=dispatch``) seen before autograd moves the version counter once it returns."""
        pending = 0
        if below_autograd:
            try:
                pending = 1 if t._version >= 0 else 0
            except RuntimeError:  # an inference tensor: no version counter to move
                pending = 0
        if not whole:
            e = self.entry(call, slot, t, True, uninitialized=True)
        else:  # the view's content is a result: digested, its base's mark set aside meanwhile (at level
            base = t._base if t._base is not None else t  # dispatch the aten write already moved it on)
            ptr = _address(base)
            mark = self._uninit.pop(ptr, None) if ptr is not None else None
            e = self.entry(call, slot, t, True, fresh=True)
            if mark is not None and ptr is not None and base is not t:
                self._uninit[ptr] = mark
        self.partly_written(t, whole, pending)
        return e

    def _mark_uninitialized(self, t: torch.Tensor) -> None:
        ptr = _address(t)
        if ptr is None:
            return
        held = self._uninit.get(ptr)
        if held is not None and held[1] is None:
            return  # memory a storage resize grew: marked for any tensor there, until something writes it
        if held is not None and held[0]() is not None and t._base is held[0]():
            return  # a view at its base's address: the base's mark covers it (and outlives it)
        if t._base is None and self._covered(t, ptr):
            return  # a view made below autograd (level=dispatch), which sets its _base only once the op returns
        if t._base is not None and self._unwritten_view(t):
            return  # a view at an offset of a marked base, in a part not written: the base's mark covers it
            # (a mark of its own ended at the first write through any sibling view: the counter is shared)
        try:
            self._parts.pop(ptr, None)
            self._uninit[ptr] = (weakref.ref(t), t._version)
        except (TypeError, RuntimeError):  # not weakly referenceable; an inference tensor (no version counter)
            return
        while len(self._uninit) > CACHE_ENTRIES:  # bounded: the oldest marks go first
            del self._uninit[next(iter(self._uninit))]

    def _covered(self, t: torch.Tensor, ptr: int) -> bool:
        """``t`` lies in the storage of another live tensor marked at its storage's start and not
        written since (its base, seen by the aten level before autograd made ``t`` its view)."""
        region = _region(t, ptr)
        held = self._uninit.get(region)
        if held is None or held[1] is None:
            return False
        other = held[0]()
        if other is None or other is t:
            return False
        try:
            return (other._version == held[1]
                    and other.untyped_storage().data_ptr() == t.untyped_storage().data_ptr())
        except (RuntimeError, NotImplementedError):  # an inference tensor; no storage
            return False

    def _still_uninitialized(self, t: torch.Tensor) -> bool:
        """``t`` is (a view at the same address of) an uninitialised output not written since: the
        same version counter value (views share their base's counter)."""
        ptr = _address(t)
        if ptr is None:
            return False
        hit = self._uninit.get(ptr)
        if hit is None:
            return self._unwritten_view(t)
        ref, version = hit
        if version is None:  # memory a storage resize grew from nothing (resized()): any tensor there
            return True
        base = ref()
        if base is None:
            # The factory's own tensor object is gone, but its memory may live on in another tensor
            # sharing its storage and version counter (``nn.Parameter(torch.empty(...))``): still
            # unwritten while that counter is unchanged. Memory freed and reused at this address by a
            # recorded op is not confused with it: a recorded output clears its address (entry()).
            try:
                return t._version == version
            except RuntimeError:  # an inference tensor at that address
                return False
        try:
            if base._version != version:
                del self._uninit[ptr]
                return False
            return t._version == version and not self._written_part(t, base, ptr)
        except RuntimeError:  # an inference tensor at that address
            return False

    def _base_mark(self, t: torch.Tensor) -> tuple[torch.Tensor, int, tuple[Any, int | None]] | None:
        """``t``'s base, its address and the mark held there; None when ``t`` is no view or its base
        is not marked."""
        try:
            base = t._base
        except RuntimeError:
            return None
        if base is None:
            return None
        ptr = _address(base)
        mark = self._uninit.get(ptr) if ptr is not None else None
        if ptr is None or mark is None:
            return None
        return base, ptr, mark

    def _unwritten_view(self, t: torch.Tensor) -> bool:
        """``t`` is a view (any offset: ``narrow``, ``chunk``, ``view``) of an uninitialised output
        that nothing wrote since: its base is that output, alive, with the version it was marked at
        (views share their base's counter, so a write through any of them moves it)."""
        found = self._base_mark(t)
        if found is None:
            return False
        base, ptr, (ref, version) = found
        if version is None:  # memory a storage resize grew from nothing (resized())
            return True
        try:
            return ref() is base and base._version == version and not self._written_part(t, base, ptr)
        except RuntimeError:  # an inference tensor
            return False

    def failed(self, stage: str, err: BaseException, call: Call | None = None) -> None:
        """Capture's own work failed at ``stage`` (``recording``, ``digest``, ``statistics``,
        ``writing``): the program continues as without capture; the record (when there is one) says
        what failed in ``capture_error``; stderr says it once per stage and exception type; the
        rank's meta notes count them."""
        msg = f"{stage}: {type(err).__name__}: {err}"[:300]
        if call is not None:
            call.rec.setdefault("capture_error", msg)
        key = (stage, type(err).__name__)
        n = self._stage_failures.get(key, 0)
        self._stage_failures[key] = n + 1
        if n == 0:
            what = ("the records that failed were dropped (meta.json 'dropped' counts them)" if stage == "writing"
                    else "affected records carry 'capture_error'")
            print(f"opguard capture: rank {self.rank}: capture's own {stage} failed ({msg}); the program "
                  f"continues unchanged, {what} (said once per stage and kind)", file=sys.stderr, flush=True)

    def _summary_failed(self, err: Exception, t: torch.Tensor) -> str:
        """The entry's ``reason`` when digesting/summarising a tensor raised; said on stderr once per
        kind of failure (exception type and dtype), every entry keeps the reason."""
        if _functorch_wrapper(t):  # inside torch.func's vmap / grad: a wrapper without storage of its own
            self.note("tensors inside torch.func transforms (vmap, grad, jacrev, ...) are wrappers without storage "
                      "of their own: their entries have no digest or statistics (reason 'torch.func wrapper')")
            return FUNCTORCH_REASON
        if _zero_tensor(t):
            self.note("efficient zero tensors (forward-mode AD's zero tangents, level=dispatch) hold no memory: their "
                      "entries have no digest or statistics (reason 'efficient zero tensor')")
            return ZERO_REASON
        reason = f"summary failed: {type(err).__name__}: {err}"[:300]
        key = (type(err).__name__, t.dtype)
        if key not in self._failures:
            self._failures.add(key)
            print(f"opguard capture: rank {self.rank}: summarising a {records.dtype_name(t.dtype)} tensor on "
                  f"{records.device_name(t.device)} failed ({reason}); such entries are recorded without digest "
                  "and statistics (their 'reason' says why) and the program continues", file=sys.stderr, flush=True)
        return reason

    # ---- records ------------------------------------------------------------------------------
    def begin(self, api: str, fn: str, site: Site, *, phase: str = "forward",
              where: tuple[str | None, str | None] | None = None) -> Call:
        """A new record; ``where`` is (module, context) when the caller has them already."""
        if self.sent:  # pickled for another process since the last record: shared memory now
            self._mark_sent()
        seq = self.seq
        self.seq += 1
        parents = self.parents
        module, context = (self.module, self.context) if where is None else where
        rec: dict[str, Any] = {
            "v": records.VERSION, "kind": "op", "seq": seq, "step": self.step, "rank": self.rank, "api": api, "fn": fn,
            "file": site.file, "line": site.line, "func": site.func, "src": site.src, "site": site.id,
            "module": module, "context": context, "depth": len(parents),
            "parent": parents[-1] if parents else None, "phase": phase, "inputs": [], "outputs": []}
        if _any_autocast():  # the type autocast runs this call in: evidence as an argument is (§3.1)
            ac = autocast_state()
            if ac is not None:
                rec["autocast"] = ac
        if not _grad_on():  # no_grad / inference_mode: an evaluation pass, told apart by compare (§3.1)
            rec["grad"] = False
        call = Call(rec)
        self.pending.append(call)
        return call

    def drop(self, call: Call) -> bool:
        """Forget ``call``, the last record begun (a conversion that returned its input): it is not
        written and its ``seq`` is given to the next record. A record with records begun after it
        is kept (False)."""
        pending = self.pending
        if pending and pending[-1] is call and self.seq == call.rec["seq"] + 1:
            pending.pop()
            self.seq -= 1
            if self._sealed > len(pending):
                self._sealed = len(pending)
            return True
        return False

    def inputs(self, call: Call, tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        ins = call.rec["inputs"]
        if self._entries_at_once(call, tensors, False, False, ins):
            return
        for slot, t in tensors:
            ins.append(self.entry(call, slot, t, False))

    def outputs(self, call: Call, tensors: Iterable[tuple[str, torch.Tensor]], *, fresh: bool = False,
                uninitialized: bool = False) -> None:
        outs = call.rec["outputs"]
        if not uninitialized and self._entries_at_once(call, tensors, True, fresh, outs):
            return
        for slot, t in tensors:
            outs.append(self.entry(call, slot, t, True, fresh=fresh, uninitialized=uninitialized))

    def _entries_at_once(self, call: Call, tensors: Iterable[tuple[str, torch.Tensor]], output: bool, fresh: bool,
                         into: list[dict[str, Any]]) -> bool:
        """The entries of a list of tensors (an optimizer step's ~100) made by one call into C
        (``_fastcall.entries``: what :meth:`entry` does for each, its Python frame left out), where
        :meth:`entry` would go straight to its fast path: the host kernel digesting and none of the
        tensors (a view of) memory marked uninitialised (§3.7; it says NotImplemented, having done
        nothing, otherwise). False: not taken, or it raised (nothing added: :meth:`entry` per tensor
        then does the same work again, from the cache, and raises where it did)."""
        many = self.c_entries
        if many is None or not self.host_digest or type(tensors) is not list or len(tensors) < 2:
            return False
        try:
            made = many(self, call, tensors, output, fresh)
        except Exception:
            return False
        if made is NotImplemented:
            return False
        into.extend(made)
        return True

    def maybe_flush(self) -> None:
        """At the end of an intercepted call: with no record open, the finished records are sealed
        and, once the buffer holds ``buffer`` records, written."""
        if self.parents:
            return
        if self._sealed < len(self.pending):
            self._seal()
        if len(self.pending) >= self.options.buffer:
            self.flush()

    def _seal(self) -> None:
        """Encode the finished op records now rather than at the flush: the same bytes, written at the
        same flush, but a record's dicts and lists die at once instead of living up to ``buffer``
        records. Kept, they outlived Python's young collections and were promoted to the oldest
        generation, whose growth sets off a full collection of every object in the process
        (docs/capture.md §3.12). A record that waits for device results (or a summary the native
        kernel did not finish) is encoded with a placeholder string in each such digest and
        statistics; the flush puts the values in (:meth:`_unseal`)."""
        pending = self.pending
        encode = records.encode
        for i in range(self._sealed, len(pending)):
            c = pending[i]
            if type(c) is not Call or c.rec["kind"] != "op":
                continue
            fills = c.fills
            try:
                if not fills:
                    pending[i] = encode(c.rec)
                    continue
                base = len(self._fills)
                for j, (e, _s, output) in enumerate(fills):
                    e["digest"] = f"{_FILL}{base + j}d"
                    if output:
                        e["stats"] = f"{_FILL}{base + j}s"
                try:
                    line = records.encode_strict(c.rec)  # orjson only: the values go in as orjson writes them
                finally:
                    for e, _s, output in fills:
                        e["digest"] = None
                        if output:
                            e["stats"] = None
                self._fills.extend(s for _e, s, _o in fills)
                pending[i] = line
            except Exception:  # kept as it is: the flush drops it and says why
                pass
        self._sealed = len(pending)

    def maybe_flush_contained(self) -> None:
        """:meth:`maybe_flush` at the end of an intercepted call: a failure is capture's own (said
        once per kind, the records counted as dropped), never the program's."""
        try:
            self.maybe_flush()
        except Exception as err:
            self.failed("writing", err)

    def dump(self, seq: int, tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        with _NO_SUBCLASS_TF():  # tensor subclasses read as Tensors (see entry())
            self._dump(seq, tensors)

    def _dump(self, seq: int, tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        for slot, t in tensors:
            if records.plain_data_reason(t) is not None or _functorch_wrapper(t):  # nothing of its own to save
                continue
            self.busy += 1
            try:
                data = _outside_modes(dumps.serialize, t)
            finally:
                self.busy -= 1
            if not self._account(len(data)):
                return
            rec = dumps.write_dump(self.rank, seq, slot, data, self.env, self.dir.name)
            self._write_line(records.encode(rec), accounted=False)

    # ---- fetching and writing -----------------------------------------------------------------
    def flush(self) -> None:
        """Fetch every queued digest and statistics row (one stacked copy per device and kind), write."""
        if not self.pending:
            return
        calls, self.pending = self.pending, []
        self._sealed = 0
        self.busy += 1
        try:
            _outside_modes(self._flush, calls)  # its torch.stack never in the program's graph or mode
        except Exception as err:  # never into the program: these records are lost, said on stderr and in meta
            self.dropped += sum(1 for c in calls if isinstance(c, bytes) or c.rec.get("kind") == "op")
            self.failed("writing", err)
        finally:
            self.busy -= 1

    def _flush(self, pending: list[Call | bytes]) -> None:
        calls = [c for c in pending if type(c) is Call and c.fills]
        sealed, self._fills = self._fills, []
        digests: dict[int, int] = {}
        rows: dict[int, list[float]] = {}
        self._fetch([s.digest for s in sealed if s.digest is not None and s.hex is None]
                    + [s.digest for c in calls for _, s, _ in c.fills if s.digest is not None and s.hex is None],
                    digests, ints=True)
        self._fetch([s.stats for s in sealed if s.stats is not None and s.values is None]
                    + [s.stats for c in calls for _, s, o in c.fills if o and s.stats is not None and s.values is None],
                    rows, ints=False)
        if sealed:
            pending = self._unseal(pending, sealed, digests, rows)
        for c in calls:
            for e, s, output in c.fills:
                h = s.hex
                if h is None and s.digest is not None:
                    h = s.hex = finish(digests[id(s.digest)], s.n)
                if h is not None:
                    e["digest"] = h
                if output:
                    v = s.values
                    if v is None and s.stats is not None:
                        v = s.values = _json_stats(finish_stats(rows[id(s.stats)], s.n))
                    if v is not None:
                        e["stats"] = v
        # the encoded records go out with one write() per flush (JsonlWriter.write_lines), in order;
        # the cap is decided per record exactly as record by record (the cap record follows the last
        # record that fitted: _reach_cap writes the batch first)
        batch: list[bytes] = []
        self._batch = batch
        encode = records.encode
        try:
            for item in pending:
                if self.cap_reached:
                    self.dropped += 1
                    continue
                if isinstance(item, bytes):  # an op record sealed when it finished (_seal)
                    line, op = item, True
                else:
                    try:
                        line = encode(item.rec)
                    except Exception as err:  # this record only (a value JSON cannot hold): the others are written
                        self.dropped += 1
                        self.failed("writing", err)
                        continue
                    op = item.rec["kind"] == "op"
                if not self._account(len(line), item):
                    self.dropped += 1
                    continue
                batch.append(line)
                if op:
                    self._batch_ops += 1
            self._write_batch()
        finally:
            self._batch = None
            self._batch_ops = 0
        self._write_tables()

    @staticmethod
    def _unseal(pending: list[Call | bytes], sealed: list[_Summary], digests: dict[int, int],
                rows: dict[int, list[float]]) -> list[Call | bytes]:
        """The sealed records with their placeholders replaced by the fetched values, encoded as the
        flush encodes them (a digest string or null; the statistics object, or null)."""
        values: dict[bytes, bytes] = {}
        dumps_ = orjson.dumps
        for k, s in enumerate(sealed):
            h = s.hex
            if h is None and s.digest is not None:
                h = s.hex = finish(digests[id(s.digest)], s.n)
            values[b"%dd" % k] = dumps_(h)
            v = s.values
            if v is None and s.stats is not None:
                v = s.values = _json_stats(finish_stats(rows[id(s.stats)], s.n))
            values[b"%ds" % k] = dumps_(v)

        def put(m: re.Match[bytes]) -> bytes:
            return values[m.group(1)]

        sub = _FILL_RE.sub
        return [sub(put, c) if type(c) is bytes and _FILL_BYTES in c else c for c in pending]

    def _write_batch(self) -> None:
        """Write the records collected by the flush in progress (counted once written)."""
        batch = self._batch
        if batch:
            ops = self._batch_ops
            self._batch, self._batch_ops = [], 0
            self.writer.write_lines(batch)
            self.records += len(batch)
            self.ops_recorded += ops

    @staticmethod
    def _fetch(tensors: list[torch.Tensor], out: dict[Any, Any], ints: bool) -> None:
        by_dev: dict[tuple[torch.device, torch.dtype], list[torch.Tensor]] = {}
        seen: set[int] = set()
        for t in tensors:
            if id(t) not in seen:
                seen.add(id(t))
                by_dev.setdefault((t.device, t.dtype), []).append(t)
        for group in by_dev.values():
            values = torch.stack(group).cpu().tolist()  # the one host transfer per device, kind, dtype
            for t, v in zip(group, values, strict=True):
                out[id(t)] = int(v) if ints else v

    def _account(self, nbytes: int, record: Call | bytes | None = None) -> bool:
        """Count ``nbytes`` against the cap; ``False`` (the cap reached, now or before) when they do
        not fit. ``record``: the record they are (its ``step`` and ``seq`` are the cap's)."""
        if self.cap_reached:
            return False
        if self.written + self._tables_bytes + nbytes > self._max_bytes:
            self._reach_cap(record)
            return False
        self.written += nbytes
        return True

    def _write_line(self, line: bytes, accounted: bool = True) -> None:
        if accounted and not self._account(len(line)):
            self.dropped += 1
            return
        self.writer.write_line(line)

    def _reach_cap(self, record: Call | bytes | None = None) -> None:
        """Stop recording: the ``cap`` record (``seq`` and ``step``: of ``record``, the first record
        not written, so that ``seq`` stays contiguous; the capture's current ones for a dump or
        table) and the message on stderr."""
        self.cap_reached = True
        step, seq = self.step, self.seq
        try:
            rec = orjson.loads(record) if isinstance(record, bytes) else record.rec if record is not None else None
            if rec is not None:
                step, seq = rec["step"], rec["seq"]
        except Exception:  # the capture's current ones
            pass
        msg = (f"opguard capture: rank {self.rank} reached the size cap OPGUARD_CAPTURE_MAX_MB="
               f"{self.options.max_mb:g} MiB at step {step} (seq {seq}); no further records are "
               f"written for this rank (trace: {self.dir}). Raise OPGUARD_CAPTURE_MAX_MB or select fewer "
               "steps/functions (OPGUARD_CAPTURE_STEPS, OPGUARD_CAPTURE_FUNCTIONS)")
        print(msg, file=sys.stderr, flush=True)
        cap = {"v": records.VERSION, "kind": "cap", "seq": seq, "step": step, "rank": self.rank,
               "limit_bytes": self.options.max_bytes, "written_bytes": self.written, "message": msg}
        self._write_batch()  # the records before the cap record, when the cap is reached in a flush
        self.writer.write_line(records.encode(cap))
        for cb in self.on_cap:
            cb()

    def _write_atomic(self, name: str, obj: dict[str, Any]) -> None:
        data = json.dumps(obj, indent=1, allow_nan=False).encode() + b"\n"
        write_rank_file(f"{self.dir.name}/{name}", data, rank=self.rank, env=self.env)
        self._file_sizes[name] = len(data)
        self._tables_bytes = sum(self._file_sizes.values())

    def _write_tables(self) -> None:
        if self.sites.dirty:
            self.sites.dirty = False
            self._write_atomic(CAPTURE_CALLSITES_FILE, self.sites.as_json(self.rank))
            if self.sources.add(self.sites.files):
                self._write_atomic(CAPTURE_SOURCES_FILE, self.sources.as_json(self.rank))
        if self.arg_names.dirty and not self.closed:  # new names: in meta.json now, a run killed later keeps them
            self.arg_names.dirty = False
            self._write_meta(final=False)

    def _write_meta(self, final: bool) -> None:
        meta = {
            "schema": records.SCHEMA, "version": records.VERSION, "opguard": opguard_version,
            "arg_forms": records.ARG_FORMS, "run": self.env.get(RUN_ENV), "rank": self.rank,
            "world_size": self.who.world_size, "local_rank": self.who.local_rank,
            "pid": os.getpid(), "host": socket.gethostname(), "started_at": self.started_at,
            "ended_at": time.time() if final else None, "torch": torch.__version__,
            "python": platform.python_version(), "level": self.options.level,
            "digest": {"mode": self.options.digest, "algorithm": ALGORITHM if self.options.digest in ("full", "sample")
                       else ("torch.hash_tensor" if self.options.digest == "xor" else None), "sample": SAMPLE},
            "host_kernel": "native" if self.host is not None else "torch",
            "options": self.options.as_json(), "records": self.records, "segments": self.writer.segment + 1,
            "cap_reached": self.cap_reached, "dropped": self.dropped,
            "trace": f"{self.dir.name}/{CAPTURE_TRACE_FILE}", "restart": self.restart,
            "step_source": self.step_source, "notes": self.notes + self._failure_notes(),
            "fast_path_off": [],  # kept for readers: fused.py keeps modules on their fast path
            "record_noise": self.options.record_noise}
        if self.wrappers.found:
            meta["collapsed_wrappers"] = self.wrappers.found
        names = self.arg_names.as_json()
        if names:
            meta["arg_names"] = names
        self._write_atomic(CAPTURE_META_FILE, meta)

    def _failure_notes(self) -> list[str]:
        return [f"capture's own {stage} failed {n} time(s) with {kind}; the program ran unchanged "
                + ("(those records were dropped: 'dropped')" if stage == "writing" else "(records carry capture_error)")
                for (stage, kind), n in sorted(self._stage_failures.items())]

    def note(self, text: str, *, warn: bool = False) -> None:
        """A human-readable note in this rank's meta (and on stderr with ``warn``)."""
        if text not in self.notes:
            self.notes.append(text)
            if warn:
                print(f"opguard capture: rank {self.rank}: warning: {text}", file=sys.stderr, flush=True)

    def advance(self, source: str, n: int | None = None) -> None:
        """Set (``n``) or advance the step; write the ``step`` record (``source``: marker, optimizer)."""
        if source == "marker":
            self.step_source = "marker"
        elif self.step_source == "none":
            self.step_source = "optimizer"
        self.step = self.step + 1 if n is None else n
        self.max_step = max(self.max_step, self.step)
        if not self.cap_reached and not self.closed:
            self.pending.append(Call({"v": records.VERSION, "kind": "step", "seq": self.seq, "step": self.step,
                                      "rank": self.rank, "source": source}))
            self.maybe_flush()

    def _selection_notes(self) -> None:
        """A selection that matched nothing by the end of the run: a warning and a note, never a
        silent empty trace."""
        if self.ops_recorded or self.cap_reached:
            return
        o = self.options
        chosen = [f"{var}={val}" for var, val, on in (
            ("OPGUARD_CAPTURE_STEPS", str(o.steps), o.steps.ranges is not None),
            ("OPGUARD_CAPTURE_FUNCTIONS", ",".join(o.functions), bool(o.functions)),
            ("OPGUARD_CAPTURE_MODULES", ",".join(o.modules), bool(o.modules)),
            ("OPGUARD_CAPTURE_CONTEXTS", ",".join(o.contexts), bool(o.contexts))) if on]
        if not chosen:
            self.note("this process recorded no operation: a program that does its work in processes it starts "
                      "itself (torch.multiprocessing.spawn, multiprocessing.Process) is not captured there; those "
                      "processes start capture themselves (opguard.capture.capture(), docs/capture.md §1)", warn=True)
            return
        how = {"marker": "set by opguard.capture.step()", "optimizer": "advanced at each Optimizer.step()",
               "none": "no opguard.capture.step() call and no Optimizer.step(): every call was step 0",
               }[self.step_source]
        self.note(f"the selection {' '.join(chosen)} matched no call: this trace holds no op record "
                  f"(steps seen 0-{self.max_step}, {how})", warn=True)

    def close(self) -> None:
        if self.closed:
            return
        try:
            if self.quiet is not None:
                self.quiet.abandon()
            self.parents.clear()
            self.flush()
            self._compile_notes()
            self._selection_notes()
            self.writer.write_line(records.encode({"v": records.VERSION, "kind": "end", "rank": self.rank,
                                                   "records": self.records, "cap_reached": self.cap_reached}))
            self.arg_names.dirty = False  # the final meta.json below holds them: not written twice
            self._write_tables()
            if self.sources.add(self.sites.files) or not (self.dir / CAPTURE_SOURCES_FILE).exists():
                self._write_atomic(CAPTURE_SOURCES_FILE, self.sources.as_json(self.rank))
            if not (self.dir / CAPTURE_CALLSITES_FILE).exists():
                self._write_atomic(CAPTURE_CALLSITES_FILE, self.sites.as_json(self.rank))
            self._write_meta(final=True)
        finally:
            self.closed = True
            self.writer.close()
            # nothing of the program's tensors is held after the end (weak references included:
            # torch.utils.swap_tensors refuses a tensor that has any)
            for s in self._cache.values():
                s.ref = None
            for held in (self._cache, self._at, self._seen, self._uninit, self._parts, self._shared):
                held.clear()
            self.wrappers.clear()

    def _compile_notes(self) -> None:
        if self.aten_unrecorded:
            self.note(f"{self.aten_unrecorded} call(s) of ATen operators (torch.ops.aten.*) made by the program's own "
                      f"code ran unrecorded at level=function (the first: {self.aten_first}): an exported program's "
                      "module (torch.export(...).module()), an FX graph or a pipeline stage computes so; a "
                      "difference computed there shows first where a recorded call uses its result; "
                      "OPGUARD_CAPTURE_LEVEL=dispatch records them")
        dyn = sys.modules.get("torch._dynamo.utils")
        counters = getattr(dyn, "counters", None)
        try:
            graphs = int(counters["stats"]["unique_graphs"]) if counters is not None else 0
        except Exception:
            graphs = 0
        if graphs:
            self.note(f"torch.compile: {graphs} compiled graph(s) ran in this process; the calls inside compiled "
                      "code are not recorded one by one (capture is invisible to Dynamo): only the calls around "
                      "them and the library kernels compiled code calls (e.g. torch.addmm), at the compiled "
                      "module's call site; a backend='eager' graph's calls are recorded, at their own lines")
        try:  # TorchScript (torch.jit.script / trace): functions of the process's compilation unit,
            unit: Any = torch.jit._state._python_cu  # but PyTorch's own (forward AD scripts its decompositions
            scripted = sum(1 for f in unit.get_functions()  # for jvp: part of the recorded op, like a kernel)
                           if not str(f.qualified_name).startswith("__torch__.torch."))
        except Exception:
            scripted = 0
        if scripted:
            self.note(f"torch.jit: {scripted} TorchScript function(s) (scripted or traced) exist in this process; "
                      "their calls run as TorchScript graphs and are not recorded (only the calls around them): a "
                      "difference computed inside one shows first where a recorded call uses its result")

    @property
    def path(self) -> Path:
        return self.dir


_ENTRY_FAST = Session._entry_fast  # what the C entry stands in for (a replaced _entry_fast is honoured)
if _fastcall is not None:
    _fastcall.configure_entry(records, _Tensor, _Parameter, sys.modules[__name__], hostkernel, _ENTRY_FAST, _Summary,
                              _Ref, _CPU, _STRIDED)
