"""Per-operation traces of PyTorch programs (``docs/capture.md``).

Importing this package does not import torch (the launcher imports
``opguard.capture.bootstrap``); ``capture``, ``context``, ``step`` and ``name_modules`` load
``opguard.capture.api`` (and torch) on first use.
"""

from __future__ import annotations

from typing import Any

__all__ = ["capture", "context", "name_modules", "step"]


def __getattr__(name: str) -> Any:
    if name in __all__:
        from opguard.capture import api

        return getattr(api, name)
    raise AttributeError(f"module 'opguard.capture' has no attribute {name!r}")
