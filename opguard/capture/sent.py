"""Tensors the captured process sends to another process (``docs/capture.md`` §5.3).

Pickling a CPU tensor for another process (``multiprocessing.Queue.put``, the arguments of a
``spawn``/``forkserver`` ``Process`` or ``torch.multiprocessing.spawn``) moves its storage into
shared memory — no ``Tensor.share_memory_()`` call, no version change — and the other process can
write it from then on. Capture's digest cache would serve such a tensor's earlier content (the
Hogwild pattern: a model passed to ``mp.spawn`` without ``share_memory()``, evaluated between the
children's turns). While capture runs, torch's ``reduce_tensor`` reductions registered with
``multiprocessing.reduction.ForkingPickler`` are wrapped: after the original moved the storage, the
tensor is queued (``Session.sent``; the queue's feeder thread pickles, so only an append happens
there) and the next record marks its memory as shared (``Session.shared``): every later use is
digested from memory. The reduction itself runs unchanged.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from typing import Any

from opguard.capture.session import Session


class SentTensors:
    """Install/uninstall the wrappers of torch's tensor reductions in ``ForkingPickler``."""

    def __init__(self, session: Session) -> None:
        self.session = session
        self.saved: dict[Any, tuple[Callable[..., Any], Callable[..., Any]]] = {}

    def install(self) -> None:
        try:
            from multiprocessing.reduction import ForkingPickler
        except ImportError:  # pragma: no cover - every CPython has it
            return
        table = getattr(ForkingPickler, "_extra_reducers", None)
        if not isinstance(table, dict):
            return
        sent = self.session.sent
        for cls, fn in list(table.items()):
            if getattr(fn, "__name__", "") != "reduce_tensor" or \
                    getattr(fn, "__module__", "") != "torch.multiprocessing.reductions":
                continue
            wrapper = _wrap(fn, sent)
            self.saved[cls] = (fn, wrapper)
            table[cls] = wrapper

    def uninstall(self) -> None:
        if not self.saved:
            return
        from multiprocessing.reduction import ForkingPickler

        table = ForkingPickler._extra_reducers  # type: ignore[attr-defined]
        for cls, (fn, wrapper) in self.saved.items():
            if table.get(cls) is wrapper:  # registered anew since: leave the program's own
                table[cls] = fn
        self.saved = {}


def _wrap(fn: Callable[..., Any], sent: list[Any]) -> Callable[..., Any]:
    def reduce_tensor(tensor: Any) -> Any:
        result = fn(tensor)
        try:
            sent.append(weakref.ref(tensor))
        except TypeError:  # not weakly referenceable: nothing capture holds of it either
            pass
        return result

    reduce_tensor.__wrapped__ = fn  # type: ignore[attr-defined]
    return reduce_tensor
