"""Call sites: the first user frame of a call, the digest of its stripped source line, the table.

A frame is *internal* when its code lives in torch, in opguard, or in Python's import machinery;
the call site is the innermost frame that is not. Classification is cached per code object and a
site per (code object, line), so the per-call cost is a short frame walk and two dict lookups.
"""

from __future__ import annotations

import hashlib
import linecache
import os
import sys
from dataclasses import dataclass
from types import CodeType, FrameType
from typing import Any

import torch

import opguard

_INTERNAL_DIRS = tuple(
    os.path.dirname(os.path.abspath(p)) + os.sep for p in (torch.__file__, opguard.__file__))
EMPTY_SHA = hashlib.sha256(b"").hexdigest()


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


class SiteTable:
    """Every call site seen by this process, numbered in order of first appearance."""

    def __init__(self) -> None:
        self._internal: dict[CodeType, bool] = {}
        self._sites: dict[tuple[CodeType, int], Site] = {}
        self._by_place: dict[tuple[str, int, str], Site] = {}
        self.sites: list[Site] = []
        self.files: set[str] = set()
        self.dirty = False

    def _is_internal(self, code: CodeType) -> bool:
        v = self._internal.get(code)
        if v is None:
            fn = code.co_filename
            v = fn.startswith(_INTERNAL_DIRS) or fn.startswith("<frozen ")
            self._internal[code] = v
        return v

    def lookup(self, frame: FrameType | None) -> Site:
        """The site of the innermost non-internal frame at or above ``frame``."""
        while frame is not None and self._is_internal(frame.f_code):
            frame = frame.f_back
        if frame is None:
            return UNKNOWN
        code = frame.f_code
        key = (code, frame.f_lineno)
        site = self._sites.get(key)
        if site is None:
            site = self._new(code, frame.f_lineno)
            self._sites[key] = site
        return site

    def here(self, depth: int = 1) -> Site:
        return self.lookup(sys._getframe(depth + 1))

    def _new(self, code: CodeType, line: int) -> Site:
        file = code.co_filename
        text = linecache.getline(file, line).strip() if line else ""
        place = (file, line, code.co_name)
        known = self._by_place.get(place)  # same place reached through another code object
        if known is not None:
            return known
        site = Site(len(self.sites), file, line, code.co_name, source_digest(text), text)
        self._by_place[place] = site
        self.sites.append(site)
        self.files.add(file)
        self.dirty = True
        return site

    def as_json(self, rank: int) -> dict[str, Any]:
        return {"version": 1, "rank": rank, "sites": [s.as_json() for s in self.sites]}
