"""A token bucket that caps a node's upload rate (``OPGUARD_SYNC_MBPS``).

The clock and the sleep are injectable, so ``bench/simulate_cluster.py`` can drive the exact
bucket the uploader uses with a virtual clock.
"""

from __future__ import annotations

import time
from collections.abc import Callable

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
        self._tokens = self.burst
        self._last = clock()
        self.slept = 0.0

    def _refill(self) -> None:
        now = self._clock()
        if now > self._last:
            self._tokens = min(self.burst, self._tokens + (now - self._last) * self.rate)
        self._last = now

    def consume(self, n: int) -> float:
        """Take ``n`` tokens, sleeping off any debt; returns the seconds slept."""
        if n <= 0:
            return 0.0
        self._refill()
        self._tokens -= n
        if self._tokens >= 0:
            return 0.0
        wait = -self._tokens / self.rate
        self._sleep(wait)
        self.slept += wait
        self._refill()
        return wait


class Unlimited:
    """The same interface without a cap (used when no rate applies)."""

    slept = 0.0

    def consume(self, n: int) -> float:
        return 0.0
