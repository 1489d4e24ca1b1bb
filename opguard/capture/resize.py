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

``UntypedStorage.copy_`` (``storage.clone()``, which ``copy.deepcopy`` of a tensor calls) is wrapped
too: PyTorch makes it of aten ops on byte views of both storages (``aten::set_`` onto the new,
uninitialised storage, then ``aten::copy_``), which the dispatch level recorded, digesting the new
storage's leftover bytes: identical runs differed there. The copy runs as capture's own work (not
recorded); then ``Session.storage_copied`` drops what capture cached for the destination and gives
it the source's uninitialised mark, if any.
"""

from __future__ import annotations

import functools
from typing import Any

import torch

from opguard.capture.dynamo_marks import runs_program
from opguard.capture.session import Session

_compiling = torch.compiler.is_dynamo_compiling


def _on_meta(storage: Any) -> bool:
    """``storage`` is on the meta device (a FakeTensor's is): no memory of its own."""
    try:
        return bool(storage.device.type == "meta")
    except Exception:
        return False


class ResizeGuard:
    """Install/uninstall the wrapper on ``torch.UntypedStorage.resize_``."""

    _MISSING = object()

    def __init__(self, session: Session) -> None:
        self.session = session
        self.saved: Any = self._MISSING  # what UntypedStorage's own __dict__ held (usually nothing)
        self.saved_copy: Any = self._MISSING
        self.installed = False

    def install(self) -> None:
        cls = torch.UntypedStorage
        orig = getattr(cls, "resize_", None)
        if orig is None or self.installed:
            return
        session = self.session

        @functools.wraps(orig)
        @runs_program
        def resize_(storage: Any, size: Any) -> Any:
            if _compiling() or _on_meta(storage):  # a FakeTensor's storage (on "meta"): no memory to read,
                return orig(storage, size)  # and PyTorch warns at its data_ptr()
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

        copy = getattr(cls, "copy_", None)

        @functools.wraps(copy)  # type: ignore[arg-type]
        @runs_program
        def copy_(storage: Any, src: Any, *args: Any, **kwargs: Any) -> Any:
            if _compiling() or copy is None:
                return copy(storage, src, *args, **kwargs)  # type: ignore[misc]
            session.busy += 1  # a memcpy: the aten ops PyTorch makes it of are not the program's calls
            try:
                result = copy(storage, src, *args, **kwargs)
            finally:
                session.busy -= 1
            if not session.closed:
                try:
                    session.storage_copied(storage.data_ptr(), src.data_ptr())
                except Exception as err:  # capture's own failure: said once, the program goes on
                    session.failed("recording", err)
            return result

        self.saved = cls.__dict__.get("resize_", self._MISSING)
        self.saved_copy = cls.__dict__.get("copy_", self._MISSING)
        cls.resize_ = resize_  # type: ignore[method-assign, assignment]
        if copy is not None:
            cls.copy_ = copy_  # type: ignore[method-assign, assignment]
        self.installed = True

    def uninstall(self) -> None:
        if not self.installed:
            return
        cls = torch.UntypedStorage
        if self.saved is self._MISSING:
            del cls.resize_
        else:
            cls.resize_ = self.saved  # type: ignore[method-assign]
        if self.saved_copy is self._MISSING:
            if "copy_" in cls.__dict__:
                del cls.copy_
        else:
            cls.copy_ = self.saved_copy  # type: ignore[method-assign]
        self.saved = self.saved_copy = self._MISSING
        self.installed = False
