"""Call sites: the first user frame of a call, the digest of its stripped source line, the table.

A frame is *internal* when its code lives in torch, in opguard, in code PyTorch generates
(``torch.compile``'s inductor cache, FX ``<eval_with_key>`` modules) or in Python's import machinery;
a frame is *library* code when it lives in the standard library or in an installed third-party
package (``site-packages``/``dist-packages``: numpy, transformers, ...). The call site is the
innermost frame that is neither; when every frame is library code (a program installed as a
package), the innermost frame that is not internal. Classification is cached per code object and a
site per (code object, line), so the per-call cost is a short frame walk and two dict lookups.

A call made while torch rebuilds a tensor from its serialized form (``torch._utils._rebuild_*``:
``torch.load``, unpickling; ``torch.multiprocessing.reductions.rebuild_*``: a DataLoader worker's
batch arriving in the main process) has no call site for a record (``SiteTable.call_site``):
it computes nothing, and when it happens depends on when the batch arrives (docs/capture.md §3.5).
"""

from __future__ import annotations

import hashlib
import linecache
import os
import re
import sys
import sysconfig
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from types import CodeType, FrameType
from typing import Any

import torch

import opguard

_INTERNAL_DIRS = tuple(
    os.path.dirname(os.path.abspath(p)) + os.sep for p in (torch.__file__, opguard.__file__))
EMPTY_SHA = hashlib.sha256(b"").hexdigest()


def _library_dirs() -> tuple[str, ...]:
    dirs = set()
    for key in ("stdlib", "platstdlib", "purelib", "platlib"):
        try:
            p = sysconfig.get_paths()[key]
        except KeyError:
            continue
        dirs.add(os.path.abspath(p) + os.sep)
    for p in sys.path:
        if os.path.basename(p.rstrip(os.sep)) in ("site-packages", "dist-packages"):
            dirs.add(os.path.abspath(p) + os.sep)
    return tuple(sorted(dirs))


_LIBRARY_DIRS = _library_dirs()


def _file_kind(fn: str) -> int:
    """_INTERNAL, _LIBRARY or _USER for code in the file ``fn``."""
    if (fn.startswith(_INTERNAL_DIRS) or fn.startswith("<frozen ") or fn.startswith(_GENERATED)
            or f"{os.sep}torchinductor_" in fn):
        return _INTERNAL
    if fn.startswith(_LIBRARY_DIRS) or any(p in fn for p in _LIBRARY_PARTS):
        return _LIBRARY
    return _USER
# code PyTorch generates at run time (torch.compile's inductor output, FX graph modules): torch's own
_GENERATED = (*(p for p in (os.environ.get("TORCHINDUCTOR_CACHE_DIR"),) if p), "<eval_with_key>")
_LIBRARY_PARTS = (f"{os.sep}site-packages{os.sep}", f"{os.sep}dist-packages{os.sep}")
# torch's code that rebuilds tensors from their serialized form: file -> prefix of its functions' names
_REBUILDS = {os.path.join(_INTERNAL_DIRS[0], "_utils.py"): "_rebuild",
             os.path.join(_INTERNAL_DIRS[0], "multiprocessing", "reductions.py"): "rebuild_"}
_USER, _LIBRARY, _INTERNAL, _REBUILD, _FX = 0, 1, 2, 3, 4  # _REBUILD and _FX are internal too
_FX_FILE = "<eval_with_key>"  # an FX graph module's generated forward (torch.compile's eager backends, FX)
_TRACE_FRAME = re.compile(r'^\s*File "(.+)", line (\d+), in (.+)$', re.MULTILINE)


@dataclass(frozen=True)
class Site:
    id: int
    file: str
    line: int
    func: str
    src: str
    text: str

    def as_json(self) -> dict[str, Any]:
        return {"id": self.id, "file": self.file, "line": self.line, "func": self.func,
                "src": self.src, "text": self.text}


def source_digest(text: str) -> str:
    return hashlib.sha256(text.strip().encode("utf-8", "surrogatepass")).hexdigest()


UNKNOWN = Site(-1, "<unknown>", 0, "<unknown>", EMPTY_SHA, "")


_MAX_AT = 1 << 16  # sites by instruction kept (cleared when full: generated code can make many)


class SiteTable:
    """Every call site seen by this process, numbered in order of first appearance."""

    def __init__(self, rebuilds_recorded: bool = False) -> None:
        # Caches by code object are keyed by id(code), the entry holding the code (so the id is not
        # reused while the entry lives): hashing a code object hashes its constants, nested code
        # included: ~3 µs for a 100-line script's module code, ~10 µs at 300 lines, per lookup.
        self._internal: dict[int, int] = {}  # id(code) -> _USER, _LIBRARY, _INTERNAL, _REBUILD (internal too)
        self._held: list[CodeType] = []  # the code objects _internal's ids stand for
        # call_site(frame): lookup() for a recorded function call, None when torch's code that rebuilds
        # a tensor from its serialized form is on the way to the user frame (the call is not
        # recorded), unless rebuilds_recorded (record_noise). A partial: one Python frame per call.
        self.call_site: Callable[[FrameType | None], Site | None] = partial(
            self._walk, rebuilds=not rebuilds_recorded)
        self._sites: dict[tuple[int, int], tuple[CodeType, Site]] = {}  # (id(code), line)
        self._by_place: dict[tuple[str, int, str], Site] = {}
        # (id(code), instruction offset) of a user frame -> (code, its site): the line is not computed again
        self._at: dict[tuple[int, int], tuple[CodeType, Site]] = {}
        # (id(code), line) of an FX graph module's generated forward -> (code, the program's site or None)
        self._fx: dict[tuple[int, int], tuple[CodeType, Site | None]] = {}
        self.sites: list[Site] = []
        self.files: set[str] = set()
        self.dirty = False

    def _classify(self, code: CodeType) -> int:
        fn = code.co_filename
        kind = _file_kind(fn)
        if kind == _INTERNAL:
            if fn.startswith(_FX_FILE):
                return _FX
            prefix = _REBUILDS.get(fn)
            return _REBUILD if prefix is not None and code.co_name.startswith(prefix) else _INTERNAL
        return kind

    def lookup(self, frame: FrameType | None) -> Site:
        """The site of the innermost user frame at or above ``frame`` (else the innermost library frame)."""
        site = self._walk(frame, False)
        assert site is not None
        return site

    def _walk(self, frame: FrameType | None, rebuilds: bool) -> Site | None:
        if frame is not None:  # a user frame seen at this instruction before: its site (no line computed)
            hit = self._at.get((id(frame.f_code), frame.f_lasti))
            if hit is not None:
                return hit[1]
        kinds = self._internal
        fallback: FrameType | None = None
        while frame is not None:
            code = frame.f_code
            k = kinds.get(id(code))
            if k is None:
                k = kinds[id(code)] = self._classify(code)
                self._held.append(code)
            if not k:
                break
            if k == _LIBRARY and fallback is None:
                fallback = frame
            elif k == _REBUILD and rebuilds:
                return None
            elif k == _FX:
                site = self._fx_site(frame)
                if site is not None:
                    return site
            frame = frame.f_back
        if frame is None:
            frame = fallback
            if frame is None:
                return UNKNOWN
        code = frame.f_code
        key = (id(code), frame.f_lineno)
        known = self._sites.get(key)
        if known is None:
            site = self._new(code, frame.f_lineno)
            self._sites[key] = (code, site)
        else:
            site = known[1]
        if not kinds[id(code)]:  # a user frame: its site by instruction from now on
            if len(self._at) >= _MAX_AT:
                self._at.clear()
            self._at[(id(code), frame.f_lasti)] = (code, site)
        return site

    def _fx_site(self, frame: FrameType) -> Site | None:
        """The program's line of a call made by an FX graph module's generated code: the innermost
        program frame of the stack trace Dynamo recorded for the graph node (``node.meta
        ["stack_trace"]``, found through the module's generated-line map as Dynamo itself does);
        None without one (an FX module traced without stack traces: the walk goes on to the frame
        that called the module). Without it a ``torch.compile(backend="eager")`` function's calls
        all read as its ``def`` line, where Dynamo's frame stands."""
        code = frame.f_code
        key = (id(code), frame.f_lineno)
        hit = self._fx.get(key)
        if hit is not None:
            return hit[1]
        site = None
        try:
            gm = frame.f_locals.get("self")
            lines = getattr(gm, "_lineno_map", None)
            index = lines.get(frame.f_lineno - code.co_firstlineno) if isinstance(lines, dict) else None
            if index is not None:
                for i, node in enumerate(gm.graph.nodes):  # type: ignore[union-attr]
                    if i == index:
                        trace = node.meta.get("stack_trace")
                        site = self._innermost(trace) if isinstance(trace, str) else None
                        break
        except Exception:  # a generated module of another shape: the walk goes on
            site = None
        if len(self._fx) >= _MAX_AT:
            self._fx.clear()
        self._fx[key] = (code, site)
        return site

    def _innermost(self, trace: str) -> Site | None:
        """The site of the innermost program frame of a formatted stack trace (else library frame)."""
        found: dict[int, tuple[str, int, str]] = {}
        for m in _TRACE_FRAME.finditer(trace):
            kind = _file_kind(m.group(1))
            if kind in (_USER, _LIBRARY):
                found[kind] = (m.group(1), int(m.group(2)), m.group(3).strip())
        place = found.get(_USER) or found.get(_LIBRARY)
        return self._place(*place) if place is not None else None

    def here(self, depth: int = 1) -> Site:
        return self.lookup(sys._getframe(depth + 1))

    def _new(self, code: CodeType, line: int) -> Site:
        return self._place(code.co_filename, line, code.co_name)

    def _place(self, file: str, line: int, func: str) -> Site:
        place = (file, line, func)
        known = self._by_place.get(place)  # same place reached through another code object
        if known is not None:
            return known
        text = linecache.getline(file, line).strip() if line else ""
        site = Site(len(self.sites), file, line, func, source_digest(text), text)
        self._by_place[place] = site
        self.sites.append(site)
        self.files.add(file)
        self.dirty = True
        return site

    def as_json(self, rank: int) -> dict[str, Any]:
        return {"version": 1, "rank": rank, "sites": [s.as_json() for s in self.sites]}
