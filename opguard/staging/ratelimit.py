"""A token bucket that caps a node's upload rate (``OPGUARD_SYNC_MBPS``).

The clock and the sleep are injectable, so ``bench/simulate_cluster.py`` can drive the exact
bucket the uploader uses with a virtual clock.
"""

from __future__ import annotations

import mmap
import time
from collections.abc import Callable, MutableSequence
from typing import Any

DEFAULT_BURST_SECONDS = 0.05


class TokenBucket:
    """``consume(n)`` returns once ``n`` bytes may pass at ``rate`` bytes/s.

    The bucket starts full with ``burst`` bytes (default: 50 ms worth of the rate, at least one
    byte) and may go into debt: a large ``consume`` sleeps for exactly the debt, so the long-run
    rate is ``rate`` regardless of chunk size.
    """

    def __init__(self, rate: float, burst: float | None = None, *,
                 clock: Callable[[], float] = time.monotonic,
                 sleep: Callable[[float], None] = time.sleep) -> None:
        if not rate > 0:
            raise ValueError(f"token bucket rate must be > 0, got {rate!r}")
        self.rate = float(rate)
        self.burst = max(1.0, float(burst) if burst is not None else rate * DEFAULT_BURST_SECONDS)
        self._clock = clock
        self._sleep = sleep
        # tokens, last refill, seconds slept: a list, or doubles in shared memory after share()
        self._s: MutableSequence[float] | Any = [self.burst, clock(), 0.0]

    @property
    def slept(self) -> float:
        return self._s[2]

    def share(self) -> None:
        """Keep the state in memory shared with the processes forked after this call (a sync's
        stream workers, ``opguard.staging.forkpool``), so that they drain one bucket: the node's cap.
        Callers serialise :meth:`consume` across those processes (the uploads take turns)."""
        import ctypes

        mem = mmap.mmap(-1, ctypes.sizeof(ctypes.c_double) * 3)
        shared = (ctypes.c_double * 3).from_buffer(mem)
        shared[:] = list(self._s)
        self._mem, self._s = mem, shared

    def _refill(self) -> None:
        s = self._s
        now = self._clock()
        if now > s[1]:
            s[0] = min(self.burst, s[0] + (now - s[1]) * self.rate)
        s[1] = now

    def consume(self, n: int) -> float:
        """Take ``n`` tokens, sleeping off any debt; returns the seconds slept."""
        if n <= 0:
            return 0.0
        s = self._s
        self._refill()
        s[0] -= n
        if s[0] >= 0:
            return 0.0
        wait = -s[0] / self.rate
        self._sleep(wait)
        s[2] += wait
        self._refill()
        return wait


class Unlimited:
    """The same interface without a cap (used when no rate applies)."""

    slept = 0.0

    def share(self) -> None:
        """Nothing to share."""

    def consume(self, n: int) -> float:
        return 0.0
