"""``torch.utils.swap_tensors`` under capture (``docs/capture.md`` §11).

``swap_tensors(t1, t2)`` refuses a tensor that has weak references, and capture's digest cache holds
one to every tensor it summarised (``docs/capture.md`` §5.3): a program that swaps tensors —
``nn.Module._apply`` does, for ``model.to(...)`` under
``torch.__future__.set_swap_module_params_on_conversion(True)`` and for wrapper-subclass
parameters — would fail only under capture. While capture runs, ``torch.utils.swap_tensors`` is
wrapped: capture first drops its references to both tensors (``Session.release``), then the swap
runs as it is. The swap itself is not recorded (it computes nothing).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch.utils

from opguard.capture.dynamo_marks import runs_program
from opguard.capture.session import Session


class SwapGuard:
    """Install/uninstall the wrapper on ``torch.utils.swap_tensors``."""

    def __init__(self, session: Session) -> None:
        self.session = session
        self.saved: Callable[..., Any] | None = None

    def install(self) -> None:
        orig = getattr(torch.utils, "swap_tensors", None)
        if orig is None:
            return
        session = self.session

        @functools.wraps(orig)
        @runs_program
        def swap_tensors(t1: Any, t2: Any) -> Any:
            try:
                session.release(t1)
                session.release(t2)
            except Exception as err:  # capture's own failure: said once, the swap runs as without capture
                session.failed("recording", err)
            return orig(t1, t2)

        self.saved = orig
        torch.utils.swap_tensors = swap_tensors

    def uninstall(self) -> None:
        if self.saved is not None:
            torch.utils.swap_tensors = self.saved
            self.saved = None
