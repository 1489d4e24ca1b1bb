"""``UntypedStorage.resize_`` under capture (``docs/capture.md`` §3.7, §5.3).

A storage resize frees or moves a tensor's memory without any call capture's function mode sees,
while the tensor object lives on: FSDP2 frees its unsharded parameters with
``untyped_storage().resize_(0)`` after each forward and backward and re-allocates them with
``resize_(n)`` before the next all-gather. Capture's digest cache serves a tensor's content while
that tensor lives (keyed by address), so a new tensor the allocator put at the freed address got
the freed parameter's digest. While capture runs, ``torch.UntypedStorage.resize_`` is wrapped: the
resize runs as it is, then ``Session.resized`` drops what capture cached for the old and the new
memory and marks memory grown from nothing as uninitialised. Nothing is recorded (a resize computes
nothing). While Dynamo traces, the wrapper only calls the original.
"""

from __future__ import annotations

import functools
from typing import Any

import torch

from opguard.capture.session import Session

_compiling = torch.compiler.is_dynamo_compiling


class ResizeGuard:
    """Install/uninstall the wrapper on ``torch.UntypedStorage.resize_``."""

    _MISSING = object()

    def __init__(self, session: Session) -> None:
        self.session = session
        self.saved: Any = self._MISSING  # what UntypedStorage's own __dict__ held (usually nothing)
        self.installed = False

    def install(self) -> None:
        cls = torch.UntypedStorage
        orig = getattr(cls, "resize_", None)
        if orig is None or self.installed:
            return
        session = self.session

        @functools.wraps(orig)
        def resize_(storage: Any, size: Any) -> Any:
            if _compiling():
                return orig(storage, size)
            try:
                before = (storage.data_ptr(), storage.nbytes())
            except Exception:  # a storage without memory of its own to read (meta, fake): nothing cached
                before = None
            result = orig(storage, size)
            if before is not None and not session.closed:
                try:
                    session.resized(before[0], storage.data_ptr(), before[1], storage.nbytes())
                except Exception as err:  # capture's own failure: said once, the program goes on
                    session.failed("recording", err)
            return result

        self.saved = cls.__dict__.get("resize_", self._MISSING)
        cls.resize_ = resize_  # type: ignore[method-assign, assignment]
        self.installed = True

    def uninstall(self) -> None:
        if not self.installed:
            return
        cls = torch.UntypedStorage
        if self.saved is self._MISSING:
            del cls.resize_
        else:
            cls.resize_ = self.saved  # type: ignore[method-assign]
        self.saved = self._MISSING
        self.installed = False
