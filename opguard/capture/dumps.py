"""Tensor dump policy and atomic dump files in the rank directory (``docs/capture.md`` §7)."""

from __future__ import annotations

import contextlib
import hashlib
import io
import os
import re
from collections.abc import Mapping
from fnmatch import fnmatchcase
from typing import Any

import torch

from opguard.capture import records
from opguard.capture.callsite import Site
from opguard.capture.options import CaptureOptions
from opguard.staging.writers import write_rank_file

_SLOT_RE = re.compile(r"[^A-Za-z0-9_.-]")


def matches(patterns: tuple[str, ...], value: str | None) -> bool:
    """Empty patterns match everything; ``None`` (no module/context) is matched as ``-``."""
    if not patterns:
        return True
    v = "-" if value is None else value
    return any(fnmatchcase(v, p) for p in patterns)


class DumpPolicy:
    def __init__(self, options: CaptureOptions) -> None:
        self.steps = options.dump_steps
        self.filter = options.dump_filter
        self.sites = options.dump_sites
        self.enabled = bool(self.sites) or self.steps.ranges is None or bool(self.steps.ranges)
        self._site_cache: dict[int, bool] = {}

    def _site_listed(self, site: Site) -> bool:
        hit = self._site_cache.get(site.id)
        if hit is None:
            base = os.path.basename(site.file)
            hit = any(line == site.line and (path == site.file or path == base or site.file.endswith("/" + path))
                      for path, line in self.sites)
            self._site_cache[site.id] = hit
        return hit

    def wants(self, step: int, fn: str, module: str | None, context: str | None, site: Site) -> bool:
        if not self.enabled:
            return False
        if self.sites and self._site_listed(site):
            return True
        if step not in self.steps:
            return False
        if not self.filter:
            return True
        return any(fnmatchcase(v, p) for p in self.filter for v in (fn, module or "-", context or "-"))


def dump_relpath(seq: int, slot: str, capture_dir: str = "capture") -> str:
    """A dump's path in the rank's directory (``capture_dir``: the attempt's capture directory)."""
    return f"{capture_dir}/tensors/{seq:09d}-{_SLOT_RE.sub('_', slot)}.pt"


def serialize(t: torch.Tensor) -> bytes:
    """``t``'s copy as ``torch.save`` bytes. Inside a ``torch.func`` transform (``jvp``, ``vmap``,
    ...) the copy is made with the transforms set aside: made under them, the copy of a plain
    tensor is the transform's wrapper, which has no storage to save."""
    buf = io.BytesIO()
    with torch.no_grad(), _no_transforms():
        torch.save(t.detach().to("cpu", copy=True), buf)
    return buf.getvalue()


def _no_transforms() -> contextlib.AbstractContextManager[Any]:
    try:
        from torch._functorch.pyfunctorch import temporarily_clear_interpreter_stack
    except ImportError:  # a PyTorch without it: as before
        return contextlib.nullcontext()
    if torch._C._functorch.peek_interpreter_stack() is None:
        return contextlib.nullcontext()
    return temporarily_clear_interpreter_stack()


def write_dump(rank: int, seq: int, slot: str, data: bytes, env: Mapping[str, str],
               capture_dir: str = "capture") -> dict[str, object]:
    """Write one dump atomically into this rank's directory; returns the ``dump`` record."""
    rel = dump_relpath(seq, slot, capture_dir)
    write_rank_file(rel, data, rank=rank, env=env)
    return {"v": records.VERSION, "kind": "dump", "seq": seq, "slot": slot, "path": rel, "bytes": len(data),
            "sha256": hashlib.sha256(data).hexdigest()}
