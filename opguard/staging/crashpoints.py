"""Deterministic kill points for the crash-consistency tests (test-only; inert in production).

The uploader calls :func:`hit` at each step of the publish protocol (``docs/protocol.md``).
When the environment variable ``OPGUARD_TEST_CRASH_AT`` is unset (always, outside the tests)
a call costs one dictionary lookup and does nothing. When it is set, the process SIGKILLs
itself — no cleanup, no ``finally``, no flush, exactly like a crash — at the chosen point:

* ``NAME``      the first time point ``NAME`` is reached;
* ``NAME#N``    the N-th time point ``NAME`` is reached (N >= 1), e.g. the 3rd batch of a drain;
* ``*#N``       the N-th crash point reached, whichever it is (random-step crash loops).

An unknown ``NAME`` is refused with a :class:`~opguard.errors.ConfigError` at the first point
reached, so a typo in a test cannot silently test nothing.

A sync that forks stream workers (``opguard.staging.forkpool``) calls :func:`share` first: the
counts then live in memory shared with the workers (the N-th point of the whole sync, as without
workers), and a worker that reaches the chosen point SIGKILLs the sync's own process first, then
itself; the other workers die with their parent. The test sees the sync killed, as without workers.
"""

from __future__ import annotations

import mmap
import os
import signal

from opguard.errors import ConfigError

ENV = "OPGUARD_TEST_CRASH_AT"

# In protocol order (docs/protocol.md, steps 1-14).
POINTS = (
    "locked",                 # 1: stream lock taken
    "initial-checkpoint",     # 3: first sync wrote the initial checkpoint
    "cleaned",                # 4: stale temporaries removed
    "building",               # 7: an entry was added to .build-* (partial batch file)
    "built",                  # 7: .build-* complete and fsynced, not yet renamed
    "batch-renamed",          # 8: pending/<name> in place, no pending.json yet
    "pending-saved",          # 8: pending.json durable
    "upload-locked",          # 9: node upload lock taken
    "upload-created",         # 10: T/.tmp-* created, empty
    "upload-writing",         # 10: a chunk was written to T/.tmp-*
    "upload-fsynced",         # 10: T/.tmp-* fsynced, not closed
    "upload-closed",          # 10: closed, not renamed
    "upload-renamed",         # 10: renamed to T/<name>, directory not fsynced
    "uploaded",               # 10: directory fsynced; checkpoint not advanced
    "checkpoint-saved",       # 11: checkpoint advanced; pending.json still there
    "pending-removed",        # 12: pending.json gone, local batch file still there
    "sealing",                # 14: about to create the seal
    "sealed",                 # 14: seal on the target, checkpoint not updated
    "durable-tmp-written",    # any atomic JSON replace: temp written, not renamed
    "exclusive-tmp-written",  # any create-if-absent: temp written, not linked
)

_spec: tuple[str, int] | None = None
_armed: bool | None = None
_counts: dict[str, int] = {}
_shared: _SharedCount | None = None


class _SharedCount:
    """The one count that matters (of the chosen point, or of all points for ``*``), in memory
    shared with forked workers, with a one-byte token in a pipe as its lock."""

    def __init__(self, start: int) -> None:
        self.root = os.getpid()
        self._mem = mmap.mmap(-1, 8)
        self._n = memoryview(self._mem).cast("q")
        self._n[0] = start
        self._r, self._w = os.pipe()
        os.write(self._w, b"t")

    def bump(self) -> int:
        os.read(self._r, 1)
        try:
            self._n[0] += 1
            return int(self._n[0])
        finally:
            os.write(self._w, b"t")


def _arm() -> None:
    global _spec, _armed
    value = os.environ.get(ENV)
    _armed = bool(value)
    if value:
        _spec = _parse(value)


def share() -> None:
    """Before forking workers: count in shared memory, and remember this process as the sync's."""
    global _shared
    if _armed is None:
        _arm()
    if _armed and _spec is not None and _shared is None:
        _shared = _SharedCount(_counts.get(_spec[0], 0))


def _parse(value: str) -> tuple[str, int]:
    name, _, n = value.partition("#")
    if (name != "*" and name not in POINTS) or (n and not (n.isdigit() and int(n) >= 1)):
        raise ConfigError(f"{ENV}={value!r} is not a crash point",
                          f"use NAME, NAME#N or *#N with NAME one of: {', '.join(POINTS)}")
    return name, int(n) if n else 1


def hit(name: str) -> None:
    """Reached crash point ``name``: SIGKILL this process if the test asked for it here."""
    if _armed is None:
        _arm()
    if not _armed or _spec is None:
        return
    if name not in POINTS:
        raise ConfigError(f"crash point {name!r} is not listed in POINTS", "add it to crashpoints.POINTS")
    key = "*" if _spec[0] == "*" else name
    if key != _spec[0]:
        return
    if _shared is not None:
        n = _shared.bump()
        if n == _spec[1] and _shared.root != os.getpid():
            os.kill(_shared.root, signal.SIGKILL)  # the sync itself; its other workers die with it
    else:
        n = _counts[key] = _counts.get(key, 0) + 1
    if n == _spec[1]:
        os.kill(os.getpid(), signal.SIGKILL)
